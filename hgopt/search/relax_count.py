"""[R6s] The 1F1B round trip in the subset-DP relaxation, per stage count (gaps4, round 8;
formulations/cluster_milp.md §5).

[C3]'s window pace makes every plan with bottleneck <= tau satisfy fill <= tau·min(S, m) (the whole
pipeline is one of the windows; S its stage count, m the microbatches). [R6] puts that condition in
the subset DP by Lagrangian weights on fill − tau·S, and the DP answers a weight with an extra cheap
stage (a stage of near-zero time lowers the average, so the condition holds in the relaxation while
[C3]'s windows without that stage would not). Here the stage count is a dimension of the DP state
instead: for every count S the DP gives the least fill (+ tail) of a relaxed plan with S stages, and
the condition is checked, and weighted, with S fixed. A plan with one more stage is a plan of count
S + 1, checked against tau·(S + 1) with its own (larger) fill; adding a stage no longer lowers the
bound of the count it left. Counts from ``STAGE_CAP`` on share one state, checked against tau·m.
[R6w]: the same for the windows without the first stage (and the link after it) and without the last
(and the link before it). Off by default (``relax.COUNT_ROWS``): valid, but on the five-zone instances
it lifts the weakest split's bound by 0.02-0.3 % for ~6x the DP's time (bench/RESULTS.md, gaps4).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hgopt.search.relax import RelaxedSplit

__all__ = ["STAGE_CAP", "count_bound"]

INF = math.inf
STAGE_CAP = 24
"""Stage counts of at least this many share the DP's last state (checked against tau·m, which every
count satisfies: min(S, m) <= m)."""
LAMBDAS = (0.0, 0.5, 2.0, 8.0)
"""Weights on fill − tau·min(S, m) per stage count (any lambda >= 0 is valid)."""
WINDOW_LAMBDAS = (2.0,)
"""Weights on the windows without the first or the last stage (their feasibility is checked too)."""
SLACK = 1e-12
"""Relative tolerance of the feasibility check fill <= tau·min(S, m) (float sums in another order)."""


def count_bound(rs: RelaxedSplit, tau: float, tails: list[np.ndarray] | list[None]) -> float:
    """[R6s], [R6w] Least fill + first-stage tail ([R5t], in ``tails`` per first-block row) of any
    plan on two or more clusters whose bottleneck is <= tau (finite), the extra layers' compute
    included: min over stage counts S of max over windows and lambda of (DP(S) − lambda·tau·S_eff),
    where DP(S) is the least (1 + lambda)·(fill − lambda/(1 + lambda)·Δ) + tail over the relaxed plans
    the DP counts with S stages, Δ what the window leaves out and S_eff = min(S − left out + missing, m)
    (``missing``: sides whose special stage no row counts). Windows ([C3]: each one's time is at most
    tau·min(its stages, m)): the whole pipeline, and, with prefix and suffix rows, the pipeline without
    its first stage and the link after it, and without its last stage and the link before it. A count
    whose least fill less Δ exceeds tau·S_eff for some window holds no plan of [C3] with that
    bottleneck (INF)."""
    N, m = rs.trunk, rs.num_microbatches or 10**9
    K = min(STAGE_CAP, m)
    missing = int(rs.p > 0 and not rs.TB) + int(rs.q > 0 and not rs.TE)
    counts = np.arange(K + 1)
    windows = ["whole"] + (["no_first", "no_last"] if rs.TB and rs.TE and rs.first_scomp and rs.end_scomp else [])
    no_tails: list[np.ndarray] | list[None] = [None] * len(rs.TB)
    best = np.full(K + 1, -INF)
    ok = np.ones(K + 1, dtype=bool)
    for win in windows:
        left = 0 if win == "whole" else 1
        s_eff = np.minimum(np.maximum(counts - left, 0) + missing, m).astype(float)
        s_eff[K] = m  # the shared last state: every count >= K, so min(S, m) <= m
        fill = _count_values(rs, tau, 1.0, 1.0, no_tails, N, K, win)  # fill − Δ, no tail
        ok &= fill <= tau * s_eff * (1.0 + SLACK)
        if not ok.any():
            return INF
        for lam in LAMBDAS if win == "whole" else WINDOW_LAMBDAS:
            v = _count_values(rs, tau, 1.0 + lam, lam, tails, N, K, win)
            best = np.maximum(best, v - lam * tau * s_eff)
    return float(np.where(ok, best, INF).min())


def _count_values(rs: RelaxedSplit, tau: float, w: float, lam: float, tails: list[np.ndarray] | list[None],
                  N: int, K: int, window: str = "whole") -> np.ndarray:
    """Per stage count S = 0..K (K: K or more), the least w·(fill + extra) − lam·Δ + tail over the
    relaxed multi-cluster plans with every stage and hand-over within tau; Δ: an upper bound on what
    the fill counts of the stage and link ``window`` leaves out ('no_first', 'no_last'; 'whole': 0)."""
    from hgopt.search.relax import _paths, _paths_to

    C = len(rs.names)
    trunk = np.array([_per_count(t, w * f, st, tau, K, N, 1) for t, f, st in zip(rs.T, rs.F, rs.stages)])
    arcs = np.where(rs.wan <= tau, w * rs.wan_fill, INF).min(axis=0)
    cut_first, cut_last = window == "no_first", window == "no_last"
    firsts = None if not rs.TB else _side_rows(rs.TB, rs.FB, rs.stages_first, tails, rs.first_scomp, rs.first_send,
                                               tau, w, lam, K, N, cut_first)
    ends = None if not rs.TE else _side_rows(rs.TE, rs.FE, rs.stages_end, [None] * len(rs.TE), rs.end_scomp,
                                             rs.end_send, tau, w, lam, K, N, cut_last)
    extra = w * rs.extra_fill
    keep = (w - lam) / w  # the cut link's arc: its fill counted w times, less lam times by the window
    if ends is None:
        return _count_dp(trunk, C, N, K, firsts[0] if firsts else None, [], _paths(arcs, C)) + extra
    if cut_first:  # the first block is the path's tied end (paths reversed), its first arc free for s = 1
        H = _paths_to(arcs.T, C)
        return _count_dp(trunk, C, N, K, ends[0], [(firsts[1], _free_last(H, arcs.T, keep)), (firsts[2], H)]) + extra
    H = _paths_to(arcs, C)
    if cut_last:  # the last block's incoming arc is free for a one-stage last block
        return _count_dp(trunk, C, N, K, firsts[0] if firsts else None,
                         [(ends[1], _free_last(H, arcs, keep)), (ends[2], H)]) + extra
    return _count_dp(trunk, C, N, K, firsts[0] if firsts else None, [(ends[0], H)]) + extra


def _side_rows(T: tuple[np.ndarray, ...], F: tuple[np.ndarray, ...], S: tuple[np.ndarray, ...],
               tails: list[np.ndarray] | list[None], scomp: tuple[np.ndarray, ...], send: tuple[np.ndarray, ...],
               tau: float, w: float, lam: float, K: int, N: int,
               cut: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The [R1e] rows of one side per cluster as (K + 1, N + 1) arrays, weighted; with ``cut``, less
    lam·Δ (Δ: the most the special stage can compute within tau holding x <= n − (s − 1) trunk layers,
    plus both directions of its intra-cluster send when s >= 2) and split into (all, one-stage rows,
    rows of two or more stages), so the caller can free the one-stage rows' WAN arc."""
    alls, ones, more = [], [], []
    n = np.arange(N + 1)
    for t, f, st, tl, sc, sd in zip(T, F, S, tails, scomp or [None] * len(T), send or [None] * len(T)):
        v = w * f + (tl if tl is not None else 0.0)
        if cut and len(t):
            j = (sc <= tau).sum(axis=1) - 1  # sc non-decreasing in x: the most trunk layers within tau
            x = np.clip(np.minimum(n[None, :] - (st[:, None] - 1), j[:, None]), 0, N).astype(np.int64)
            delta = np.take_along_axis(sc, x, axis=1) + np.where(st > 1, 2.0 * sd, 0.0)[:, None]
            v = v - lam * delta
        alls.append(_per_count(t, v, st, tau, K, N + 1, 0))
        if cut:
            one = st == 1
            ones.append(_per_count(t[one], v[one], st[one], tau, K, N + 1, 0))
            more.append(_per_count(t[~one], v[~one], st[~one], tau, K, N + 1, 0))
    if not cut:
        a = np.array(alls)
        return a, a, a
    return np.array(alls), np.array(ones), np.array(more)


