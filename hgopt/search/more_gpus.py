"""Plans that use more GPUs of one cluster than a given plan does (the CLI's why-not lines for a
partly used cluster: "what would it cost me to use all of it?").

:func:`use_more` keeps the plan's skeleton — its pipelines, every other cluster's stages, the cluster
order, the layer block each cluster hosts and the inter-cluster boundary precisions — and re-plans
the cluster's block with the intra-cluster DP (``best_local_plan``) under a GPU floor
(``min_gpus``): first all the GPUs its copies of the block can share, then fewer, down to one more
than the plan uses; at each floor the plan's own microbatch first, then (for identical pipelines)
the nearest other divisors of the pipeline's samples, every cluster's block re-planned by the DP at
that microbatch. The first (floor, microbatch) that yields a plan that fits is kept, its layers are
re-partitioned over all stages ([H8] ``repartition``) when that is faster, its gradient-sync fields
and ZeRO-1 chosen as hgopt's planners choose them (``choose_sync(..., zero=True)``), and it is scored
by ``evaluate``.

No cost formula lives here: the DP's and ``evaluate``'s are the kernel's."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from hgopt.cost import evaluate
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Boundary, Pipeline, Plan, Stage
from hgopt.spec import Instance

__all__ = ["MoreGpus", "floors", "use_more"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoreGpus:
    """What :func:`use_more` found for one cluster."""

    cluster: str
    gpus_used: int
    """The cluster's GPUs in the given plan."""
    gpus: int
    plan: Plan | None
    """The plan that uses more of the cluster (None: none found, ``note`` says why)."""
    iteration_time_s: float = math.inf
    """``evaluate(plan).iteration_time_s``."""
    floor: int = 0
    """GPUs per copy of the cluster's block the DP had to use at least."""
    microbatch: int = 0
    """The microbatch of the pipelines holding the cluster in ``plan``."""
    tried: tuple[tuple[int, int], ...] = ()
    """(floor, microbatch) tried, in order."""
    note: str = ""


def floors(used: int, budget: int) -> tuple[int, ...]:
    """GPU floors per copy of the block, most first: the whole budget, then three quarters, half and
    a quarter of the way from ``used`` to it, then ``used + 1`` (distinct, all above ``used``)."""
    if budget <= used:
        return ()
    span = budget - used
    cand = [budget] + [used + math.ceil(span * f) for f in (0.75, 0.5, 0.25)] + [used + 1]
    return tuple(sorted({c for c in cand if used < c <= budget}, reverse=True))


def _block(pipe: Pipeline, cluster: str) -> tuple[int, int] | None:
    """[first, last] stage indices of ``cluster`` in ``pipe`` (None: absent); ValueError when its
    stages are not contiguous or share a stage with another cluster."""
    idx = [i for i, s in enumerate(pipe.stages) if cluster in s.clusters()]
    if not idx:
        return None
    if idx != list(range(idx[0], idx[-1] + 1)):
        raise ValueError("its stages are not contiguous in a pipeline")
    if any(len(pipe.stages[i].groups) != 1 for i in idx):
        raise ValueError("a stage of it also holds replicas of another cluster")
    return idx[0], idx[-1]


def _replace_block(pipe: Pipeline, first: int, last: int, stages: tuple[Stage, ...]) -> Pipeline:
    """``pipe`` with stages [first, last] replaced by ``stages``; the boundaries at the block's edges
    keep their precisions, those inside it are native (as the DP's local pipelines are)."""
    new_stages = pipe.stages[:first] + stages + pipe.stages[last + 1 :]
    if not pipe.boundaries:
        return dataclasses.replace(pipe, stages=new_stages)
    b = [pipe.boundary(i) for i in range(len(pipe.stages) - 1)]
    bounds = b[:first] + [Boundary()] * (len(stages) - 1) + b[last:]
    return dataclasses.replace(pipe, stages=new_stages, boundaries=tuple(bounds))


