"""[H9] Data parallelism across cluster groups: the clusters are split into groups, every group trains
its own share of the global batch with its own pipelines (found by the hierarchical search on the
group alone), and the gradients of every layer are all-reduced across the groups over the WAN.

The single-family space of the rest of the heuristic (k identical pipelines over one ordered subset of
clusters) cannot express this: e.g. four zones of one region, each training a quarter of the batch
with its own tensor/data parallelism and meeting only for the gradient all-reduce, beats any
pipeline crossing the zones when the model's gradients are small next to its activations.

Search (all plans scored by ``evaluate`` on the whole instance):

1. Groupings: the connected components of the clusters joined by links at least as fast as a
   threshold, for every distinct link speed as the threshold (from all-singletons to one group; the
   one-group case is the main search). A grouping is skipped when a lower bound — the batch over the
   clusters' compute rate bounds (:func:`rate_bound`) plus one ring of the model's gradients between
   the two closest groups, which share that link ([C5w]; a bound when those groups are single
   clusters, an estimate otherwise) — already reaches the best plan known. A grouping is not rated
   either when no subset of its groups can have an estimate (step 3) below the realisation threshold
   whatever the ratings (:func:`subsets_cannot_reach`: compute rate bounds and the capped links' rings
   of the whole gradient): the result is then the same without its searches.
2. Rates: each group plans one rating share (G over the power of two nearest the cluster count) with
   the hierarchical search (no grouping inside); its pipeline rate r_g = share / pipeline time. Alike
   single clusters share one search (:func:`_signature`).
3. Subsets: from the best pair of groups, greedily the group that lowers the estimate G / Σ r_g +
   slowest group's sync/optimizer tail + WAN all-reduce over the subset's clusters most; the two best
   subsets are realised with shares proportional to the rates (multiples of a power-of-two unit),
   re-balanced once from the realised pipeline times, assembled and scored.
4. Gradient precision: the cross-group all-reduce in the training dtype and, when the link policy
   allows a 16-bit format, in it (``Plan.grad_sync_precision``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from hgopt.cost import evaluate
from hgopt.cost.comm import gradient_bytes
from hgopt.cost.links import max_rate_from, ring_time
from hgopt.cost.tables import CostTables, allreduce_time, bandwidth_bytes_per_s, link_bytes_factor
from hgopt.plan import Plan
from hgopt.spec import DTYPE_BYTES, Bandwidth, Instance, Topology

__all__ = ["GroupedPlan", "best_grouped_plan", "group_rate_bound", "groupings", "per_sample_layer_seconds",
           "proportional_shares", "rate_bound", "share_unit", "sub_instance", "subset_estimate", "subsets_cannot_reach"]

log = logging.getLogger(__name__)
INF = math.inf
_REALISE = 2
"""Subsets of groups realised (best estimates first)."""

SubPlanner = Callable[[Instance], "tuple[Plan, float] | None"]
"""Plans one group's sub-instance: (plan, pipeline time in seconds), or None when nothing fits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupedPlan:
    plan: Plan
    iteration_time_s: float
    groups: tuple[tuple[str, ...], ...]
    shares: tuple[int, ...]
    """Samples per iteration of each group."""


def sub_instance(instance: Instance, clusters: Sequence[str], global_batch: int) -> Instance:
    """``instance`` restricted to ``clusters`` (and the links among them) training ``global_batch``."""
    keep = set(clusters)
    topo = Topology(clusters=tuple(c for c in instance.topology.clusters if c.name in keep),
                    links=tuple(l for l in instance.topology.links if l.src in keep and l.dst in keep))
    return dataclasses.replace(instance, name=f"{instance.name}[{'+'.join(clusters)}]", topology=topo,
                               job=dataclasses.replace(instance.job, global_batch=global_batch))


def _speed(instance: Instance, a: str, b: str) -> float:
    """Bytes/s of the slower direction between two clusters for a 64 MB message."""
    t = instance.topology
    return min(bandwidth_bytes_per_s(t.link(a, b), 64e6), bandwidth_bytes_per_s(t.link(b, a), 64e6))


