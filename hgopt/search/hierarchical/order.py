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
    sends = _sends(ctx, names, B, m)
    if len(names) <= 5:
        return min(itertools.permutations(names), key=lambda o: (_cost(sends, o, m), o))
    return _two_opt(sends, _greedy_path(sends, names, m), m)


def _block_boundary(ctx: Ctx) -> int:
    cut = ctx.layout.pre + max(ctx.layout.blocks // 2, 1)  # a block boundary
    return min(max(cut, 1), ctx.tables.num_layers - 1) if ctx.tables.num_layers > 1 else 1


def _sends(ctx: Ctx, names: Sequence[str], B: int, m: int) -> dict[tuple[str, str], tuple[float, float]]:
    """(forward, backward) seconds of every boundary a → b between ``names`` at the block boundary."""
    cut = _block_boundary(ctx)
    out = {}
    for a in names:
        for b in names:
            if a != b:
                _, f, bw = best_link(ctx, a, b, B, cut, m)
                out[(a, b)] = (f, bw)
    return out


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


def _two_opt(sends: dict[tuple[str, str], tuple[float, float]], order: tuple[str, ...], m: int) -> tuple[str, ...]:
    best, cost = order, _cost(sends, order, m)
    improved = True
    while improved:
        improved = False
        for i in range(len(best) - 1):
            for j in range(i + 2, len(best) + 1):
                cand = best[:i] + best[i:j][::-1] + best[j:]
                c = _cost(sends, cand, m)
                if c < cost - 1e-12:
                    best, cost, improved = cand, c, True
    return best
