"""[H3] Cluster order along the pipeline over the WAN matrix: (m − 1)·slowest boundary + sum of
boundary times; exhaustive up to 5 clusters, else greedy + 2-opt."""

from __future__ import annotations

import itertools
from typing import Sequence

from hgopt.cost.pipeline import pipeline_time
from hgopt.search.hierarchical.context import Ctx
from hgopt.search.hierarchical.links import best_link


def cluster_order(ctx: Ctx, names: tuple[str, ...], B: int, m: int) -> tuple[str, ...]:
    """Cluster order minimising (m − 1)·slowest WAN boundary + sum of WAN boundary times, at the
    block boundary's activation size: exhaustive up to 5 clusters, else greedy + 2-opt."""
    if len(names) <= 5:
        return _best_of(ctx, list(itertools.permutations(names)), B, m)
    return _two_opt(ctx, _greedy_path(ctx, names, B, m), B, m)


def path_cost(ctx: Ctx, order: Sequence[str], B: int, m: int) -> float:
    cut = ctx.layout.pre + max(ctx.layout.blocks // 2, 1)  # a block boundary
    cut = min(max(cut, 1), ctx.tables.num_layers - 1) if ctx.tables.num_layers > 1 else 1
    worst = total = 0.0
    for a, b in zip(order, order[1:]):
        _, f, bw = best_link(ctx, a, b, B, cut, m)
        worst, total = max(worst, f, bw), total + f + bw
    return pipeline_time(m, worst, total)


def _best_of(ctx: Ctx, orders: Sequence[tuple[str, ...]], B: int, m: int) -> tuple[str, ...]:
    return min(orders, key=lambda o: (path_cost(ctx, o, B, m), o))


def _greedy_path(ctx: Ctx, names: tuple[str, ...], B: int, m: int) -> tuple[str, ...]:
    best: tuple[float, tuple[str, ...]] | None = None
    pair = {(a, b): path_cost(ctx, (a, b), B, m) for a in names for b in names if a != b}
    for start in names:
        path, left = [start], set(names) - {start}
        while left:
            nxt = min(sorted(left), key=lambda n: pair[(path[-1], n)])
            path.append(nxt)
            left.remove(nxt)
        cost = path_cost(ctx, path, B, m)
        if best is None or cost < best[0]:
            best = (cost, tuple(path))
    assert best is not None
    return best[1]


def _two_opt(ctx: Ctx, order: tuple[str, ...], B: int, m: int) -> tuple[str, ...]:
    best, cost = order, path_cost(ctx, order, B, m)
    improved = True
    while improved:
        improved = False
        for i in range(len(best) - 1):
            for j in range(i + 2, len(best) + 1):
                cand = best[:i] + best[i:j][::-1] + best[j:]
                c = path_cost(ctx, cand, B, m)
                if c < cost - 1e-12:
                    best, cost, improved = cand, c, True
    return best
