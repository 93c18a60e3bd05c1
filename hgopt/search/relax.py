"""A combinatorial relaxation of one batch split's MILP: a lower bound on every plan of the split
from a dynamic programme over subsets of clusters [R1]..[R5] (formulations/cluster_milp.md, §5).

For a bottleneck cap tau the relaxation keeps, per cluster and trunk count n, the least fill of a
trunk-only local pipeline whose stages all run within tau (memory checked with the fewest in-flight
microbatches any position allows); every real block costs at least that plus its special layers.
The clusters of a pipeline must then cover the trunk (a min-plus convolution over subsets) and be
chained by WAN links no slower than tau (a Held-Karp path over the same subsets). The tail is bounded
separately by the least tail of the pipeline's first stage [C7o] (the cheap bound's s_lb), or,
with a prefix, in the first block's rows by what its first stage must hold within tau [R5t]. Bottleneck values are taken on a geometric
grid: plans with bottleneck in [tau_i, tau_{i+1}) cost at least w·tau_i + fill_lb(tau_{i+1}) + ...
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from hgopt.cost.pipeline import in_flight, occupancy_bounds, replay_bounds, search_windows, stage_fill, stage_line, weighted_time
from hgopt.cost.tables import CostTables, memoised
from hgopt.search.blocks import ArcTable, CheapBounds, LinkPolicy, arc_table, model_shape, role_geometry
from hgopt.search.intra import StageModel, TrunkCosts, local_configs
from hgopt.search.relax_count import count_bound
from hgopt.spec import Instance

__all__ = ["MAX_CLUSTERS", "RelaxedSplit", "relax_split"]

INF = math.inf
MAX_CLUSTERS = 12
"""Above this many clusters the subset DP (2^C states) is skipped and the cheap bound is used."""
COUNT_ROWS = False
"""gaps4 [R6s]/[R6w]: also bound each bottleneck per stage count with the windows without the first or
the last stage (``relax_count``; valid, ~6x the DP time for +0.02 % on sailor-geo-5x32: off)."""
SPECIAL_AT_CONFIG = True
"""gaps4 [R1c]: the [R1e] rows count the prefix (suffix) at their own config (False: at the least over
every config, in ``extra_fill`` only; what rounds 6-7 did)."""
LAMBDAS = (0.0, 0.5, 2.0, 8.0)
"""Lagrangian weights of the round-trip condition fill <= tau·S tried at each bottleneck [R6]; only 0
unless ``pipeline.search_windows`` (false under the replay and with ``CLOSED_CAP``: the condition is [C3]'s
window pace, which neither the exact timeline, where a window of S >= m stages completes no round trip, ``window_cycles``, nor the
closed form [C3c], capped by it, carries)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RelaxedSplit:
    """Per cluster, rows (config, stage count) × trunk count n of bottleneck, fill and tail."""

    names: tuple[str, ...]
    T: tuple[np.ndarray, ...]
    F: tuple[np.ndarray, ...]
    wan: np.ndarray
    """wan[π, a, b]: pace of a hand-over a→b at allowed precision pair π (the slower direction, all
    k pipelines' bytes [C4w], a one-sample cast [C4q]: a lower bound for any microbatch size)."""
    wan_fill: np.ndarray
    """wan_fill[π, a, b]: fill of that hand-over (both directions)."""
    extra_fill: float
    stages: tuple[np.ndarray, ...] = ()
    """Per cluster: stage count of each row."""
    p: int = 0
    q: int = 0
    trunk: int
    weight: float
    """The cheap bound's weight (``pipeline.search_weight``)."""
    s_lb: float
    TE: tuple[np.ndarray, ...] = ()
    """gaps2 [R1e]: per cluster, rows (config, stage count) × trunk count n = 0..N of the least largest
    stage of its block when that block ends the pipeline: its last stage holds the suffix layers
    (the head) and x >= 0 trunk layers, so the suffix's compute counts against the bottleneck; empty:
    no suffix (q = 0), every cluster's trunk rows only."""
    FE: tuple[np.ndarray, ...] = ()
    """gaps2 [R1e]: the fill of those rows (trunk layers and intra-cluster sends; the suffix's own
    compute stays in ``extra_fill``)."""
    stages_end: tuple[np.ndarray, ...] = ()
    TB: tuple[np.ndarray, ...] = ()
    """gaps2 [R1e]: the same for a block that begins the pipeline: its first stage holds the prefix
    layers and x >= 0 trunk layers (empty: no prefix, p = 0; then no member of the subset DP is
    the first block, and without a suffix the path has no fixed end)."""
    FB: tuple[np.ndarray, ...] = ()
    stages_first: tuple[np.ndarray, ...] = ()
    first_tail: tuple[np.ndarray, ...] = ()
    """gaps3 [R5t]: per cluster, for each row of ``TB`` (config, stage count s), x = 0..N: the least
    tail (``StageModel.first_tail``, made non-increasing from the back: its least over x' >= x) of the
    first stage holding the prefix and x trunk layers; empty: no prefix, the tail is ``s_lb``."""
    first_comp: tuple[np.ndarray, ...] = ()
    """gaps3 [R5t]: per cluster and row, x = 0..N: compute of a trunk stage of x layers of the row's
    config (running maximum), so that the layers a stage holds within tau are counted."""
    first_caps: tuple[np.ndarray, ...] = ()
    """gaps3 [R5t]: per cluster and row, the memory caps (trunk layers) of the block's other s − 1
    stages at distances 1..s − 1 from the pipeline's end (the largest they can be), 0 beyond s − 1."""
    offset: float = 0.0
    """[C3b] ``CheapBounds.offset``, subtracted once from every bound."""
    busy: float = 0.0
    """[C3b] ``CheapBounds.busy``: every plan also costs >= busy·bottleneck + s_lb."""
    stage_line: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """replay3 [R4s] (m − 1 + ρ, ρ, E) under the replay (``pipeline.stage_line``), (0, 0, 0) under the closed form:
    a plan of S stages with bottleneck >= a costs >= (m − 1 + ρ)·a + E − (ρ·a + E)·S + fill + tail."""
    num_microbatches: int = 0
    """gaps4 [R6s]: the split's m (the round trip's window holds min(S, m) microbatches); 0: unknown."""
    first_scomp: tuple[np.ndarray, ...] = ()
    """gaps4 [R6w]: per cluster, for each row of ``TB``, x = 0..N: compute of the first stage holding
    the prefix and x trunk layers at the row's config (empty: no prefix)."""
    first_send: tuple[np.ndarray, ...] = ()
    """gaps4 [R6w]: per cluster, for each row of ``TB``: its intra-cluster send (one direction)."""
    end_scomp: tuple[np.ndarray, ...] = ()
    """gaps4 [R6w]: the same for the rows of ``TE`` (the last stage holding the suffix and x)."""
    end_send: tuple[np.ndarray, ...] = ()

    def bound_at(self, tau: float, reward: float = 0.0) -> float:
        """[R4] Least fill + tail of any plan on two or more clusters whose bottleneck is <= tau
        (plans on one cluster are bounded exactly, see ``split_bound``). Besides every stage and
        WAN send within tau, the 1F1B round trip of the first stage needs fill <= tau·min(S, m),
        so fill − tau·S <= 0 with S the stage count [C3]; it enters by Lagrangian weights lambda:
        fill >= (1 + lambda)·fill − lambda·tau·S >= the subset DP on those weights [R6]. The DP's
        stage count must be at least S: the trunk rows count only stages holding trunk layers, but
        the [R1e] rows of the first and last blocks count all of theirs (a stage of the prefix or
        the suffix alone too), so S is counted exactly; only without them (p or q = 0 rows) is 1
        per missing side subtracted (gaps3; before, 2 always). The first block's rows also carry its
        first stage's tail [R5t] (``_first_tails``), unweighted. ``reward`` (replay3 [R4s], lambda 0
        only): every row's fill less ``reward`` per stage it counts, i.e. the least fill + tail − reward·S
        (the missing sides' stages subtracted too, so S is never undercounted)."""
        N = self.trunk
        best = -INF
        # gaps3 [R5t]: the first block's rows carry its first stage's tail (never weighted by lambda)
        tails = self._first_tails(tau) if self.TB and self.first_tail else [None] * len(self.TB)
        # the Lagrangian term needs a finite tau (at tau = inf it is -inf, not a bound)
        for lam in LAMBDAS if math.isfinite(tau) and search_windows() and not reward else (0.0,):  # [C3c] closed8
            rows = [(_weighted(t, f, st, tau, lam, reward=reward) if len(t) else np.full(N, INF))
                    for t, f, st in zip(self.T, self.F, self.stages)]
            # the cheapest allowed precision of each link whose pace fits tau [R3]
            arcs = np.where(self.wan <= tau, (1.0 + lam) * self.wan_fill, INF).min(axis=0)
            # gaps2 [R1e]: the blocks that begin and end the pipeline hold the prefix and the suffix too
            ends = None if not self.TE else np.array([
                _weighted(t, f, st, tau, lam, reward=reward) if len(t) else np.full(N + 1, INF)
                for t, f, st in zip(self.TE, self.FE, self.stages_end)])
            firsts = None if not self.TB else np.array([
                _weighted(t, f, st, tau, lam, tl, reward=reward) if len(t) else np.full(N + 1, INF)
                for t, f, st, tl in zip(self.TB, self.FB, self.stages_first, tails)])
            g = _subset_dp(np.array(rows), arcs, N, ends, firsts)
            if not math.isfinite(g):
                return INF
            g += (1.0 + lam) * self.extra_fill
            if lam or reward:  # gaps3: only stages no row counts (a prefix or suffix alone: none with the [R1e] rows)
                g -= ((lam * tau if lam else 0.0) + reward) * (int(self.p > 0 and not self.TB) + int(self.q > 0 and not self.TE))
            best = max(best, g)
        if COUNT_ROWS and math.isfinite(tau) and search_windows():  # gaps4 [R6s]: per stage count
            best = max(best, count_bound(self, tau, tails))
        return best + self._tail_lb(tau)

    def _tail_lb(self, tau: float) -> float:
        """[R5] The tail [C7o]: the iteration ends at least the pipeline's first stage's sync +
        optimizer after the pipeline (stages after it start their sync earlier, by the backward
        path to them, so the largest stage tail of [C7] is no bound); the first stage holds at
        least layers [0, max(p, 1)): ``s_lb`` of the cheap bound [B4]. With a prefix the first
        block's rows carry the tail instead ([R5t], ``_first_tails``): 0 here."""
        return 0.0 if self.TB and self.first_tail else self.s_lb

    def _first_tails(self, tau: float) -> list[np.ndarray]:
        """gaps3 [R5t] Per cluster, rows of ``TB`` × n = 0..N: the least tail of the first stage of a
        first block of that row holding n trunk layers with every stage within ``tau``. Its other
        s − 1 stages hold at most min(cap_d, j(tau)) trunk layers each (j(tau): the most whose compute
        fits tau; cap_d: memory at the least distance d they can have), so the first stage holds
        x >= n − Σ_d min(cap_d, j(tau)) of them, and its tail is at least ``first_tail`` at that x
        (non-increasing from the back). Plans whose first stage holds the prefix and x trunk layers
        are all in some row (``_end_rows``), so the least over rows bounds them."""
        N = self.trunk
        n = np.arange(N + 1)
        out = []
        for tl, comp, caps in zip(self.first_tail, self.first_comp, self.first_caps):
            if not len(tl):
                out.append(np.zeros((0, N + 1)))
                continue
            j = (comp <= tau).sum(axis=1) - 1  # comp[:, 0] = 0 and comp non-decreasing: layers within tau
            held = np.minimum(caps, j[:, None]).sum(axis=1).astype(np.int64)
            x = np.clip(n[None, :] - held[:, None], 0, N)
            out.append(np.take_along_axis(tl, x, axis=1))
        return out


