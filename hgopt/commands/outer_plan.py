"""``hgopt plan INSTANCE --outer-steps 1,10,50,200``: per H the best plan with an outer synchronisation
every H steps across cluster groups (``hgopt.search.lowcomm``), beside the synchronous plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from hgopt.commands._deadline import Deadline, search_limit
from hgopt.cost.outer import OuterEvaluation, evaluate_outer
from hgopt.plan import Plan
from hgopt.search import PlanOptions
from hgopt.search.lowcomm import DELTA_PRECISIONS, LowCommResult, plan_low_comm
from hgopt.spec import Instance
from hgopt.table import fmt_bytes, format_table
from hgopt.jsonable import json_safe

__all__ = ["add_arguments", "evaluate_outer_command", "parse_steps", "render", "render_outer", "run_outer", "to_json"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--outer-steps", default=None, metavar="H[,H..]",
                   help="plan DiLoCo-style training instead: cluster groups that synchronise their parameters only "
                        "every H steps (e.g. 1,10,50,200); prints tokens/s, GPUs, WAN bytes per step and outer syncs "
                        "per billion tokens per H (H > 1 changes the optimisation: your choice)")
    p.add_argument("--delta-precision", default=",".join(DELTA_PRECISIONS), metavar="P[,P..]",
                   help="with --outer-steps: delta precisions the planner may choose among (fp32, bf16, fp8, int8; "
                        "default all: the widest within 1 %% of the fastest)")
    p.add_argument("--outer-fragments", type=int, default=1, metavar="F",
                   help="with --outer-steps: stream the delta in F layer fragments, one every H/F steps (default 1)")
    p.add_argument("--outer-overlap", action="store_true",
                   help="with --outer-steps: price each fragment's exchange as overlapped with the next H/F inner "
                        "steps (the runner runs it blocking: such a plan does not export)")


def parse_steps(text: str) -> list[int]:
    out = []
    for item in (x.strip() for x in text.split(",")):
        try:
            h = int(item)
        except ValueError:
            raise ValueError(f"--outer-steps: expected integers separated by commas, got {item!r}") from None
        if h < 1:
            raise ValueError(f"--outer-steps: every H must be >= 1, got {h}")
        out.append(h)
    return out


def _precisions(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in DELTA_PRECISIONS]
    if bad or not out:
        raise ValueError(f"--delta-precision: expected some of {', '.join(DELTA_PRECISIONS)}, got {text!r}")
    return out


def run_outer(args: argparse.Namespace, inst: Instance, opts: PlanOptions, deadline: Deadline | None = None) -> int:
    """deadline3: with ``deadline`` (the command's) the search gets ``search_limit(T)`` and stops at
    ``deadline.stop_at`` (``plan_low_comm``'s ``stop_at``)."""
    steps = parse_steps(args.outer_steps)
    precs = _precisions(args.delta_precision)
    planner = args.planner if args.planner in ("heuristic", "milp") else "heuristic"
    if args.outer_fragments < 1:
        raise ValueError(f"--outer-fragments: must be >= 1, got {args.outer_fragments}")
    if deadline is not None:
        opts = dataclasses.replace(opts, time_limit_s=search_limit(deadline.time_limit_s))
    res = plan_low_comm(inst, steps, opts, planner=planner, precisions=precs,  # type: ignore[arg-type]
                        fragments=args.outer_fragments, overlap=args.outer_overlap,
                        stop_at=deadline.stop_at if deadline is not None else None,
                        clock=deadline.clock if deadline is not None else time.monotonic)
    if args.output:
        for c in res.choices:
            path = Path(args.output) if len(res.choices) == 1 else Path(args.output).with_suffix(
                f".H{c.steps}{Path(args.output).suffix}")
            path.write_text(c.plan.to_json() + "\n")
    print(json.dumps(to_json(res), indent=2) if args.json else render(res))
    return 0 if res.choices else 1


def render(res: LowCommResult) -> str:
    s = res.sync
    rows: list[list[Any]] = [["sync", "-", "-", round(s.tokens_per_s), s.gpus_used, fmt_bytes(s.wan_bytes_per_step),
                              "-", "-", "1 group (the synchronous plan)"]]
    for c in res.choices:
        e = c.evaluation
        groups = " | ".join(f"{'+'.join(g.clusters)} ({g.samples} samples, {g.gpus} GPUs)" for g in e.groups)
        rows.append([str(c.steps), e.precision, f"{e.exposed_sync_s:.3g} s", round(e.tokens_per_s), e.gpus_used,
                     fmt_bytes(e.wan_bytes_per_step), f"{e.syncs_per_billion_tokens:.4g}",
                     round(e.fluid_tokens_per_s), groups])
    out = [f"{res.instance}: outer synchronisation every H steps across cluster groups (DiLoCo)",
           format_table(["H", "delta", "sync/round", "tokens/s", "GPUs", "WAN/step", "syncs/1e9 tok",
                         "fluid tok/s", "groups"], rows),
           f"fluid: the groups alone at their own pace, no outer sync; compute bound of the instance (every cluster "
           f"busy, no communication): {res.compute_bound_tokens_per_s:.4g} tokens/s"]
    for c in res.choices:
        alts = ", ".join(f"{p} {e.tokens_per_s:.4g}" for p, e in c.by_precision if e.feasible)
        out.append(f"H {c.steps}: tokens/s by delta precision: {alts}")
    out.extend(f"note: {n}" for n in res.notes)
    return "\n".join(out)


def to_json(res: LowCommResult) -> dict[str, Any]:
    def num(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        "instance": res.instance,
        "sync": {"tokens_per_s": res.sync.tokens_per_s, "gpus_used": res.sync.gpus_used,
                 "wan_bytes_per_step": res.sync.wan_bytes_per_step,
                 "plan": res.sync.plan.to_dict() if res.sync.plan else None},
        "compute_bound_tokens_per_s": res.compute_bound_tokens_per_s,
        "outer": [{"steps": c.steps, "precision": c.evaluation.precision, "tokens_per_s": c.evaluation.tokens_per_s,
                   "gpus_used": c.evaluation.gpus_used, "wan_bytes_per_step": c.evaluation.wan_bytes_per_step,
                   "syncs_per_billion_tokens": c.evaluation.syncs_per_billion_tokens,
                   "fluid_tokens_per_s": c.evaluation.fluid_tokens_per_s,
                   "exposed_sync_s": num(c.evaluation.exposed_sync_s),
                   "by_precision": {p: e.tokens_per_s for p, e in c.by_precision},
                   "plan": c.plan.to_dict()} for c in res.choices],
        "notes": list(res.notes),
    }


def render_outer(ev: OuterEvaluation) -> str:
    """``hgopt evaluate`` of a plan with an outer synchronisation ([C9])."""
    rows = [[i, "+".join(g.clusters), g.gpus, g.samples, f"{g.inner_step_s:.4g} s", fmt_bytes(g.wan_bytes_per_step)]
            for i, g in enumerate(ev.groups)]
    out = [format_table(["group", "clusters", "GPUs", "samples/step", "inner step", "WAN/step inside"], rows)] if rows else []
    if ev.groups:
        out.append(f"outer sync every {ev.steps} steps, {ev.precision} deltas ({fmt_bytes(ev.delta_bytes)}): "
                   f"{ev.sync_s:.4g} s per sync, {ev.exposed_sync_s:.4g} s exposed, outer update {ev.update_s:.4g} s")
        out.append(f"round {ev.round_s:.4g} s = {ev.steps} x {ev.inner_step_s:.4g} s (slowest group) + exposed sync + "
                   f"update; {ev.step_time_s:.4g} s per step, {ev.tokens_per_s:,.0f} tokens/s on {ev.gpus_used} GPUs "
                   f"(fluid: {ev.fluid_tokens_per_s:,.0f})")
        out.append(f"WAN {fmt_bytes(ev.wan_bytes_per_step)} per step, {ev.syncs_per_billion_tokens:.4g} outer syncs per "
                   f"billion tokens; outer state {fmt_bytes(ev.outer_state_bytes_per_gpu)} per GPU (not charged)")
        out.append("note: H > 1 changes the optimisation (the groups train apart between outer steps)")
    out.append("feasible" if ev.feasible else "INFEASIBLE:")
    out.extend(f"  - {v}" for v in ev.violations)
    return "\n".join(out)


def evaluate_outer_command(args: argparse.Namespace, plan: Plan, inst: Instance) -> int:
    ev = evaluate_outer(plan, inst)
    if args.json:
        import dataclasses

        doc = dataclasses.asdict(ev)
        print(json.dumps(json_safe(doc), indent=2))
    else:
        print(render_outer(ev))
    return 0 if ev.feasible else 1
