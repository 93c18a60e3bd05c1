"""The heuristic's plan JSON on a few instances, without a time limit (so deterministic), one file per
instance and link policy: a refactoring of ``hgopt/search/hierarchical/`` must leave them byte-identical.

    PYTHONPATH=$PWD .venv/bin/python bench/heuristic_snapshot.py OUT_DIR [instance ...]
    diff -r BEFORE_DIR AFTER_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hgopt.instances import load_instance
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic

DEFAULT = ("default", "sailor-het-32+96", "geo-4r-llama7b", "scale-8r-1024-llama70b", "sailor-geo-5x128",
           "sailor-geo-5x32")


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in argv[1:] or DEFAULT:
        t0 = time.perf_counter()
        inst = load_instance(name)
        for policy in ("native", "auto"):
            res = plan_heuristic(inst, options=HeuristicOptions(time_limit_s=None, link_precision=policy))
            text = res.plan.to_json() if res.plan else "null"
            (out / f"{name}.{policy}.json").write_text(f"{text}\n{res.iteration_time_s!r}\n")
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