def groupings(instance: Instance) -> list[tuple[tuple[str, ...], ...]]:
    """[H9] Every partition of the clusters into the components of links at least as fast as a
    threshold, for each distinct link speed (and all-singletons), with more than one group."""
    names = [c.name for c in instance.topology.clusters]
    speeds = sorted({_speed(instance, a, b) for i, a in enumerate(names) for b in names[i + 1 :]}, reverse=True)
    out: list[tuple[tuple[str, ...], ...]] = []
    for thr in [INF, *speeds]:
        parent = {n: n for n in names}

        def root(n: str) -> str:
            while parent[n] != n:
                n = parent[n]
            return n

        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if _speed(instance, a, b) >= thr:
                    parent[root(b)] = root(a)
        comp: dict[str, list[str]] = {}
        for n in names:
            comp.setdefault(root(n), []).append(n)
        part = tuple(tuple(v) for v in comp.values())
        if len(part) > 1 and part not in out:
            out.append(part)
    return out


def wan_allreduce_time(instance: Instance, tables: CostTables, clusters: Sequence[str], precision: str) -> float:
    """[C5] The cross-cluster ring of the whole model's gradients over ``clusters`` (the slowest link
    between any two of them), as ``evaluate`` costs one segment holding every layer."""
    if len(clusters) < 2:
        return 0.0
    tab = tables.table(instance.topology.cluster(clusters[0]).gpu, 1)
    nbytes = gradient_bytes(float(tab.params[-1] - tab.params[0]), tables.dtype_bytes,
                            link_bytes_factor(instance.model.dtype, precision))
    topo = instance.topology
    return max(allreduce_time(topo.link(a, b), nbytes, len(clusters)) for a in clusters for b in clusters if a != b)


def wan_ring_time(instance: Instance, clusters: Sequence[str], own_bytes: float, total_bytes: float) -> float:
    """links: [C5]/[C5w] as ``evaluate`` prices the cross-cluster ring of one stage's gradients
    (``own_bytes``) over ``clusters`` while every stage's rings together carry ``total_bytes``: each ring
    edge is one flow at the per-flow rate, and they share a link only through its aggregate cap."""
    if len(clusters) < 2:
        return 0.0
    topo, k = instance.topology, len(clusters)
    return max(ring_time(topo.link_spec(a, b), own_bytes, k, total_bytes) for a in clusters for b in clusters if a != b)


def _grad_bytes(instance: Instance, tables: CostTables, clusters: Sequence[str], precision: str,
                lo: int = 0, hi: int | None = None) -> float:
    tab = tables.table(instance.topology.cluster(clusters[0]).gpu, 1)
    hi = tables.num_layers if hi is None else hi
    return gradient_bytes(float(tab.params[hi] - tab.params[lo]), tables.dtype_bytes,
                          link_bytes_factor(instance.model.dtype, precision))


def wan_allreduce_floor(instance: Instance, tables: CostTables, clusters: Sequence[str], precision: str) -> float:
    """links: a lower bound of how long ``evaluate``'s iteration runs past the pipelines' end for any
    plan with data parallelism over ``clusters`` (every layer held in each). [C7o]/[C7b]: only the
    pipelines' first stage syncs after its pipeline ends, its last bucket holding layer 0, which rings
    at least layer 0's gradients per flow and, on a capped link, at least its share of the cap (a
    bucket of x bytes takes ring(aggregate, x·load/segment) >= ring(aggregate, x)); the syncs of later
    stages start before the pipeline ends, so the largest layer or the whole model's bytes are no bound."""
    if len(clusters) < 2:
        return 0.0
    first = _grad_bytes(instance, tables, clusters, precision, 0, 1)
    return wan_ring_time(instance, clusters, first, first)


def _largest_stage(tables: CostTables, plan: Plan) -> tuple[int, int]:
    """links: the layer range of ``plan``'s stage with most parameters (tp-1 sizes of its first GPU type)."""
    tab = next(iter(tables.by_gpu_tp.values()))
    stages = [s for p in plan.pipelines for s in p.stages]
    s = max(stages, key=lambda s: float(tab.params[s.end] - tab.params[s.start]))
    return s.start, s.end