def _weighted(t: np.ndarray, f: np.ndarray, st: np.ndarray, tau: float, lam: float,
              tail: np.ndarray | None = None, reward: float = 0.0) -> np.ndarray:
    """Per trunk count, the least over rows whose largest stage fits ``tau`` of (1 + lam)·fill −
    (lam·tau + reward)·stages [R6] / [R4s] (+ ``tail``, per row, [R5t])."""
    per = (lam * tau if lam else 0.0) + reward  # (0·inf is not 0: tau may be inf with lam 0)
    v = (1.0 + lam) * f - per * st[:, None] if per else f
    if tail is not None:
        v = v + tail
    return np.where(t <= tau, v, INF).min(axis=0)


def _subset_dp(fills: np.ndarray, arcs: np.ndarray, N: int, ends: np.ndarray | None = None,
               firsts: np.ndarray | None = None) -> float:
    """[R3] min over non-empty cluster sets X of (cheapest WAN path through X) + (least fill of N
    trunk layers over X, every member hosting >= 1). With ``ends`` (per cluster, fill of n = 0..N
    trunk layers in a block that also holds the suffix [R1e]): one member e of X is the pipeline's
    last block, hosting n >= 0 trunk layers by ``ends[e]``, and the path through X ends at e; with
    ``firsts`` (the same for the prefix) another member is the first block, by ``firsts`` (the
    path's start is not tied to it: a relaxation)."""
    C = fills.shape[0]
    full = 1 << C
    # A[X]: (N+1,) least fill of exactly n layers over the clusters of X, each >= 1 layer
    A = np.full((full, N + 1), INF)
    A[0, 0] = 0.0
    f1 = np.concatenate([np.full((C, 1), INF), fills], axis=1)  # f1[c, n] for n = 0..N (n=0 not allowed)
    shifts = _shift_matrices(f1, N)  # per cluster, not per subset
    # relaxspeed: the subsets of one size at once (each is built from the one without its lowest member,
    # one smaller); the min-plus convolution prev ⊕ f1[c] of each, as before
    layers, low = _subset_layers(C)
    for X in layers:
        Y = X ^ (1 << low[X])
        A[X] = np.min(A[Y][:, None, :] + shifts[low[X]], axis=2)
    if firsts is not None:
        # A1[X]: the same with one member of X the first block (>= 0 trunk layers by firsts)
        A1 = np.full((full, N + 1), INF)
        fshift = _shift_matrices(firsts, N)
        for X in layers:
            c = low[X]
            Y = X ^ (1 << c)
            A1[X] = np.minimum(np.min(A1[Y][:, None, :] + shifts[c], axis=2), np.min(A[Y][:, None, :] + fshift[c], axis=2))
        A = A1
    if ends is not None:
        H = _paths_to(arcs, C)
        xs, es = np.nonzero((np.arange(full)[:, None] >> np.arange(C)[None, :]) & 1)  # every (X, e in X)
        # the others (X without e) host N − j trunk layers, e hosts j
        per = H[xs, es] + np.min(A[xs ^ (1 << es)][:, ::-1] + ends[es], axis=1)
        vals = np.full(full, INF)
        np.minimum.at(vals, xs, per)
        singles = [1 << c for c in range(C)]
        vals[[0, *singles]] = INF
        return float(vals.min())
    P = _paths(arcs, C)
    vals = P + A[:, N]
    singles = [1 << c for c in range(C)]
    vals[[0, *singles]] = INF  # one-cluster plans are bounded exactly elsewhere
    return float(vals.min())


