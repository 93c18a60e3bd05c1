"""[H11b] A lower bound on every plan of k identical pipelines whose stages hold replica groups of any
clusters (the exact planner's k-identical space and the mixed-stage family [H11] of ``hgopt.search.mixed``
alike), built only from the cost kernel's functions.

For a plan of k identical pipelines, each of m microbatches of B samples (G = k·m·B), S stages with
stage times t_s and bottleneck τ = max_s t_s, ``evaluate`` reports at least

    T ≥ w(m, S)·τ + Σ_s t_s − off(m, S) + opt_0

(``pipeline.search_weight``/``search_offset``: [C3]'s m − 1 under the closed form, [C3b]'s weight under
the replay; Σ_s t_s ≤ R_0 because sends are ≥ 0; opt_0 the first stage's optimizer step, which starts
after its last backward). A stage's groups each run their layers at their own microbatch n ≤ B within
t_s and fit in memory [C6] at the stage's in-flight depth min(S − s, m) (ZeRO-1 over at most B replicas,
with or without recomputation [C6r]); a GPU of such a group serves n / tp samples of the stage's B.

The GPUs are coupled by a Lagrangian relaxation: with prices λ_c ≥ 0 per GPU of cluster c,
Σ_s t_s ≥ Σ_s (t_s + λ·GPUs_s) − λ·N/k, and each stage's t_s + λ·GPUs_s is at least the least
"time level plus priced GPUs" that serves B samples (a fractional knapsack over the clusters, each at
its best samples per GPU within that time and memory, at most N_c / k GPUs). Stage times are taken on
a geometric grid (a time in (θ_{j−1}, θ_j] counts θ_{j−1}, its groups all within θ_j), τ likewise, and a
DP over the layers gives the least sum for every stage count S. Every λ gives a valid bound; λ is
searched by coordinate scaling, from the scale prices and from the previous (B, m) pair's prices
relative to its scale (the better of the two; a pair that would set a new least from the warm start
runs the scale start's search too), and the pair that sets the bound so far is polished with finer
scalings (any λ is valid). The bound is the least over (B, m, k) of the best λ
found, and at least ``mixed.compute_floor``.

Computation (hetgap2): the arrays run over the (level, range) entries where some group runs one sample
in time (the others are infeasible); the levels below the bottleneck's window enter only through their
least, so per (depth, range) only the feasible levels whose GPUs differ from the level below are kept
(one with the same GPUs and a higher level is never less); the price product over the clusters is one
matrix product. ``_setup(..., compact=False)`` is the plain definition (tests: the same values).

With k ≥ 2 pipelines the first stage's layer-0 gradient collective among ≥ k holders follows the
pipeline (:func:`_tail_floor`). Not modelled (each only adds to ``evaluate``): boundary sends, the rest
of the gradient sync tail, integrality of replicas and samples; grouped plans [H9] (pipelines that are
not identical) are not covered.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, get_args

import numpy as np

from hgopt.cost.compute import forward_share_of, optimizer_time, stage_compute_v
from hgopt.cost.memory import recompute_inputs_prefix, recompute_largest_table, recompute_largest_v, stage_memory, stage_memory_recompute
from hgopt.cost.pipeline import search_offset, search_weight
from hgopt.cost.links import ring_bandwidth, ring_time
from hgopt.cost.tables import CostTables, GpuTpTable, allreduce_time, build_tables, link_bytes_factor
from hgopt.plan import LinkPrecision
from hgopt.spec import Cluster, Instance

__all__ = ["MixedBound", "MixedBoundOptions", "mixed_bound"]

log = logging.getLogger(__name__)
INF = math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedBoundOptions:
    fine_ratio: float = 1.02
    """Grid ratio of the bottleneck's window [compute_floor / m, target / (m − 1)]."""
    coarse_ratio: float = 1.15
    """Grid ratio of stage times below that window."""
    span: float = 1e-3
    """Stage times below ``span``·top count as 0."""
    factors: tuple[float, ...] = (0.0, 0.3, 0.7, 1.4, 3.0)
    """Scalings of one cluster's price tried per step (one batch)."""
    rounds: int = 3
    """Passes of coordinate scaling over the clusters."""
    polish_factors: tuple[float, ...] = (0.8, 0.9, 0.95, 1.05, 1.1, 1.25)
    """Finer scalings tried on the pair that sets the bound."""
    polish_rounds: int = 4
    """Passes of the finer scaling (0: none)."""
    warm_start: bool = True
    """Also start each pair's search at the previous pair's prices relative to its scale."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedBound:
    value: float
    """min(target, the bound), and at least ``floor``."""
    floor: float
    """``mixed.compute_floor`` (valid for every plan of any planner)."""
    microbatch: int = 0
    microbatches: int = 0
    pipelines: int = 0
    """(B, m, k) setting ``value`` (0: the floor or the target does)."""
    complete: bool = True
    """False when the deadline left (B, m) pairs at the floor."""

    def describe(self) -> str:
        where = (f" (B {self.microbatch}, m {self.microbatches}, k {self.pipelines})" if self.microbatch else "")
        cut = "" if self.complete else "; the deadline left some microbatch shapes at the compute floor"
        return f"bound over k identical pipelines with stages of any replica groups {self.value:.6g} s{where}{cut}"


@dataclass(frozen=True, slots=True)
class _Kind:
    """One cluster's replicas at one tp, with or without recomputation, over every layer range."""

    cluster: int
    tp: int
    recompute: bool
    cap: int
    times: np.ndarray
    """(cap, R): seconds at microbatch 1..cap, made non-decreasing in the microbatch (suffix minimum)."""
    params: np.ndarray
    act: np.ndarray
    inputs: np.ndarray
    largest: np.ndarray
    update: np.ndarray
    tab: GpuTpTable


