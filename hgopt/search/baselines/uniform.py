"""``uniform``: a Megatron-LM / DeepSpeed-style homogeneous 3-D grid, PP × TP × DP.

What such a framework can express (Megatron-LM's ``--pipeline-model-parallel-size``,
``--tensor-model-parallel-size``, data parallelism = world / (PP·TP), ``--micro-batch-size``):

- every stage holds the same number of transformer blocks (the blocks must divide evenly by PP; the
  embedding goes with the first stage and the head with the last, as in Megatron-LM);
- every stage has the same TP degree, the same DP degree and every replica the same microbatch size;
- ranks are laid out TP-fastest, then DP, then PP, over the GPUs in the order they are listed (the
  hostfile order: clusters in the instance's order); the framework does not look at GPU speeds,
  regions or links, so a stage's replicas may sit in different clusters and it runs at the slowest;
- ZeRO-1 (Megatron's distributed optimizer / DeepSpeed stage 1) only when the grid does not fit
  without it.

The grid is placed on the largest set of GPUs where it fits: only GPUs that can hold any stage of the
grid (a homogeneous framework treats ranks as interchangeable), PP·TP·DP of them. Among the grids
that use that largest GPU count, the one with the shortest iteration time by ``evaluate`` is
returned — the best a user could get by trial runs of the grid on the real machines.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

from hgopt.cost import Evaluation, evaluate
from hgopt.cost.memory import stage_memory_parts
from hgopt.cost.pipeline import in_flight
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search.baselines._common import (
    Budget,
    block_layout,
    min_shards_to_fit,
    powers_of_two_upto,
)
from hgopt.spec import Cluster, Instance

__all__ = ["GridConfig", "grid_plan", "plan_uniform", "search_grid"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class GridConfig:
    pp: int
    tp: int
    dp: int
    mbs: int
    zero: int

    @property
    def gpus(self) -> int:
        return self.pp * self.tp * self.dp


def plan_uniform(
    instance: Instance, *, tables: CostTables | None = None, time_limit_s: float | None = None,
    scores: dict[Plan, Evaluation] | None = None,
) -> Plan | None:
    """The best homogeneous PP×TP×DP grid on the largest set of GPUs where one fits (``None``: no
    grid fits at all). ``scores`` (deadline4): filled with the ``evaluate`` of every grid scored."""
    tables = tables or build_tables(instance)
    layout = block_layout(instance)
    pps = tuple(p for p in range(1, layout.blocks + 1) if layout.blocks % p == 0)
    tps = tuple(sorted({t for c in instance.topology.clusters for t in instance.model.tps(c.gpu)}))
    return search_grid(instance, tables, pps=pps, tps=tps, zeros=(0, 1), planner="uniform", time_limit_s=time_limit_s,
                       scores=scores)


def search_grid(
    instance: Instance,
    tables: CostTables,
    *,
    pps: Sequence[int],
    tps: Sequence[int],
    zeros: Sequence[int],
    planner: str,
    time_limit_s: float | None = None,
    scores: dict[Plan, Evaluation] | None = None,
) -> Plan | None:
    """Enumerate grids, keep those on the most GPUs (then without ZeRO if possible) and return the
    one ``evaluate`` scores best (``scores``: every finalist's evaluation, by plan)."""
    budget = Budget(time_limit_s)
    found: list[tuple[GridConfig, tuple[Cluster, ...]]] = []
    shards: dict[tuple[object, ...], float] = {}  # deadline4: _needs_shards per GPU type, shared by the zeros
    for pp in pps:
        for tp in tps:
            for mbs in _mbs_choices(instance, tp):
                for zero in zeros:
                    hit = _largest_grid(instance, tables, pp, tp, mbs, zero, shards)
                    if hit is not None:
                        found.append(hit)
    if not found:
        log.info("%s: no grid fits on %s", planner, instance.name)
        return None
    top = max(cfg.gpus for cfg, _ in found)
    best_zero = min(cfg.zero for cfg, _ in found if cfg.gpus == top)
    finalists = [(cfg, cl) for cfg, cl in found if cfg.gpus == top and cfg.zero == best_zero]
    best: tuple[float, Plan] | None = None
    for cfg, clusters in finalists:
        plan = grid_plan(instance, cfg, clusters, planner=planner)
        ev = evaluate(plan, instance, tables)
        if scores is not None:
            scores[plan] = ev
        if ev.feasible and (best is None or ev.iteration_time_s < best[0]):
            best = (ev.iteration_time_s, plan)
        if budget.exhausted() and best is not None:
            break
    log.debug("%s: %d grids on %d GPUs, %.3f s", planner, len(finalists), top, budget.elapsed())
    return None if best is None else best[1]


def _mbs_choices(instance: Instance, tp: int) -> tuple[int, ...]:
    """Powers of two up to the largest profiled microbatch size (a framework user's usual choices)."""
    top = max((max(instance.model.mbss(g, tp), default=1) for g in instance.model.gpu_types()), default=1)
    return powers_of_two_upto(min(top, instance.job.global_batch))


def _largest_grid(
    instance: Instance, tables: CostTables, pp: int, tp: int, mbs: int, zero: int,
    cache: dict[tuple[object, ...], float] | None = None,
) -> tuple[GridConfig, tuple[Cluster, ...]] | None:
    """The largest DP for which enough GPUs can hold every stage of the (pp, tp, mbs, zero) grid.
    ``cache`` (deadline4): :func:`_needs_shards` by (GPU type, GPU memory, pp, tp, mbs, m), the only
    parts of a cluster it reads: 64 clusters of 5 types pay 5 (scale-64r's stand-in plan, 2.6 -> 0.5 CPU s)."""
    cache = {} if cache is None else cache

    def needs(c: Cluster, m: int) -> float:
        key = (c.gpu, c.gpu_memory_bytes, pp, tp, mbs, m)
        got = cache.get(key)
        if got is None:
            got = cache[key] = _needs_shards(instance, tables, c, tp, mbs, m, ranges)
        return got

    G = instance.job.global_batch
    usable = [c for c in instance.topology.clusters if tp in instance.model.tps(c.gpu) and c.gpus_per_node % tp == 0]
    if not usable:
        return None
    ranges = block_layout(instance).stage_ranges(pp)
    max_dp = sum(c.num_gpus for c in usable) // (pp * tp)
    for dp in range(max_dp, 0, -1):
        if G % (dp * mbs):
            continue
        m = G // (dp * mbs)
        shards = dp if zero else 1
        fit = tuple(c for c in usable if needs(c, m) <= shards)
        if sum(c.num_gpus for c in fit) >= pp * tp * dp:
            return GridConfig(pp=pp, tp=tp, dp=dp, mbs=mbs, zero=zero), fit
    return None


def _needs_shards(
    instance: Instance, tables: CostTables, c: Cluster, tp: int, mbs: int, m: int, ranges: Sequence[tuple[int, int]]
) -> float:
    """ZeRO-1 shard count a GPU of ``c`` needs to hold the most demanding stage of the grid."""
    need = 1.0
    for s, (lo, hi) in enumerate(ranges):
        base, opt = stage_memory_parts(instance, tables, c, tp, lo, hi, mbs, in_flight(len(ranges), s, m))
        need = max(need, min_shards_to_fit(base, opt, c.gpu_memory_bytes))
        if math.isinf(need):
            break
    return need


def grid_plan(instance: Instance, cfg: GridConfig, clusters: Sequence[Cluster], *, planner: str) -> Plan:
    """Lay the grid's ranks out TP-fastest, then DP, then PP over ``clusters`` in order."""
    ranges = block_layout(instance).stage_ranges(cfg.pp)
    per_stage = cfg.tp * cfg.dp
    slots = [(c.name, c.num_gpus // cfg.tp * cfg.tp) for c in clusters]
    stages = []
    cursor = 0  # first unused GPU, counted over ``slots``
    for lo, hi in ranges:
        groups = _take(slots, cursor, per_stage, cfg)
        cursor += per_stage
        stages.append(Stage(start=lo, end=hi, groups=groups, zero=cfg.zero))
    m = instance.job.global_batch // (cfg.dp * cfg.mbs)
    meta = (("grid", f"pp={cfg.pp} tp={cfg.tp} dp={cfg.dp} mbs={cfg.mbs} zero={cfg.zero}"),)
    return Plan(
        pipelines=(Pipeline(stages=tuple(stages), num_microbatches=m),),
        planner=planner,
        instance=instance.name,
        meta=meta,
    )


def _take(slots: Sequence[tuple[str, int]], start: int, count: int, cfg: GridConfig) -> tuple[ReplicaGroup, ...]:
    """Replica groups covering GPUs [start, start + count) of the concatenated cluster slots."""
    groups: list[ReplicaGroup] = []
    offset = 0
    for name, n in slots:
        lo, hi = max(start, offset), min(start + count, offset + n)
        if hi > lo:
            assert (hi - lo) % cfg.tp == 0
            groups.append(ReplicaGroup(cluster=name, tp=cfg.tp, dp=(hi - lo) // cfg.tp, mbs=cfg.mbs))
        offset += n
    assert sum(g.gpus for g in groups) == count
    return tuple(groups)