def _shift_matrix(f: np.ndarray, N: int) -> np.ndarray:
    """M[n, j] = f[n − j] (inf where n − j < 0), so min_j (prev[j] + M[n, j]) is the convolution."""
    idx = np.arange(N + 1)[:, None] - np.arange(N + 1)[None, :]
    return np.where(idx >= 0, f[np.clip(idx, 0, N)], INF)


def _shift_matrices(f: np.ndarray, N: int) -> np.ndarray:
    """``_shift_matrix`` of every row of ``f`` (C, N + 1) at once: (C, N + 1, N + 1)."""
    idx = np.arange(N + 1)[:, None] - np.arange(N + 1)[None, :]
    return np.where(idx[None] >= 0, f[:, np.clip(idx, 0, N)], INF)


def _subset_layers(C: int) -> tuple[list[np.ndarray], np.ndarray]:
    """relaxspeed: the non-empty subsets of C clusters grouped by size (ascending), and each subset's
    lowest member."""
    X = np.arange(1, 1 << C)
    size = np.zeros(len(X), dtype=np.int64)
    for c in range(C):
        size += (X >> c) & 1
    low = np.zeros(1 << C, dtype=np.int64)
    low[1:] = np.log2(X & -X).astype(np.int64)
    return [X[size == k] for k in range(1, C + 1)], low


