"""Work and CPU of the grouped bound alone (``hgopt.search.master.grouped_bound``, formulations §9):
its value, whether it completed, and how many ``cheap_bounds`` calls (the per-group phase's work) it made.

    PYTHONPATH=$PWD python bench/grouped_bound_work.py INSTANCE TARGET_S DEADLINE_S

TARGET_S: the k-identical bound the grouped bound is measured against (only values below it matter);
DEADLINE_S: seconds of wall time it may take (at the deadline it returns its valid, weaker floor).
The call count is work, not time: it does not depend on the machine's load."""

from __future__ import annotations

import sys
import time

import hgopt.search.master as master
from hgopt.cost import build_tables
from hgopt.instances import load_instance
from hgopt.search.milp import link_policy


def main(argv: list[str]) -> int:
    name, target, seconds = argv[0], float(argv[1]), float(argv[2])
    calls = [0]
    cheap = master.cheap_bounds

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return cheap(*args, **kwargs)

    master.cheap_bounds = counted  # type: ignore[assignment]
    inst = load_instance(name)
    tables = build_tables(inst)
    c0, t0 = time.process_time(), time.perf_counter()
    gb = master.grouped_bound(inst, tables, link_policy(inst, {}), target=target, deadline=time.perf_counter() + seconds)
    load = open("/proc/loadavg").read().split()[0]
    print(f"{name}: grouped bound {gb.value:.6g} s complete={gb.complete} partition={gb.partition} "
          f"cheap_bounds calls={calls[0]} cpu={time.process_time() - c0:.1f} s wall={time.perf_counter() - t0:.1f} s "
          f"load={load}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
