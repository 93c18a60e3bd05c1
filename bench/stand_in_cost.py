"""deadline4: CPU seconds of the deadline's stand-in plan (``hgopt.commands._search.stand_in``, the
plan a search stopped before any incumbent returns) per instance, against ``stand_in_reserve_s``'s
estimate (slowdown 1).

    PYTHONPATH=$PWD nice .venv/bin/python bench/stand_in_cost.py scale-64r-16384-gpt175b scale-16r-4096-gpt175b default
"""

from __future__ import annotations

import argparse
import time

from hgopt.commands._search import stand_in, stand_in_reserve_s
from hgopt.instances import list_instances, load_instance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instances", nargs="*")
    args = ap.parse_args()
    print("| instance | GPUs | stand-in CPU s | reserve (slowdown 1) s | stand-in iteration s |")
    print("|---|---|---|---|---|")
    for name in args.instances or [i.name for i in list_instances()]:
        inst = load_instance(name)
        t0 = time.process_time()
        _, _, t = stand_in(inst)
        cpu = time.process_time() - t0
        gpus = sum(c.num_gpus for c in inst.topology.clusters)
        print(f"| {name} | {gpus} | {cpu:.3f} | {stand_in_reserve_s(inst):.3f} | {t:.6g} |")


if __name__ == "__main__":
    main()
