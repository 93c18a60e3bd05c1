"""``hgopt plan INSTANCE``: find a plan with a registered planner (default: the exact MILP planner)
and print it with its predicted throughput (by ``evaluate``), the proven lower bound on the
iteration time and the gap. Progress goes to stderr while the search runs.

Exit status: 0 a plan was found, 1 none (infeasible or no plan within the time limit), 2 bad input."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from typing import Any

from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import Evaluation
from hgopt.instances import load_instance
from hgopt.plan import Plan
from hgopt.search import PlanOptions, PlanResult, get_planner, link_penalties, planner_names
from hgopt.solvers import backend_names
from hgopt.spec import Instance
from hgopt.table import fmt_seconds, format_table

__all__ = ["LINK_PLANNERS", "register", "render_result", "result_to_json"]

LINK_PLANNERS = ("milp", "heuristic")
"""Planners that choose inter-cluster link precisions (``link_precision`` etc. in PlanOptions.extra)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="find a plan (exact MILP planner by default) and print it with its bound")
    p.add_argument("instance", help="instance name (see `hgopt instances`) or path")
    p.add_argument("--planner", default="milp", choices=planner_names(), help="planner (default: milp)")
    p.add_argument("--solver", default="highs", choices=backend_names(), help="MILP backend (default: highs)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="search budget in seconds (default 60)")
    p.add_argument("--gap", type=float, default=0.01, metavar="G",
                   help="stop once the relative gap to the lower bound is <= G (default 0.01)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="solver threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="solver random seed")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan as JSON to FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--link-precision", choices=("native", "fp32", "bf16", "fp16", "fp8", "auto"), default=None,
                   help="precision of inter-cluster boundaries (milp and heuristic planners; default native; "
                        "auto: native, bf16 or fp8 per boundary, as the planner finds fastest)")
    p.add_argument("--max-compressed-links", type=int, default=None, metavar="N",
                   help="at most N compressed inter-cluster boundaries per pipeline (milp and heuristic planners)")
    p.add_argument("--link-penalty", default=None, metavar="P=S[,P=S]",
                   help="seconds added to the objective per boundary compressed to precision P, e.g. fp8=0.05 "
                        "(default 0 for every precision)")
    p.set_defaults(func=run)


def _options(args: argparse.Namespace) -> PlanOptions:
    if not args.time_limit > 0:
        raise ValueError(f"--time-limit: must be > 0 seconds, got {args.time_limit}")
    if not 0 <= args.gap < 1:
        raise ValueError(f"--gap: must be in [0, 1), got {args.gap}")
    if args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    extra: dict[str, str] = {}
    if args.link_precision not in (None, "native") or args.max_compressed_links is not None or args.link_penalty:
        if args.planner not in LINK_PLANNERS:
            raise ValueError(
                f"--link-precision/--max-compressed-links/--link-penalty: only the {' and '.join(LINK_PLANNERS)} "
                f"planners choose link precisions (the {args.planner} plan space is native precision); "
                "add --planner milp or --planner heuristic"
            )
        if args.max_compressed_links is not None and args.max_compressed_links < 0:
            raise ValueError(f"--max-compressed-links: must be >= 0, got {args.max_compressed_links}")
        extra["link_precision"] = args.link_precision or "auto"
        if args.max_compressed_links is not None:
            extra["max_compressed_links"] = str(args.max_compressed_links)
        if args.link_penalty:
            link_penalties({"link_penalty": args.link_penalty})  # bad input fails here, naming the option
            extra["link_penalty"] = args.link_penalty
    return PlanOptions(time_limit_s=args.time_limit, gap=args.gap, solver=args.solver, threads=args.threads,
                       seed=args.seed, extra=extra)


def run(args: argparse.Namespace) -> int:
    inst = load_instance(args.instance)
    res = get_planner(args.planner)(inst, _options(args))
    ev = evaluate(res.plan, inst, build_tables(inst)) if res.plan is not None else None
    if args.output and res.plan is not None:
        with open(args.output, "w") as fh:
            fh.write(res.plan.to_json() + "\n")
    if args.json:
        print(json.dumps(result_to_json(res, ev), indent=2))
    else:
        print(render_result(inst, res, ev))
        if args.output and res.plan is not None:
            print(f"plan written to {args.output}")
    return 0 if res.plan is not None else 1


