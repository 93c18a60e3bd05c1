"""[H3] Cluster order along the pipeline over the WAN matrix: (m − 1)·slowest boundary + sum of
boundary times; exhaustive up to 5 clusters, else greedy + 2-opt. Above ``Ctx.neighbours`` + 1 clusters
the greedy walks each cluster's neighbour list (every other cluster by a one-sample send, sorted once
per search), the 2-opt tries only the reversals that join a cluster to one of its ``neighbours``
nearest, and a boundary is costed only when a path uses it: O(clusters²) per call and
O(clusters² · neighbours) per 2-opt sweep instead of O(clusters³) (and O(clusters²) link costings
per microbatch size); at or below it both are the full searches (same orders as before)."""

from __future__ import annotations

import itertools
from typing import Sequence

from hgopt.cost.pipeline import pipeline_time
from hgopt.search.hierarchical.context import Ctx
from hgopt.search.hierarchical.links import best_link, link_times


def cluster_order(ctx: Ctx, names: tuple[str, ...], B: int, m: int) -> tuple[str, ...]:
    """Cluster order minimising (m − 1)·slowest WAN boundary + sum of WAN boundary times, at the
    block boundary's activation size: exhaustive up to 5 clusters, else greedy + 2-opt (above
    ``ctx.neighbours`` + 1 clusters on neighbour lists, the boundaries costed only where used)."""
    sends = _Sends(ctx, B, m)
    if len(names) <= 5:
        return min(itertools.permutations(names), key=lambda o: (_cost(sends, o, m), o))
    if len(names) <= ctx.neighbours + 1:
        return _two_opt(sends, _greedy_path(sends, names, m), m)
    keep = set(names)
    ranked = {a: [b for b in _ranking(ctx, a) if b in keep] for a in names}
    near = {a: frozenset(r[: ctx.neighbours]) for a, r in ranked.items()}
    return _two_opt(sends, _greedy_walk(sends, names, ranked, m), m, near)


class _Sends(dict):  # type: ignore[type-arg]
    """(forward, backward) seconds of a boundary a → b at the block boundary, costed on first use."""

    def __init__(self, ctx: Ctx, B: int, m: int) -> None:
        super().__init__()
        self.ctx, self.B, self.m, self.cut = ctx, B, m, _block_boundary(ctx)

    def __missing__(self, key: tuple[str, str]) -> tuple[float, float]:
        _, f, bw = best_link(self.ctx, key[0], key[1], self.B, self.cut, self.m)
        self[key] = (f, bw)
        return (f, bw)


def _ranking(ctx: Ctx, a: str) -> list[str]:
    """Every other cluster by the native one-sample send a → b plus b → a at the block boundary (the
    neighbour lists of the large-instance order search; computed once per search)."""
    if a not in ctx.ranks:
        cut = _block_boundary(ctx)
        names = [c.name for c in ctx.instance.topology.clusters if c.name != a]
        cost = {b: sum(link_times(ctx, a, b, 1, cut)) + sum(link_times(ctx, b, a, 1, cut)) for b in names}
        ctx.ranks[a] = sorted(names, key=lambda b: (cost[b], b))
    return ctx.ranks[a]


def _greedy_walk(
    sends: dict[tuple[str, str], tuple[float, float]], names: tuple[str, ...], ranked: dict[str, list[str]], m: int
) -> tuple[str, ...]:
    """Nearest-neighbour paths along the neighbour lists ``ranked`` from every start; the cheapest."""
    best: tuple[float, tuple[str, ...]] | None = None
    for start in names:
        path, seen = [start], {start}
        while len(path) < len(names):
            nxt = next(b for b in ranked[path[-1]] if b not in seen)
            path.append(nxt)
            seen.add(nxt)
        cost = _cost(sends, path, m)
        if best is None or cost < best[0]:
            best = (cost, tuple(path))
    assert best is not None
    return best[1]


def _block_boundary(ctx: Ctx) -> int:
    cut = ctx.layout.pre + max(ctx.layout.blocks // 2, 1)  # a block boundary
    return min(max(cut, 1), ctx.tables.num_layers - 1) if ctx.tables.num_layers > 1 else 1


def _cost(sends: dict[tuple[str, str], tuple[float, float]], order: Sequence[str], m: int) -> float:
    worst = total = 0.0
    for a, b in zip(order, order[1:]):
        f, bw = sends[(a, b)]
        worst, total = max(worst, f, bw), total + f + bw
    return pipeline_time(m, worst, total)


def _greedy_path(sends: dict[tuple[str, str], tuple[float, float]], names: tuple[str, ...], m: int) -> tuple[str, ...]:
    best: tuple[float, tuple[str, ...]] | None = None
    pair = {(a, b): _cost(sends, (a, b), m) for a in names for b in names if a != b}
    for start in names:
        path, left = [start], set(names) - {start}
        while left:
            nxt = min(sorted(left), key=lambda n: pair[(path[-1], n)])
            path.append(nxt)
            left.remove(nxt)
        cost = _cost(sends, path, m)
        if best is None or cost < best[0]:
            best = (cost, tuple(path))
    assert best is not None
    return best[1]


def _two_opt(
    sends: dict[tuple[str, str], tuple[float, float]], order: tuple[str, ...], m: int,
    near: dict[str, frozenset[str]] | None = None,
) -> tuple[str, ...]:
    """Reverse runs best[i:j] while that lowers the path cost; with ``near``, only the reversals whose
    new boundary before the run joins neighbours (best[i − 1] and best[j − 1]), or that start the
    path or end it (O(clusters · neighbours) reversals per sweep)."""
    best, cost = order, _cost(sends, order, m)
    n = len(order)
    improved = True
    while improved:
        improved = False
        for i in range(n - 1):
            for j in range(i + 2, n + 1):
                if near is not None and i > 0 and j < n and best[j - 1] not in near[best[i - 1]]:
                    continue
                cand = best[:i] + best[i:j][::-1] + best[j:]
                c = _cost(sends, cand, m)
                if c < cost - 1e-12:
                    best, cost, improved = cand, c, True
    return best


def cheapest_reversals(ctx: Ctx, order: tuple[str, ...], B: int, m: int, limit: int) -> list[tuple[str, ...]]:
    """[H3] The ``limit`` reversals of a run of ``order`` with the cheapest WAN path cost (the 2-opt
    moves of the neighbour lists: a reversal inside the path joins neighbours before the run),
    without ``order`` itself and its mirror; for the reorder step on large instances, which then
    splits O(limit) orders instead of O(clusters²)."""
    sends = _Sends(ctx, B, m)
    keep = set(order)
    near = {a: frozenset([b for b in _ranking(ctx, a) if b in keep][: ctx.neighbours]) for a in order}
    n = len(order)
    cands = {order[:i] + order[i:j][::-1] + order[j:] for i in range(n - 1) for j in range(i + 2, n + 1)
             if i == 0 or j == n or order[j - 1] in near[order[i - 1]]}
    cands.discard(order)
    cands.discard(order[::-1])
    return sorted(cands, key=lambda o: (_cost(sends, o, m), o))[:limit]
