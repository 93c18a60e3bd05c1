"""[H11] Stages that mix replica groups of clusters joined by fast links (e.g. A100 and V100 clusters in
one zone): one pipeline whose stages draw their data-parallel replicas from a *pool* of such clusters.

The rest of the heuristic gives every cluster its own local stages, so on Sailor's A100+V100 setups the
GPUs that do not fill a power-of-two stage of one type stay idle, and a stage of one type cannot lend
samples to the other. Metis (Um et al., ATC'24) plans such mixed stages; this is hgopt's own search of
the same idea, scored by ``evaluate`` alone (a stage's groups each run their own ``mbs``; the stage
takes as long as its slowest group, [C2]):

1. Pools (:func:`fast_pools`): clusters in one region, or joined both ways by per-flow links at least
   as fast as both clusters' own inter-node bandwidth and without an aggregate cap; pools of >= 2.
2. Per pool, each cluster order (every permutation up to ``MixedOptions.max_orders``), tensor-parallel
   degree per cluster (its smallest profiled ones), microbatch B (a divisor of the global batch, one
   pipeline, m = G / B) and stage count S: the ordered replica list is cut into S consecutive chunks,
   of equal replica count or of equal compute power (:func:`chunkings`), each at most B replicas.
3. Each stage's B samples are split over its replicas by water-filling on the replicas' whole-model
   times (:func:`split_samples`: a cluster's replicas get q or q + 1 samples, so two groups per
   cluster at most), within the largest profiled microbatch size.
4. Layers: a min-max DP over contiguous ranges of the stages' [C2] compute, each range kept only where
   every group of the stage fits in memory with ZeRO-1 over the stage's replicas ([C6],
   ``stage_memory``; unsharded where the stage's groups differ in tp, which the export cannot shard).
5. The candidates are ranked by [C3]'s (m − 1)·bottleneck + fill on that compute, the leading
   ``finalists`` are scored by ``evaluate``, the best improved by single-layer boundary moves, and its
   gradient-sync fields chosen by ``choose_sync(..., zero=True)``.

No clock is read: the search is bounded by its candidate counts, so the same instance gives the same
plan (the exact planner relies on that: ``hgopt.search.exact``), unless the caller's ``stop`` (a stop
request or its deadline) ends it early. Such plans lie outside the exact
planner's certified space; :func:`compute_floor` is a bound valid for every plan of any planner.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hgopt.cost import evaluate
from hgopt.cost.compute import stage_compute_v
from hgopt.cost.memory import stage_memory
from hgopt.cost.pipeline import fill_time, in_flight, pipeline_time
from hgopt.cost.tables import CostTables, GpuTpTable, build_tables
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search.groups import per_sample_layer_seconds
from hgopt.spec import Cluster, Instance

__all__ = ["MixedOptions", "MixedPlan", "best_mixed_plan", "chunkings", "compute_floor", "fast_pools",
           "split_samples"]

log = logging.getLogger(__name__)
INF = math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedOptions:
    max_stages: int = 8
    """Deepest pipeline tried."""
    max_orders: int = 6
    """Cluster orders tried per pool (all permutations up to this many; else by GPU speed both ways)."""
    tp_choices: int = 2
    """Smallest profiled tensor-parallel degrees tried per cluster."""
    min_microbatches: int = 2
    max_microbatches: int = 64
    finalists: int = 12
    """Candidates scored by ``evaluate`` (leading estimates, at most ``per_shape`` per (B, S))."""
    per_shape: int = 2
    polished: int = 2
    """Best finalists improved by boundary moves and given their sync fields (``choose_sync``)."""
    move_rounds: int = 2
    """Passes of single-layer boundary moves on the best finalist."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPlan:
    plan: Plan
    iteration_time_s: float
    pool: tuple[str, ...]