def result_to_json(res: PlanResult, ev: Evaluation | None) -> dict[str, Any]:
    """The --json document: the headline numbers, the plan and the stage breakdown."""
    def num(x: float | None) -> float | None:
        return None if x is None or not math.isfinite(x) else x

    return {
        "planner": res.planner,
        "status": res.status,
        "solver": res.solver,
        "iteration_time_s": num(ev.iteration_time_s) if ev else None,
        "throughput_samples_per_s": num(ev.throughput_samples_per_s) if ev else None,
        "tokens_per_s": num(ev.tokens_per_s) if ev else None,
        "lower_bound_s": num(res.lower_bound_s),
        "gap": res.gap,
        "search_time_s": res.search_time_s,
        "plan_space": res.plan_space,
        "notes": list(res.notes),
        "gpus_used": ev.gpus_used if ev else 0,
        "feasible": ev.feasible if ev else False,
        "plan": res.plan.to_dict() if res.plan else None,
    }


def render_result(inst: Instance, res: PlanResult, ev: Evaluation | None) -> str:
    """Human-readable plan: the stage table of one pipeline (the others are identical copies when
    the planner says so), then the summary with throughput, bound and gap."""
    out = [f"{inst.name}: planner {res.planner}, status {res.status}" + (f", solver {res.solver}" if res.solver else "")]
    if res.plan is None or ev is None:
        out.append("no plan" + (f"; lower bound on the iteration time {fmt_seconds(res.lower_bound_s)}"
                                if res.lower_bound_s is not None else ""))
        out.extend(f"  {n}" for n in res.notes)
        return "\n".join(out)
    out.append(_stage_table(inst, res.plan))
    out.append(_summary(inst, res, ev))
    return "\n".join(out)


def _stage_table(inst: Instance, plan: Plan) -> str:
    pipes = plan.pipelines
    same = all(p == pipes[0] for p in pipes)
    rows = []
    shown = pipes[:1] if same else pipes
    links = any(b.fwd != "native" or b.bwd != "native" for p in shown for b in p.boundaries)
    for pi, p in enumerate(shown):
        for si, s in enumerate(p.stages):
            for g in s.groups:
                c = inst.topology.cluster(g.cluster)
                rows.append([f"{pi}.{si}", f"{s.start}-{s.end - 1}", g.cluster, c.gpu, g.tp, g.dp, g.mbs, g.gpus])
                if links:  # precision of the boundary to the next stage (fwd/bwd when they differ)
                    b = p.boundary(si) if si + 1 < len(p.stages) else None
                    rows[-1].append("" if b is None else b.fwd if b.fwd == b.bwd else f"{b.fwd}/{b.bwd}")
    head = (f"{len(pipes)} identical pipeline(s), each:" if same else f"{len(pipes)} pipelines:")
    cols = ["stage", "layers", "cluster", "GPU", "tp", "dp", "mbs", "GPUs"] + (["link to next"] if links else [])
    return head + "\n" + format_table(cols, rows)


def _summary(inst: Instance, res: PlanResult, ev: Evaluation) -> str:
    plan = res.plan
    assert plan is not None
    used = ", ".join(f"{c} {n}/{inst.topology.cluster(c).num_gpus}" for c, n in plan.gpus_by_cluster().items())
    shapes = Counter((p.microbatch, p.num_microbatches) for p in plan.pipelines)
    lines = [
        "pipelines " + " + ".join(f"{n} x microbatch {b} x {m} microbatches" for (b, m), n in shapes.items())
        + f" = global batch {inst.job.global_batch}"
        + ("" if plan.grad_sync_precision == "native" else
           f"; gradients all-reduced across clusters in {plan.grad_sync_precision}"),
        f"GPUs used {ev.gpus_used} of {inst.topology.num_gpus()} ({used})",
        f"iteration time {fmt_seconds(ev.iteration_time_s)} (pipeline {fmt_seconds(ev.pipeline_time_s)} + "
        f"sync/optimizer {fmt_seconds(ev.sync_optimizer_time_s)}), throughput {ev.throughput_samples_per_s:.4g} "
        f"samples/s ({ev.tokens_per_s:.4g} tokens/s)" + ("" if ev.feasible else "  INFEASIBLE: " + "; ".join(ev.violations)),
    ]
    if res.lower_bound_s is not None:
        gap = res.gap
        lines.append(f"lower bound on the iteration time {fmt_seconds(res.lower_bound_s)}, gap "
                     f"{'n/a' if gap is None else f'{100 * gap:.2f} %'} (proven over the plan space below)")
    else:
        lines.append("no lower bound (heuristic planner)")
    lines.append(f"search time {res.search_time_s:.1f} s")
    if res.plan_space:
        lines.append(f"plan space: {res.plan_space}")
    lines.extend(f"note: {n}" for n in res.notes)
    return "\n".join(lines)