def _free_last(H: np.ndarray, arcs: np.ndarray, keep: float) -> np.ndarray:
    """Held-Karp ``H[X, e]`` with the arc into e weighted by ``keep`` (its share the window keeps)."""
    C = arcs.shape[0]
    arcs = np.where(np.isfinite(arcs), keep * arcs, INF)  # an arc beyond tau stays forbidden
    out = np.full_like(H, INF)
    for X in range(1, H.shape[0]):
        for e in range(C):
            if X >> e & 1:
                Y = X ^ (1 << e)
                out[X, e] = 0.0 if Y == 0 else float(np.min(H[Y] + arcs[:, e]))
    return out


def _per_count(t: np.ndarray, v: np.ndarray, st: np.ndarray, tau: float, K: int, width: int, n0: int) -> np.ndarray:
    """(K + 1, N + 1): per stage count s (K: K or more) and trunk count n, the least ``v`` over the
    rows of s stages whose largest stage fits tau; the rows' columns are n = n0 .. n0 + width − 1."""
    out = np.full((K + 1, n0 + width), INF)
    if len(t):
        vals = np.where(t <= tau, v, INF)
        rows = np.minimum(st.astype(np.int64), K)
        np.minimum.at(out, (rows[:, None], np.arange(n0, n0 + width)[None, :]), vals)
    return out


