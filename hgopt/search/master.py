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
their least GPU-seconds per sample).

[G3] Master. For a partition π of the clusters into n >= 2 groups (a plan that leaves clusters idle or
uses fewer groups is a plan of the partition that merges those clusters into a group: a group's bound
covers plans on a subset of its clusters, and fewer representatives only shorten X), the pipelines
finish by t only if every group's share is one it can train within t; relaxing Σ b_g = G to
Σ cap_S(t) >= G, with cap_S(t) the largest share b <= G with PB_S(b) <= t (scanned downward from
rate_S·t: every share is checked, none is skipped), gives a superset of the feasible t, so
    bound(π) = X(π) + min { t : Σ_{S in π} cap_S(t) >= G }
by bisection on t (feasibility is monotone in t; the bound kept is the largest t found infeasible).
The grouped bound is min over every partition (Bell(C) − 1 of them; at most MAX_CLUSTERS clusters).

[G4] Pruning and the deadline. Only a bound below ``target`` (the k-identical space's bound) changes the
certificate, so a partition whose rate floor G/Σ rate + X or whose test at t = target − X already fails
is settled at >= target. Every loop checks the deadline; at a stop each unfinished partition keeps its
valid floor (its largest infeasible t so far, at least G/Σ rate, plus X), so the result is always a
bound, weaker when the time ran out (``GroupedBound.complete``).

[G5] Outside the certificate: groups whose pipelines are not identical within the group, two groups
sharing a cluster, and a stage whose replicas span several clusters (``PLAN_SPACE_OUTSIDE``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from hgopt.cost.pipeline import steady_weight
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.search import PlanResult
from hgopt.search.blocks import CheapBounds, LinkPolicy, cheap_bounds
from hgopt.search.groups import grad_precisions, rate_bound, sub_instance, wan_allreduce_floor
from hgopt.search.milp import batch_splits
from hgopt.search.precisions import allowed_link_precisions
from hgopt.spec import Instance

__all__ = ["GROUPED_SPACE", "MAX_CLUSTERS", "PLAN_SPACE_OUTSIDE", "GroupedBound", "GroupBounds", "certify", "cross_floor", "grouped_bound",
           "partitions"]

log = logging.getLogger(__name__)
INF = math.inf
MAX_CLUSTERS = 8
"""Above this many clusters the partitions are not enumerated (Bell(9) = 21,147) and the grouped space
is bounded by its rate floor alone."""
BISECT_RATIO = 1.0005
"""The bisection on a partition's pipeline time stops when its bracket is this narrow (relative)."""

GROUPED_SPACE = (
    "data parallelism across cluster groups: n >= 2 groups on disjoint cluster sets, group g training any "
    "batch share b_g (sum = global_batch) with k_g identical pipelines of the space above on its own "
    "clusters, every layer's gradients all-reduced across the groups in {precisions}"
)
PLAN_SPACE_OUTSIDE = (
    "outside: pipelines that are not identical within a group, two groups sharing a cluster, a stage "
    "whose replicas span several clusters"
)


class _OutOfTime(Exception):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupedBound:
    """A lower bound on the iteration time of every grouped plan [G3] (n >= 2 groups)."""

    value: float
    """min(target, the bound): ``target`` itself means no grouped plan can beat it."""
    partition: tuple[tuple[str, ...], ...] = ()
    """The partition that sets ``value`` (empty when ``target`` does)."""
    cross_s: float = 0.0
    """X of that partition [G1]."""
    partitions: int = 0
    settled_by_rate: int = 0
    """Partitions settled at >= target by their rate floor alone."""
    complete: bool = True
    """False when the deadline (or the cluster count) left partitions at their rate floor [G4]."""
    precisions: tuple[str, ...] = ("native",)
    """The gradient precisions across groups the bound covers."""

    def describe(self) -> str:
        if not self.partition:
            return f"no plan with data parallelism across cluster groups can beat {self.value:.6g} s"
        groups = " | ".join("+".join(g) for g in self.partition)
        return (f"data parallelism across cluster groups: bound {self.value:.6g} s at groups {groups} "
                f"(cross-group all-reduce of layer 0 >= {self.cross_s:.4g} s)"
                + ("" if self.complete else "; the time limit left some partitions at their rate floor"))


class GroupBounds:
    """[G2] PB_S(b) and cap_S(t) of one group S, memoised (structures per (k, B), values per share)."""

    def __init__(self, instance: Instance, tables: CostTables, group: tuple[str, ...], links: LinkPolicy,
                 deadline: float) -> None:
        self.sub = sub_instance(instance, group, instance.job.global_batch)
        self.tables, self.links, self.deadline = tables, links, deadline
        self.G = instance.job.global_batch
        self.rate = sum(rate_bound(instance, tables, c) for c in group)
        self._cheap: dict[tuple[int, int], CheapBounds] = {}
        self._pb: dict[int, float] = {}

    def pipeline_bound(self, b: int) -> float:
        """PB_S(b): a lower bound on the pipeline time of every plan of the group with share b [G2]."""
        if b not in self._pb:
            best = b / self.rate if self.rate > 0 else INF
            lowest = INF
            share = dataclasses.replace(self.sub, job=dataclasses.replace(self.sub.job, global_batch=b))
            for sp in batch_splits(share):  # every (k, B, m) with k·B·m = b, k <= the group's GPUs
                if time.perf_counter() > self.deadline:
                    raise _OutOfTime
                cb = self._structure(sp.k, sp.microbatch, sp.num_microbatches)
                w = steady_weight(sp.num_microbatches)
                lowest = min(lowest, dataclasses.replace(cb, weight=w, s_lb=0.0).value)
            self._pb[b] = max(best, lowest)
        return self._pb[b]

    def _structure(self, k: int, B: int, m: int) -> CheapBounds:
        key = (k, B)
        if key not in self._cheap:
            self._cheap[key] = cheap_bounds(self.sub, self.tables, replicas=k, microbatch=B, num_microbatches=m,
                                            links=self.links)
        return self._cheap[key]

    def capacity(self, t: float) -> int:
        """cap_S(t): the largest share b <= G whose bound PB_S(b) is <= t (0 when none): every share
        from rate_S·t down is checked [G3]."""
        top = min(self.G, math.floor(self.rate * t * (1 + 1e-12))) if math.isfinite(self.rate * t) else self.G
        for b in range(top, 0, -1):
            if self.pipeline_bound(b) <= t:
                return b
        return 0

    def rate_capacity(self, t: float) -> float:
        """An upper bound of cap_S(t) that costs nothing: rate_S·t."""
        return self.rate * t


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


def grouped_bound(instance: Instance, tables: CostTables, links: LinkPolicy, *, link_precision: str = "native",
                  target: float = INF, deadline: float = INF) -> GroupedBound:
    """[G3] A lower bound on every grouped plan's iteration time, min(target, ...)."""
    names = [c.name for c in instance.topology.clusters]
    precs = grad_precisions(instance, allowed_link_precisions(instance, link_precision))
    cheapest = precs[-1]
    if len(names) < 2:
        return GroupedBound(value=target, precisions=precs)
    G = instance.job.global_batch
    rate_total = sum(rate_bound(instance, tables, c) for c in names)
    floor_t = G / rate_total if rate_total > 0 else INF
    if len(names) > MAX_CLUSTERS:
        pair = min(wan_allreduce_floor(instance, tables, (a, b), cheapest) for a, b in itertools.combinations(names, 2))
        value = min(target, floor_t + pair)
        return GroupedBound(value=value, complete=False, precisions=precs,
                            partition=() if value >= target else (tuple(names),), cross_s=pair)
    groups: dict[tuple[str, ...], GroupBounds] = {}
    best, best_part, best_x = target, (), 0.0
    count = by_rate = 0
    complete = True
    todo = [p for p in partitions(names) if len(p) >= 2]
    # cheapest first: the partitions whose rate floor is lowest are the ones that can set the bound
    memo: dict[tuple[str, ...], float] = {}
    keyed = sorted(((floor_t + cross_floor(instance, tables, p, cheapest, memo), i, p) for i, p in enumerate(todo)))
    for floor_p, _, part in keyed:
        count += 1
        x = floor_p - floor_t
        if floor_p >= best:
            by_rate += 1
            continue
        if time.perf_counter() > deadline:
            complete = False
            best, best_part, best_x = floor_p, part, x  # sorted: the least floor left bounds the rest
            break
        for g in part:
            if g not in groups:
                groups[g] = GroupBounds(instance, tables, g, links, deadline)
        gb = [groups[g] for g in part]
        try:
            lo = _partition_bound(gb, G, floor_t, best - x)
        except _OutOfTime as stop:
            complete = False
            lo = stop.args[0] if stop.args else floor_t
            value = lo + x
            if value < best:
                best, best_part, best_x = value, part, x
            # the rest keep their rate floors: the least of them (sorted) bounds them all
            rest = [f for f, _, _ in keyed[count:]]
            if rest and rest[0] < best:
                best, best_part, best_x = rest[0], keyed[count][2], rest[0] - floor_t
            break
        if lo + x < best:
            best, best_part, best_x = lo + x, part, x
        log.debug("partition %s: bound %.6g s (X %.4g s)", part, lo + x, x)
    return GroupedBound(value=best, partition=best_part if best < target else (), cross_s=best_x,
                        partitions=count, settled_by_rate=by_rate, complete=complete, precisions=precs)


def _partition_bound(gb: list[GroupBounds], G: int, lo: float, hi: float) -> float:
    """min { t : Σ cap_S(t) >= G } from below (the largest t found infeasible), or ``hi`` when t = hi
    is infeasible already (the partition cannot go below the target). Raises _OutOfTime(lo) with the
    largest infeasible t so far."""

    def feasible(t: float) -> bool:
        if sum(g.rate_capacity(t) for g in gb) < G:
            return False
        total = 0
        for g in gb:
            total += g.capacity(t)
            if total >= G:
                return True
        return False

    if not math.isfinite(hi):
        hi = max(lo * 4, 1e-9)
        while True:
            try:
                if feasible(hi):
                    break
            except _OutOfTime:
                raise _OutOfTime(lo) from None
            lo, hi = hi, hi * 2
            if hi > 1e9:
                return INF
    try:
        if not feasible(hi):
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



def certify(res: PlanResult, gb: GroupedBound, *, gap: float, grouped_plan: "tuple[Plan, float] | None" = None) -> PlanResult:
    """``res`` (the k-identical space's result, ``plan_milp``) with the certificate over the union of
    both spaces: lower bound min(res's, ``gb``'s), gap and status recomputed on it, the plan space
    saying what is covered and what is not; ``grouped_plan`` (a grouped plan and its evaluate time,
    e.g. the heuristic's [H9]) becomes the result when it is faster, being inside the space now."""
    if res.plan is None or res.lower_bound_s is None:
        return res
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
