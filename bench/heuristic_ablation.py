"""What each late part of the hierarchical heuristic contributes, on every shipped instance: the full
heuristic, without data parallelism across cluster groups [H9], and without the global re-partition
[H8] as well (formulations/hierarchical.md). Iteration time by ``evaluate`` and CPU seconds.

    .venv/bin/python bench/heuristic_ablation.py [--instances NAME ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from hgopt.cost import build_tables
from hgopt.instances import list_instances, load_instance
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic

VARIANTS = {
    "full": HeuristicOptions(),
    "no [H9]": HeuristicOptions(cross_cluster_dp=False),
    "no [H8], no [H9]": HeuristicOptions(cross_cluster_dp=False, repartition=False),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", nargs="*", default=None)
    args = ap.parse_args(argv)
    names = args.instances or [e.name for e in list_instances()]
    head = " | ".join(f"{v} (s) | CPU (s)" for v in VARIANTS)
    print(f"| instance | {head} | full vs no [H8]/[H9] |")
    print("|---" * (2 * len(VARIANTS) + 2) + "|")
    ratios = []
    for n in names:
        inst = load_instance(n)
        tables = build_tables(inst)
        cells, times = [], []
        for opts in VARIANTS.values():
            c0 = time.process_time()
            res = plan_heuristic(inst, tables=tables, options=opts)
            cpu = time.process_time() - c0
            times.append(res.iteration_time_s)
            cells.append(f"{res.iteration_time_s:.4f} | {cpu:.2f}")
        ratio = times[-1] / times[0]
        ratios.append(ratio)
        print(f"| {n} | {' | '.join(cells)} | {ratio:.3f}x |", flush=True)
    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"\ngeometric mean, full vs no [H8]/[H9]: {gm:.3f}x over {len(ratios)} instances")
    return 0


if __name__ == "__main__":
    sys.exit(main())
