"""``hgopt plan INSTANCE``: find a plan with a registered planner (default: the exact MILP planner)
and print it with its predicted throughput (by ``evaluate``), the proven lower bound on the
iteration time and the gap, and explain it (``hgopt.explain``): memory per stage, GPUs used, busy
share and MFU per cluster, dollars per iteration and per million tokens, and for every idle cluster
the best plan found that uses it (for every partly used one, the best found that uses more of it). Without a plan it names the binding constraint. A heartbeat line
goes to stderr at least every 2 s while the search runs (``-q`` silences it).

``--time-limit T`` bounds the whole command (``hgopt.commands._deadline``): it returns within
max(1.1 T, T + 2 s) of the process start; phases skipped for want of time are listed in ``skipped``.

Exit status: 0 a plan was found, 1 none (infeasible or no plan within the time limit), 2 bad input,
130 / 143 interrupted by SIGINT / SIGTERM (the best plan so far is still printed and written)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
from collections import Counter
from typing import Any

from hgopt.commands._deadline import DEADLINE_GRACE_S, POST_RESERVE_S, Deadline, hard_limit, search_limit
from hgopt.commands._search import EXIT_CODES, SearchInterrupted, exit_code, run_planner, stand_in_reserve_s
from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import Evaluation
from hgopt.explain import Explanation, explain, infeasibility, why_not
from hgopt.instances import load_instance
from hgopt.plan import Plan
from hgopt.progress import Progress
from hgopt.search import PlanOptions, PlanResult, get_planner, link_penalties, planner_names
from hgopt.solvers import backend_names
from hgopt.spec import Instance
from hgopt.table import fmt_seconds, format_table

from hgopt.commands._paths import check_output_file

__all__ = ["LINK_PLANNERS", "check_outputs", "register", "render_result", "result_to_json"]

LINK_PLANNERS = ("milp", "heuristic")
"""Planners that choose inter-cluster link precisions (``link_precision`` etc. in PlanOptions.extra)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="find a plan (exact MILP planner by default) and print it with its bound")
    p.add_argument("instance", help="instance name (see `hgopt instances`) or path")
    p.add_argument("--planner", default="milp", choices=planner_names(), help="planner (default: milp)")
    p.add_argument("--solver", default="highs", choices=backend_names(), help="MILP backend (default: highs)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="seconds the whole command may take, from the process start (default 60): the search "
                        "gets S - 1 s (at least S/2), a search still running near max(1.1 S, S + 2 s) is stopped with its best plan "
                        "and bound, and what does not fit after it (why-not lines, --timeline) is skipped, saying so; "
                        "with --objective cost/--budget/--pareto the cluster subsets share the search's part; with "
                        "--outer-steps the synchronous plan gets half of the search's part and each group plan an eighth "
                        "(1-10 s), the group plans not started by the deadline are skipped, saying so")
    p.add_argument("--gap", type=float, default=0.01, metavar="G",
                   help="stop once the relative gap to the lower bound is <= G (default 0.01)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="solver threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="solver random seed")
    p.add_argument("--work-limit", type=float, default=None, metavar="W",  # determinism (issue #11 item 5)
                   help="nominal seconds of work the exact planner's phases may spend (hgopt.search.work; default: the "
                        "search's part of --time-limit): the same input, W and --seed give the same plan and bound "
                        "unless --time-limit, the watchdog, cuts a phase first (then a note says so)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan as JSON to FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--timeline", metavar="FILE.png", help="draw the plan's pipeline timeline to FILE.png")
    p.add_argument("--why-not-time", type=float, default=None, metavar="S",
                   help="seconds for the why-not lines (per idle cluster the heuristic's best plan that uses it, per "
                        "partly used cluster the plan with its block re-planned on more of its GPUs), on top of "
                        "--time-limit; default: what is left of --time-limit after the search, which bounds the "
                        "whole command (none left: the lines are skipped, saying so); 0 leaves them out")
    p.add_argument("--link-precision", choices=("native", "fp32", "bf16", "fp16", "fp8", "auto"), default=None,
                   help="precision of inter-cluster boundaries (milp and heuristic planners; default native; "
                        "auto: native, bf16 or fp8 per boundary, as the planner finds fastest; a policy other than "
                        "native also lets the heuristic all-reduce gradients across cluster groups in bf16, which the "
                        "output names)")
    p.add_argument("--max-compressed-links", type=int, default=None, metavar="N",
                   help="at most N compressed inter-cluster boundaries per pipeline (milp and heuristic planners)")
    p.add_argument("--link-penalty", default=None, metavar="P=S[,P=S]",
                   help="seconds added to the objective per boundary compressed to precision P, e.g. fp8=0.05 "
                        "(default 0 for every precision)")
    from hgopt.commands import plan_cost  # issue #14 (cli): --objective, --budget, --pareto

    plan_cost.add_arguments(p)
    from hgopt.commands import outer_plan  # issue #15 (diloco): --outer-steps, --delta-precision

    outer_plan.add_arguments(p)
    p.set_defaults(func=run)


