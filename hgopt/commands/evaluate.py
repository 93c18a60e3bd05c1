"""``hgopt evaluate INSTANCE PLAN [--json] [--timeline F.png]``: score a plan with the one cost model,
with the plan's explanation (GPUs used, busy share and MFU per cluster, dollars; ``hgopt.explain``).

Exit status: 0 feasible, 1 infeasible (violations or out of memory), 2 unreadable input."""

from __future__ import annotations

import argparse
import json

from hgopt.cost import Evaluation, build_tables, evaluate
from hgopt.explain import explain
from hgopt.instances import load_instance
from hgopt.plan import load_plan
from hgopt.table import fmt_seconds, format_table
from hgopt.jsonable import json_safe

__all__ = ["register", "render_evaluation"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="score a plan: iteration time, throughput, memory per stage")
    p.add_argument("instance", help="instance name (see `hgopt instances`) or path")
    p.add_argument("plan", help="plan JSON file (as written by `hgopt plan -o`)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeline", metavar="FILE.png", help="draw the plan's pipeline timeline to FILE.png")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hgopt.commands.plan import _timeline_kwargs, check_outputs, render_explanation

    inst = load_instance(args.instance)
    check_outputs(args, "--timeline")
    plan = load_plan(args.plan)
    if plan.outer is not None:  # issue #15 (diloco): groups meeting every H steps, priced by [C9]
        from hgopt.commands.outer_plan import evaluate_outer_command

        return evaluate_outer_command(args, plan, inst)
    tables = build_tables(inst)
    ev = evaluate(plan, inst, tables)
    expl = explain(plan, inst, ev, tables) if ev.stages else None
    if args.json:
        doc = ev.to_dict()
        doc["explanation"] = expl.to_dict() if expl else None
        print(json.dumps(json_safe(doc), indent=2))
    else:
        print(render_evaluation(ev) + ("\n" + render_explanation(expl) if expl else ""))
    if args.timeline and ev.stages:
        from hgopt.report import plot_timeline

        plot_timeline(plan, inst, args.timeline, tables=tables, **_timeline_kwargs(plan.planner))
    return 0 if ev.feasible else 1


def render_evaluation(ev: Evaluation) -> str:
    """The per-stage breakdown table and the summary lines."""
    out: list[str] = []
    if ev.stages:
        rows = [
            [f"{s.pipeline}.{s.stage}", f"{s.layers[0]}-{s.layers[1] - 1}", s.layout, fmt_seconds(s.fwd_s),
             fmt_seconds(s.bwd_s), fmt_seconds(s.send_fwd_s), fmt_seconds(s.send_bwd_s), fmt_seconds(s.sync_s),
             fmt_seconds(s.optimizer_s),
             f"{s.peak_memory_bytes / 1e9:.1f}/{s.memory_capacity_bytes / 1e9:.0f} GB" + (" OOM" if s.oom else "")]
            for s in ev.stages
        ]
        out.append(format_table(
            ["stage", "layers", "replicas", "fwd", "bwd", "send fwd", "send bwd", "grad sync", "optim", "memory/GPU"],
            rows))
        out.append("")
        for p in ev.pipelines:
            out.append(
                f"pipeline {p.index}: {p.num_microbatches} microbatches of {p.microbatch}, bottleneck "
                f"{fmt_seconds(p.bottleneck_s)}, fill+drain {fmt_seconds(p.fill_drain_s)}, time {fmt_seconds(p.time_s)}"
            )
        out.append(
            f"iteration {fmt_seconds(ev.iteration_time_s)} = pipeline {fmt_seconds(ev.pipeline_time_s)} + "
            f"grad sync/optimizer {fmt_seconds(ev.sync_optimizer_time_s)}"
        )
        out.append(
            f"throughput {ev.throughput_samples_per_s:.3f} samples/s, {ev.tokens_per_s:,.0f} tokens/s on {ev.gpus_used} GPUs"
        )
    out.append("feasible" if ev.feasible else "INFEASIBLE:")
    out.extend(f"  - {v}" for v in ev.violations)
    return "\n".join(out)