def _paths(arcs: np.ndarray, C: int) -> np.ndarray:
    """Held-Karp: P[X] = cheapest Hamiltonian path through the clusters of X (0 for one cluster)."""
    return _paths_to(arcs, C).min(axis=1)


def _paths_to(arcs: np.ndarray, C: int) -> np.ndarray:
    """Held-Karp: H[X, e] = cheapest Hamiltonian path through the clusters of X that ends at e."""
    full = 1 << C
    H = np.full((full, C), INF)
    for c in range(C):
        H[1 << c, c] = 0.0
    # relaxspeed: the subsets of one size at once, every u outside them at once: the path through X ending at
    # e, then the arc e -> u (the same sums, the same least value per (X | u, u))
    us = np.arange(C)
    for X in _subset_layers(C)[0][:-1]:
        best = np.min(H[X][:, :, None] + arcs[None, :, :], axis=1)  # best[x, u] = min_e H[X_x, e] + arcs[e, u]
        xi, ui = np.nonzero(((X[:, None] >> us[None, :]) & 1) == 0)
        np.minimum.at(H, (X[xi] | (1 << ui), ui), best[xi, ui])
    return H


def relax_split(instance: Instance, tables: CostTables, *, replicas: int, microbatch: int, num_microbatches: int,
                cheap: CheapBounds, links: LinkPolicy | None = None, arcs: ArcTable | None = None) -> RelaxedSplit | None:
    """[R1, R2] The relaxation tables of a split (None above MAX_CLUSTERS clusters). Hand-overs are
    costed at every precision pair ``links`` allows; the link penalty is left out (>= 0)."""
    if len(instance.topology.clusters) > MAX_CLUSTERS:
        return None
    shape = model_shape(instance)
    N, m = shape.trunk, num_microbatches
    geo, _ = role_geometry(shape, "middle")
    L = shape.num_layers
    names = tuple(c.name for c in instance.topology.clusters)
    Ts, Fs, Ns = [], [], []
    TEs, FEs, NEs, TBs, FBs, NBs = [], [], [], [], [], []
    TLs, TCs, TKs = [], [], []  # gaps3 [R5t]
    SBs, DBs, SEs, DEs = [], [], [], []  # gaps4 [R6w]
    extra = {l: INF for l in [*range(shape.p), *range(shape.num_layers - shape.q, shape.num_layers)]}
    for c in instance.topology.clusters:
        budget = c.num_gpus // replicas
        rows_t, rows_f, rows_n = [], [], []
        ends_t, ends_f, ends_n = [], [], []
        sc_b, sd_b, sc_e, sd_e = [], [], [], []  # gaps4 [R6w]
        firsts_t, firsts_f, firsts_n = [], [], []
        firsts_tail, firsts_comp, firsts_caps = [], [], []
        for cfg in local_configs(instance, c.name, microbatch, tables):  # with recomputation [I3r]
            if cfg.gpus > budget:
                continue
            sm = StageModel(instance, tables, c, cfg, replicas)
            for l in extra:
                extra[l] = min(extra[l], float(sm.compute_memo(np.array([l]), np.array([l + 1]))[0]))
            tc = TrunkCosts(sm, geo, N)
            lat = c.inter_node.latency_s if occupancy_bounds() else 0.0  # [C3c] closed8
            t, f = _trunk_rows(tc, min(budget // cfg.gpus, N), m, lat)
            rows_t.append(t), rows_f.append(f)
            rows_n.append(np.arange(1, len(t) + 1, dtype=float))
            xs = np.arange(N + 1)  # gaps2 [R1e]: the suffix (prefix) and x = 0..N trunk layers in one stage
            if shape.q:
                lo, hi = L - shape.q - xs, np.full_like(xs, L)
                te, fe = _end_rows(tc, sm.compute_memo(lo, hi), sm.max_in_flight_v(lo, hi), min(budget // cfg.gpus, N + 1), m, 1, lat)
                ends_t.append(te), ends_n.append(np.arange(1, len(te) + 1, dtype=float))
                ends_f.append(fe + _at_config(sm, L - shape.q, L))  # gaps4 [R1c]
                sc_e.append(np.repeat(sm.compute_memo(lo, hi)[None, :], len(te), axis=0))
                sd_e.append(np.full(len(te), tc.t_send))
            if shape.p:
                lo, hi = np.zeros_like(xs), shape.p + xs
                tb, fb = _end_rows(tc, sm.compute_memo(lo, hi), sm.max_in_flight_v(lo, hi), min(budget // cfg.gpus, N + 1), m, 0, lat)
                firsts_t.append(tb), firsts_n.append(np.arange(1, len(tb) + 1, dtype=float))
                firsts_f.append(fb + _at_config(sm, 0, shape.p))  # gaps4 [R1c]
                sc_b.append(np.repeat(sm.compute_memo(lo, hi)[None, :], len(tb), axis=0))
                sd_b.append(np.full(len(tb), tc.t_send))
                tl, caps = _first_tail_rows(tc, sm, lo, hi, len(tb), m)
                firsts_tail.append(np.repeat(tl[None, :], len(tb), axis=0))
                firsts_comp.append(np.repeat(np.maximum.accumulate(tc.t_comp)[None, :], len(tb), axis=0))
                firsts_caps.append(caps)
        Ts.append(np.concatenate(rows_t) if rows_t else np.zeros((0, N)))
        Fs.append(np.concatenate(rows_f) if rows_f else np.zeros((0, N)))
        Ns.append(np.concatenate(rows_n) if rows_n else np.zeros(0))
        TEs.append(np.concatenate(ends_t) if ends_t else np.zeros((0, N + 1)))
        FEs.append(np.concatenate(ends_f) if ends_f else np.zeros((0, N + 1)))
        NEs.append(np.concatenate(ends_n) if ends_n else np.zeros(0))
        TBs.append(np.concatenate(firsts_t) if firsts_t else np.zeros((0, N + 1)))
        FBs.append(np.concatenate(firsts_f) if firsts_f else np.zeros((0, N + 1)))
        NBs.append(np.concatenate(firsts_n) if firsts_n else np.zeros(0))
        TLs.append(np.concatenate(firsts_tail) if firsts_tail else np.zeros((0, N + 1)))
        TCs.append(np.concatenate(firsts_comp) if firsts_comp else np.zeros((0, N + 1)))
        TKs.append(_pad_rows(firsts_caps))
        SBs.append(np.concatenate(sc_b) if sc_b else np.zeros((0, N + 1)))
        DBs.append(np.concatenate(sd_b) if sd_b else np.zeros(0))
        SEs.append(np.concatenate(sc_e) if sc_e else np.zeros((0, N + 1)))
        DEs.append(np.concatenate(sd_e) if sd_e else np.zeros(0))
    # gaps4: the [R1e] rows carry their own config's compute of the suffix (prefix), less the least
    # over every config that ``extra_fill`` counts (a prefix or suffix on fewer GPUs costs more there)
    sfx = sum(v for l, v in extra.items() if l >= shape.p)
    pfx = sum(v for l, v in extra.items() if l < shape.p)
    if SPECIAL_AT_CONFIG:
        FEs = [f - sfx for f in FEs]
        FBs = [f - pfx for f in FBs]
    pol = links or LinkPolicy()
    table = arcs if arcs is not None else arc_table(instance, tables, microbatch, replicas, pol, shape)  # [M8f]
    wan = np.full((len(pol.pairs), len(names), len(names)), INF)
    wan_fill = np.full((len(pol.pairs), len(names), len(names)), INF)
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if a != b:
                for k, e in enumerate(table[(a, b)]):
                    wan[k, i, j], wan_fill[k, i, j] = e.bound_pace(1.0), e.fill(1.0)  # [C3b]
    return RelaxedSplit(names=names, T=tuple(Ts), F=tuple(Fs), wan=wan, wan_fill=wan_fill, stages=tuple(Ns),
                        extra_fill=sum(extra.values()), p=shape.p, q=shape.q, trunk=N, weight=cheap.weight,
                        s_lb=cheap.s_lb, offset=cheap.offset, busy=cheap.busy, num_microbatches=m,
                        stage_line=stage_line(num_microbatches, *cheap.fwd_share) if replay_bounds() else (0.0, 0.0, 0.0),
                        **({"TE": tuple(TEs), "FE": tuple(FEs), "stages_end": tuple(NEs), "end_scomp": tuple(SEs),
                            "end_send": tuple(DEs)} if shape.q else {}),
                        **({"TB": tuple(TBs), "FB": tuple(FBs), "stages_first": tuple(NBs), "first_scomp": tuple(SBs),
                            "first_send": tuple(DBs),
                            "first_tail": tuple(TLs), "first_comp": tuple(TCs), "first_caps": tuple(TKs)}
                           if shape.p else {}))


def _trunk_rows(tc: TrunkCosts, s_max: int, m: int, latency: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """[R1] For s = 1..s_max stages of n = 1..N trunk layers, at the most permissive memory (stage at
    distance r keeps min(r, m) microbatches): the least largest stage (so least bottleneck and tail;
    a send counts by its occupancy, less ``latency`` [C3b]), and the fill n·t1 + 2(s−1)·send.
    relaxspeed: the send-free part (``_trunk_compute_rows``) is memoised by the config's compute and
    memory key, so clusters of one GPU type and splits of one microbatch size share it."""
    N = tc.xmax
    caps = _trunk_caps(tc, s_max, m)
    key = ("relax_trunk_rows", tc.sm.key_memory, tc.geo.t0, N, caps.tobytes())
    comp, ok = memoised(tc.sm.tables, key, lambda: _trunk_compute_rows(tc, caps))
    n = np.arange(1, N + 1)
    sends = np.arange(s_max)[:, None] * tc.t_send  # (s − 1)·send per row
    send_pace = max(tc.t_send - latency, 0.0)
    t = comp.copy()
    t[1:] = np.maximum(comp[1:], send_pace)
    T = np.where(ok, t, INF)
    F = np.where(ok, stage_fill(tc.t_comp[n][None, :], sends, sends), INF)
    return T, F


def _trunk_caps(tc: TrunkCosts, s_max: int, m: int) -> np.ndarray:
    """``_caps`` of the trunk stages of ``tc``'s config, memoised by its memory key."""
    return memoised(tc.sm.tables, ("relax_caps", tc.sm.key_memory, tc.geo.t0, tc.xmax, s_max, m),
                    lambda: _caps(tc.kmax("t"), s_max, m, tc.xmax))


def _caps(km: np.ndarray, s_max: int, m: int, N: int) -> np.ndarray:
    """Per distance r = 1..s_max from the pipeline's end: the most trunk layers x such that stages of
    1..x layers all keep in_flight(r, 0, m) microbatches ([C6], ``km``: most in flight per x); N when all do."""
    need = np.asarray(in_flight(np.arange(1, s_max + 1), 0, m))
    bad = ~(km[1:][None, :] >= need[:, None])
    return np.where(bad.any(axis=1), bad.argmax(axis=1), N).astype(np.int64)


def _trunk_compute_rows(tc: TrunkCosts, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_trunk_rows`` without sends: per s (rows) and n = 1..N, the compute of the largest stage when the
    s stages (memory caps ``caps`` by distance) hold n trunk layers, and whether they can."""
    N = tc.xmax
    s_max = len(caps)
    xs = np.arange(N + 1)
    G = np.cumsum(np.minimum(caps[:, None], xs[None, :]), axis=0)  # G[s-1, x]
    n = np.arange(1, N + 1)
    comp = np.zeros((s_max, N))
    ok = np.zeros((s_max, N), dtype=bool)
    for si in range(s_max):
        if caps[si] < 1:
            break  # caps shrink with distance: no deeper pipeline fits either
        xm = np.searchsorted(G[si], n, side="left")
        ok[si] = (xm <= N) & (n >= si + 1)
        comp[si] = tc.t_comp[np.minimum(xm, N)]
    return comp, ok


def _first_tail_rows(tc: TrunkCosts, sm: StageModel, lo: np.ndarray, hi: np.ndarray, s_max: int,
                     m: int) -> tuple[np.ndarray, np.ndarray]:
    """gaps3 [R5t] For one config: the first stage's tail with the prefix and x = 0..N trunk layers
    (layers [lo[x], hi[x]), ``first_tail``), as its least over x' >= x, and per stage count s =
    1..s_max the memory caps of the other s − 1 trunk stages at distances 1..s − 1 (as ``_end_rows``
    with shift 0), 0-padded to s_max − 1 columns."""
    tail = sm.first_tail(lo, hi, monotone=True)
    tail = np.minimum.accumulate(tail[::-1])[::-1]
    caps = np.zeros((s_max, max(s_max - 1, 1)), dtype=np.int64)
    if s_max > 1:
        r = np.arange(1, s_max)  # distance r: rows s >= r + 1 (index >= r) have a stage there
        caps[:, : s_max - 1] = np.where(np.arange(s_max)[:, None] >= r[None, :],
                                        _trunk_caps(tc, s_max - 1, m)[None, :], 0)
    return tail, caps


def _at_config(sm: StageModel, lo: int, hi: int) -> float:
    """gaps4 [R1c] Compute of the special layers [lo, hi) at ``sm``'s config (0 with the flag off)."""
    return float(sm.compute(np.array([lo]), np.array([hi]))[0]) if SPECIAL_AT_CONFIG else 0.0


def _pad_rows(blocks: list[np.ndarray]) -> np.ndarray:
    """Stack 2-d blocks of different widths, 0-padded on the right."""
    if not blocks:
        return np.zeros((0, 1), dtype=np.int64)
    w = max(b.shape[1] for b in blocks)
    out = np.zeros((sum(b.shape[0] for b in blocks), w), dtype=np.result_type(*blocks))
    i = 0
    for b in blocks:
        out[i: i + b.shape[0], : b.shape[1]] = b
        i += b.shape[0]
    return out


def _end_rows(tc: TrunkCosts, comp: np.ndarray, kmax: np.ndarray, s_max: int, m: int,
              shift: int, latency: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """gaps2 [R1e] For a block that ends (``shift`` 1) or begins (``shift`` 0) the pipeline, s =
    1..s_max stages holding n = 0..N trunk layers: its special stage holds the suffix (prefix) and
    x >= 0 trunk layers (compute ``comp[x]``, memory at 1 in-flight microbatch, the fewest any stage
    keeps), the other s − 1 hold >= 1 trunk layer each with the memory caps of [R1]'s rows at
    distances 1 + shift .. s − 1 + shift from the pipeline's end (the last block's are 2..s; the first
    block's are at least 1..s − 1); the least largest stage (and the intra-cluster send for s >= 2),
    and the fill of the n trunk layers and the 2(s − 1) sends, as [R1]. Every block that holds the
    suffix (prefix) is one of these, so the rows bound it. relaxspeed: the send-free part
    (``_end_compute_rows``, all s at once) is memoised by the config's compute and memory key."""
    N = tc.xmax
    xs = np.arange(N + 1)
    caps = _trunk_caps(tc, s_max, m)
    head = np.where(kmax >= in_flight(1, 0, m), comp, INF)  # (N + 1,) the special stage with x trunk layers
    key = ("relax_end_rows", tc.sm.key_memory, tc.geo.t0, N, shift, caps.tobytes(), head.tobytes())
    t0 = memoised(tc.sm.tables, key, lambda: _end_compute_rows(tc.t_comp, head, caps, shift, N))
    t = t0.copy()
    t[1:] = np.maximum(t0[1:], max(tc.t_send - latency, 0.0))  # a send counts by its occupancy, less ``latency`` [C3b]
    sends = np.arange(s_max)[:, None] * tc.t_send  # (s − 1)·send per row
    F = np.where(np.isfinite(t), stage_fill(tc.t_comp[xs][None, :], sends, sends), INF)
    return t, F


def _end_compute_rows(t_comp: np.ndarray, head: np.ndarray, caps: np.ndarray, shift: int, N: int) -> np.ndarray:
    """``_end_rows`` without sends, every s at once: T[s − 1, n] = min over x <= n of max(head[x], the
    largest of s − 1 trunk stages holding n − x layers under the caps at distances 1 + shift ..)."""
    s_max = len(caps)
    xs = np.arange(N + 1)
    rest = np.full((s_max, N + 1), INF)
    rest[0] = np.where(xs == 0, 0.0, INF)
    if s_max > 1:
        G = np.cumsum(np.minimum(caps[shift: shift + s_max - 1][:, None], xs[None, :]), axis=0).astype(float)
        for si in range(1, s_max):  # capacity of the s − 1 trunk stages
            xm = np.searchsorted(G[si - 1], xs, side="left")
            rest[si] = np.where((xm <= N) & (xs >= si), t_comp[np.minimum(xm, N)], INF)
    idx = xs[:, None] - xs[None, :]  # idx[n, x] = n − x: trunk layers left for the other stages
    both = np.where(idx[None] >= 0, np.maximum(head[None, None, :], rest[:, np.clip(idx, 0, N)]), INF)
    return both.min(axis=2)


def split_bound(rs: RelaxedSplit, cheap: CheapBounds, *, target: float, single: float, deadline: float = INF,
                ratio: float = 1.0005, above: float = 0.0) -> float:
    """[R4] Lower bound on every plan of the split: ``single`` (the exact best one-cluster plan) or,
    for plans on several clusters (bottleneck >= the fastest WAN send), min over bottleneck intervals
    [tau_i, tau_{i+1}) of w·tau_i + bound_at(tau_{i+1}); intervals are refined (bisection in log
    scale) only while their bound is below ``target`` and wider than ``ratio``. With ``above``, only
    plans whose bottleneck is >= above are bounded (the cap loop [M0])."""
    return min(single, _multi_bound(rs, cheap, target=target, deadline=deadline, ratio=ratio, above=above))


def _multi_bound(rs: RelaxedSplit, cheap: CheapBounds, *, target: float, deadline: float, ratio: float,
                 above: float = 0.0) -> float:
    w = rs.weight
    lo_t = max(cheap.t_lb, float(rs.wan.min()) if len(rs.names) > 1 else INF, above)
    if not math.isfinite(lo_t):
        return INF
    hi_t = max(lo_t * 1.02, _tau_beyond(rs, target))
    memo: dict[float, float] = {}

    def at(tau: float) -> float:
        if tau not in memo:
            memo[tau] = rs.bound_at(tau)
        return memo[tau]

    slope, rho, excess = rs.stage_line

    def val_at(a: float, b: float) -> float:  # [C3b] offset, and the busy chain m·a + s_lb under the replay
        v = max(weighted_time(w, a, at(b)) - rs.offset, rs.busy * a + rs.s_lb)
        if slope and v < target:  # replay3 [R4s] the stage-count line at a, where it may matter
            v = max(v, slope * a + excess + rs.bound_at(b, reward=rho * a + excess))
        return v

    if not math.isfinite(hi_t):  # no target (no incumbent yet): one interval [lo_t, inf)
        return val_at(lo_t, INF)
    # plans with bottleneck >= hi_t cost at least w·hi_t + (their fill and tail, >= the value at inf)
    best_above = val_at(hi_t, INF)
    # gaps2: best first (the lowest interval is refined next; a child is never below its parent, as
    # val_at does not fall with a nor rise with b), so the result is the same as refining every interval
    # below the target, and it is reached as soon as the lowest interval is too narrow; at the deadline
    # the lowest interval's value is the bound so far
    heap = [(val_at(lo_t, hi_t), lo_t, hi_t)]
    while True:
        val, a, b = heapq.heappop(heap)
        if val >= min(target, best_above) or b <= a * ratio or time.perf_counter() > deadline:
            return min(val, best_above)
        mid = math.sqrt(a * b)
        heapq.heappush(heap, (val_at(a, mid), a, mid))
        heapq.heappush(heap, (val_at(mid, b), mid, b))


def _tau_beyond(rs: RelaxedSplit, target: float) -> float:
    """A bottleneck above which no plan can cost less than ``target``."""
    if not math.isfinite(target):
        return INF
    return max(target - rs.extra_fill - rs.s_lb + rs.offset, 0.0) / max(rs.weight, 1e-12)