def _options(args: argparse.Namespace) -> PlanOptions:
    if not args.time_limit > 0:
        raise ValueError(f"--time-limit: must be > 0 seconds, got {args.time_limit}")
    if getattr(args, "work_limit", None) is not None and not 0 < args.work_limit < math.inf:  # determinism
        raise ValueError(f"--work-limit: must be > 0 nominal seconds, got {args.work_limit}")
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


def check_outputs(args: argparse.Namespace, *options: str) -> None:
    """Every output file the command will write is writable, checked before any search starts.
    ``options``: the option names as the user sees them (``-o/--output``, ``--timeline``)."""
    for opt in options:
        path = getattr(args, opt.rpartition("--")[2].replace("-", "_"), None)
        if path is not None:
            check_output_file(path, opt)


def variant_name(planner: str, extra: dict[str, str] | Any) -> str:
    """``milp:auto`` for a milp plan searched with ``--link-precision auto`` (the timeline title)."""
    prec = extra.get("link_precision") if extra else None
    return f"{planner}:{prec}" if prec and prec != "native" else planner


WHY_NOT_MIN_S = 1.0
"""Below this much of --time-limit left after the search, the default skips the why-not lines
(deadline: a heuristic run has a floor of work whatever its limit: given 0.5 s at 25 % of a core,
sailor-geo-5x32's why-not line took about 2 s)."""


def why_not_budget(time_limit_s: float, why_not_time: float | None, elapsed_s: float) -> tuple[float, str]:
    """Seconds for the why-not lines and, when the default leaves none, the line saying so: an
    explicit ``--why-not-time`` is extra time; by default what is left of ``--time-limit``."""
    if why_not_time is not None:
        return why_not_time, ""
    left = time_limit_s - elapsed_s - POST_RESERVE_S  # deadline: explain and the output come after them
    if left >= WHY_NOT_MIN_S:
        return left, ""
    return 0.0, (f"why-not lines skipped: the search used the whole --time-limit of {time_limit_s:g} s "
                 "(--why-not-time S gives them S seconds more)")


def run(args: argparse.Namespace, *, deadline: Deadline | None = None) -> int:
    # deadline: --time-limit bounds the whole command, measured from the process start when run as `hgopt`
    # (from ``main``'s start when called in-process; hgopt.commands._deadline); ``deadline``: tests' fake clock
    dl = deadline or Deadline.for_command(args.time_limit, getattr(args, "started_at", None))
    inst = load_instance(args.instance)
    check_outputs(args, "-o/--output", "--timeline")
    if args.why_not_time is not None and not (args.why_not_time >= 0 and math.isfinite(args.why_not_time)):
        raise ValueError(f"--why-not-time: must be >= 0 seconds, got {args.why_not_time}")
    opts = _options(args)
    if getattr(args, "outer_steps", None):  # issue #15 (diloco): plans with an outer sync every H steps
        from hgopt.commands.outer_plan import run_outer

        return run_outer(args, inst, opts, deadline=dl)
    from hgopt.commands import plan_cost  # issue #14 (cli): cost as an objective

    if plan_cost.wanted(args):
        return plan_cost.run_cost(args, inst, opts, deadline=dl)
    tables = build_tables(inst)
    progress = Progress(args.planner)
    opts = dataclasses.replace(opts, time_limit_s=search_limit(args.time_limit),  # deadline: the search's share
                               work_limit_s=getattr(args, "work_limit", None))  # determinism: its work (None: the same)
    try:
        res = run_planner(args.planner, get_planner(args.planner), inst, opts, progress, stop_at=dl.stop_at,
                          stop_grace_s=DEADLINE_GRACE_S, clock=dl.clock,
                          stand_in_s=stand_in_reserve_s(inst, dl.slowdown))  # deadline4
    except SearchInterrupted as exc:  # a second signal: abort without a plan
        print(f"hgopt: aborted by {signal.Signals(exc.signum).name}; no plan written", file=sys.stderr)
        return EXIT_CODES.get(exc.signum, 130)  # type: ignore[call-overload, no-any-return]
    ev = evaluate(res.plan, inst, tables) if res.plan is not None else None
    if args.output and res.plan is not None:
        with open(args.output, "w") as fh:
            fh.write(res.plan.to_json() + "\n")
    interrupted = exit_code(progress)
    expl = None
    reasons: tuple[str, ...] = ()
    skipped: list[str] = []  # deadline: post-search phases left out for want of time, named in the output
    if res.plan is not None and ev is not None and ev.feasible:
        why_s, why_skip = why_not_budget(args.time_limit, args.why_not_time, dl.elapsed())
        why = () if interrupted or why_s == 0 else why_not(
            res.plan, inst, ev, time_limit_s=why_s, extra=dict(opts.extra), tables=tables)
        expl = explain(res.plan, inst, ev, tables, why)
        if why_skip and not interrupted and any(0 < c.gpus_used < c.gpus or c.gpus_used == 0 for c in expl.clusters):
            expl = dataclasses.replace(expl, why_not_note=why_skip)
            skipped.append("why-not lines (no time left of --time-limit)")
    elif not interrupted:
        if dl.hard_left() > POST_RESERVE_S:
            reasons = infeasibility(inst, tables)
        else:
            skipped.append("the infeasibility reasons (no time left of --time-limit)")
    draw = bool(args.timeline and res.plan is not None and ev is not None and ev.stages)
    if draw and dl.hard_left() < TIMELINE_MIN_S:
        draw = False
        skipped.append(f"the timeline {args.timeline} (under {TIMELINE_MIN_S:g} s left before the deadline of "
                       f"{hard_limit(args.time_limit):g} s)")
    if args.json:
        print(json.dumps({**result_to_json(res, ev, expl, reasons), "skipped": skipped}, indent=2))
    else:
        print(render_result(inst, res, ev, expl, reasons))
        if args.output and res.plan is not None:
            print(f"plan written to {args.output}")
        for what in skipped:
            print(f"skipped: {what}")
    if draw:
        from hgopt.report import plot_timeline

        assert res.plan is not None
        plot_timeline(res.plan, inst, args.timeline, tables=tables, **_timeline_kwargs(variant_name(args.planner, opts.extra)))
    if interrupted:
        return interrupted
    return 0 if res.plan is not None else 1


