"""The heuristic's plan JSON on a few instances, without a time limit (so deterministic), one file per
instance and link policy: a refactoring of ``hgopt/search/hierarchical/`` must leave them byte-identical.

    PYTHONPATH=$PWD .venv/bin/python bench/heuristic_snapshot.py OUT_DIR [instance ...]
    diff -r BEFORE_DIR AFTER_DIR

``geo-8r-llama70b-512`` names ``bench/plan_quality.py``'s ``speed_instance`` (the speed bench's 512 GPUs
in 8 clusters; ``bench/heuristic_speed.py``), which no instance file holds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hgopt.instances import load_instance  # noqa: E402
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic  # noqa: E402
from hgopt.spec import Instance  # noqa: E402

DEFAULT = ("default", "sailor-het-32+96", "geo-4r-llama7b", "scale-8r-1024-llama70b", "sailor-geo-5x128",
           "sailor-geo-5x32", "geo-8r-llama70b-512")
SPEED = "geo-8r-llama70b-512"


def _instance(name: str) -> Instance:
    if name == SPEED:
        from plan_quality import speed_instance

        return speed_instance()
    return load_instance(name)


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in argv[1:] or DEFAULT:
        t0 = time.perf_counter()
        inst = _instance(name)
        for policy in ("native", "auto"):
            res = plan_heuristic(inst, options=HeuristicOptions(time_limit_s=None, link_precision=policy))
            text = res.plan.to_json() if res.plan else "null"
            (out / f"{name}.{policy}.json").write_text(f"{text}\n{res.iteration_time_s!r}\n")
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
