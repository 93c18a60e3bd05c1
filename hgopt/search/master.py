"""The certificate over data parallelism across cluster groups [G1]..[G5] (formulations/cluster_milp.md, §9).

A *grouped plan* splits the clusters into n >= 2 groups on disjoint cluster sets; group g trains a
batch share b_g (Σ b_g = global batch) with k_g identical pipelines of the MILP's space on its own
clusters, and every layer's gradients are all-reduced across the groups (``Plan.grad_sync_precision``).
This module bounds the iteration time of every such plan from below, so that the exact planner's
certificate covers the union of what hgopt's planners return: min(bound of the k-identical space
(``plan_milp``), bound of the grouped space (:func:`grouped_bound`)).

[G1] Per pipeline. A group's pipelines run on its own clusters and links only (the boundaries of
another group never share them), so each pipeline's time P_p is the one it has in the group's
sub-instance (``groups.sub_instance``). The first stage of every pipeline holds layer 0; the bucket
holding layer 0 is the last of that stage's sync and ready only when its last backward ends, at P_p
([C7o], ``pipeline.last_backward_ends``); it is one collective among the first stages of every group
(it starts when the slowest is ready, ``gradsync.bucket_schedule``). So
    T >= max_p P_p + X,   X = the cross-cluster ring of layer 0's gradients over the clusters holding it,
which contain one cluster of each group: X >= min over one representative per group of
``groups.wan_allreduce_floor`` (the cheapest gradient precision the link policy allows). The intra-cluster
part of that bucket and the optimizer step are left out (>= 0).

[G2] Per group and share. Every plan of group S with share b has k identical pipelines, microbatch B and
m = b/(k·B) microbatches for some split of b; each pipeline's time is at least the cheap bound of that
split [B4] without its tail (``CheapBounds`` with ``s_lb = 0``: the bound is w·tau + fill + s_lb in every
interval, so dropping s_lb leaves a bound on (m − 1)·bottleneck + fill). The cheap bound's bottleneck
and fill rows do not depend on m (memory is checked at one microbatch in flight, the most permissive),
so they are computed once per (group, k, B) and re-weighted with w = m − 1 for every share.
PB_S(b) = min over the splits of b. And P >= b / rate_S (``groups.rate_bound``: the group's GPUs at
their least GPU-seconds per sample). A group whose GPUs cannot hold one copy of the model's state
(:func:`holds_a_replica`) trains nothing. PB_S is one memoised :class:`ShareTable` per group, shared by
every partition and look-alike group, with budget classes of k sharing structures ([G2t], §9).

[G3] Master. For a partition π of the clusters into n >= 2 groups (a plan that leaves clusters idle or
uses fewer groups is a plan of the partition that merges those clusters into a group: a group's bound
covers plans on a subset of its clusters, and fewer representatives only shorten X), the pipelines
finish by t only if every group's share is one it can train within t; relaxing Σ b_g = G to
Σ cap_S(t) >= G and every cap_S(t) >= 1 (each group of a plan of π trains a sample; a plan with an
empty group is one of a coarser partition), with cap_S(t) the largest share b <= G with PB_S(b) <= t (scanned downward from
rate_S·t: every share is checked, none is skipped), gives a superset of the feasible t, so
    bound(π) = X(π) + min { t : Σ_{S in π} cap_S(t) >= G }
by bisection on t (feasibility is monotone in t; the bound kept is the largest t found infeasible).
The grouped bound is min over every partition (Bell(C) − 1 of them; at most MAX_CLUSTERS clusters:
above, grouped plans are named outside the certified space, ``GroupedBound.covered``).

[G4] Pruning and the deadline. Only a bound below ``target`` (the k-identical space's bound) changes the
certificate, so a partition whose rate floor G/Σ rate + X or whose test at t = target − X already fails
is settled at >= target. Every loop checks the deadline; at a stop each unfinished partition keeps its
valid floor (its largest infeasible t so far, at least G/Σ rate, plus X), so the result is always a
bound, weaker when the time ran out (``GroupedBound.complete``).

[G6] Whole-gradient floor W(π) (:func:`gradient_floor`). In a plan of π every layer is held once in
each group, so every sync segment's cross-cluster ring spans >= n = |π| clusters, one per group at least,
and carries the segment's gradient (``segment_allreduce``: the largest tp_min·shard bytes among its
clusters, >= B_l = Σ_layers min over the partition's (GPU, tp) of tp·shard bytes, times the cheapest
gradient precision's factor). Two parts of ``evaluate`` price all of it:
(a) the [C5w] aggregate cap: for two groups g, h, every segment's ring uses a pair {a in g, b in h},
so the loads (``_segments_and_loads``) of those pairs sum to >= B; a stage holding a segment over {a, b}
ends its sync >= its first bucket's start + allreduce_time(aggregate(a→b), load(a, b), k >= n); when
every link a→b (g to h) is capped, the largest of these is >= 2(n−1)/n·B / Σ_{a,b} peak(aggregate(a→b))
+ 2(n−1)·min λ (the loads cannot all be below their links' share); a ZeRO-1
stage pays only the reduce-scatter share of it there (``gradsync.ZERO_PHASE`` = 1/2 in the zero1ov
kernel, 1 before it: the floor takes 1/2, valid in both). T >= that.
(b) per flow: one pipeline of group g has at most min(L, N_g) stages; its stages' buckets cover every
layer, each stage's buckets run one after another, each >= the per-flow ring of its bytes (ring over
>= n clusters: 2(n−1)/n·bytes / the best per-flow rate of the slowest link among one representative
per group, or of those clusters' NICs); a ZeRO-1 stage's reduce-scatters (1/2 of it) plus its
all-gather after the step (1/2, native >= the cheapest precision) are the whole ring. So the stage with
most bytes runs >= ring(B)/min(L, N_g) within the iteration, T >= max over g of that.
Different stages' syncs do not share a NIC or an uncapped link in ``evaluate`` (each bucket is priced
alone, per flow), so no floor on the whole gradient over "the cut's parallel bandwidth" holds beyond
(a) and (b): bound(π) = max(X(π) + min{t : ...}, W(π)).

[G5] Outside the certificate: groups whose pipelines are not identical within the group, two groups
sharing a cluster (``PLAN_SPACE_OUTSIDE``); stages whose replicas span several clusters are named once, by
the exact planner (``hgopt.search.exact``, hetgap).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from hgopt.cost.comm import gradient_bytes, ring_edge_bytes, ring_latency_s
from hgopt.cost.gradsync import ZERO_PHASE
from hgopt.cost.links import max_rate_from
from hgopt.cost.tables import CostTables, link_bytes_factor
from hgopt.plan import Plan
from hgopt.search import PlanResult
from hgopt.search.blocks import CheapBounds, LinkPolicy, cheap_bounds
from hgopt.search.groups import grad_precisions, rate_bound, sub_instance, wan_allreduce_floor
from hgopt.search.milp import _divisors
from hgopt.search.precisions import allowed_link_precisions
from hgopt.spec import Instance

__all__ = ["GROUPED_SPACE", "MAX_CLUSTERS", "PLAN_SPACE_OUTSIDE", "GroupedBound", "ShareTable", "certify", "cross_floor", "gradient_floor", "grouped_bound", "holds_a_replica",
           "name_outside", "partition_time", "partitions"]

log = logging.getLogger(__name__)
INF = math.inf
MAX_CLUSTERS = 8
"""Above this many clusters the partitions are not enumerated (Bell(9) = 21,147) and the grouped space
is bounded by its rate floor alone."""
BISECT_RATIO = 1.0005
"""The bisection on a partition's pipeline time stops when its bracket is this narrow (relative)."""
ZERO_RS_SHARE = ZERO_PHASE
"""The share of a ZeRO-1 segment's [C5] all-reduce its reduce-scatter costs (the kernel's
``gradsync.ZERO_PHASE``) [G6]."""