TIMELINE_MIN_S = 2.0
"""deadline: seconds the timeline drawing needs (matplotlib's import and one figure); with less left
before the hard deadline it is skipped and named."""


def _timeline_kwargs(variant: str) -> dict[str, str]:
    """``label=`` (the planner variant, e.g. ``milp:auto``) for report.plot_timeline when it takes one
    (the simulator-drawn timeline does; the older one titles the plan's ``planner``)."""
    import inspect

    from hgopt.report import plot_timeline

    return {"label": variant} if "label" in inspect.signature(plot_timeline).parameters else {}


def result_to_json(res: PlanResult, ev: Evaluation | None, expl: Explanation | None = None,
                   reasons: tuple[str, ...] = ()) -> dict[str, Any]:
    """The --json document: the headline numbers, the plan, the stage breakdown and the explanation."""
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
        "objective": res.objective,  # (costheur) the $ objective's value, bound and gap
        "usd_per_iteration": res.usd_per_iteration,
        "usd_lower_bound": res.usd_lower_bound,
        "usd_gap": res.usd_gap,
        "search_time_s": res.search_time_s,
        "plan_space": res.plan_space,
        "notes": list(res.notes),
        "gpus_used": ev.gpus_used if ev else 0,
        "feasible": ev.feasible if ev else False,
        "plan": res.plan.to_dict() if res.plan else None,
        "explanation": expl.to_dict() if expl else None,
        "infeasibility": list(reasons),
    }


def render_result(inst: Instance, res: PlanResult, ev: Evaluation | None, expl: Explanation | None = None,
                  reasons: tuple[str, ...] = ()) -> str:
    """Human-readable plan: the stage table of one pipeline (the others are identical copies when
    the planner says so), then the summary with throughput, bound and gap, then the explanation."""
    out = [f"{inst.name}: planner {res.planner}, status {res.status}" + (f", solver {res.solver}" if res.solver else "")]
    if res.plan is None or ev is None:
        out.append("no plan" + (f"; lower bound on the iteration time {fmt_seconds(res.lower_bound_s)}"
                                if res.lower_bound_s is not None else ""))
        out.extend(f"  {n}" for n in res.notes)
        if reasons:
            out.append("why no plan fits:")
            out.extend(f"  {r}" for r in reasons)
        return "\n".join(out)
    out.append(_stage_table(inst, res.plan, ev))
    out.append(_summary(inst, res, ev))
    if expl is not None:
        out.append(render_explanation(expl))
    return "\n".join(out)


def _pct(v: float | None, note: str = "n/a") -> str:
    return note if v is None else f"{100 * v:.1f} %"


def _usd(v: float | None) -> str:
    return "n/a" if v is None else f"${v:.4g}"