def _conv(prev: np.ndarray, f: np.ndarray, K: int) -> np.ndarray:
    """Min-plus convolution in both dimensions, stage counts saturating at K:
    out[min(a + b, K), n] = min over j of prev[a, n − j] + f[b, j]."""
    N1 = prev.shape[1]
    out = np.full_like(prev, INF)
    live_a = np.flatnonzero(np.isfinite(prev).any(axis=1))
    if not live_a.size:
        return out
    idx = np.arange(N1)[:, None] - np.arange(N1)[None, :]  # idx[n, j'] = n − j'
    valid = idx >= 0
    for b in np.flatnonzero(np.isfinite(f).any(axis=1)):
        shift = np.where(valid, f[b][np.clip(idx, 0, N1 - 1)], INF)  # shift[n, j'] = f[b, n − j']
        c = np.min(prev[live_a][:, None, :] + shift[None, :, :], axis=2)  # (live a, n)
        dest = np.minimum(live_a + b, K)
        np.minimum.at(out, dest, c)
    return out


def _count_dp(fills: np.ndarray, C: int, N: int, K: int, untied: np.ndarray | None,
              tied: list[tuple[np.ndarray, np.ndarray]], paths: np.ndarray | None = None) -> np.ndarray:
    """``relax._subset_dp`` with the stage count as a second dimension: per count S, min over
    cluster sets X (two or more) of a WAN path through X + the least fill of the N trunk layers over X
    with S stages in all (each member >= 1 trunk layer, but the blocks of the two sides, which hold
    the prefix or suffix by their rows with n >= 0). ``untied``: one member's block by these rows, its
    place in the path free; ``tied``: (rows, H) pairs, one member e by the rows and the path H[X, e]
    ending at e (the least over the pairs); without ``tied``, ``paths[X]`` (any ends)."""
    full = 1 << C
    A = np.full((full, K + 1, N + 1), INF)
    A[0, 0, 0] = 0.0
    for X in range(1, full):
        c = (X & -X).bit_length() - 1
        A[X] = _conv(A[X ^ (1 << c)], fills[c], K)
    if untied is not None:
        A1 = np.full_like(A, INF)
        for X in range(1, full):
            c = (X & -X).bit_length() - 1
            Y = X ^ (1 << c)
            A1[X] = np.minimum(_conv(A1[Y], fills[c], K), _conv(A[Y], untied[c], K))
        A = A1
    vals = np.full(K + 1, INF)
    singles = {1 << c for c in range(C)}
    for X in range(1, full):
        if X in singles:
            continue
        if not tied:
            if paths is not None and math.isfinite(paths[X]):
                vals = np.minimum(vals, paths[X] + A[X][:, N])
            continue
        for e in range(C):
            if not X >> e & 1:
                continue
            rest = A[X ^ (1 << e)]
            if not np.isfinite(rest).any():
                continue
            for rows, H in tied:
                if math.isfinite(H[X, e]):
                    # the others hold N − j trunk layers, e holds j: the convolution at n = N
                    vals = np.minimum(vals, H[X, e] + _conv(rest, rows[e], K)[:, N])
    return vals