def use_more(plan: Plan, instance: Instance, cluster: str, *, tables: CostTables | None = None,
             deadline: float | None = None) -> MoreGpus:
    """The plan with ``cluster``'s block re-planned by the intra-cluster DP to use more of its GPUs
    (see the module docstring); ``deadline``: ``time.monotonic()`` after which no further floor is
    tried."""
    from hgopt.search.intra import best_local_plan
    from hgopt.search.sync_choice import choose_sync

    tables = tables or build_tables(instance)
    c = instance.topology.cluster(cluster)
    used = plan.gpus_by_cluster().get(cluster, 0)

    def none(note: str, tried: tuple[tuple[int, int], ...] = ()) -> MoreGpus:
        return MoreGpus(cluster=cluster, gpus_used=used, gpus=c.num_gpus, plan=None, tried=tried, note=note)

    if used == 0:
        return none("the plan does not use it (the why-not line of an idle cluster asks the heuristic)")
    try:
        blocks = [(i, _block(p, cluster)) for i, p in enumerate(plan.pipelines)]
    except ValueError as exc:
        return none(f"the plan's shape is outside what the intra-cluster DP re-plans: {exc}")
    holding = [(i, b) for i, b in blocks if b is not None]
    first_block = [plan.pipelines[i].stages[b[0] : b[1] + 1] for i, b in holding]
    if any(blk != first_block[0] for blk in first_block):
        return none("the plan's pipelines hold different layouts of it")
    pi, (first, last) = holding[0]
    pipe = plan.pipelines[pi]
    block = first_block[0]
    replicas = len(holding)
    per_copy = sum(s.gpus for s in block)
    budget = c.num_gpus // replicas
    ladder = floors(per_copy, budget)
    if not ladder:
        return none(f"its {replicas} copies of the block already use {per_copy} GPUs each, all "
                    f"{c.num_gpus} // {replicas} they can share")
    after = max(len(plan.pipelines[i].stages) - 1 - b[1] for i, b in holding)
    before = min(b[0] for _, b in holding)
    mb = block[0].microbatch
    family = all(plan.pipelines[i] == pipe for i, _ in holding)
    others = _other_microbatches(pipe, mb, MICROBATCHES) if family else ()
    tried: list[tuple[int, int]] = []
    for floor in ladder:
        for b in (mb, *others):
            if deadline is not None and tried and time.monotonic() > deadline:
                return none("the time for why-not lines ran out (--why-not-time)", tuple(tried))
            tried.append((floor, b))
            if b == mb:
                lp = best_local_plan(instance, tables, cluster, block[0].start, block[-1].end, microbatch=mb,
                                     num_microbatches=pipe.num_microbatches, gpu_budget=budget,
                                     stages_before=before, stages_after=after, replicas=replicas, min_gpus=floor)
                pipes = list(plan.pipelines)
                if lp is not None:
                    for i, (f, l) in holding:
                        pipes[i] = _replace_block(pipes[i], f, l, lp.stages)
                new = None if lp is None else tuple(pipes)
            else:
                new = _rechained(plan, instance, tables, [i for i, _ in holding], cluster, floor, b)
            if new is None:
                log.debug("use_more %s: no local plans with >= %d GPUs per copy at microbatch %d", cluster, floor, b)
                continue
            how = f"{cluster}: at least {floor} GPUs per copy of its block, microbatch {b}"
            got = _best_fitting(dataclasses.replace(plan, pipelines=new, meta=(("more_gpus", how),)), instance, tables)
            if got is None:
                log.debug("use_more %s: >= %d GPUs per copy at microbatch %d does not fit", cluster, floor, b)
                continue
            # the DP builds ZeRO-1 stages: also try them without it where memory allows, as the planners do
            out = choose_sync(got, instance, tables, zero=True)
            note = f"the same skeleton, its block re-planned with at least {floor} GPUs per copy" + (
                "" if b == mb else f" at microbatch {b} instead of {mb}, every block re-planned at it")
            return MoreGpus(cluster=cluster, gpus_used=used, gpus=c.num_gpus, plan=out,
                            iteration_time_s=evaluate(out, instance, tables).iteration_time_s, floor=floor,
                            microbatch=b, tried=tuple(tried), note=note)
    return none(f"the intra-cluster DP found no layout of its layers {block[0].start}-{block[-1].end - 1} with "
                f"more than {per_copy} GPUs per copy that fits (memory, or the microbatch "
                f"{'sizes tried' if others else mb} and the layer count limit tp x dp x stages)", tuple(tried))