def render_explanation(e: Explanation) -> str:
    """The cluster table (GPUs used, busy share, MFU, price), the $ line and the why-not lines."""
    rows = [[c.name, c.gpu, f"{c.gpus_used}/{c.gpus}", _pct(c.busy_share, "idle"),
             _pct(c.mfu, "n/a" if c.gpus_used else "-"), "-" if c.usd_per_gpu_hour is None else f"${c.usd_per_gpu_hour:g}"]
            for c in e.clusters]
    out = ["", "clusters (busy: compute seconds of the used GPUs over GPUs x iteration time; "
               "MFU: model FLOPs over GPUs x iteration time x datasheet peak):",
           format_table(["cluster", "GPU", "GPUs used", "busy", "MFU", "$/GPU-hour"], rows)]
    out.append("MFU of all used GPUs " + (_pct(e.mfu) if e.mfu is not None else e.mfu_note or "n/a"))
    m = e.money
    line = (f"cost {_usd(m.usd_per_iteration)} per iteration, {_usd(m.usd_per_million_tokens)} per million tokens "
            f"(GPU-hours {_usd(m.gpu_usd_per_iteration)}, WAN egress {_usd(m.egress_usd_per_iteration)})")
    out.append(line + (f"; {'; '.join(m.notes)}" if m.notes else ""))
    for w in e.why_not:
        head = f"why not {'more of ' if w.gpus_used else ''}{w.cluster} ({w.gpus_used}/{w.gpus} GPUs used): "
        if w.alternative_s is not None and w.slower is not None:
            cost = "" if w.costlier is None else f", {100 * w.costlier:+.1f} % $ per iteration"
            mine = dict(w.alternative_gpus).get(w.cluster, 0)
            gpus = ", ".join(f"{c} {n}" for c, n in w.alternative_gpus)
            how = (f"the best plan the {w.planner} finds using {mine}/{w.gpus} of its GPUs"
                   + (f" ({w.note})" if w.note else ""))
            out.append(head + f"{how} takes {fmt_seconds(w.alternative_s)} per iteration, {100 * w.slower:+.1f} % "
                       f"time{cost} (GPUs: {gpus})")
        else:
            out.append(head + w.note)
    if e.why_not_note:
        out.append(e.why_not_note)
    return "\n".join(out)


def _stage_table(inst: Instance, plan: Plan, ev: Evaluation | None = None) -> str:
    pipes = plan.pipelines
    same = all(p == pipes[0] for p in pipes)
    rows = []
    shown = pipes[:1] if same else pipes
    links = any(b.fwd != "native" or b.bwd != "native" for p in shown for b in p.boundaries)
    recompute = any(s.recompute != "none" for p in shown for s in p.stages)  # hfrec: a column only when used
    mem = {(s.pipeline, s.stage): (s.peak_memory_bytes, s.memory_capacity_bytes, s.oom) for s in ev.stages} if ev else {}
    for pi, p in enumerate(shown):
        for si, s in enumerate(p.stages):
            for g in s.groups:
                c = inst.topology.cluster(g.cluster)
                rows.append([f"{pi}.{si}", f"{s.start}-{s.end - 1}", g.cluster, c.gpu, g.tp, g.dp, g.mbs, g.gpus])
                if mem:
                    r = mem.get((pi, si))
                    rows[-1].append("" if r is None else f"{r[0] / 1e9:.1f}/{r[1] / 1e9:.1f} GB" + (" OOM" if r[2] else ""))
                if links:  # precision of the boundary to the next stage (fwd/bwd when they differ)
                    b = p.boundary(si) if si + 1 < len(p.stages) else None
                    rows[-1].append("" if b is None else b.fwd if b.fwd == b.bwd else f"{b.fwd}/{b.bwd}")
                if recompute:
                    rows[-1].append(s.recompute)
    head = (f"{len(pipes)} identical pipeline(s), each:" if same else f"{len(pipes)} pipelines:")
    cols = (["stage", "layers", "cluster", "GPU", "tp", "dp", "mbs", "GPUs"] + (["peak mem/GPU"] if mem else [])
            + (["link to next"] if links else []) + (["recompute"] if recompute else []))
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
    elif res.objective == "time":
        lines.append("no lower bound (heuristic planner)")
    if res.objective == "cost":  # (costheur) the $ objective's value, bound and gap
        usd = "-" if res.usd_per_iteration is None else f"${res.usd_per_iteration:.4g}"
        bound = "no lower bound" if res.usd_lower_bound is None else f"lower bound ${res.usd_lower_bound:.4g}"
        gap = "" if res.usd_gap is None else f", gap {100 * res.usd_gap:.2f} %"
        lines.append(f"objective cost: {usd} per iteration, {bound}{gap} (the bound holds for every plan)")
    lines.append(f"search time {res.search_time_s:.1f} s")
    if res.plan_space:
        lines.append(f"plan space: {res.plan_space}")
    lines.extend(f"note: {n}" for n in res.notes)
    return "\n".join(lines)