def _ranges(L: int) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = np.triu_indices(L + 1, k=1)
    return lo.astype(np.int64), hi.astype(np.int64)


def _kinds(instance: Instance, tables: CostTables, lo: np.ndarray, hi: np.ndarray) -> list[_Kind]:
    pre = recompute_inputs_prefix(instance)
    out = []
    for ci, c in enumerate(instance.topology.clusters):
        for tp in instance.model.tps(c.gpu):
            if c.gpus_per_node % tp or tp > c.num_gpus or (c.gpu, tp) not in tables.by_gpu_tp:
                continue
            tab = tables.table(c.gpu, tp)
            cap = max(1, int(tab.mbs[-1]))
            for rc in ((False, True) if instance.job.recompute != "off" else (False,)):
                t = np.array([stage_compute_v(tab, n, lo, hi, rc) for n in range(1, cap + 1)])
                t = np.minimum.accumulate(t[::-1], axis=0)[::-1]
                out.append(_Kind(cluster=ci, tp=tp, recompute=rc, cap=cap, times=t,
                                 params=tab.params[hi] - tab.params[lo], act=tab.act_mem[hi] - tab.act_mem[lo],
                                 inputs=pre[hi] - pre[lo],
                                 largest=recompute_largest_v(recompute_largest_table(tab), lo, hi),
                                 update=tab.update[hi] - tab.update[lo], tab=tab))
    return out


