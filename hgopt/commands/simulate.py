"""``hgopt simulate INSTANCE PLAN [--json] [--timeline FILE.png]``: replay one training step of a plan event by event
(:func:`hgopt.simulate.simulate`) and print its iteration time next to ``evaluate``'s, each stage's
busy and idle time and each link's utilisation.

Exit status: 0, or 2 for an unreadable or invalid plan."""

from __future__ import annotations

import argparse
import json
import math

from hgopt.cost import build_tables, evaluate
from hgopt.instances import load_instance
from hgopt.plan import load_plan
from hgopt.simulate import simulate
from hgopt.table import fmt_seconds, format_table

__all__ = ["register"]

_MAX_LINKS = 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="replay one step event by event; compare with evaluate")
    p.add_argument("instance", help="instance name (see `hgopt instances`) or path")
    p.add_argument("plan", help="plan JSON file (as written by `hgopt plan -o`)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--events", action="store_true", help="with --json: include every event of the step")
    p.add_argument("--timeline", metavar="FILE.png", help="draw the simulated step (hgopt.report.plot_timeline)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    inst = load_instance(args.instance)
    plan = load_plan(args.plan)
    tables = build_tables(inst)
    ev = evaluate(plan, inst, tables)
    if not ev.pipelines:
        raise ValueError(f"{args.plan}: cannot simulate an invalid plan: {'; '.join(ev.violations)}")
    sim = simulate(plan, inst, tables)
    ratio = sim.iteration_time_s / ev.iteration_time_s if ev.iteration_time_s > 0 else math.nan
    if args.timeline:
        from hgopt.report import plot_timeline

        plot_timeline(plan, inst, args.timeline, tables=tables)
    if args.json:
        print(json.dumps({
            "evaluate": {"iteration_time_s": ev.iteration_time_s, "pipeline_time_s": ev.pipeline_time_s},
            "simulate": sim.to_dict(events=args.events),
            "ratio": ratio,
        }, indent=2))
        return 0
    rows = [[f"{s.pipeline}.{s.stage}", fmt_seconds(s.busy_s), fmt_seconds(s.idle_s),
             f"{100 * s.busy_s / sim.iteration_time_s:.0f} %", fmt_seconds(s.compute_end_s), fmt_seconds(s.sync_end_s),
             fmt_seconds(s.end_s)] for s in sim.stages]
    print(format_table(["stage", "busy", "idle", "busy %", "last bwd ends", "sync ends", "optim ends"], rows))
    print()
    busiest = sorted(sim.links, key=lambda lk: (-lk.utilisation, lk.name))
    links = [[lk.name, f"{lk.bytes / 1e9:.3f} GB", fmt_seconds(lk.busy_s), f"{100 * lk.utilisation:.0f} %",
              str(lk.max_flows)] for lk in busiest[:_MAX_LINKS]]
    if links:
        print(format_table(["link (busiest first)", "carried", "busy", "busy %", "max flows"], links))
        if len(busiest) > _MAX_LINKS:
            print(f"... and {len(busiest) - _MAX_LINKS} more link resources (--json lists all)")
        print()
    print(f"pipeline  {fmt_seconds(ev.pipeline_time_s)} by evaluate, {fmt_seconds(sim.pipeline_time_s)} by simulate")
    print(f"iteration {fmt_seconds(ev.iteration_time_s)} by evaluate, {fmt_seconds(sim.iteration_time_s)} by simulate "
          f"(simulate / evaluate = {ratio:.3f})")
    return 0
