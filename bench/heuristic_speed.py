"""CPU time of the heuristic at 512 GPUs in 8 clusters (issue #10's planning-speed target: <= 1 s CPU),
for before/after comparisons: one warm-up run, then ``REPEATS`` timed runs on the same cost tables
(built once, outside the timing). Every run is the whole search: no time limit (the heuristic's default
10 s wall-clock limit cuts the search short on a loaded machine, which then looks faster: fewer
estimates, less CPU; a run the limit or the work limit stopped would be reported). Prints the median and the least CPU seconds (contention inflates
CPU time, never deflates it: the least is the steadier figure on a loaded machine) and the load.

    PYTHONPATH=$PWD .venv/bin/python bench/heuristic_speed.py [REPEATS] [LABEL] [--profile N] [--instance NAME]

Run it alternately in two trees (before, after) to compare them under the same load. ``--profile N``:
instead, one whole search after the warm-up under cProfile with a CPU-time clock (a loaded machine
inflates wall-clock profiles unevenly), its N costliest functions by own time and by cumulative time.
``--instance NAME``: a shipped instance instead (e.g. the 64-cluster ``scale-64r-16384-gpt175b``, whose
search must stay near-linear in the clusters)."""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_quality import speed_instance  # noqa: E402

from hgopt.cost import build_tables  # noqa: E402
from hgopt.instances import load_instance  # noqa: E402
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic  # noqa: E402


def main(argv: list[str]) -> None:
    profile = 0
    if "--profile" in argv:
        i = argv.index("--profile")
        profile, argv = int(argv[i + 1]), argv[:i] + argv[i + 2 :]
    name = None
    if "--instance" in argv:
        i = argv.index("--instance")
        name, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    repeats = int(argv[0]) if argv else 5
    label = argv[1] if len(argv) > 1 else "heuristic"
    inst = speed_instance() if name is None else load_instance(name)
    tables = build_tables(inst)
    whole = HeuristicOptions(time_limit_s=None)  # the whole search, however loaded the machine
    plan_heuristic(inst, tables=tables, options=whole)  # warm-up: imports, first-call caches
    if profile:
        prof = cProfile.Profile(time.process_time)
        c0 = time.process_time()
        prof.runcall(plan_heuristic, inst, tables=tables, options=whole)
        print(f"{label}: one profiled search, CPU {time.process_time() - c0:.3f} s, load {os.getloadavg()[0]:.1f}")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(profile)
        stats.sort_stats("cumulative").print_stats(profile)
        return
    cpus, stopped = [], set()
    for _ in range(repeats):
        c0 = time.process_time()
        res = plan_heuristic(inst, tables=tables, options=whole)
        cpus.append(time.process_time() - c0)
        stopped.add(res.stopped)
    if stopped != {""}:
        raise SystemExit(f"a run was stopped early ({sorted(stopped)}): its CPU time is not the search's")
    print(f"{label}: median CPU {statistics.median(cpus):.3f} s, least {min(cpus):.3f} s over {repeats} runs, "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
