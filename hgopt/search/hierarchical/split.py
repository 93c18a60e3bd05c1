"""[H4] The layer split of one ordered cluster subset on the estimates: a bottleneck-cap start,
greedy growth/shrink to all layers, then pairwise layer moves; the [C6] memory screen of a subset."""

from __future__ import annotations

import bisect
import itertools
import math
from typing import NamedTuple, Sequence

from hgopt.cost.memory import stage_memory
from hgopt.cost.pipeline import pipeline_time
from hgopt.search.hier_tables import ClusterTable, role_of
from hgopt.search.hierarchical.context import Ctx
from hgopt.search.hierarchical.estimates import (Lists, alt_tables, as_lists, cells, choose_weights, estimate_at, real_table,
                                                round_up, trip_depths)
from hgopt.search.hierarchical.links import Wan, block_cut, link_choice, wan_times
from hgopt.search.hierarchical.order import cluster_order
from hgopt.search.hierarchical.records import Estimated, Skeleton


class LayerSplit(NamedTuple):
    """[H4] Layers per cluster of one order and the estimate there."""

    estimate_s: float
    layers: tuple[int, ...]


def best_for_subset(
    ctx: Ctx, k: int, B: int, names: tuple[str, ...], passes: int = 2
) -> Estimated | None:
    """Order ``names``, split the layers on the estimates (with ``passes`` = 2 a second time with
    the stages after each cluster that the first split implies) and return (estimate, skeleton)."""
    key = (k, B, names, passes)
    if key in ctx.subsets:
        return ctx.subsets[key]
    got = None
    ctx.work += 1  # (work_limit) one subset split
    if can_hold(ctx, k, names):
        m = ctx.instance.job.global_batch // (k * B)
        order = cluster_order(ctx, names, k * B, m)  # WAN load of the k pipelines [C4w]
        orders = (order, order[::-1]) if passes > 1 else (order,)  # the coarse pass keeps one direction
        found = [g for o in dict.fromkeys(orders) if (g := split_order(ctx, k, B, m, o, passes)) is not None]
        got = min(found, key=lambda x: x.estimate_s) if found else None
    ctx.subsets[key] = got
    return got