def per_sample_layer_seconds(instance: Instance, tables: CostTables, cluster: str) -> np.ndarray | None:
    """Per layer the least GPU-seconds one sample needs on ``cluster``'s GPU: min over profiled (tp, mbs)
    of tp·(f+b)(mbs)/mbs ([C2] interpolates linearly between profiled sizes and proportionally outside
    them, so the cheapest is at a profiled size); None when the GPU has no profile."""
    c = instance.topology.cluster(cluster)
    per_layer = None
    for tp in instance.model.tps(c.gpu):
        t = tables.table(c.gpu, tp)
        for j, mbs in enumerate(t.mbs):
            cost = tp * (np.diff(t.fwd[j]) + np.diff(t.bwd[j])) / mbs
            per_layer = cost if per_layer is None else np.minimum(per_layer, cost)
    return per_layer


def rate_bound(instance: Instance, tables: CostTables, cluster: str) -> float:
    """Samples/s that no plan can exceed on ``cluster``: its GPUs times the reciprocal of the GPU-seconds
    one sample needs, each layer at its cheapest (:func:`per_sample_layer_seconds`). A pipeline's time
    is at least its samples times this cost over its GPUs."""
    per_layer = per_sample_layer_seconds(instance, tables, cluster)
    if per_layer is None or float(per_layer.sum()) <= 0:
        return INF
    return instance.topology.cluster(cluster).num_gpus / float(per_layer.sum())


def grad_precisions(instance: Instance, allowed: Sequence[str]) -> tuple[str, ...]:
    """Precisions the cross-group gradient all-reduce may use: native, and a 16-bit format narrower
    than the training dtype when the link policy allows one (fp8 cannot be summed)."""
    native = DTYPE_BYTES[instance.model.dtype]
    low = [p for p in ("bf16", "fp16") if p in allowed and DTYPE_BYTES[p] < native]
    return ("native", *low[:1])


def share_unit(G: int, n: int) -> int:
    """Largest power of two u dividing G with G/u >= 16·n (shares are multiples of u)."""
    u = 1
    while G % (2 * u) == 0 and G // (2 * u) >= 16 * n:
        u *= 2
    return u