class _OutOfTime(Exception):
    pass


GROUPED_SPACE = (
    "data parallelism across cluster groups: n >= 2 groups on disjoint cluster sets, group g training any "
    "batch share b_g (sum = global_batch) with k_g identical pipelines of the space above on its own "
    "clusters, every layer's gradients all-reduced across the groups in {precisions}"
)
PLAN_SPACE_OUTSIDE = (
    "outside: pipelines that are not identical within a group, two groups sharing a cluster"
)  # hetgap: stages mixing clusters are named once, by hgopt.search.exact

OUTSIDE_WHEN_OFF = ("; outside: data parallelism across cluster groups (not bounded: grouped_bound off, or auto "
                    "without a faster grouped plan), pipelines that are not identical")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupedBound:
    """A lower bound on the iteration time of every grouped plan [G3] (n >= 2 groups)."""

    value: float
    """min(target, the bound): ``target`` itself means no grouped plan can beat it."""
    partition: tuple[tuple[str, ...], ...] = ()
    """The partition that sets ``value`` (empty when ``target`` does)."""
    cross_s: float = 0.0
    """X of that partition [G1]."""
    gradient_s: float = 0.0
    """W of that partition [G6] (the whole-gradient floor)."""
    partitions: int = 0
    settled_by_rate: int = 0
    """Partitions settled at >= target by their rate floor alone."""
    complete: bool = True
    """False when the deadline (or the cluster count) left partitions at their rate floor [G4]."""
    precisions: tuple[str, ...] = ("native",)
    """The gradient precisions across groups the bound covers."""
    covered: bool = True
    """False above MAX_CLUSTERS clusters: grouped plans are not bounded and are named outside."""

    def describe(self) -> str:
        if not self.covered:
            return (f"data parallelism across cluster groups not bounded (more than {MAX_CLUSTERS} clusters: "
                    "its partitions are not enumerated); it is outside the certified space")
        if not self.partition:
            return f"no plan with data parallelism across cluster groups can beat {self.value:.6g} s"
        groups = " | ".join("+".join(g) for g in self.partition)
        return (f"data parallelism across cluster groups: bound {self.value:.6g} s at groups {groups} "
                f"(cross-group all-reduce of layer 0 >= {self.cross_s:.4g} s, of every layer >= {self.gradient_s:.4g} s)"
                + ("" if self.complete else "; the time limit left some partitions at their rate floor"))


