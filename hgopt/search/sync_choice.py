"""The gradient-sync fields of a finished plan ([C7o]): bucket size chosen by the kernel's price.

``choose_sync`` scores a plan with overlapped sync in 25 MiB buckets (PyTorch DDP's default) and with
one bucket per sync segment (a cap above the model's gradient bytes), both by the headline
``evaluate(...).iteration_time_s`` ([C7o] with overlap on), and returns the plan with the faster
setting. Across WAN links the per-bucket latency of many small buckets can outweigh the overlap;
inside a cluster the buckets usually hide behind the backward. ZeRO-1 stages sync one bucket
whatever the cap, so for the planners' plans the choice only matters where a stage has ``zero = 0``.
"""

from __future__ import annotations

import dataclasses

from hgopt.cost import evaluate
from hgopt.cost.gradsync import MIB
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Plan
from hgopt.spec import Instance

__all__ = ["DEFAULT_BUCKET_MB", "choose_sync", "one_bucket_mb"]

DEFAULT_BUCKET_MB = 25.0


def one_bucket_mb(tables: CostTables) -> float:
    """A bucket cap (MiB) that no segment's gradients exceed: every segment is one bucket."""
    most = max(float(t.params[-1] - t.params[0]) for t in tables.by_gpu_tp.values()) * tables.dtype_bytes
    return float(int(most / MIB) + 1)


def choose_sync(plan: Plan, instance: Instance, tables: CostTables | None = None) -> Plan:
    """``plan`` with overlap on and the bucket cap (25 MiB or one bucket per segment) whose [C7o]
    iteration time is lower (ties keep 25 MiB)."""
    tables = tables or build_tables(instance)
    best, best_t = plan, None
    for mb in (DEFAULT_BUCKET_MB, one_bucket_mb(tables)):
        cand = dataclasses.replace(plan, overlap_grad_sync=True, grad_bucket_mb=mb)
        ev = evaluate(cand, instance, tables)
        if ev.pipelines and (best_t is None or ev.iteration_time_s < best_t):
            best, best_t = cand, ev.iteration_time_s
    return best