def proportional_shares(G: int, rates: Sequence[float], unit: int) -> list[int] | None:
    """Shares of G in multiples of ``unit`` proportional to ``rates`` (largest remainder); None when
    a group would get nothing."""
    units = G // unit
    total = sum(rates)
    raw = [units * r / total for r in rates]
    out = [int(math.floor(x)) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[: units - sum(out)]:
        out[i] += 1
    if min(out) < 1:
        return None
    return [u * unit for u in out]


def best_grouped_plan(
    instance: Instance, tables: CostTables, sub_planner: SubPlanner, *, incumbent: float,
    allowed: Sequence[str] = ("native",), out_of_time: Callable[[], bool] = lambda: False,
) -> GroupedPlan | None:
    """[H9] The best plan with data parallelism across cluster groups that beats ``incumbent``
    (None when none does or none fits)."""
    G = instance.job.global_batch
    precs = grad_precisions(instance, allowed)
    cheapest = precs[-1]
    memo: dict[tuple[object, int], tuple[Plan, float, str] | None] = {}
    tails: dict[tuple[str, ...], float] = {}  # sync + optimizer seconds of each group's rating plan
    widest: dict[tuple[str, ...], tuple[int, int]] = {}  # links: each rating plan's largest stage

    def plan_group(group: tuple[str, ...], share: int) -> tuple[Plan, float] | None:
        # alike single clusters (same GPUs, shape and bandwidths) share one plan, relabelled: fewer
        # searches, and their stage cuts line up (fewer all-reduce segments [C5])
        key = (_signature(instance, group), share)
        if key not in memo:
            got = sub_planner(sub_instance(instance, group, share))
            memo[key] = None if got is None else (got[0], got[1], group[0])
        hit = memo[key]
        if hit is None:
            return None
        plan, t, source = hit
        return (plan if source == group[0] else _relabel(plan, source, group[0])), t

    n_clusters = len(instance.topology.clusters)
    rating = _rating_share(G, n_clusters, share_unit(G, n_clusters))
    best: GroupedPlan | None = None
    compute_floor = G / sum(rate_bound(instance, tables, c.name) for c in instance.topology.clusters)
    for part in groupings(instance):
        if out_of_time():
            break
        floor = compute_floor + min(wan_allreduce_floor(instance, tables, g_pair, cheapest) for g_pair in _pairs(part))
        if floor >= min(incumbent, best.iteration_time_s if best else INF):
            log.debug("grouping %s: compute bound + WAN all-reduce %.3g s, skipped", part, floor)
            continue
        if subsets_cannot_reach(instance, tables, part, cheapest,
                                1.05 * min(incumbent, best.iteration_time_s if best else INF)):
            log.debug("grouping %s: no subset's estimate can reach the realisation threshold, not rated", part)
            continue
        unit = share_unit(G, len(part))
        share = rating  # one rating share for every grouping: the ratings are reused across them
        rated = []
        for g in part:
            got = plan_group(g, share)
            if got is not None and got[1] > 0:
                if g not in tails:
                    tails[g] = evaluate(got[0], sub_instance(instance, g, share), tables).sync_optimizer_time_s
                rated.append((share / got[1], tails[g], g))
                widest[g] = _largest_stage(tables, got[0])
        ests = _greedy_subsets(instance, tables, rated, cheapest, widest)
        ests.sort(key=lambda x: x[0])
        for est, head in ests[:_REALISE]:
            if est >= min(incumbent, best.iteration_time_s if best else INF) * 1.05:
                break
            got = _realise(instance, tables, [g for _, _, g in head], [r for r, _, _ in head], unit, plan_group, precs)
            if got is not None and (best is None or got.iteration_time_s < best.iteration_time_s):
                best = got
        log.debug("grouping %s: best %s", part, best and round(best.iteration_time_s, 4))
    if best is None or best.iteration_time_s >= incumbent:
        return None
    return best


def group_rate_bound(instance: Instance, tables: CostTables, group: Sequence[str]) -> float:
    """Samples/s that no plan on ``group``'s clusters alone can exceed: their GPUs over the GPU-seconds
    one sample needs with each layer on the cheapest of them (:func:`per_sample_layer_seconds`; every
    stage's GPUs work at least its samples times its layers' cost, summed over stages). One cluster:
    :func:`rate_bound`."""
    per_layer = None
    for c in group:
        got = per_sample_layer_seconds(instance, tables, c)
        if got is None:
            return INF
        per_layer = got if per_layer is None else np.minimum(per_layer, got)
    if per_layer is None or float(per_layer.sum()) <= 0:
        return INF
    return sum(instance.topology.cluster(c).num_gpus for c in group) / float(per_layer.sum())


def subsets_cannot_reach(
    instance: Instance, tables: CostTables, part: Sequence[tuple[str, ...]], precision: str, threshold: float,
) -> bool:
    """[H9] Whether :func:`_greedy_subsets`' estimate of EVERY subset of at least two of ``part``'s
    groups is at least ``threshold`` whatever the groups' rating plans, so that none of them would be
    realised (``best_grouped_plan`` realises only estimates below it) and rating the groups — one
    hierarchical search each — cannot change the result.

    The estimate (:func:`subset_estimate`) of a subset S of j groups over the clusters C (|C| = k >= j)
    is G / Σ rate + max tail + max over ordered pairs of C of ``ring_time`` (``wan_ring_time``). Each part
    is bounded from below: a group's rating rate share / pipeline time is at most
    :func:`group_rate_bound`, so G / Σ rate >= G / (the j largest bounds); tails >= 0; ``ring_time``
    >= the aggregate cap's ring of the subset's whole gradient (at least the least ``_grad_bytes`` of
    any cluster's GPU), which is at least ``allreduce_time`` at the cap's best rate for any message of
    at least bytes / n (``links.max_rate_from``: the ring's chunk is bytes / k) among j (no curve left:
    increasing in the ring size). Every cluster c of C has at least j − 1 partners in C in other
    groups, so the max over C's pairs is at least, for some c, the (j − 1)-th smallest of c's terms.
    The bound of j groups, A_j + B_j, has B_j non-decreasing in j: the loop stops at the first j
    whose bound is below the threshold (False) or whose B_j alone reaches it (True)."""
    if len(part) < 2 or not math.isfinite(threshold):
        return False
    G, topo = instance.job.global_batch, instance.topology
    rates = sorted((group_rate_bound(instance, tables, g) for g in part), reverse=True)
    names = [c for g in part for c in g]
    n = len(topo.clusters)
    total = min(_grad_bytes(instance, tables, [c], precision) for c in names)
    group_of = {c: gi for gi, g in enumerate(part) for c in g}
    caps: dict[str, list[tuple[Bandwidth, ...]]] = {}  # per cluster, per partner in another group: both caps
    for a in names:
        row = []
        for b in names:
            if group_of[b] == group_of[a]:
                continue
            both = tuple(_relaxed(l.aggregate, total / n) for l in (topo.link_spec(a, b), topo.link_spec(b, a))
                         if l.aggregate is not None)
            row.append(both)
        caps[a] = row
    for j in range(2, len(part) + 1):
        rate = sum(rates[:j])
        a_j = G / rate if rate > 0 else INF
        b_j = INF
        for row in caps.values():
            terms = sorted(max((allreduce_time(bw, total, j) for bw in both), default=0.0) for both in row)
            b_j = min(b_j, terms[j - 2])
        if (a_j + b_j) * (1.0 - 1e-9) < threshold:  # float safety: the estimate sums the same terms otherwise
            return False
        if b_j * (1.0 - 1e-9) >= threshold:
            return True
    return True


def _relaxed(bw: Bandwidth, nbytes: float) -> Bandwidth:
    """``bw`` at its best rate for any message of at least ``nbytes`` (``links.max_rate_from``), no curve."""
    return Bandwidth(gbyte_s=max_rate_from(bw, nbytes) / 1e9, latency_s=bw.latency_s)


def subset_estimate(
    instance: Instance, tables: CostTables, head: Sequence[tuple[float, float, tuple[str, ...]]], precision: str,
    widest: dict[tuple[str, ...], tuple[int, int]] | None = None,
) -> float:
    """[H9] The estimate of one subset ``head`` of rated groups (rate, tail, group): G / Σ rate + slowest
    tail + WAN all-reduce over their clusters (``wan_ring_time``: the largest stage of the groups' rating
    plans per flow, every layer through a capped link; ``widest`` omitted: the whole model per flow)."""
    clusters = [c for _, _, g in head for c in g]
    total = _grad_bytes(instance, tables, clusters, precision)
    own = total if not widest else max(_grad_bytes(instance, tables, clusters, precision, *widest[g])
                                       for _, _, g in head)
    return (instance.job.global_batch / sum(r for r, _, _ in head) + max(t for _, t, _ in head)
            + wan_ring_time(instance, clusters, own, total))


def _greedy_subsets(
    instance: Instance, tables: CostTables, rated: list[tuple[float, float, tuple[str, ...]]], precision: str,
    widest: dict[tuple[str, ...], tuple[int, int]] | None = None,
) -> list[tuple[float, list[tuple[float, float, tuple[str, ...]]]]]:
    """[H9] Subsets of rated groups (rate, tail, group) with their estimates (:func:`subset_estimate`):
    the best pair, then greedily the group whose addition lowers the estimate most, every subset on the
    way kept."""

    def est(head: list[tuple[float, float, tuple[str, ...]]]) -> float:
        return subset_estimate(instance, tables, head, precision, widest)

    if len(rated) < 2:
        return []
    pairs = [[a, b] for i, a in enumerate(rated) for b in rated[i + 1 :]]
    cur = min(pairs, key=est)
    out = [(est(cur), cur)]
    while len(cur) < len(rated):
        nxt = min(([*cur, g] for g in rated if g not in cur), key=est)
        out.append((est(nxt), nxt))
        if out[-1][0] >= out[-2][0]:
            break
        cur = nxt
    return out


def _rating_share(G: int, n: int, unit: int) -> int:
    """The share each group is rated with: G over the power of two nearest to n, in whole units
    (a power-of-two fraction of the batch keeps the group's microbatch choices rich)."""
    p = 1 << max(round(math.log2(n)), 0)
    return max(unit, (G // p) // unit * unit)


def _signature(instance: Instance, group: tuple[str, ...]) -> object:
    """What a one-cluster group's plan depends on besides its name, to within the buckets of
    :func:`_bucket` (multi-cluster groups: themselves)."""
    if len(group) > 1:
        return group
    c = instance.topology.cluster(group[0])
    return (c.gpu, c.gpu_memory_bytes, c.nodes, c.gpus_per_node, c.memory_bandwidth_gbyte_s,
            _bucket(c.intra_node), _bucket(c.inter_node))


def _bucket(bw: Bandwidth) -> tuple[int, int]:
    """A bandwidth to within 10 % (at 64 MB) and its latency to within 10 µs: clusters that differ
    less share one search; the shared plan is then scored exactly on each cluster by ``evaluate``."""
    return (round(math.log(bandwidth_bytes_per_s(bw, 64e6)) / math.log(1.1)), round(bw.latency_s * 1e5))


def _relabel(plan: Plan, old: str, new: str) -> Plan:
    """``plan`` with every replica group of cluster ``old`` moved to ``new``."""
    pipes = tuple(dataclasses.replace(p, stages=tuple(
        dataclasses.replace(st, groups=tuple(dataclasses.replace(g, cluster=new) if g.cluster == old else g
                                             for g in st.groups)) for st in p.stages)) for p in plan.pipelines)
    return dataclasses.replace(plan, pipelines=pipes)


def _pairs(part: tuple[tuple[str, ...], ...]) -> list[tuple[str, str]]:
    """One cluster from each of two groups, for every pair of groups (a lower bound on the WAN ring
    any subset of at least two groups pays)."""
    return [(a[0], b[0]) for i, a in enumerate(part) for b in part[i + 1 :]]


def _realise(
    instance: Instance, tables: CostTables, groups: list[tuple[str, ...]], rates: list[float], unit: int,
    plan_group: Callable[[tuple[str, ...], int], "tuple[Plan, float] | None"], precs: Sequence[str],
) -> GroupedPlan | None:
    """Plans of ``groups`` with shares proportional to ``rates``, re-balanced once from the realised
    pipeline times; the best by ``evaluate`` over the gradient precisions."""
    G = instance.job.global_batch
    best: GroupedPlan | None = None
    for _ in range(2):
        shares = proportional_shares(G, rates, unit)
        if shares is None:
            return best
        subs = [plan_group(g, s) for g, s in zip(groups, shares)]
        if any(s is None for s in subs):
            return best
        pipes = tuple(p for sp in subs for p in sp[0].pipelines)  # type: ignore[index]
        for prec in precs:
            plan = Plan(pipelines=pipes, planner="heuristic", instance=instance.name, grad_sync_precision=prec)  # type: ignore[arg-type]
            ev = evaluate(plan, instance, tables)
            if ev.feasible and (best is None or ev.iteration_time_s < best.iteration_time_s):
                best = GroupedPlan(plan=plan, iteration_time_s=ev.iteration_time_s, groups=tuple(groups),
                                   shares=tuple(shares))
        new_rates = [s / sp[1] for s, sp in zip(shares, subs)]  # type: ignore[index]
        if max(new_rates) <= 0 or all(abs(a / sum(new_rates) - b / sum(rates)) < 0.01 for a, b in zip(new_rates, rates)):
            break
        rates = new_rates
    return best