class ShareTable:
    """[G2] PB_S(b) and cap_S(t) of one group S, memoised, shared by every partition S is in (and by
    look-alike groups, ``_alike``). PB_S(b) = max(b / rate_S, min over the splits (k, B, m) of b of the
    split's cheap bound without its tail): every split's cheap-bound structure is built once (at one
    microbatch: the longest grid, the tightest value at every weight [B4]) and re-weighted with
    w = m − 1 for every m; the pipeline counts k with the same per-cluster budgets N_c // k share the
    structure of the least of them (``_class``). Only values below
    ``limit`` are needed (a partition whose pipelines need that long is settled [G4]): a bound >= it is
    kept as "+inf (>= limit)".
    Raises _OutOfTime at ``deadline`` (what is memoised stays valid)."""

    def __init__(self, instance: Instance, tables: CostTables, group: tuple[str, ...], links: LinkPolicy, *,
                 limit: float = INF, deadline: float = INF, stop: Callable[[], bool] | None = None) -> None:
        self.sub = sub_instance(instance, group, instance.job.global_batch)
        self.tables, self.links, self.limit, self.deadline = tables, links, limit, deadline
        self.stop = stop  # determinism: a stop request ends it like the deadline
        self.G = instance.job.global_batch
        self.rate = sum(rate_bound(instance, tables, c) for c in group)
        self.gpus = self.sub.topology.num_gpus()
        self._sizes = [c.num_gpus for c in self.sub.topology.clusters]
        self._classes: dict[int, int] = {}
        self.structures = 0
        """cheap_bounds calls made (the work of this table)."""
        self._cheap: dict[tuple[int, int], CheapBounds] = {}
        self._pb: dict[int, float] = {}
        self._lb: dict[int, float] = {}  # a lower bound of PB_S(b) where it is not known exactly
        self._by_microbatch: dict[int, list[tuple[int, CheapBounds]]] = {}

    def pipeline_bound(self, b: int) -> float:
        """PB_S(b): a lower bound on the pipeline time of every plan of the group with share b (inf:
        >= ``limit``) [G2]."""
        if b not in self._pb:
            best = b / self.rate if self.rate > 0 else INF
            lowest = INF
            for k in _divisors(b):  # every (k, B, m) with k·B·m = b, k <= the group's GPUs
                if k > self.gpus or lowest <= best:
                    break
                for B in _divisors(b // k):
                    m = b // (k * B)
                    kmin = self._class(k)
                    cb = self._structure((kmin, B), kmin, B)
                    lowest = min(lowest, self._value(cb, m))
                    if lowest <= best:
                        break  # the rate floor is the larger already
            v = max(best, lowest)
            self._pb[b] = INF if v >= self.limit else v
        return self._pb[b]

    def at_most(self, b: int, t: float) -> bool:
        """Whether PB_S(b) <= t, building only the structures that can decide it: a split's floor
        from what is built is its own value, else the largest value of a built split (k', B, m) with
        k' below its class (more GPUs per pipeline, hand-overs no slower: a relaxation of it, as the
        classes are [G2t]); the splits are decided by floor, lowest first, until one is <= t."""
        if b in self._pb:
            return self._pb[b] <= t
        if self.rate <= 0 or b / self.rate > t or self._lb.get(b, 0.0) > t:
            return False
        splits = []
        for k in _divisors(b):
            if k > self.gpus:
                break
            kmin = self._class(k)
            splits.extend((kmin, B, b // (k * B)) for B in _divisors(b // k))
        floors = sorted((self._floor(kmin, B, m), i, kmin, B, m) for i, (kmin, B, m) in enumerate(splits))
        known = []
        for f, _, kmin, B, m in floors:
            if f <= t:
                f = max(f, self._value(self._structure((kmin, B), kmin, B), m))
                if f <= t:
                    return True
            known.append(f)
        self._lb[b] = max(self._lb.get(b, 0.0), min(known, default=INF))
        return False

    def _floor(self, kmin: int, B: int, m: int) -> float:
        if (kmin, B) in self._cheap:
            return self._value(self._cheap[(kmin, B)], m)
        return max((self._value(cb, m) for j, cb in self._by_microbatch.get(B, ()) if j < kmin), default=0.0)

    @staticmethod
    def _value(cb: CheapBounds, m: int) -> float:
        return dataclasses.replace(cb.reweighted(m), s_lb=0.0).value

    def _class(self, k: int) -> int:
        """The least k' whose per-cluster budgets N_c // k' are those of k. The split (k', B)'s cheap
        bound holds for every plan of (k, B) [G2]: its pipelines fit the same budgets, and the only
        other part that reads the pipeline count, the hand-overs' floor (``links.handover_lower_bound``:
        all copies' bytes on an aggregate cap and on a node's NIC), grows with it (the tail, which also
        reads it, is dropped here)."""
        if k not in self._classes:
            budgets = [n // k for n in self._sizes]
            self._classes[k] = next(j for j in range(1, k + 1) if [n // j for n in self._sizes] == budgets)
        return self._classes[k]

    def _structure(self, key: tuple[int, int], k: int, B: int) -> CheapBounds:
        if key not in self._cheap:
            if time.perf_counter() > self.deadline or (self.stop is not None and self.stop()):
                raise _OutOfTime
            self._cheap[key] = cheap_bounds(self.sub, self.tables, replicas=k, microbatch=B, num_microbatches=1,
                                            links=self.links)
            self._by_microbatch.setdefault(B, []).append((k, self._cheap[key]))
            self.structures += 1
        return self._cheap[key]

    def capacity(self, t: float, need: int = 1) -> int:
        """cap_S(t) when it is >= ``need``: the largest share b <= G − 1 whose bound PB_S(b) is <= t,
        every share from rate_S·t down to ``need`` checked [G3]; 0 when none of them is (cap_S(t) <
        need). Exact for t < ``limit``."""
        top = self.G - 1
        if math.isfinite(self.rate * t):
            top = min(top, math.floor(self.rate * t * (1 + 1e-12)))
        for b in range(top, max(need, 1) - 1, -1):
            if self.at_most(b, t):
                return b
        return 0

    def rate_capacity(self, t: float) -> int:
        """An upper bound of cap_S(t) that costs nothing: min(G − 1, rate_S·t)."""
        if not math.isfinite(self.rate * t):
            return self.G - 1
        return min(self.G - 1, math.floor(self.rate * t * (1 + 1e-12)))


def partitions(items: Sequence[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of ``items`` into non-empty blocks (blocks and members in input order)."""
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in partitions(rest):
        yield ((first,), *part)
        for i in range(len(part)):
            yield (*part[:i], (first, *part[i]), *part[i + 1 :])


def cross_floor(instance: Instance, tables: CostTables, part: tuple[tuple[str, ...], ...], precision: str,
                memo: dict[tuple[str, ...], float] | None = None) -> float:
    """X(π) [G1]: the least ring of layer 0's gradients over one representative cluster per group
    (``memo``: by the sorted representatives, at most 2^C of them)."""
    memo = {} if memo is None else memo
    best = INF
    for reps in itertools.product(*part):
        key = tuple(sorted(reps))
        if key not in memo:
            memo[key] = wan_allreduce_floor(instance, tables, key, precision)
        best = min(best, memo[key])
    return best


def min_gradient_bytes(instance: Instance, tables: CostTables, clusters: Sequence[str], precision: str) -> float:
    """[G6] B: the least bytes the cross-cluster rings of all sync segments of a plan on ``clusters``
    carry together (every layer's tp·shard bytes at the cheapest (GPU, tp) of those clusters, in the
    training dtype, times ``precision``'s factor; ``segment_allreduce`` carries the largest of them)."""
    need = None
    for c in clusters:
        gpu = instance.topology.cluster(c).gpu
        for tp in instance.model.tps(gpu):
            shard = tp * np.diff(tables.table(gpu, tp).params)
            need = shard if need is None else np.minimum(need, shard)
    if need is None:
        return 0.0
    return float(gradient_bytes(float(need.sum()), tables.dtype_bytes, link_bytes_factor(instance.model.dtype, precision)))


def gradient_floor(instance: Instance, tables: CostTables, part: tuple[tuple[str, ...], ...], precision: str) -> float:
    """[G6] W(π): a lower bound on every plan of partition ``part``'s iteration time from the
    cross-group traffic of the whole gradient: (a) the aggregate caps between single-cluster groups,
    (b) the per-flow rings of the stage with most bytes."""
    n = len(part)
    if n < 2:
        return 0.0
    topo = instance.topology
    B = min_gradient_bytes(instance, tables, [c for g in part for c in g], precision)
    if B <= 0:
        return 0.0
    ring_bytes = ring_edge_bytes(B, n)  # [C5] per ring edge: 2(n − 1)/n · B
    best = 0.0
    for i, g in enumerate(part):  # (a): every segment's ring uses a pair (a in g, b in h); Σ loads >= B
        for h in part[i + 1 :]:
            for src, dst in ((g, h), (h, g)):
                aggs = [topo.link_spec(a, b).aggregate for a in src for b in dst]
                if any(x is None for x in aggs):
                    continue  # an uncapped link between them: no shared pipe to fill
                cap = sum(max_rate_from(x, 1.0) for x in aggs)
                t = ring_bytes / cap + ring_latency_s(min(x.latency_s for x in aggs), n)
                best = max(best, ZERO_RS_SHARE * t)
    # (b): seconds per byte of a ring over one representative per group, the cheapest choice
    per_byte = INF
    for reps in itertools.product(*part):
        worst = max(1.0 / max_rate_from(topo.cluster(c).inter_node, 1.0) for c in reps)
        for a in reps:
            for b in reps:
                if a != b:
                    worst = max(worst, 1.0 / max_rate_from(topo.link_spec(a, b).bandwidth, 1.0))
        per_byte = min(per_byte, worst)
    L = tables.num_layers
    stages = min(min(L, sum(topo.cluster(c).num_gpus for c in g)) for g in part)
    return max(best, ring_bytes * per_byte / max(stages, 1))


def grouped_bound(instance: Instance, tables: CostTables, links: LinkPolicy, *, link_precision: str = "native",
                  target: float = INF, deadline: float = INF, stop: Callable[[], bool] | None = None) -> GroupedBound:
    """[G3] A lower bound on every grouped plan's iteration time, min(target, ...). determinism: ``stop``
    (e.g. ``Progress.stop_requested``) answering True ends it as the deadline does [G4]: still a bound."""
    names = [c.name for c in instance.topology.clusters]
    precs = grad_precisions(instance, allowed_link_precisions(instance, link_precision))
    cheapest = precs[-1]
    if len(names) < 2:
        return GroupedBound(value=target, precisions=precs)
    G = instance.job.global_batch
    rate_total = sum(rate_bound(instance, tables, c) for c in names)
    floor_t = G / rate_total if rate_total > 0 else INF
    if len(names) > MAX_CLUSTERS:
        # not enumerated: the space stays k identical pipelines and grouped plans are named outside
        # (a rate floor over all partitions would be a bound, but far below any plan: it would void the gap)
        return GroupedBound(value=target, covered=False, complete=False, precisions=precs)
    best, best_part, best_x = target, (), 0.0
    count = by_rate = 0
    complete = True
    todo = [p for p in partitions(names) if len(p) >= 2]
    memo: dict[tuple[str, ...], float] = {}
    fit: dict[tuple[str, ...], bool] = {}
    xs: dict[tuple[tuple[str, ...], ...], float] = {}
    ws: dict[tuple[tuple[str, ...], ...], float] = {}

    def part_floor(p: tuple[tuple[str, ...], ...]) -> float:
        # every group of a plan of p trains >= 1 sample, so every group must hold a model replica
        for g in p:
            if g not in fit:
                fit[g] = holds_a_replica(instance, tables, g)
            if not fit[g]:
                return INF
        xs[p] = cross_floor(instance, tables, p, cheapest, memo)
        ws[p] = gradient_floor(instance, tables, p, cheapest)
        return max(floor_t + xs[p], ws[p])

    # cheapest first: the partitions whose rate floor is lowest are the ones that can set the bound
    keyed = sorted(((part_floor(p), i, p) for i, p in enumerate(todo)))
    # a group's pipeline time matters only below target − X of a partition it is in [G4]
    limit = target - min(xs.values(), default=0.0)
    tabs: dict[object, ShareTable] = {}  # per group, shared by every partition it is in (and by look-alikes)
    for floor_p, _, part in keyed:
        count += 1
        x, w = xs.get(part, 0.0), ws.get(part, 0.0)
        if floor_p >= best:
            by_rate += 1
            continue
        if time.perf_counter() > deadline or (stop is not None and stop()):
            complete = False
            best, best_part, best_x = floor_p, part, x  # sorted: the least floor left bounds the rest
            break
        for g in part:
            key = _alike(instance, g)
            if key not in tabs:
                tabs[key] = ShareTable(instance, tables, g, links, limit=limit, deadline=deadline, stop=stop)
        gt = [tabs[_alike(instance, g)] for g in part]
        try:
            lo = partition_time(gt, G, floor_t, best - x)
        except _OutOfTime as stop:
            complete = False
            lo = stop.args[0] if stop.args else floor_t
            value = max(lo + x, w, floor_p)
            # the rest keep their floors: the least of them (sorted) bounds them all
            rest = keyed[count:]
            if rest and rest[0][0] < value:
                value, part, x = rest[0][0], rest[0][2], xs.get(rest[0][2], 0.0)
            if value < best:
                best, best_part, best_x = value, part, x
            break
        value = max(lo + x, w)
        if value < best:
            best, best_part, best_x = value, part, x
        log.debug("partition %s: bound %.6g s (X %.4g s, W %.4g s)", part, value, x, w)
    return GroupedBound(value=best, partition=best_part if best < target else (), cross_s=best_x,
                        gradient_s=ws.get(best_part, 0.0) if best < target else 0.0,
                        partitions=count, settled_by_rate=by_rate, complete=complete, precisions=precs)


def holds_a_replica(instance: Instance, tables: CostTables, group: tuple[str, ...]) -> bool:
    """[G2] Whether the group's GPUs can hold one copy of the model's state at all ([C6] summed over
    the GPUs of one pipeline: every layer's weights and gradients on each of its tp·dp GPUs, at least
    tp·(2·w) bytes per parameter of a tp shard, and its optimizer state once over the dp replicas,
    tp·o; activations >= 0; each GPU also keeps the workspace). A necessary condition for the group
    to train anything: Σ_c N_c·(memory_c − workspace) >= Σ_layers min over (GPU, tp) tp·P_shard·(2w + o)."""
    topo = instance.topology
    ws = instance.job.workspace_bytes
    room = sum(topo.cluster(c).num_gpus * max(0.0, topo.cluster(c).gpu_memory_bytes - ws) for c in group)
    per_param = 2.0 * tables.dtype_bytes + tables.optimizer_bytes_per_param
    need = None
    for c in group:
        gpu = topo.cluster(c).gpu
        for tp in instance.model.tps(gpu):
            shard = tp * np.diff(tables.table(gpu, tp).params)
            need = shard if need is None else np.minimum(need, shard)
    return need is not None and room >= per_param * float(need.sum()) * (1 - 1e-12)


def _alike(instance: Instance, group: tuple[str, ...]) -> object:
    """What a group's bounds depend on: a one-cluster group's cluster without its name, region and
    price (its sub-instance has no links; the bounds read the GPU, memory, shape and bandwidths);
    a larger group itself."""
    if len(group) > 1:
        return group
    c = instance.topology.cluster(group[0])
    return dataclasses.replace(c, name="", region="", cost_per_gpu_hour=None, defaults=())


def partition_time(tabs: Sequence[ShareTable], G: int, lo: float, hi: float) -> float:
    """[G3] min { t : Σ_S cap_S(t) >= G, every cap_S(t) >= 1 } from below, by bisection on t within
    [lo, hi] (feasibility is monotone in t; the value kept is the largest t found infeasible, so it is
    a bound), or ``hi`` when t = hi is infeasible already (the partition cannot go below it). Raises
    _OutOfTime(lo) with the largest infeasible t so far."""

    order = sorted(range(len(tabs)), key=lambda i: tabs[i].gpus)  # the cheapest tables first

    def feasible(t: float) -> bool:
        # each group trains at least one sample and together they train G: a group's share must be at
        # least G − what the others can train, so its scan stops there (the others at their exact
        # capacity once known, else at their rate's)
        caps = [tab.rate_capacity(t) for tab in tabs]
        if sum(caps) < G or min(caps) < 1:
            return False
        for i in order:
            need = max(1, G - (sum(caps) - caps[i]))
            caps[i] = tabs[i].capacity(t, need)
            if caps[i] < need:
                return False
        return True

    try:
        if not math.isfinite(hi):
            hi = max(lo * 4, 1e-9)
            while not feasible(hi):
                lo, hi = hi, hi * 2
                if hi > 1e9:
                    return INF
        elif not feasible(hi):
            return hi
        while hi > lo * BISECT_RATIO and hi - lo > 1e-9:
            mid = 0.5 * (lo + hi)
            if feasible(mid):
                hi = mid
            else:
                lo = mid
    except _OutOfTime:
        raise _OutOfTime(lo) from None
    return lo


def name_outside(res: PlanResult) -> PlanResult:
    """``res`` (the k-identical space's result) when the grouped bound is off: its plan space also names
    data parallelism across cluster groups as outside the certified space (the heuristic's [H9] plans)."""
    if res.plan is None:
        return res
    space = res.plan_space + OUTSIDE_WHEN_OFF
    meta = dict(res.plan.meta)
    if "plan_space" in meta:
        meta["plan_space"] = space
    return dataclasses.replace(res, plan=dataclasses.replace(res.plan, meta=tuple(meta.items())), plan_space=space)


def certify(res: PlanResult, gb: GroupedBound, *, gap: float, grouped_plan: "tuple[Plan, float] | None" = None) -> PlanResult:
    """``res`` (the k-identical space's result, ``plan_milp``) with the certificate over the union of
    both spaces: lower bound min(res's, ``gb``'s), gap and status recomputed on it, the plan space
    saying what is covered and what is not; ``grouped_plan`` (a grouped plan and its evaluate time,
    e.g. the heuristic's [H9]) becomes the result when it is faster, being inside the space now."""
    if res.plan is None or res.lower_bound_s is None:
        return res
    res = dataclasses.replace(res, plan_space=res.plan_space.removesuffix(OUTSIDE_WHEN_OFF))
    if not gb.covered:
        space = (f"{res.plan_space}; outside: data parallelism across cluster groups (more than {MAX_CLUSTERS} "
                 "clusters), pipelines that are not identical")
        return dataclasses.replace(res, plan_space=space, notes=(*res.notes, gb.describe()))
    space = (f"{res.plan_space}; or {GROUPED_SPACE.format(precisions='{' + ', '.join(gb.precisions) + '}')}; "
             f"{PLAN_SPACE_OUTSIDE}")
    plan, time_s = res.plan, res.iteration_time_s
    notes = list(res.notes)
    if grouped_plan is not None and grouped_plan[1] < time_s:
        plan, time_s = dataclasses.replace(grouped_plan[0], planner="milp", meta=res.plan.meta), grouped_plan[1]
        notes = [n for n in notes if not n.startswith("outside this plan space")]
        notes.append(f"the heuristic's plan with data parallelism across cluster groups ({time_s:.6g} s by evaluate) "
                     f"is faster than the best plan of k identical pipelines ({res.iteration_time_s:.6g} s) and is "
                     "the result")
    lb = min(res.lower_bound_s, gb.value)
    g = max(0.0, (time_s - lb) / time_s)
    status = "optimal" if g <= gap + 1e-12 else "feasible"
    solver = res.solver
    if status != res.status and "certified the result" in solver:
        solver = solver.split(" (")[0] + " (not run: the k-identical space's bounds certified it, the grouped space's did not)"
    notes.append(f"bound over k identical pipelines {res.lower_bound_s:.6g} s; {gb.describe()}")
    meta = dict(res.plan.meta)
    meta.update(lower_bound_s=repr(lb), gap=f"{g:.6f}", status=status, plan_space=space, solver=solver)
    meta["lower_bound_k_identical_s"] = repr(res.lower_bound_s)
    meta["lower_bound_grouped_s"] = repr(gb.value)
    plan = dataclasses.replace(plan, meta=tuple(meta.items()))
    return dataclasses.replace(res, plan=plan, iteration_time_s=time_s, lower_bound_s=lb, status=status,
                               solver=solver, plan_space=space, notes=tuple(notes))