def _mem_limit(inst: Instance, tables: CostTables, k: _Kind, cap_bytes: float, B: int, shards: int,
               depths: np.ndarray) -> np.ndarray:
    """(R, D) the largest microbatch (≤ B) a group of kind ``k`` may run on each range at each in-flight
    depth within ``cap_bytes`` ([C6] with ZeRO-1 over ``shards`` replicas, the most a stage has; [C6r]
    when recomputing), generous by a relative 1e-9."""
    kw = dict(dtype_bytes=tables.dtype_bytes, optimizer_bytes=tables.optimizer_bytes_per_param, shards=shards,
              workspace=inst.job.workspace_bytes)
    p = k.params[:, None]
    d = depths[None, :].astype(float)
    if k.recompute:
        base = stage_memory_recompute(p, k.inputs[:, None], k.largest[:, None], d, 0, **kw)
        slope = stage_memory_recompute(p, k.inputs[:, None], k.largest[:, None], d, 1, **kw) - base
    else:
        base = stage_memory(p, k.act[:, None], d, 0, **kw)
        slope = stage_memory(p, k.act[:, None], d, 1, **kw) - base
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(slope > 0, np.floor((cap_bytes * (1 + 1e-9) - base) / np.where(slope > 0, slope, 1.0)), B)
    return np.where(base > cap_bytes * (1 + 1e-9), 0.0, np.clip(n, 0.0, B))


def _time_limit(k: _Kind, theta: np.ndarray) -> np.ndarray:
    """(J, R) the largest microbatch whose [C2] time on each range is within each θ (proportional past
    the largest profiled size, as [C2] extrapolates)."""
    top = k.times[-1]
    inside = (k.times[None, :, :] <= theta[:, None, None] * (1 + 1e-12)).sum(axis=1).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        beyond = np.floor(theta[:, None] * k.cap / np.where(top > 0, top, 1.0)[None, :] * (1 + 1e-12))
    return np.where(theta[:, None] >= top[None, :], np.maximum(beyond, k.cap), inside)


def _grid(low: float, window: float, top: float, opts: MixedBoundOptions) -> np.ndarray:
    lo = top * opts.span
    coarse = [] if window <= lo else list(lo * opts.coarse_ratio ** np.arange(int(math.log(window / lo) / math.log(opts.coarse_ratio)) + 1))
    start = max(window, lo)
    fine = list(start * opts.fine_ratio ** np.arange(int(math.log(top / start) / math.log(opts.fine_ratio)) + 2)) if top > start else [top]
    return np.array(sorted(set(coarse + fine)))


