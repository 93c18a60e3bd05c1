"""``hgopt replan PLAN --instance X --change C [--change C ...] | --new-instance NEW``: a new plan for
changed resources that keeps the global batch, priced with the migration of parameters and optimizer
state between clusters ([M1], ``hgopt.cost.migration``) and chosen for the least total time over
``--horizon-steps`` steps (move + steps × iteration time). Candidates: the planner's plan for the new
resources and the old plan repaired (same layer ranges) where that is valid (``hgopt.search.replan``).

Prints the changes, the throughput before and after, every candidate, what moves where and how long
the move takes, and the exact planner's lower bound for the new resources (``--planner milp``).

Exit status: 0 a plan was found, 1 none, 2 bad input (a malformed or impossible change names itself).

deadline2: ``--time-limit T`` (default 1 s for the heuristic, 60 s otherwise) bounds the whole
command as for ``hgopt plan`` (``hgopt.commands._deadline``): the planner gets ``search_limit(T)``
and a watchdog near max(1.1 T, T + 2 s) stops it with its best plan and bound (the planner's status
``feasible`` / ``heuristic``, its note saying so); the repaired old plans and the migration pricing
come after it (``POST_RESERVE_S``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hgopt.changes import apply_changes, describe_change, parse_change
from hgopt.commands._deadline import DEADLINE_GRACE_S, Deadline, search_limit
from hgopt.commands._paths import check_output_file
from hgopt.commands._search import EXIT_CODES, SearchInterrupted, exit_code, run_planner
from hgopt.export.elastic import instance_to_dict
from hgopt.instances import load_instance
from hgopt.plan import load_plan, validate
from hgopt.progress import Progress
from hgopt.search import PlanOptions, PlanResult, get_planner, planner_names
from hgopt.search.replan import ReplanResult, replan
from hgopt.solvers import backend_names
from hgopt.spec import Instance
from hgopt.table import fmt_bytes, fmt_seconds, format_table

__all__ = ["register", "render", "result_to_json"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replan", help="re-plan for changed resources, priced with the state migration")
    p.add_argument("plan", help="the running plan (JSON from `hgopt plan -o`)")
    p.add_argument("--instance", default=None,
                   help="the instance the plan runs on (name or path; default: the one the plan names)")
    p.add_argument("--change", action="append", default=[], metavar="CHANGE",
                   help="cluster=NAME:-16 | cluster=NAME:+8 (whole nodes) | drop=NAME | link=A>B:2Gbit "
                        "(A<>B: both directions; a bandwidth in Gbit/Mbit/GB/MB per second, or x0.5); repeatable")
    p.add_argument("--new-instance", default=None, metavar="NEW",
                   help="the new topology as a whole instance (same model and global batch); --change applies on top")
    p.add_argument("--horizon-steps", type=int, default=1000, metavar="N",
                   help="steps the new plan will run: the move is amortised over them (default 1000)")
    p.add_argument("--planner", default="heuristic", choices=planner_names(),
                   help="planner for the new resources (default heuristic; milp also gives the lower bound)")
    p.add_argument("--solver", default="highs", choices=backend_names(), help="MILP backend (default: highs)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="seconds the whole command may take, from the process start (default: 1 for heuristic, 60 "
                        "otherwise); the planner gets S - 1 s (at least S/2) and is stopped with its best plan near "
                        "max(1.1 S, S + 2 s)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the chosen plan as JSON to FILE")
    p.add_argument("--instance-out", metavar="FILE",
                   help="write the changed instance as JSON to FILE (for `hgopt export --instance FILE`)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _load(args: argparse.Namespace) -> tuple[Any, Instance, Instance, list[str]]:
    changes = [parse_change(c) for c in args.change]  # bad syntax fails first, before any file is read
    if not changes and args.new_instance is None:
        raise ValueError("give at least one --change or --new-instance (what changed?)")
    plan = load_plan(args.plan)
    if not (args.instance or plan.instance):
        raise ValueError(f"{args.plan}: the plan names no instance; give --instance (the instance it runs on)")
    old = load_instance(args.instance or plan.instance)
    bad = validate(plan, old)
    if bad:
        raise ValueError(f"{args.plan}: the plan is not valid on {old.name}: {bad[0]}"
                         + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    base = load_instance(args.new_instance) if args.new_instance else old
    lines = [f"new instance {base.name}"] if args.new_instance else []
    cur = base
    for ch in changes:
        nxt = apply_changes(cur, [ch])
        lines.append(describe_change(ch, cur))
        cur = nxt
    new = apply_changes(base, changes)
    return plan, old, new, lines


def run(args: argparse.Namespace, *, deadline: Deadline | None = None) -> int:
    # deadline2: ``deadline``: tests' fake clock; else from the process start (``hgopt.cli.main``)
    started = getattr(args, "started_at", None) or time.monotonic()
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit: must be > 0 seconds, got {args.time_limit}")
    if args.horizon_steps < 1:
        raise ValueError(f"--horizon-steps: must be >= 1, got {args.horizon_steps}")
    check_output_file(args.output, "-o/--output")
    check_output_file(args.instance_out, "--instance-out")
    plan, old, new, lines = _load(args)
    limit = args.time_limit if args.time_limit is not None else (1.0 if args.planner == "heuristic" else 60.0)
    dl = deadline or Deadline.for_command(limit, started)
    opts = PlanOptions(time_limit_s=search_limit(limit), solver=args.solver)
    progress = Progress(args.planner)
    inner = get_planner(args.planner)

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:  # deadline2: under the watchdog
        return run_planner(args.planner, inner, instance, options, progress, stop_at=dl.stop_at,
                           stop_grace_s=DEADLINE_GRACE_S, clock=dl.clock)

    try:
        res = replan(plan, old, new, args.planner, planner, opts, args.horizon_steps)
    except SearchInterrupted as exc:  # a second signal: abort without a plan
        print(f"hgopt: aborted by {signal.Signals(exc.signum).name}; no plan written", file=sys.stderr)
        return EXIT_CODES.get(exc.signum, 130)  # type: ignore[call-overload, no-any-return]
    if args.output and res.chosen is not None:  # the plan names the instance it was made for (the written one)
        named = dataclasses.replace(res.chosen.plan, instance=str(args.instance_out) if args.instance_out else new.name)
        Path(args.output).write_text(named.to_json() + "\n")
    if args.instance_out:
        Path(args.instance_out).write_text(json.dumps(instance_to_dict(new), indent=1) + "\n")
    if args.json:
        print(json.dumps(result_to_json(res, lines, new), indent=2))
    else:
        print(render(res, old, new, lines))
        if args.output and res.chosen is not None:
            print(f"plan written to {args.output}")
    interrupted = exit_code(progress)
    if interrupted:
        return interrupted
    return 0 if res.chosen is not None else 1


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def result_to_json(res: ReplanResult, changes: list[str], new: Instance) -> dict[str, Any]:
    def cand(c: Any) -> dict[str, Any]:
        return {"name": c.name, "iteration_time_s": c.evaluation.iteration_time_s,
                "migration_egress_usd": c.migration.egress_usd(new),
                "throughput_samples_per_s": c.evaluation.throughput_samples_per_s,
                "gpus_used": c.evaluation.gpus_used, "migration_bytes": c.migration.bytes,
                "migration_time_s": c.migration.time_s, "total_time_s": c.total_s,
                "flows": [{"src": f.src, "dst": f.dst, "param_bytes": f.param_bytes,
                           "optimizer_bytes": f.optimizer_bytes, "layers": list(f.layers), "time_s": f.time_s}
                          for f in c.migration.flows],
                "from_checkpoint": [{"cluster": c_, "layer": layer, "bytes": b}
                                    for c_, layer, b in c.migration.from_checkpoint],
                "inside": [{"cluster": c_, "bytes": b, "time_s": t} for c_, b, t in c.migration.inside]}

    lb = res.planner.lower_bound_s
    return {
        "changes": changes,
        "horizon_steps": res.horizon_steps,
        "before": {"iteration_time_s": _num(res.before.iteration_time_s),
                   "throughput_samples_per_s": _num(res.before.throughput_samples_per_s),
                   "feasible": res.before.feasible},
        "chosen": cand(res.chosen) if res.chosen else None,
        "candidates": [cand(c) for c in res.candidates],
        "rejected": [{"name": n, "why": w} for n, w in res.rejected],
        "planner": res.planner.planner,
        "planner_status": res.planner.status,
        "planner_notes": list(res.planner.notes),
        "lower_bound_s": _num(lb),
        "horizon_lower_bound_s": _num(lb * res.horizon_steps) if lb is not None else None,
        "plan_space": res.planner.plan_space,
        "search_time_s": res.search_time_s,
        "plan": res.chosen.plan.to_dict() if res.chosen else None,
    }


def render(res: ReplanResult, old: Instance, new: Instance, changes: list[str]) -> str:
    out = [f"replan {old.name} -> {new.topology.num_gpus()} GPUs in {len(new.topology.clusters)} cluster(s):"]
    out += [f"  {c}" for c in changes]
    b = res.before
    out.append(f"before: iteration {fmt_seconds(b.iteration_time_s)}, {b.throughput_samples_per_s:.4g} samples/s "
               f"on {b.gpus_used} GPUs (the old plan on the old resources)")
    n = res.horizon_steps
    rows = [[c.name, fmt_seconds(c.evaluation.iteration_time_s), f"{c.evaluation.throughput_samples_per_s:.4g}",
             c.evaluation.gpus_used, fmt_bytes(c.migration.bytes), fmt_bytes(c.migration.inside_bytes),
             fmt_seconds(c.migration.time_s), fmt_seconds(c.total_s)] for c in res.candidates]
    if rows:
        out.append(f"candidates (total = move + {n} x iteration), best first:")
        out.append(format_table(["candidate", "iteration", "samples/s", "GPUs", "between clusters", "inside",
                                 "move time", f"total over {n} steps"], rows))
    for name, why in res.rejected:
        out.append(f"not usable: {name}: {why}")
    c = res.chosen
    if c is None:
        out.append("no plan fits the new resources")
    else:
        ev = c.evaluation
        out.append(f"chosen: {c.name}")
        from hgopt.commands.plan import _stage_table  # the same stage table `hgopt plan` prints

        out.append(_stage_table(new, c.plan, c.evaluation))
        rel = (f" ({100 * (ev.throughput_samples_per_s / b.throughput_samples_per_s - 1):+.1f} % throughput)"
               if b.throughput_samples_per_s > 0 else "")
        out.append(f"after: iteration {fmt_seconds(ev.iteration_time_s)}, {ev.throughput_samples_per_s:.4g} samples/s "
                   f"on {ev.gpus_used} GPUs{rel}")
        m = c.migration
        if m.flows:
            usd = m.egress_usd(new)
            out.append(f"migration: {fmt_bytes(m.bytes)} between clusters in {fmt_seconds(m.time_s)} "
                       "(all links at once; [M1] in hgopt/cost/migration.py), WAN egress "
                       + ("n/a (no egress_usd_per_gb on its links)" if usd is None else f"${usd:.4g}") + ":")
            out.append(format_table(["from", "to", "parameters", "optimizer state", "layers", "link time"],
                                    [[f.src, f.dst, fmt_bytes(f.param_bytes), fmt_bytes(f.optimizer_bytes),
                                      _ranges(f.layers), fmt_seconds(f.time_s)] for f in m.flows]))
        else:
            out.append("migration: nothing crosses clusters (every cluster keeps the layers it holds)")
        if m.inside:
            out.append("inside clusters ([M1i]: earlier holders feed added GPUs, a new tp split or ZeRO shard count): "
                       + ", ".join(f"{c_} {fmt_bytes(b)} in {fmt_seconds(t)}" for c_, b, t in m.inside))
        if m.from_checkpoint:
            lost = sum(x for _, _, x in m.from_checkpoint)
            out.append(f"from the last checkpoint (no surviving cluster holds it; not priced): {fmt_bytes(lost)} "
                       f"for layers {_ranges(tuple(sorted({layer for _, layer, _ in m.from_checkpoint})))}")
    lb = res.planner.lower_bound_s
    if lb is not None:
        out.append(f"lower bound on the iteration time for the new resources ({res.planner.planner}, "
                   f"{res.planner.status}): {fmt_seconds(lb)}; over {n} steps at least {fmt_seconds(lb * n)} "
                   f"(plan space: {res.planner.plan_space})")
    else:
        out.append(f"lower bound: none (the {res.planner.planner} planner proves none; use --planner milp)")
    stop = next((n for n in res.planner.notes if "deadline" in n), None)  # deadline2: the watchdog's words
    if stop:
        out.append(f"note ({res.planner.planner}): {stop}")
    out.append(f"replan time {res.search_time_s:.2f} s")
    return "\n".join(out)


def _ranges(layers: tuple[int, ...]) -> str:
    """``0-3,7,9-10``."""
    parts: list[str] = []
    for x in layers:
        if parts and int(parts[-1].rpartition("-")[2]) == x - 1:
            lo = parts[-1].partition("-")[0]
            parts[-1] = f"{lo}-{x}"
        else:
            parts.append(str(x))
    return ",".join(parts)
