"""Benchmark of the exact planner (``--planner milp``): for every shipped instance and each available
MILP backend, the time to a proven 1 % gap, the final gap at the time limit, the model size of the
best split, and the plan's iteration time re-scored by ``evaluate``. Writes its section of
bench/RESULTS.md (``## Exact planner``) unless ``--no-write``.

    .venv/bin/python bench/exact.py [--time-limit 60] [--solvers highs,scip,...] [--instances a,b]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

from hgopt.cost import evaluate
from hgopt.instances import list_instances, load_instance
from hgopt.search import PlanOptions
from hgopt.search.exact import plan_exact
from hgopt.solvers import available_backends

HEADING = "## Exact planner (exact-planner helper)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def _trace() -> dict[str, list[tuple[float, float]]]:
    """gaps2: wrap the planner's phases (``hgopt.search.milp``'s cheap bound, relaxation, arc table and
    split MILP) to record (start, seconds) per call: where the time limit goes."""
    import hgopt.search.milp as milp

    calls: dict[str, list[tuple[float, float]]] = {}
    for name in ("cheap_bounds", "_relaxation_bound", "arc_table", "solve_split"):
        f = getattr(milp, name)

        def timed(*a: object, _f: object = f, _n: str = name, **k: object) -> object:
            s = time.perf_counter()
            out = _f(*a, **k)  # type: ignore[operator]
            calls.setdefault(_n, []).append((s, time.perf_counter() - s))
            return out

        setattr(milp, name, timed)
    return calls


def run_one(name: str, solver: str, limit: float, gap: float, trace: bool = False) -> dict[str, object]:
    inst = load_instance(name)
    calls = _trace() if trace else None
    t0 = time.perf_counter()
    try:
        res = plan_exact(inst, PlanOptions(time_limit_s=limit, gap=gap, solver=solver))
    except ValueError as exc:
        return {"instance": name, "solver": solver, "status": f"n/a ({exc})"}
    wall = time.perf_counter() - t0
    if calls is not None:
        import hgopt.search.milp as milp

        print(f"{name}: {len(milp.batch_splits(inst))} batch splits", flush=True)
        for phase, xs in calls.items():
            print(f"  {phase}: {len(xs)} calls, {sum(d for _, d in xs):.2f} s, from {xs[0][0] - t0:.1f} s to "
                  f"{xs[-1][0] + xs[-1][1] - t0:.1f} s", flush=True)
    it = evaluate(res.plan, inst).iteration_time_s if res.plan is not None else math.inf
    size = next((n for n in res.notes if "variables" in n), "")
    return {
        "instance": name, "solver": solver, "status": res.status, "wall_s": wall, "iteration_s": it,
        "bound_s": res.lower_bound_s, "gap": res.gap, "size": re.sub(r"^best split ", "", size),
        "clusters": len(inst.topology.clusters), "layers": inst.model.num_layers, "gpus": inst.topology.num_gpus(),
    }


def fmt(row: dict[str, object]) -> str:
    if "wall_s" not in row:
        return f"| {row['instance']} | {row['solver']} | {row['status']} | | | | | |"
    gap = row["gap"]
    gap_s = "n/a" if gap is None else f"{100 * float(gap):.2f} %"  # type: ignore[arg-type]
    proven = gap is not None and float(gap) <= 0.01 + 1e-12  # type: ignore[arg-type]
    bound = row["bound_s"]
    return (f"| {row['instance']} ({row['clusters']}×{row['layers']}, {row['gpus']} GPUs) | {row['solver']} | "
            f"{row['status']} | {float(row['iteration_s']):.4g} s | "  # type: ignore[arg-type]
            f"{'n/a' if bound is None else f'{float(bound):.4g} s'} | {gap_s} | "  # type: ignore[arg-type]
            f"{float(row['wall_s']):.1f} s{'' if proven else ' (limit)'} | {row['size']} |")  # type: ignore[arg-type]


def write_section(lines: list[str], command: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    body = "\n".join([
        HEADING, "",
        "`bench/exact.py`: `hgopt plan --planner milp` on every shipped instance and available MILP backend. "
        "Time = wall time until the proven gap (evaluate(plan) − lower bound) / evaluate(plan) <= 1 % "
        "(`(limit)`: the time limit ended the search first); bound = proven lower bound on the iteration "
        "time over the plan space of formulations/cluster_milp.md §1; size = the MILP of the best split "
        "(last cap). Measured on the shared 2-core machine while other agents ran (timings inflated).", "",
        f"Command: `{command}`", "",
        "| instance | solver | status | iteration (evaluate) | lower bound | gap | time | best split, MILP size |",
        "|---|---|---|---|---|---|---|---|",
        *lines, "",
    ])
    pattern = re.compile(re.escape(HEADING) + r".*?(?=\n## |\Z)", re.S)
    text = pattern.sub(body.rstrip() + "\n", text) if HEADING in text else text.rstrip() + "\n\n" + body
    RESULTS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--gap", type=float, default=0.01)
    ap.add_argument("--solvers", default=",".join(available_backends()))
    ap.add_argument("--instances", default="", help="comma-separated (default: every shipped instance)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    ap.add_argument("--trace", action="store_true", help="print per phase (cheap bound, relaxation, arc table, "
                    "split MILP) how many calls and seconds (one instance and solver per process: it wraps them)")
    args = ap.parse_args(argv)
    names = [n for n in args.instances.split(",") if n] or [e.name for e in list_instances()]
    lines = []
    for name in names:
        for solver in [s for s in args.solvers.split(",") if s]:
            row = run_one(name, solver, args.time_limit, args.gap, args.trace)
            lines.append(fmt(row))
            print(lines[-1], flush=True)
    if not args.no_write:
        write_section(lines, " ".join([".venv/bin/python", os.path.relpath(__file__, Path.cwd()), *(argv or sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