def _allocations(B: int, rate: np.ndarray, cap: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """The fractional knapsack "serve B samples, cluster c at ``rate`` samples per GPU and at most ``cap``
    samples" (arrays (C, ...)): for any prices λ ≥ 0 its least Σ_c λ_c·GPUs_c is the greedy fill in the
    order of λ_c / rate_c, so it is the least over every fill order of that order's λ·GPUs. Returns the
    GPUs per cluster of each order's fill (each (C, ...)) and where B cannot be served at all."""
    C = rate.shape[0]
    out = []
    for order in itertools.permutations(range(C)):
        left = np.full(rate.shape[1:], float(B))
        g = np.zeros_like(rate)
        for c in order:
            x = np.minimum(cap[c], left)
            with np.errstate(divide="ignore", invalid="ignore"):
                g[c] = np.where(x > 0, x / np.where(rate[c] > 0, rate[c], 1.0), 0.0)
            left = left - x
        out.append(g)
    return out, cap.sum(axis=0) < B * (1 - 1e-12)


def _tail_floor(inst: Instance, tables: CostTables, k: int) -> float:
    """[C7o] What k ≥ 2 identical pipelines add after the pipeline: layer 0 is held by at least k
    replicas (one per pipeline), its gradient bucket is ready only when the first stage's last backward
    ends, and its collective ([C5] ``segment_allreduce``; with ZeRO-1 the reduce-scatter, ZERO_PHASE of
    it, then the all-gather after the step, the other half) runs after it. The least [C5] all-reduce of
    layer 0's bytes among n ≥ k holders: in one cluster (every n from k to its GPUs / tp, every tp; its
    ring at ``links.ring_bandwidth``), or across a set of >= 2 clusters (the cross-cluster ring alone, at
    the narrowest gradient precision; the rings inside clusters only add). 0 for k = 1."""
    if k < 2:
        return 0.0
    topo = inst.topology
    full = INF

    def inside(c: Cluster, least: int) -> float:
        """The least ring inside ``c`` among n ≥ ``least`` of its replicas holding layer 0 (every tp)."""
        nonlocal full
        out = INF
        for tp in inst.model.tps(c.gpu):
            if c.gpus_per_node % tp or (c.gpu, tp) not in tables.by_gpu_tp:
                continue
            tab = tables.table(c.gpu, tp)
            x = float(tab.params[1] - tab.params[0]) * tables.dtype_bytes
            full = min(full, x * tp)
            for n in range(max(least, 1), c.num_gpus // tp + 1):
                bw = ring_bandwidth(c.intra_node, c.inter_node, c.gpus_per_node, n, tp, tp)
                out = min(out, allreduce_time(bw, x, n))
        return out

    best = min(inside(c, k) for c in topo.clusters)  # every holder in one cluster
    if math.isfinite(full):
        wan = full * min(link_bytes_factor(inst.model.dtype, p) for p in get_args(LinkPrecision))
        names = [c.name for c in topo.clusters]
        for size in range(2, len(names) + 1):
            for group in itertools.combinations(names, size):
                try:
                    ring = max(ring_time(topo.link_spec(a, b), wan, size) for a in group for b in group if a != b)
                except KeyError:
                    continue
                nic = max(allreduce_time(topo.cluster(c).inter_node, wan, size) for c in group)
                # some cluster of the set holds at least ceil(k / size) of them: its ring is in the max too
                ring_in = min(inside(topo.cluster(c), -(-k // size)) for c in group)
                best = min(best, max(ring, nic, 0.0 if not math.isfinite(ring_in) else ring_in))
    return 0.0 if not math.isfinite(best) else best


def _setup(inst: Instance, tables: CostTables, kinds: list[_Kind], lo: np.ndarray, hi: np.ndarray,
           B: int, m: int, k: int, floor: float, target: float, rho_e: tuple[float, float],
           opts: MixedBoundOptions, compact: bool = True) -> Callable[[np.ndarray], np.ndarray]:
    """The Lagrangian dual function of plans of k identical pipelines of m microbatches of B samples: a
    function from price vectors (Λ, C) to their bounds (Λ,) (each a valid bound; the stage-time grid ends at
    ``target`` / (m − 1)). ``compact=False``: every level below the window enters the least (the plain
    definition; the same values, for tests)."""
    L = tables.num_layers
    topo = inst.topology
    C = len(topo.clusters)
    N = np.array([float(c.num_gpus // k) for c in topo.clusters])  # identical pipelines: integer GPUs each
    tmax = max(float(kd.times[-1].max()) * max(B / kd.cap, 1.0) for kd in kinds)  # no stage takes longer
    top = min(tmax, target / max(m - 1, 1)) if math.isfinite(target) else tmax
    window = min(floor / m, top)
    theta = _grid(floor, window, top, opts)
    J = len(theta)
    D = min(L, m)
    depths = np.arange(1, D + 1)
    R = len(lo)
    below = np.concatenate(([0.0], theta[:-1]))  # a stage time in (θ_{j−1}, θ_j] counts θ_{j−1}
    # ... or the least time any group can take on the range (one sample, fastest kind), if more
    tmin = np.min([kd.times[0] for kd in kinds], axis=0)  # (R,)
    floor_jr = np.maximum(below[:, None], tmin[None, :])  # (J, R)
    # only the (level, range) entries where some group runs one sample in time: every other one is
    # infeasible (no kind's time limit admits a sample), so the arrays below are over those entries only
    # (``compact=False``: every entry, the infeasible ones too: the plain definition)
    jx, rx = np.nonzero((theta[:, None] * (1 + 1e-12) >= tmin[None, :]) | (not compact))
    rate = np.zeros((C, len(jx), D))
    # a stage has at most min(B, its pipeline's GPUs) replicas: its ZeRO-1 shard count
    shards = max(1, min(B, int(math.floor(N.sum() + 1e-9))))
    for kd in kinds:
        n = np.minimum(_time_limit(kd, theta)[jx, rx][:, None],
                       _mem_limit(inst, tables, kd, topo.clusters[kd.cluster].gpu_memory_bytes, B, shards, depths)[rx])
        n = np.minimum(n, B)
        np.maximum(rate[kd.cluster], np.where(n >= 1, n / kd.tp, 0.0), out=rate[kd.cluster])
    cap = rate * N[:, None, None]
    # the taus: bottleneck in (θ_{i−1}, θ_i] for θ_i ≥ the window (τ ≥ compute_floor / m)
    taus = np.nonzero(theta >= window * (1 - 1e-12))[0]
    opt0 = np.full(L + 1, INF)  # the first stage's optimizer step [0, b) (unsharded at most B ways)
    for kd in kinds:
        sel = lo == 0
        opt0[hi[sel]] = np.minimum(opt0[hi[sel]], optimizer_time(kd.tab, 0, hi[sel], max(1, min(B, int(N.sum() + 1e-9)))))
    opt0[0] = 0.0
    rho, excess = rho_e
    tail = _tail_floor(inst, tables, k)
    weights = np.array([search_weight(m, S, rho) for S in range(1, L + 1)])
    offsets = np.array([search_offset(m, S, excess) for S in range(1, L + 1)])

    fills, infeasible = _allocations(B, rate, cap)
    del rate, cap
    i0 = int(taus[0])
    F = np.stack(fills)  # (O, C, E, D): one price vector's knapsack cost is one product over the clusters
    del fills
    O = F.shape[0]
    add = np.where(infeasible, INF, floor_jr[jx, rx][:, None])  # (E, D)
    # levels up to i0 enter only through their least (the bottleneck is at least θ_{i0}): per (d, r) keep
    # the feasible levels whose GPUs differ from the level below (one with the same GPUs and a higher
    # level is never less), as one flat list grouped by (d, r)
    index = np.full((J, R), -1)
    index[jx, rx] = np.arange(len(jx))
    head_e = np.flatnonzero(jx <= i0)
    keep = np.isfinite(add[head_e]) if compact else np.ones((len(head_e), D), dtype=bool)
    if compact:
        prev = np.where(jx[head_e] > 0, index[np.maximum(jx[head_e] - 1, 0), rx[head_e]], -1)
        has = prev >= 0
        same = np.zeros_like(keep)
        same[has] = np.all(F[:, :, head_e[has]] == F[:, :, prev[has]], axis=(0, 1)) & np.isfinite(add[prev[has]])
        keep &= ~same
    ee, dd = np.nonzero(keep)
    ee = head_e[ee]
    rr, jj = rx[ee], jx[ee]
    order = np.lexsort((jj, rr, dd))
    ee, dd, rr = ee[order], dd[order], rr[order]
    group = dd * R + rr
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if len(group) else np.zeros(0, np.int64)
    Gh = np.ascontiguousarray(F[:, :, ee, dd].transpose(1, 0, 2))  # (C, O, E'): a plain matrix product
    addh = add[ee, dd]
    slots = group[starts]
    # levels above i0 dense (I − 1, D, R), entries left out infeasible
    tail_e = np.flatnonzero(jx > i0)
    Ft = np.zeros((O, C, J - i0 - 1, D, R))
    Ft[:, :, jx[tail_e] - i0 - 1, :, rx[tail_e]] = F[:, :, tail_e].transpose(2, 0, 1, 3)
    Ft = np.ascontiguousarray(Ft.reshape(O, C, -1).transpose(1, 0, 2))
    addt = np.full((J - i0 - 1, D, R), INF)
    addt[jx[tail_e] - i0 - 1, :, rx[tail_e]] = add[tail_e]
    del F
    steady = np.maximum(below[taus], window)  # (I,)
    opt_min = float(np.min(opt0[1:]))

    def evaluate(lam: np.ndarray) -> np.ndarray:
        """(Λ,) the bound at each price vector."""
        Λ = lam.shape[0]
        head = np.full((Λ, D * R), INF)
        if len(starts):
            ch = np.tensordot(lam, Gh, axes=([1], [0])).min(axis=1) + addh[None]
            head[:, slots] = np.minimum.reduceat(ch, starts, axis=1)
        cost = np.tensordot(lam, Ft, axes=([1], [0])).min(axis=1).reshape(Λ, -1, D, R) + addt[None]
        # (Λ, I, D, R): stage times ≤ θ_i, i from the window on
        best = np.minimum.accumulate(np.concatenate((head.reshape(Λ, 1, D, R), cost), axis=1), axis=1)
        I = best.shape[1]
        M = np.full((Λ, I, D, L + 1, L + 1), INF)
        M[..., lo, hi] = best
        V = np.full((Λ, I, L + 1), INF)  # V[..., a]: stages covering [a, L) (q of them)
        V[..., L] = 0.0
        out = np.full((Λ, I), INF)
        for q in range(1, L + 1):
            d = min(q, m) - 1
            nxt = (M[:, :, d] + V[:, :, None, :]).min(axis=3)
            nxt[..., L] = INF
            V = nxt
            # closing stage [0, b): its optimizer step after the last backward
            out = np.minimum(out, weights[q - 1] * steady[None, :] - offsets[q - 1] + V[..., 0])
        # the first stage's optimizer step: a valid (tiny) addition taken over every first-stage end
        res = out - (lam * N[None, :]).sum(axis=1)[:, None] + opt_min + tail
        return np.min(res, axis=1)

    return evaluate


def _start(inst: Instance, floor: float, m: int, k: int) -> np.ndarray:
    """The first price vector: a GPU-second scale (the floor's per-microbatch time over the pipeline's
    GPUs), the same for every cluster."""
    N = sum(c.num_gpus // k for c in inst.topology.clusters)
    return np.array([[floor / m / max(float(N), 1e-9)] * len(inst.topology.clusters)])


def _trials(lam: np.ndarray, c: int, opts: MixedBoundOptions) -> np.ndarray:
    """One step of coordinate scaling: every price scaled together (c < 0) or cluster c's alone."""
    trial = np.repeat(lam, len(opts.factors), axis=0)
    f = np.array(opts.factors)
    if c < 0:
        trial *= np.where(f > 0, f, 1.0 / 8.0)[:, None]
    else:
        trial[:, c] *= f
    return trial


@dataclass(slots=True)
class _Search:
    """One (B, m) pair's coordinate scaling of the prices, one step at a time (any λ gives a valid bound:
    ``value`` is one at every step)."""

    B: int
    m: int
    lam: np.ndarray
    value: float
    step: int = 0
    """Steps done: step // (C + 1) the round, step % (C + 1) - 1 the cluster scaled (-1: all)."""
    improved: bool = False
    done: bool = False

    def advance(self, evaluate: Callable[[np.ndarray], np.ndarray], C: int, opts: MixedBoundOptions) -> None:
        trial = _trials(self.lam, self.step % (C + 1) - 1, opts)
        vals = evaluate(trial)
        i = int(np.argmax(vals))
        if vals[i] > self.value + 1e-15:
            self.value, self.lam, self.improved = float(vals[i]), trial[i : i + 1].copy(), True
        self.step += 1
        if self.step % (C + 1) == 0:
            if not self.improved or self.step >= opts.rounds * (C + 1):
                self.done = True
            self.improved = False


def _pair_bound(inst: Instance, tables: CostTables, kinds: list[_Kind], lo: np.ndarray, hi: np.ndarray,
                B: int, m: int, k: int, floor: float, target: float, rho_e: tuple[float, float],
                opts: MixedBoundOptions) -> float:
    """The bound over plans of k identical pipelines of m microbatches of B samples (min(target, ·)):
    the coordinate scaling run to its end."""
    evaluate = _setup(inst, tables, kinds, lo, hi, B, m, k, floor, target, rho_e, opts)
    lam = _start(inst, floor, m, k)
    s = _Search(B=B, m=m, lam=lam, value=float(evaluate(lam)[0]))
    C = len(inst.topology.clusters)
    while s.value < target and not s.done:
        s.advance(evaluate, C, opts)
    return min(s.value, target)


def mixed_bound(instance: Instance, tables: CostTables | None = None, *, target: float = INF,
                deadline: float | None = None, options: MixedBoundOptions = MixedBoundOptions(),
                stop: Callable[[], bool] | None = None) -> MixedBound:
    """A lower bound on the iteration time of every plan of k identical pipelines with stages of any
    replica groups (module docstring); min(``target``, ·), never below ``compute_floor``. ``deadline``
    (``time.perf_counter()``): the (B, m) pairs left when it passes count at the floor; so do those left
    once ``stop`` (determinism: e.g. ``Progress.stop_requested``) answers True."""
    from hgopt.search.mixed import compute_floor

    tables = tables or build_tables(instance)
    floor = compute_floor(instance, tables)
    if floor >= target:
        return MixedBound(value=target, floor=floor)
    L = tables.num_layers
    lo, hi = _ranges(L)
    kinds = _kinds(instance, tables, lo, hi)
    if not kinds:
        return MixedBound(value=floor, floor=floor)
    G = instance.job.global_batch
    rho_e = forward_share_of(tables, G)
    C = len(instance.topology.clusters)

    def late() -> bool:
        return (deadline is not None and time.perf_counter() > deadline) or (stop is not None and stop())

    # the (B, m) pairs one after another, each with the least bound so far as its target (a pair whose dual
    # reaches it has no plan below it: the search stops there); each search starts at the better of the
    # scale prices and the previous pair's prices relative to its scale (neighbouring pairs price alike)
    best, where, complete = target, (0, 0, 0), True
    ratio: np.ndarray | None = None
    for B in (d for d in range(1, G + 1) if G % d == 0):
        for m in (d for d in range(1, G // B + 1) if (G // B) % d == 0):
            if late():
                complete = False
                best = min(best, floor)
                continue
            k = G // (B * m)
            ev = _setup(instance, tables, kinds, lo, hi, B, m, k, floor, best, rho_e, options)
            lam0 = _start(instance, floor, m, k)
            first = lam0 if ratio is None or not options.warm_start else np.vstack((lam0, lam0 * ratio))
            vals = ev(first)
            i = int(np.argmax(vals))
            one = _Search(B=B, m=m, lam=first[i : i + 1].copy(), value=float(vals[i]))
            while one.value < best and not one.done:
                one.advance(ev, C, options)
            ratio = one.lam / lam0
            if one.value < best and i > 0:  # a new least from the warm start: the scale start's path too
                other = _Search(B=B, m=m, lam=lam0, value=float(vals[0]))
                while other.value < best and not other.done:
                    other.advance(ev, C, options)
                one = max(one, other, key=lambda x: x.value)
            if one.value < best and options.polish_rounds > 0:  # it sets the bound: polish its prices
                fine = dataclasses.replace(options, factors=options.polish_factors, rounds=options.polish_rounds)
                one.step, one.done, one.improved = 0, False, False
                while one.value < best and not one.done:
                    one.advance(ev, C, fine)
            if one.value < best:
                best, where = one.value, (B, m, k)
    value = max(best, floor) if best < target else target
    if value == floor:
        where = (0, 0, 0)
    log.debug("mixed bound %.6g s at B, m, k = %s (floor %.6g)", value, where, floor)
    return MixedBound(value=value, floor=floor, microbatch=where[0], microbatches=where[1], pipelines=where[2],
                      complete=complete)