def can_hold(ctx: Ctx, k: int, names: tuple[str, ...]) -> bool:
    """[C6] memory bound: every pipeline keeps each parameter's weight and gradient at least once and
    its optimizer state at least once in total (ZeRO-1 shards it over a stage's replicas), so the
    GPU memory one pipeline gets, Σ_c ⌊n_c / k⌋ · (capacity_c − workspace), must hold
    P · (2·w + o), P the fewest parameters of one model replica over the profiled tp degrees."""
    key = (k, names)
    if key not in ctx.holds:
        inst, tb = ctx.instance, ctx.tables
        room = sum((c.num_gpus // k) * max(c.gpu_memory_bytes - inst.job.workspace_bytes, 0.0)
                   for c in inst.topology.clusters if c.name in names)
        need = stage_memory(min(tp * float(t.params[-1]) for (gpu, tp), t in tb.by_gpu_tp.items()), 0.0, 0, 0,
                            dtype_bytes=tb.dtype_bytes, optimizer_bytes=tb.optimizer_bytes_per_param)
        ctx.holds[key] = room >= need
    return ctx.holds[key]


def split_order(
    ctx: Ctx, k: int, B: int, m: int, order: tuple[str, ...], passes: int
) -> Estimated | None:
    """The layer split of one cluster order (both directions of a path cost the same on symmetric
    links, but the first cluster also holds the embedding and the last the head)."""
    after = [round_up(len(order) - 1 - i) for i in range(len(order))]
    links = link_choice(ctx, order, k * B, m, [block_cut(ctx)] * (len(order) - 1))
    got = None
    for _ in range(passes):
        tabs = [real_table(ctx, n, role_of(i, len(order)), k, B, m, after[i]) for i, n in enumerate(order)]
        split = split_layers(ctx, order, tabs, k * B, m, links, start=got.skeleton.layers if got else None,
                             steps=(1, 2, 4) if passes > 1 else (1,))
        if split is None:
            return got
        est, layers = split
        est2, ws = choose_weights(ctx, order, [alt_tables(ctx, n, role_of(i, len(order)), k, B, m, after[i])
                                               for i, n in enumerate(order)], layers, k * B, m, links)
        got = Estimated(est2, Skeleton(pipelines=k, microbatch=B, order=order, layers=layers,
                                       weights=() if all(w == m for w in ws) else ws, links=links))
        stages = [cells(alt_tables(ctx, n, role_of(i, len(order)), k, B, m, after[i]), c)[ws[i]].stages
                  for i, (n, c) in enumerate(zip(order, layers))]
        new_after = [round_up(sum(stages[i + 1 :])) for i in range(len(order))]
        if new_after == after:
            break
        after = new_after
    return got


def split_layers(
    ctx: Ctx, order: tuple[str, ...], tabs: Sequence[ClusterTable], B: int, m: int, links: Sequence[str] = (),
    start: Sequence[int] | None = None, steps: tuple[int, ...] = (1,),
) -> LayerSplit | None:
    """[H4] Layers per cluster: from the smallest bottleneck cap that holds all layers (and from
    ``start``, e.g. the previous pass's split), surplus layers taken back and missing ones added
    where the estimate changes least, then layers moved between any two clusters (1, 2 or 4 at a
    time) while that lowers the estimate; the better of the starts."""
    L = ctx.tables.num_layers
    prep = [prepared(ctx, tb) for tb in tabs]
    if any(p.low is None for p in prep):
        return None
    t = [p.lists for p in prep]
    lo: list[int] = [p.low for p in prep]  # type: ignore[misc]
    if sum(lo) > L:
        return None
    wan = wan_times(ctx, order, B, links)
    starts = [_cap_start(prep, L)]
    if start is not None and len(start) == len(t) and sum(start) == L and all(a >= b for a, b in zip(start, lo)):
        starts.append(list(start))
    near = None if len(t) <= ctx.neighbours + 1 else ctx.neighbours
    got = [r for n0 in starts if (r := _descend(t, n0, lo, L, m, wan, steps, near)) is not None]
    return min(got) if got else None


def _descend(
    t: Sequence[Lists], n: list[int], lo: Sequence[int], L: int, m: int, wan: Wan, steps: tuple[int, ...] = (1,),
    near: int | None = None,
) -> LayerSplit | None:
    """Shrink/grow ``n`` to L layers, then pairwise layer moves while one lowers the estimate. With
    ``near`` (large instances), the moves of a sweep go from the ``near`` most loaded clusters to
    the ``near`` least loaded (each cluster's own (m − 1)·bottleneck + fill + sync): O(near² ·
    clusters) per sweep instead of O(clusters³); None: every pair."""
    n = list(n)
    depth = trip_depths(t, m)
    while sum(n) > L:  # the cap start may overshoot: take layers back where that helps most
        i = _cheapest_shrink(t, n, lo, m, wan, depth, near)
        if i is None:
            return None
        n[i] -= 1
    for _ in range(L - sum(n)):
        i = _cheapest_growth(t, n, m, wan, L)
        if i is None:
            return None
        n[i] += 1
    cur = estimate_at(t, n, m, wan, depth)
    improved = True
    while improved and math.isfinite(cur):
        improved = False
        for step in steps:
            for i, j in _pairs(t, n, m, step, L, near):
                if n[i] - step < lo[i] or n[j] + step > L:
                    continue
                n[i] -= step
                n[j] += step
                est = estimate_at(t, n, m, wan, depth)
                if est < cur - 1e-12:
                    cur, improved = est, True
                else:
                    n[i] += step
                    n[j] -= step
    return LayerSplit(cur, tuple(n)) if math.isfinite(cur) else None


def _load(ti: Lists, n: int, m: int) -> float:
    """One cluster's own (m − 1)·bottleneck + fill + sync at ``n`` layers (inf past its table)."""
    if n >= len(ti.fill):
        return math.inf
    return pipeline_time(m, ti.bott[n], ti.fill[n]) + ti.sync[n]


def _pairs(
    t: Sequence[Lists], n: Sequence[int], m: int, step: int, L: int, near: int | None
) -> list[tuple[int, int]]:
    """The (from, to) cluster pairs of one sweep's layer moves: all of them, or (``near``) the most
    loaded ``near`` clusters to the ``near`` least loaded after the move, in index order."""
    C = len(n)
    if near is None:
        return list(itertools.permutations(range(C), 2))
    donors = set(sorted(range(C), key=lambda i: (-_load(t[i], n[i], m), i))[:near])
    takers = set(sorted(range(C), key=lambda j: (_load(t[j], min(n[j] + step, L), m), j))[:near])
    return [(i, j) for i in sorted(donors) for j in sorted(takers) if i != j]


def _cheapest_growth(t: Sequence[Lists], n: Sequence[int], m: int, wan: Wan, L: int) -> int | None:
    """The cluster whose one more layer raises the estimate least (maxima of the others kept by a
    top-two scan, so each step is O(clusters))."""
    bott = [ti.bott[ni] for ti, ni in zip(t, n)]
    sync = [ti.sync[ni] for ti, ni in zip(t, n)]
    fill = sum(ti.fill[ni] for ti, ni in zip(t, n)) + wan.total_s
    b1, b2 = _top_two(bott)
    s1, s2 = _top_two(sync)
    best: tuple[float, int] | None = None
    for i, ti in enumerate(t):
        if n[i] + 1 > L:
            continue
        ob = b2 if bott[i] == b1 else b1
        os_ = s2 if sync[i] == s1 else s1
        est = (pipeline_time(m, max(ob, ti.bott[n[i] + 1], wan.worst_s), fill - ti.fill[n[i]] + ti.fill[n[i] + 1])
               + max(os_, ti.sync[n[i] + 1]))
        if math.isfinite(est) and (best is None or est < best[0]):
            best = (est, i)
    return None if best is None else best[1]


class Prepared(NamedTuple):
    """[H4] What the split reads of one cluster table, once per table and search (``prepared``)."""

    table: ClusterTable
    """The table itself (kept alive: the memo's key is its id)."""
    lists: Lists
    low: int | None
    """The fewest layers (>= 1) it can host (None: no layer count fits)."""
    run: list[float]
    """From ``low`` to L layers, the running maximum of the bottleneck (inf where nothing fits)."""
    caps: frozenset[float]
    """The finite values of ``run``."""


def prepared(ctx: Ctx, tb: ClusterTable) -> Prepared:
    """``tb``'s :class:`Prepared`, memoised in the search's context (the split of every subset and pass
    reads the same tables again)."""
    got = ctx.split_tables.get(id(tb))
    if got is None or got.table is not tb:
        ti = as_lists(tb)
        L = len(ti.fill) - 1
        ok = [n for n in range(1, L + 1) if math.isfinite(ti.fill[n])]
        low = ok[0] if ok else None
        run: list[float] = []
        if low is not None:
            b = [ti.bott[n] if math.isfinite(ti.fill[n]) else math.inf for n in range(low, L + 1)]
            run = list(itertools.accumulate(b, max))
        got = ctx.split_tables[id(tb)] = Prepared(tb, ti, low, run, frozenset(v for v in run if math.isfinite(v)))
    return got


def _cap_start(prep: Sequence[Prepared], L: int) -> list[int]:
    """Smallest bottleneck cap at which the clusters can hold every layer (binary search over the
    estimated bottleneck values), and each cluster's largest layer count under it (the bottleneck
    taken as its running maximum over n, so that the count is monotone in the cap)."""
    runs = [(p.low, p.run) for p in prep]
    lo = [p.low for p in prep]
    caps = sorted(frozenset().union(*(p.caps for p in prep)))

    def counts(cap: float) -> list[int]:
        return [max(low, low + bisect.bisect_right(r, cap) - 1) for low, r in runs]

    a, b = 0, len(caps) - 1
    if not caps or sum(counts(caps[b])) < L:
        return list(lo)
    while a < b:
        mid = (a + b) // 2
        if sum(counts(caps[mid])) >= L:
            b = mid
        else:
            a = mid + 1
    return counts(caps[a])


def _cheapest_shrink(
    t: Sequence[Lists], n: Sequence[int], lo: Sequence[int], m: int, wan: Wan, depth: Sequence[int],
    near: int | None = None,
) -> int | None:
    """The cluster whose one layer less lowers the estimate most (``near``: among the ``near`` most
    loaded ones)."""
    best: tuple[float, int] | None = None
    idx = range(len(n)) if near is None else sorted(
        sorted(range(len(n)), key=lambda i: (-_load(t[i], n[i], m), i))[:near])
    for i in idx:
        if n[i] - 1 < lo[i]:
            continue
        trial = list(n)
        trial[i] -= 1
        est = estimate_at(t, trial, m, wan, depth)
        if best is None or est < best[0]:
            best = (est, i)
    return None if best is None else best[1]


def _top_two(values: Sequence[float]) -> tuple[float, float]:
    a = b = 0.0
    for v in values:
        if v > a:
            a, b = v, a
        elif v > b:
            b = v
    return a, b