MICROBATCHES = 6
"""Other microbatch sizes tried (the divisors of a pipeline's samples nearest the plan's own) when
the plan's own admits no layout of the cluster with more GPUs."""


def _other_microbatches(pipe: Pipeline, mb: int, n: int) -> tuple[int, ...]:
    """Up to ``n`` divisors of the pipeline's samples other than ``mb``, nearest to it first (by ratio)."""
    samples = pipe.samples
    divs = [d for d in range(1, samples + 1) if samples % d == 0 and d != mb]
    return tuple(sorted(divs, key=lambda d: (abs(math.log(d / mb)), d))[:n])


def _best_fitting(cand: Plan, instance: Instance, tables: CostTables) -> Plan | None:
    """``cand`` or its [H8] re-partition, whichever ``evaluate`` finds faster among those that fit."""
    from hgopt.search.repartition import repartition

    best: tuple[float, Plan] | None = None
    ev = evaluate(cand, instance, tables)
    if ev.feasible:
        best = (ev.iteration_time_s, cand)
    rep = repartition(cand, instance, tables)
    if rep is not None and (best is None or rep.iteration_time_s < best[0]):
        best = (rep.iteration_time_s, rep.plan)
    return None if best is None else best[1]


def _chain(pipe: Pipeline) -> list[tuple[str, int, int]] | None:
    """The pipeline's cluster blocks in order: (cluster, first stage, last stage); None when a stage
    holds several groups or a cluster's stages are not contiguous."""
    out: list[tuple[str, int, int]] = []
    for i, s in enumerate(pipe.stages):
        if len(s.groups) != 1:
            return None
        name = s.groups[0].cluster
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1], i)
        elif any(name == o[0] for o in out):
            return None
        else:
            out.append((name, i, i))
    return out


def _rechained(plan: Plan, instance: Instance, tables: CostTables, family: list[int], cluster: str, floor: int,
               mb: int) -> tuple[Pipeline, ...] | None:
    """The identical pipelines ``family`` of ``plan`` at microbatch ``mb``: the same cluster order and
    layer blocks, every block re-planned by the intra-cluster DP back to front (``cluster``'s with at
    least ``floor`` GPUs per copy), each cluster's GPUs not used by the other pipelines shared by the
    family's copies; boundaries between clusters keep their precisions. None when a block has no plan."""
    from hgopt.search.intra import best_local_plan

    pipe = plan.pipelines[family[0]]
    chain = _chain(pipe)
    if chain is None:
        return None
    r = len(family)
    outside: dict[str, int] = {}
    for i, p in enumerate(plan.pipelines):
        if i not in family:
            for s in p.stages:
                for g in s.groups:
                    outside[g.cluster] = outside.get(g.cluster, 0) + g.gpus
    m = pipe.samples // mb
    after = 0
    blocks: list[tuple[Stage, ...]] = []
    for name, first, last in reversed(chain):
        budget = (instance.topology.cluster(name).num_gpus - outside.get(name, 0)) // r
        want = floor if name == cluster else 0
        if budget < max(want, 1):
            return None
        lp = best_local_plan(instance, tables, name, pipe.stages[first].start, pipe.stages[last].end, microbatch=mb,
                             num_microbatches=m, gpu_budget=budget, stages_after=after, replicas=r, min_gpus=want)
        if lp is None:
            return None
        blocks.append(lp.stages)
        after += len(lp.stages)
    blocks.reverse()
    stages = tuple(s for blk in blocks for s in blk)
    bounds: list[Boundary] = []
    if pipe.boundaries:
        for (_, _, last), blk in zip(chain, blocks):
            bounds += [Boundary()] * (len(blk) - 1)
            if last + 1 < len(pipe.stages):
                bounds.append(pipe.boundary(last))
    new = dataclasses.replace(pipe, stages=stages, num_microbatches=m, boundaries=tuple(bounds))
    return tuple(new if i in family else p for i, p in enumerate(plan.pipelines))
