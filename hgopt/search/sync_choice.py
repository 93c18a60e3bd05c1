"""The gradient-sync fields of a finished plan ([C7o]): bucket size chosen by the kernel's price.

``choose_sync`` scores a plan with overlapped sync in 25 MiB buckets (PyTorch DDP's default) and with
one bucket per sync segment (a cap above the model's gradient bytes), both by the headline
``evaluate(...).iteration_time_s`` ([C7o] with overlap on), and returns the plan with the faster
setting. Across WAN links the per-bucket latency of many small buckets can outweigh the overlap;
inside a cluster the buckets usually hide behind the backward.

With ``zero`` (hgopt's own planners, whose stages are all ZeRO-1) it also scores the plan with ZeRO-1
off (``zero = 0``) on every stage whose memory allows it: a ZeRO-1 stage reduce-scatters its buckets
overlapped with the backward but then all-gathers its parameters after the optimizer step (half an
all-reduce that nothing hides), while a ``zero = 0`` stage's all-reduce buckets may hide entirely
behind the backward at the price of an unsharded optimizer step and state ([C7o], [C6]). The bounds
of the search hold for both (``gradsync.exposed_sync_floor`` with ``zero``).
"""

from __future__ import annotations

import dataclasses

from hgopt.cost import evaluate
from hgopt.cost.gradsync import MIB
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Plan
from hgopt.spec import Instance

__all__ = ["DEFAULT_BUCKET_MB", "choose_sync", "one_bucket_mb", "without_zero"]

DEFAULT_BUCKET_MB = 25.0


def one_bucket_mb(tables: CostTables) -> float:
    """A bucket cap (MiB) that no segment's gradients exceed: every segment is one bucket."""
    most = max(float(t.params[-1] - t.params[0]) for t in tables.by_gpu_tp.values()) * tables.dtype_bytes
    return float(int(most / MIB) + 1)


def choose_sync(plan: Plan, instance: Instance, tables: CostTables | None = None, *, zero: bool = False) -> Plan:
    """``plan`` with overlap on and the bucket cap (25 MiB or one bucket per segment) whose [C7o]
    iteration time is lower (ties keep 25 MiB); with ``zero`` also :func:`without_zero` of it (ties
    keep the plan's own ZeRO-1 setting)."""
    tables = tables or build_tables(instance)
    variants = [plan]
    if zero and (plain := without_zero(plan, instance, tables)) is not None:
        variants.append(plain)
    best, best_t = plan, None
    for v in variants:
        for mb in (DEFAULT_BUCKET_MB, one_bucket_mb(tables)):
            cand = dataclasses.replace(v, overlap_grad_sync=True, grad_bucket_mb=mb)
            ev = evaluate(cand, instance, tables)
            if ev.pipelines and (best_t is None or ev.iteration_time_s < best_t):
                best, best_t = cand, ev.iteration_time_s
    return best


def without_zero(plan: Plan, instance: Instance, tables: CostTables) -> Plan | None:
    """``plan`` with ``zero = 0`` on every ZeRO-1 stage that still fits in memory unsharded (judged by
    ``evaluate``'s memory check [C6]); None when no stage can drop ZeRO-1."""
    if not any(st.zero for p in plan.pipelines for st in p.stages):
        return None

    def flip(keep: set[tuple[int, int]]) -> Plan:
        return dataclasses.replace(plan, pipelines=tuple(
            dataclasses.replace(p, stages=tuple(st if (pi, si) in keep else dataclasses.replace(st, zero=0)
                                                for si, st in enumerate(p.stages)))
            for pi, p in enumerate(plan.pipelines)))

    every = flip(set())
    ev = evaluate(every, instance, tables)
    if not ev.pipelines:
        return None
    keep = {(r.pipeline, r.stage) for r in ev.stages
            if r.oom and plan.pipelines[r.pipeline].stages[r.stage].zero}
    if len(keep) == sum(1 for p in plan.pipelines for st in p.stages if st.zero):
        return None
    return flip(keep) if keep else every