# ---- 1. pools ---------------------------------------------------------------------------------
def _fast_link(inst: Instance, a: Cluster, b: Cluster) -> bool:
    topo = inst.topology
    try:
        links = (topo.link_spec(a.name, b.name), topo.link_spec(b.name, a.name))
    except KeyError:
        return False
    floor = min(a.inter_node.gbyte_s, b.inter_node.gbyte_s)
    return all(lk.aggregate is None and lk.bandwidth.gbyte_s >= floor and lk.bandwidth.latency_s <= 1e-3
               for lk in links)


def fast_pools(instance: Instance) -> list[tuple[str, ...]]:
    """Connected components (>= 2 clusters) of "same region or fast link both ways", in topology order."""
    cl = instance.topology.clusters
    parent = list(range(len(cl)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j in itertools.combinations(range(len(cl)), 2):
        if cl[i].region == cl[j].region or _fast_link(instance, cl[i], cl[j]):
            parent[root(j)] = root(i)
    comps: dict[int, list[str]] = {}
    for i, c in enumerate(cl):
        comps.setdefault(root(i), []).append(c.name)
    return [tuple(v) for v in comps.values() if len(v) >= 2]


# ---- 2./3. replicas of a stage and their samples ----------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Kind:
    """One cluster's replicas at one tp: its table and whole-model times per microbatch size 1..cap."""

    cluster: Cluster
    tp: int
    count: int
    tab: GpuTpTable
    times: tuple[float, ...]
    """times[k - 1]: fwd + bwd seconds of all layers at microbatch k [C2]."""

    @property
    def cap(self) -> int:
        return len(self.times)


def _kind(inst: Instance, tables: CostTables, c: Cluster, tp: int) -> _Kind:
    tab = tables.table(c.gpu, tp)
    cap = int(tab.mbs[-1])
    L = tables.num_layers
    lo, hi = np.array([0]), np.array([L])
    times = tuple(float(stage_compute_v(tab, k, lo, hi)[0]) for k in range(1, cap + 1))
    return _Kind(cluster=c, tp=tp, count=c.num_gpus // tp, tab=tab, times=times)


def split_samples(counts: list[tuple[int, tuple[float, ...]]], samples: int) -> list[list[tuple[int, int]]] | None:
    """Split ``samples`` over replicas of several kinds (``counts``: (replicas, time at microbatch
    1..cap) per kind, times increasing) so that the slowest replica's time is least: every replica
    gets at least one sample; per kind the replicas get q or q + 1. Returns per kind
    [(replicas, mbs), ...] (at most two entries), or None when the replicas cannot take ``samples``
    (more replicas than samples, or more samples than their largest microbatches)."""
    total = sum(n for n, _ in counts)
    if total > samples or total == 0 or sum(n * len(t) for n, t in counts) < samples:
        return None
    need = samples - total
    vals = sorted({t for _, times in counts for t in times[1:]})

    def level(times: tuple[float, ...], limit: float) -> int:
        return max(1, int(np.searchsorted(np.asarray(times), limit, side="right")))

    def extra(limit: float) -> int:
        return sum(n * (level(t, limit) - 1) for n, t in counts)

    if need == 0:
        return [[(n, 1)] if n else [] for n, _ in counts]
    lo, hi = 0, len(vals) - 1  # the least value whose levels hold `need` extra samples
    while lo < hi:
        mid = (lo + hi) // 2
        if extra(vals[mid]) >= need:
            hi = mid
        else:
            lo = mid + 1
    below = vals[lo - 1] if lo > 0 else -INF
    base = [level(t, below) if below > -INF else 1 for _, t in counts]
    top = [level(t, vals[lo]) for _, t in counts]
    rem = need - sum(n * (b - 1) for (n, _), b in zip(counts, base))
    out: list[list[tuple[int, int]]] = []
    for (n, _), b, t in zip(counts, base, top):
        up = min(rem, n) if t > b else 0
        rem -= up
        out.append([(x, m) for x, m in ((n - up, b), (up, b + 1)) if x > 0])
    return out if rem == 0 else None


def chunkings(sizes: list[int], power: list[float], stages: int, cap: int) -> list[list[list[int]]]:
    """Cuts of the ordered replica list (``sizes[i]`` replicas of kind i, each of compute ``power[i]``)
    into ``stages`` consecutive chunks of at most ``cap`` replicas each, as replicas per kind per
    chunk: equal replica counts, and equal compute power (then capped). Duplicates removed."""
    flat = [i for i, n in enumerate(sizes) for _ in range(n)]
    R = len(flat)
    if R < stages:
        return []
    use = min(R, stages * cap)
    even = [use // stages + (1 if s < use % stages else 0) for s in range(stages)]
    cum = np.cumsum([power[i] for i in flat])
    cuts = [0] + [int(np.searchsorted(cum, cum[-1] * s / stages - 1e-12, side="left")) + 1 for s in range(1, stages)] + [R]
    balanced = [max(1, b - a) for a, b in zip(cuts, cuts[1:])]
    out: list[list[list[int]]] = []
    for lens in (even, balanced, *_divisor_sizes(R, stages, cap)):
        if sum(lens) > R:
            continue
        chunks, pos = [], 0
        for n in lens:
            take = flat[pos : pos + n][:cap]
            pos += n
            chunks.append([take.count(i) for i in range(len(sizes))])
        if all(sum(c) >= 1 for c in chunks) and chunks not in out:
            out.append(chunks)
    return out


def _divisor_sizes(replicas: int, stages: int, cap: int, enumerate_upto: int = 4) -> list[list[int]]:
    """Chunk sizes that divide the microbatch ``cap`` (so a one-kind stage splits its samples evenly,
    no replica idling at a smaller microbatch): stage by stage the remaining replicas over the
    remaining stages rounded down to a divisor of ``cap``, once from the front and once from the back;
    and up to ``enumerate_upto`` stages every sequence of the divisors cap/8 .. cap that uses the
    replicas maximally (what is left is less than the smallest chunk; Metis's rule for its groups)."""
    divs = [d for d in range(1, cap + 1) if cap % d == 0]
    out = []
    for back in (False, True):
        left, lens = replicas, []
        for s in range(stages):
            target = left // (stages - s)
            d = max((x for x in divs if x <= target), default=0)
            if d == 0:
                break
            lens.append(d)
            left -= d
        if len(lens) == stages:
            out.append(lens[::-1] if back else lens)
    if stages <= enumerate_upto:
        big = [d for d in divs if d * 8 >= cap]
        for lens in itertools.product(big, repeat=stages):
            used = sum(lens)
            if used <= replicas and replicas - used < min(lens) and list(lens) not in out:
                out.append(list(lens))
    return out


# ---- 4. layers ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Candidate:
    estimate: float
    microbatch: int
    bounds: tuple[int, ...]
    stages: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per stage: (kind index, replicas, mbs) groups."""


class _Layers:
    """Per (kind, mbs) the [C2] compute matrix over layer ranges [a, b), cached."""

    def __init__(self, tables: CostTables) -> None:
        self.L = tables.num_layers
        self.tables = tables
        a, b = np.meshgrid(np.arange(self.L + 1), np.arange(self.L + 1), indexing="ij")
        self.a, self.b = a, b
        self.valid = b > a
        self._compute: dict[tuple[int, int], np.ndarray] = {}

    def compute(self, ki: int, kind: _Kind, mbs: int) -> np.ndarray:
        key = (ki, mbs)
        if key not in self._compute:
            lo, hi = self.a.ravel(), self.b.ravel()
            v = stage_compute_v(kind.tab, mbs, np.minimum(lo, hi), hi).reshape(self.a.shape)
            self._compute[key] = np.where(self.valid, v, INF)
        return self._compute[key]

    def fits(self, kind: _Kind, mbs: int, depth: int, shards: int, inst: Instance) -> np.ndarray:
        tab = kind.tab
        params = tab.params[self.b] - tab.params[self.a]
        act = tab.act_mem[self.b] - tab.act_mem[self.a]
        mem = stage_memory(params, act, depth, mbs, dtype_bytes=self.tables.dtype_bytes,
                           optimizer_bytes=self.tables.optimizer_bytes_per_param, shards=shards,
                           workspace=inst.job.workspace_bytes)
        return mem <= kind.cluster.gpu_memory_bytes


def _partition(layers: _Layers, mats: list[np.ndarray]) -> tuple[float, tuple[int, ...], list[float]] | None:
    """Min-max contiguous partition of the layers over the stages (``mats[s][a, b]``: stage s's time
    on [a, b), inf where it does not fit): (bottleneck, cut points, stage times) or None."""
    L = layers.L
    best = mats[0][0].copy()
    back = []
    for M in mats[1:]:
        cand = np.maximum(best[:, None], M)
        arg = np.argmin(cand, axis=0)
        back.append(arg)
        best = cand[arg, np.arange(L + 1)]
    if not math.isfinite(best[L]):
        return None
    cuts = [L]
    for arg in reversed(back):
        cuts.append(int(arg[cuts[-1]]))
    cuts.append(0)
    cuts.reverse()
    times = [float(M[a, b]) for M, a, b in zip(mats, cuts, cuts[1:])]
    return float(best[L]), tuple(cuts), times


# ---- 5. search ------------------------------------------------------------------------------------
def _orders(inst: Instance, pool: tuple[str, ...], kinds_speed: dict[str, float], limit: int) -> list[tuple[str, ...]]:
    perms = list(itertools.permutations(pool))
    if len(perms) <= limit:
        return perms
    fast = tuple(sorted(pool, key=lambda n: kinds_speed[n]))
    return [pool, fast, tuple(reversed(fast))]


def _tp_sets(inst: Instance, clusters: list[Cluster], choices: int) -> list[tuple[int, ...]]:
    per = []
    for c in clusters:
        tps = [t for t in inst.model.tps(c.gpu) if c.gpus_per_node % t == 0 and c.num_gpus // t >= 1][:choices]
        if not tps:
            return []
        per.append(tps)
    if len(clusters) <= 3:
        return list(itertools.product(*per))
    return [tuple(p[min(i, len(p) - 1)] for p in per) for i in range(choices)]


def _candidates(inst: Instance, tables: CostTables, pool: tuple[str, ...], opts: MixedOptions,
                stop: Callable[[], bool] = lambda: False) -> list[tuple[_Candidate, tuple[_Kind, ...]]]:
    G = inst.job.global_batch
    topo = inst.topology
    clusters = [topo.cluster(n) for n in pool]
    layers = _Layers(tables)
    L = tables.num_layers
    out: list[tuple[_Candidate, tuple[_Kind, ...]]] = []
    speed1 = {c.name: _kind(inst, tables, c, inst.model.tps(c.gpu)[0]).times[0] for c in clusters}
    for tps in _tp_sets(inst, clusters, opts.tp_choices):
        base = {c.name: _kind(inst, tables, c, tp) for c, tp in zip(clusters, tps)}
        for order in _orders(inst, pool, speed1, opts.max_orders):
            kinds = tuple(base[n] for n in order)
            layers._compute.clear()  # keys are kind indices of this order
            sizes = [k.count for k in kinds]
            power = [k.cap / k.times[-1] for k in kinds]
            for B in (d for d in range(1, G + 1) if G % d == 0):
                if stop():  # a stop request or the caller's deadline: the candidates so far
                    return out
                m = G // B
                if not opts.min_microbatches <= m <= opts.max_microbatches:
                    continue
                for S in range(1, min(opts.max_stages, L) + 1):
                    for chunks in chunkings(sizes, power, S, B):
                        cand = _candidate(inst, layers, kinds, chunks, B, m)
                        if cand is not None:
                            out.append((cand, kinds))
    return out


def _candidate(inst: Instance, layers: _Layers, kinds: tuple[_Kind, ...], chunks: list[list[int]], B: int,
               m: int) -> _Candidate | None:
    S = len(chunks)
    stages, mats = [], []
    for s, chunk in enumerate(chunks):
        idx = [i for i, n in enumerate(chunk) if n > 0]
        split = split_samples([(chunk[i], kinds[i].times) for i in idx], B)
        if split is None:
            return None
        groups = tuple((i, n, mbs) for i, parts in zip(idx, split) for n, mbs in parts)
        depth = int(in_flight(S, s, m, "1f1b"))
        shards = sum(n for _, n, _ in groups) if _one_tp(kinds, groups) else 1
        M = None
        for i, _, mbs in groups:
            t = layers.compute(i, kinds[i], mbs)
            t = np.where(layers.fits(kinds[i], mbs, depth, shards, inst), t, INF)
            M = t if M is None else np.maximum(M, t)
        stages.append(groups)
        mats.append(M)
    got = _partition(layers, mats)
    if got is None:
        return None
    bottleneck, cuts, times = got
    zeros = [0.0] * S
    est = float(pipeline_time(m, bottleneck, fill_time(times, zeros, zeros)))
    return _Candidate(estimate=est, microbatch=B, bounds=cuts, stages=tuple(stages))


def _one_tp(kinds: tuple[_Kind, ...], groups: tuple[tuple[int, int, int], ...]) -> bool:
    """Whether a stage's groups share one tp degree: only then is ZeRO-1 sharding planned (the export
    keeps the full optimizer state on layers held at several tp degrees, ``export/build.py``
    ``_zero_level``, so the plan says ``zero = 0`` there and its memory is checked unsharded)."""
    return len({kinds[i].tp for i, _, _ in groups}) == 1


def _plan(inst: Instance, kinds: tuple[_Kind, ...], cand: _Candidate, bounds: tuple[int, ...] | None = None) -> Plan:
    cuts = bounds or cand.bounds
    stages = tuple(
        Stage(start=a, end=b, zero=int(_one_tp(kinds, groups)), groups=tuple(
            ReplicaGroup(cluster=kinds[i].cluster.name, tp=kinds[i].tp, dp=n, mbs=mbs) for i, n, mbs in groups))
        for (a, b), groups in zip(zip(cuts, cuts[1:]), cand.stages))
    return Plan(pipelines=(Pipeline(stages=stages, num_microbatches=inst.job.global_batch // cand.microbatch),),
                planner="heuristic", instance=inst.name)


def _score(inst: Instance, tables: CostTables, plan: Plan) -> float:
    ev = evaluate(plan, inst, tables)
    return ev.iteration_time_s if ev.feasible else INF


def _moves(inst: Instance, tables: CostTables, kinds: tuple[_Kind, ...], cand: _Candidate, t0: float,
           rounds: int) -> tuple[tuple[int, ...], float]:
    """Single-layer moves of the stage boundaries while ``evaluate`` improves (first improvement)."""
    cuts, best = list(cand.bounds), t0
    for _ in range(rounds):
        moved = False
        for j in range(1, len(cuts) - 1):
            for d in (-1, 1):
                trial = cuts.copy()
                trial[j] += d
                if not trial[j - 1] < trial[j] < trial[j + 1]:
                    continue
                t = _score(inst, tables, _plan(inst, kinds, cand, tuple(trial)))
                if t < best - 1e-12:
                    cuts, best, moved = trial, t, True
        if not moved:
            break
    return tuple(cuts), best


def best_mixed_plan(instance: Instance, tables: CostTables | None = None,
                    options: MixedOptions = MixedOptions(), stop: Callable[[], bool] | None = None) -> MixedPlan | None:
    """The best plan of the mixed-stage family over every fast pool (None: no pool, or nothing fits),
    with its sync fields chosen like every hgopt plan's (``choose_sync(..., zero=True)``). ``stop``
    (a stop request or a deadline, checked between microbatch sizes and between scored candidates):
    when it returns True the search ends with what it has (then the result depends on when)."""
    from hgopt.search.sync_choice import choose_sync

    stop = stop or (lambda: False)
    tables = tables or build_tables(instance)
    best: MixedPlan | None = None
    for pool in fast_pools(instance):
        if stop():
            break
        cands = _candidates(instance, tables, pool, options, stop)
        cands.sort(key=lambda ck: (ck[0].estimate, ck[0].bounds, ck[0].microbatch))
        scored = []
        seen: dict[tuple[int, int], int] = {}
        for cand, kinds in cands:
            key = (cand.microbatch, len(cand.stages))
            if seen.get(key, 0) >= options.per_shape:  # diversity among the finalists
                continue
            seen[key] = seen.get(key, 0) + 1
            scored.append((_score(instance, tables, _plan(instance, kinds, cand)), cand, kinds))
            if len(scored) >= options.finalists or stop():
                break
        scored = sorted((x for x in scored if math.isfinite(x[0])), key=lambda x: x[0])
        if not scored:
            continue
        polished = []
        for t, cand, kinds in scored[: 1 if stop() else options.polished]:
            cuts, t = _moves(instance, tables, kinds, cand, t, 0 if stop() else options.move_rounds)
            plan = choose_sync(_plan(instance, kinds, cand, cuts), instance, tables, zero=True)
            polished.append((_score(instance, tables, plan), plan, cand))
        t, plan, cand = min(polished, key=lambda x: x[0])
        log.debug("mixed stages on %s: %d candidates, best %.4f s", "+".join(pool), len(cands), t)
        if best is None or t < best.iteration_time_s:
            desc = f"pool {'+'.join(pool)}: {len(cand.stages)} stages, B {cand.microbatch}"
            best = MixedPlan(plan=dataclasses.replace(plan, meta=(("mixed", desc),)), iteration_time_s=t, pool=pool)
    return best


# ---- a floor for every plan ----------------------------------------------------------------------
def _per_sample_costs(instance: Instance, tables: CostTables) -> tuple[list[int], np.ndarray]:
    """Per cluster its GPUs and per layer the least GPU-seconds one sample needs there
    (``groups.per_sample_layer_seconds``; recomputation only adds)."""
    gpus, rows = [], []
    for c in instance.topology.clusters:
        per = per_sample_layer_seconds(instance, tables, c.name)
        if per is not None:
            gpus.append(c.num_gpus)
            rows.append(per)
    return gpus, np.array(rows)


def compute_floor(instance: Instance, tables: CostTables | None = None, rounds: int = 3) -> float:
    """A lower bound on every plan's iteration time (any planner, any stage layout, mixed stages too):
    every sample passes forward and backward through every layer on some GPU, and every GPU's compute
    (m microbatches of its stage, one after another) fits in the pipeline time, which the iteration
    time is at least ([C3]: (m − 1)·bottleneck + fill ≥ m·(f + b) of every stage and group). So with
    x_cl the samples cluster c runs layer l for (Σ_c x_cl = G) and w_cl its least per-sample
    GPU-seconds (:func:`_per_sample_costs`), N_c·T ≥ Σ_l w_cl·x_cl; for any λ ≥ 0 summing λ_c times
    these gives T ≥ G·Σ_l min_c λ_c·w_cl / Σ_c λ_c·N_c (weak duality of that LP). λ is searched by
    coordinate scaling from λ_c = 1/Σ_l w_cl; every λ tried gives a valid bound, the largest is kept."""
    tables = tables or build_tables(instance)
    gpus, w = _per_sample_costs(instance, tables)
    if not gpus:
        return 0.0
    G = instance.job.global_batch
    N = np.array(gpus, dtype=float)

    def bound(lam: np.ndarray) -> float:
        return float(G * np.min(lam[:, None] * w, axis=0).sum() / float(lam @ N))

    lam = 1.0 / w.sum(axis=1)
    best = bound(lam)
    factors = np.exp(np.linspace(-2.0, 2.0, 41))
    for _ in range(rounds):
        for c in range(len(gpus)):
            for f in factors:
                trial = lam.copy()
                trial[c] *= f
                v = bound(trial)
                if v > best:
                    best, lam = v, trial
    return best
