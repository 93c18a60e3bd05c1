"""Fast estimates of what one cluster costs when it hosts n layers of every pipeline, for the
hierarchical heuristic (formulations/hierarchical.md, [H2]).

For a cluster, a role along the pipeline (``first`` holds the leading non-block layers, ``last`` the
trailing ones, ``only`` both, ``middle`` neither), a microbatch B, m microbatches, a GPU budget per
pipeline, k identical pipelines and d stages after the cluster, ``cluster_table`` returns for every
layer count n the best local pipeline *estimate* over (tp, dp, local stages s): blocks spread evenly
over the s local stages, the special layers counted as extra work. It mirrors the terms of
``hgopt.cost.evaluate`` ([C2]–[C6]) without the exact partition, and is vectorised over (s, n).
The heuristic only uses it to choose; the final plan's local pipelines come from the
intra-cluster DP (``hgopt.search.intra.best_local_plan``) and its time from ``evaluate``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Literal, Mapping, Sequence

import numpy as np

from hgopt.cost.comm import allreduce_time_v, gradient_bytes, transfer_time
from hgopt.cost.compute import optimizer_share
from hgopt.cost.links import node_samples, ring_bandwidth
from hgopt.cost.memory import stage_memory
from hgopt.cost.pipeline import in_flight, pipeline_time, stage_fill
from hgopt.cost.tables import CostTables
from hgopt.search.baselines._common import BlockLayout
from hgopt.search.intra import LocalConfig, local_configs
from hgopt.spec import Cluster, Instance

__all__ = ["MOST_STAGES", "ClusterTable", "LazyTables", "Role", "cluster_table", "cluster_tables", "lazy_cluster_tables",
           "role_of"]

Role = Literal["first", "middle", "last", "only"]


def role_of(position: int, count: int) -> Role:
    if count == 1:
        return "only"
    return "first" if position == 0 else ("last" if position == count - 1 else "middle")


@dataclass(frozen=True, slots=True)
class ClusterTable:
    """Arrays indexed by the cluster's layer count n = 0..L (inf where nothing fits)."""

    bottleneck: np.ndarray
    fill: np.ndarray
    sync_opt: np.ndarray
    stages: np.ndarray
    """Local stages of the best estimate (0 where nothing fits)."""
    tp: np.ndarray | None = None
    dp: np.ndarray | None = None
    """The estimate's config per n (0 where nothing fits)."""
    recompute: np.ndarray | None = None
    """1 where the estimate's config recomputes activations ([C2r]/[C6r], hfrec), else 0."""

    def objective(self, m: int) -> np.ndarray:
        ok = np.isfinite(self.fill)
        return np.where(ok, pipeline_time(m, np.where(ok, self.bottleneck, 0.0), self.fill) + self.sync_opt, math.inf)


_FIELDS = ("bottleneck", "fill", "sync_opt", "stages")
MOST_STAGES = 0
"""The weight key of the alternative with the most local stages (more stages hold more microbatches
in flight, which lowers the 1F1B round-trip pace of [C3])."""


@dataclass(frozen=True, slots=True)
class _Parts:
    """Per-GPU quantities of one (GPU type, tp, mbs): block average, leading and trailing layers."""

    time: tuple[float, float, float]
    fwd: tuple[float, float, float]
    """Forward seconds alone (what recomputation adds to the backward, [C2r])."""
    params: tuple[float, float, float]
    act: tuple[float, float, float]
    update: tuple[float, float, float]


def _parts(tables: CostTables, layout: BlockLayout, gpu: str, tp: int, mbs: int) -> _Parts:
    tab = tables.table(gpu, tp)
    pre, nb = layout.pre, layout.blocks
    spans = ((pre, pre + nb), (0, pre), (pre + nb, pre + nb + layout.post))

    def per(arr: np.ndarray) -> tuple[float, float, float]:
        vals = [float(arr[hi] - arr[lo]) for lo, hi in spans]
        return vals[0] / max(nb, 1), vals[1], vals[2]

    times, fwds = [], []
    for lo, hi in spans:
        f, b = tab.times(mbs, lo, hi) if hi > lo else (0.0, 0.0)
        times.append(f + b)
        fwds.append(f)
    return _Parts(
        time=(times[0] / max(nb, 1), times[1], times[2]),
        fwd=(fwds[0] / max(nb, 1), fwds[1], fwds[2]),
        params=per(tab.params),
        act=per(tab.act_mem),
        update=per(tab.update),
    )


def cluster_table(
    instance: Instance,
    tables: CostTables,
    layout: BlockLayout,
    cluster: Cluster,
    role: Role,
    *,
    microbatch: int,
    num_microbatches: int,
    gpu_budget: int,
    replicas: int,
    stages_after: int,
    cache: dict[tuple[object, ...], object] | None = None,
) -> ClusterTable:
    """[H2] Best estimated local pipeline per layer count n (see the module docstring)."""
    return cluster_tables(instance, tables, layout, cluster, role, microbatch=microbatch,
                          num_microbatches=num_microbatches, gpu_budget=gpu_budget, replicas=replicas,
                          stages_after=stages_after, cache=cache)[num_microbatches]


def cluster_tables(
    instance: Instance,
    tables: CostTables,
    layout: BlockLayout,
    cluster: Cluster,
    role: Role,
    *,
    microbatch: int,
    num_microbatches: int,
    gpu_budget: int,
    replicas: int,
    stages_after: int,
    weights: Sequence[int] = (),
    cache: dict[tuple[object, ...], object] | None = None,
) -> dict[int, ClusterTable]:
    """[H2] For the real microbatch count m and every extra ``weight`` w: per layer count n, the
    estimate minimising (w − 1)·bottleneck + fill + sync_opt (memory always checked at m). A small
    w favours local pipelines with little fill and gradient sync, the right choice when the
    pipeline's bottleneck is elsewhere. Every weight's table built (:func:`lazy_cluster_tables`)."""
    return dict(lazy_cluster_tables(instance, tables, layout, cluster, role, microbatch=microbatch,
                                    num_microbatches=num_microbatches, gpu_budget=gpu_budget, replicas=replicas,
                                    stages_after=stages_after, weights=weights, cache=cache).items())


def lazy_cluster_tables(
    instance: Instance,
    tables: CostTables,
    layout: BlockLayout,
    cluster: Cluster,
    role: Role,
    *,
    microbatch: int,
    num_microbatches: int,
    gpu_budget: int,
    replicas: int,
    stages_after: int,
    weights: Sequence[int] = (),
    cache: dict[tuple[object, ...], object] | None = None,
) -> LazyTables:
    """:func:`cluster_tables` as a :class:`LazyTables`: the block of every config's estimate and what
    fits with ``stages_after`` stages after the cluster now, each weight's table when it is read."""
    L = tables.num_layers
    n = np.array([L]) if role == "only" else np.arange(L + 1)  # 'only' hosts the whole model
    m = num_microbatches
    ws = tuple(dict.fromkeys((m, *weights)))
    cache = {} if cache is None else cache
    if cache.setdefault(("tables",), tables) is not tables:  # its keys name the cluster, not the cost tables
        raise ValueError("cluster_tables: an estimate cache is shared only by searches on the same cost tables")
    # clusters alike in everything the estimate reads (GPU type, node size, bandwidths) share it
    key = ("block", cluster.gpu, cluster.gpus_per_node, cluster.intra_node, cluster.inter_node, role, microbatch, m,
           gpu_budget, replicas, cluster.gpu_memory_bytes,  # memory: which layouts get recomputing estimates
           instance.job.global_batch)  # so do the batch's microbatches in flight (a cache shared by sub-instances)
    if key not in cache:
        cache[key] = _block(instance, tables, layout, cluster, role, n, microbatch, m, gpu_budget, replicas, cache)
    blk: _Block | None = cache[key]  # type: ignore[assignment]
    ok = None if blk is None else blk.fits(stages_after, m, cluster.gpu_memory_bytes)
    return LazyTables(ws, blk, ok, n, m, L)


class LazyTables(Mapping[int, ClusterTable]):
    """[H2] :func:`lazy_cluster_tables`' result: per weight w its :class:`ClusterTable`, built on first
    access; :meth:`cells` reads one layer count of every weight without building the others' tables
    (the split's choice of local alternatives reads one count per cluster). Each weight's table is the
    one the stacked computation gives: per layer count the first best row of its objective among the
    rows that fit (the most local stages first, then the objective at m, for ``MOST_STAGES``; else
    (w − 1)·bottleneck + fill + sync_opt); where none fits, infinite and 0."""

    __slots__ = ("_ws", "_blk", "_ok", "_n", "_m", "_L", "_built", "_cells")

    def __init__(self, ws: tuple[int, ...], blk: _Block | None, ok: np.ndarray | None, n: np.ndarray, m: int,
                 L: int) -> None:
        self._ws, self._blk, self._ok, self._n, self._m, self._L = ws, blk, ok, n, m, L
        self._built: dict[int, ClusterTable] = {}
        self._cells: dict[int, dict[int, tuple[float, float, float, int]]] = {}

    def __getitem__(self, w: int) -> ClusterTable:
        got = self._built.get(w)
        if got is None:
            if w not in self._ws:
                raise KeyError(w)
            got = self._built[w] = self._table(w)
        return got

    def __iter__(self) -> Iterator[int]:
        return iter(self._ws)

    def __len__(self) -> int:
        return len(self._ws)

    def _objective(self, w: int, col: int | slice) -> np.ndarray:
        """Weight ``w``'s objective at the block's columns ``col``, infinite where a row does not fit."""
        blk, ok, m = self._blk, self._ok, self._m
        assert blk is not None and ok is not None
        bott, fill, sync = blk.bott[:, col], blk.fill[:, col], blk.sync[:, col]
        s = blk.s if isinstance(col, slice) else blk.s[:, 0]
        if w == MOST_STAGES:
            j = -s * 1e12 + pipeline_time(m, bott, fill) + sync
        else:
            j = pipeline_time(max(w, 1), bott, fill) + sync
        np.copyto(j, math.inf, where=~ok[:, col])
        return j

    def _table(self, w: int) -> ClusterTable:
        L, n, blk = self._L, self._n, self._blk
        cols = [np.full(L + 1, math.inf) for _ in range(3)] + [np.zeros(L + 1, dtype=int) for _ in range(4)]
        if blk is not None:
            j = self._objective(w, slice(None))
            pick = np.argmin(j, axis=0)  # per layer count: the first best row
            at = (pick, np.arange(len(n)))
            feasible = np.isfinite(j[at])
            for col, a in zip(cols, (blk.bott, blk.fill, blk.sync)):
                col[n] = np.where(feasible, a[at], math.inf)
            for col, a in zip(cols[3:], (blk.s, blk.tp, blk.dp, blk.rc)):  # (rows, 1): the picked rows'
                col[n] = np.where(feasible, a[pick, 0], 0)
        return ClusterTable(*cols)

    def cells(self, layers: int) -> dict[int, tuple[float, float, float, int]]:
        """Per weight, (bottleneck, fill, sync_opt, stages) of its table at ``layers`` layers: what
        ``self[w]`` holds there, read off the block for the tables not built (memoised per count)."""
        out = self._cells.get(layers)
        if out is not None:
            return out
        out = self._cells[layers] = {}
        hit = np.flatnonzero(self._n == layers)
        for w in self._ws:
            t = self._built.get(w)
            if t is not None:
                out[w] = (float(t.bottleneck[layers]), float(t.fill[layers]), float(t.sync_opt[layers]),
                          int(t.stages[layers]))
                continue
            got = (math.inf, math.inf, math.inf, 0)
            if self._blk is not None and len(hit):
                c = int(hit[0])
                j = self._objective(w, c)
                r = int(np.argmin(j))
                if math.isfinite(j[r]):
                    got = (float(self._blk.bott[r, c]), float(self._blk.fill[r, c]), float(self._blk.sync[r, c]),
                           int(self._blk.s[r, 0]))
            out[w] = got
        return out


@dataclass(frozen=True, slots=True)
class _Block:
    """Every config's estimate stacked (rows: config × local stage count, columns: n); memory kept
    as base + in-flight · activations so that any number of stages after the cluster is cheap. What
    is constant along a row (its stage count and config) is one column (rows, 1)."""

    bott: np.ndarray
    fill: np.ndarray
    sync: np.ndarray
    s: np.ndarray
    """(rows, 1)."""
    shape_ok: np.ndarray
    first_base: np.ndarray
    first_act: np.ndarray
    trunk_base: np.ndarray
    trunk_act: np.ndarray
    tp: np.ndarray
    """(rows, 1), as ``dp`` and ``rc``."""
    dp: np.ndarray
    rc: np.ndarray

    def fits(self, d: int, m: int, capacity: float) -> np.ndarray:
        """[C6] the first local stage keeps min(s + d, m) microbatches, a trunk stage min(s − 1 + d, m)."""
        first = self.first_base + in_flight(self.s + d, 0, m) * self.first_act <= capacity
        trunk = (self.s == 1) | (self.trunk_base + in_flight(self.s + d, 1, m) * self.trunk_act <= capacity)
        return self.shape_ok & first & trunk


def _block(
    instance: Instance, tables: CostTables, layout: BlockLayout, cluster: Cluster, role: Role, n: np.ndarray,
    microbatch: int, m: int, budget: int, replicas: int, cache: dict[tuple[object, ...], object],
) -> _Block | None:
    has_pre = role in ("first", "only")
    has_post = role in ("last", "only")
    nb = n - (layout.pre if has_pre else 0) - (layout.post if has_post else 0)
    valid = (nb >= 0) & (n >= 1)
    ckey = ("configs", cluster.gpu, cluster.gpus_per_node, cluster.gpu_memory_bytes, microbatch,
            instance.job.global_batch)  # what local_configs reads of the cluster and the job
    if ckey not in cache:
        cache[ckey] = local_configs(instance, cluster.name, microbatch, tables)  # which layouts may recompute [I3r]
    configs: tuple[LocalConfig, ...] = cache[ckey]  # type: ignore[assignment]
    rc_layouts = {(cfg.tp, cfg.dp) for cfg in configs if cfg.recompute}  # the layouts that may recompute
    layouts: list[tuple[int, int]] = []
    for tp in instance.model.tps(cluster.gpu):
        if cluster.gpus_per_node % tp:
            continue
        top_mbs = max(instance.model.mbss(cluster.gpu, tp))
        for dp in range(1, microbatch + 1):
            # replicas beyond the profiled microbatch sizes gain nothing ([C2] is proportional there)
            if microbatch % dp or tp * dp > budget or microbatch // dp > top_mbs:
                continue
            layouts.append((tp, dp))
    if not layouts:
        return None

    def estimates(which: list[tuple[int, int]], rc: bool) -> list[tuple[np.ndarray, ...]]:
        return _config_estimates(instance, tables, layout, cluster, [(tp, dp, microbatch // dp) for tp, dp in which],
                                 budget, replicas, nb, has_pre, has_post, cache, rc)

    plain = estimates(layouts, False)  # each layout's estimate without recomputation
    # [I3r] with recomputation too (hfrec), unless every estimate of the layout fits with m in flight:
    # then recomputation cannot help
    with_rc = [i for i, (tp, dp) in enumerate(layouts)
               if (tp, dp) in rc_layouts and not _fits_deepest(plain[i], m, cluster.gpu_memory_bytes)]
    rcs = dict(zip(with_rc, estimates([layouts[i] for i in with_rc], True)))
    parts: list[tuple[np.ndarray, ...]] = []
    labels: list[tuple[int, int, int, int]] = []  # (tp, dp, recompute, rows) per part
    for i, (tp, dp) in enumerate(layouts):
        for rc, est in ((0, plain[i]), (1, rcs.get(i))):
            if est is not None:
                parts.append(est)
                labels.append((tp, dp, rc, est[0].shape[0]))
    # the stage count of each row (constant along it) as one column
    arrays = [np.concatenate([p[i][:, :1] if i == 3 else p[i] for p in parts]) for i in range(9)]
    rows = [r for *_, r in labels]
    for j in range(3):  # the config of every row: tp, dp, recompute
        arrays.append(np.repeat(np.array([lab[j] for lab in labels]), rows)[:, None])
    arrays[4] = arrays[4] & valid[None, :]
    return _Block(*arrays)


def _fits_deepest(est: tuple[np.ndarray, ...], m: int, capacity: float) -> bool:
    """Every (s, n) estimate of a layout fits with the most microbatches in flight (m) [C6]."""
    first = est[5] + m * est[6] <= capacity
    trunk = (est[3] == 1) | (est[7] + m * est[8] <= capacity)
    return bool(np.all((first & trunk) | ~est[4]))


def _stage_grid(top: int) -> np.ndarray:
    """Local stage counts tried: every count up to 12, then about 15 % apart (an estimate only needs
    the shape of the cost curve; the intra-cluster DP later tries every count)."""
    vals = list(range(1, min(top, 12) + 1))
    v = 12
    while v < top:
        v = min(top, max(v + 1, int(v * 1.15)))
        vals.append(v)
    return np.array(vals, dtype=np.int64)


def _config_estimates(
    instance: Instance, tables: CostTables, layout: BlockLayout, c: Cluster, specs: Sequence[tuple[int, int, int]],
    budget: int, replicas: int, nb: np.ndarray, has_pre: bool, has_post: bool,
    cache: dict[tuple[object, ...], object], recompute: bool = False,
) -> list[tuple[np.ndarray, ...]]:
    """Per (tp, dp, mbs) config of ``specs``, its estimate for every (local stage count s, layer count
    n): rows s, columns n; (bottleneck, fill, sync_opt, s, shape ok, first-stage memory base and
    activations per microbatch in flight, trunk-stage memory base and activations per microbatch).
    With ``recompute`` ([C2r]/[C6r]): each layer's backward repeats its forward, a microbatch in
    flight keeps only each layer's input (the mean boundary bytes) and one layer's activations are
    rebuilt at a time. The configs not memoised yet are computed together, stacked row-wise (every
    element by the same operations as one config alone)."""
    L = tables.num_layers
    # the estimate reads neither m nor the budget beyond its stage grid: alike calls share one (replan speed)
    # the cluster's part of the keys as one small token (hashing its bandwidths for every config and
    # lookup cost more than the rest of the keys): equal parts get the same token, a new one a new token
    token = cache.setdefault(("cluster", c.gpu, c.gpus_per_node, c.intra_node, c.inter_node), len(cache))
    memos = [("config", token, tp, dp, mbs, min(budget // (tp * dp), L), replicas, has_pre, has_post, recompute,
              len(nb)) for tp, dp, mbs in specs]
    spec_of = dict(zip(memos, specs))
    todo = [key for key in spec_of if key not in cache]
    if todo:
        got = _config_estimates_uncached(instance, tables, layout, c, [spec_of[key] for key in todo], budget,
                                         replicas, nb, has_pre, has_post, cache, recompute)
        cache.update(zip(todo, got))
    return [cache[key] for key in memos]  # type: ignore[misc]


def _config_estimates_uncached(
    instance: Instance, tables: CostTables, layout: BlockLayout, c: Cluster, specs: Sequence[tuple[int, int, int]],
    budget: int, replicas: int, nb: np.ndarray, has_pre: bool, has_post: bool,
    cache: dict[tuple[object, ...], object], recompute: bool,
) -> list[tuple[np.ndarray, ...]]:
    L = tables.num_layers
    if ("act_mean",) not in cache:  # the same for every config: one mean per cache (per tables, as "parts")
        cache[("act_mean",)] = float(np.mean(tables.activation_bytes))
    act_bytes: float = cache[("act_mean",)]  # type: ignore[assignment]
    # per config, its scalars (Python floats, as for one config alone), then one row per local stage count
    grids, cols = [], []
    for tp, dp, mbs in specs:
        key = ("parts", c.gpu, tp, mbs)
        if key not in cache:
            cache[key] = _parts(tables, layout, c.gpu, tp, mbs)
        P: _Parts = cache[key]  # type: ignore[assignment]
        t_b, t_pre, t_post = P.time
        if recompute:
            t_b, t_pre, t_post = (t + f for t, f in zip(P.time, P.fwd))
        p_b, p_pre, p_post = P.params
        pre_p, post_p = (p_pre if has_pre else 0.0), (p_post if has_post else 0.0)
        a_b, a_pre, a_post = P.act
        top = min(budget // (tp * dp), L)
        if ("grid", top) not in cache:
            cache[("grid", top)] = _stage_grid(top)
        grids.append(cache[("grid", top)])  # read only
        cols.append((
            t_b, (t_pre if has_pre else 0.0) + (t_post if has_post else 0.0),  # block seconds, extra seconds
            max(t_pre if has_pre else 0.0, t_post if has_post else 0.0),  # the heavier special layer
            transfer_time(c.inter_node, node_samples(c.gpus_per_node, tp, replicas * dp, mbs) * act_bytes),  # NIC
            p_b, pre_p, post_p, max(pre_p, post_p), P.update[0], dp, mbs,
            a_b, a_pre if has_pre else 0.0, a_post if has_post else 0.0,
            max(a_b, a_pre if has_pre else 0.0, a_post if has_post else 0.0),  # the largest layer rebuilt [C6r]
        ))
    sizes = [len(g) for g in grids]
    s = np.concatenate(grids)[:, None]
    per_row = np.repeat(np.array(cols, dtype=float), sizes, axis=0)  # dp, mbs too: small integers, exact as floats
    (t_b, extra_t, special_t, send, p_b, pre_p, post_p, special_p, u_b, dp, mbs, a_b, a_pre, a_post,
     big_first) = (per_row[:, j : j + 1] for j in range(per_row.shape[1]))
    nbc = np.maximum(nb, 0)[None, :]
    work = nbc * t_b + extra_t
    per_stage_blocks = np.ceil(nbc / s)
    low_blocks = np.floor(nbc / s)
    # compute: the heaviest stage holds ceil(nb/s) blocks or a special layer with its share
    bott = np.maximum(per_stage_blocks * t_b, special_t)
    bott = np.maximum(bott, work / s)
    bott = np.where(s > 1, np.maximum(bott, send), bott)
    fill = stage_fill(work, (s - 1) * send, (s - 1) * send)
    # gradient sync + optimizer of the stage with most parameters [C5, C6]
    stage_params = np.maximum(per_stage_blocks * p_b, low_blocks * p_b + special_p)
    stage_params = np.where(s == 1, nbc * p_b + pre_p + post_p, stage_params)
    stage_update = np.divide(stage_params, p_b, out=np.zeros(stage_params.shape), where=p_b > 0) * u_b
    grad = gradient_bytes(stage_params, tables.dtype_bytes)
    ring_s = np.empty(grad.shape)
    row = 0
    for (tp, dp_, mbs_), size in zip(specs, sizes):
        ring = replicas * dp_
        bw = ring_bandwidth(c.intra_node, c.inter_node, c.gpus_per_node, ring, tp, tp)  # links: NIC / tp rings
        ring_s[row : row + size] = allreduce_time_v(bw, grad[row : row + size], ring)
        row += size
    sync = ring_s + optimizer_share(stage_update, dp)
    # memory of the first local stage (most microbatches in flight) and of a trunk stage [C6]
    ws = instance.job.workspace_bytes

    def base_mem(params: np.ndarray) -> np.ndarray:  # [C6] without activations
        return stage_memory(params, 0.0, 0, mbs, dtype_bytes=tables.dtype_bytes,
                            optimizer_bytes=tables.optimizer_bytes_per_param, shards=dp, workspace=ws)

    first_params = np.where(s == 1, stage_params, low_blocks * p_b + pre_p)
    if recompute:  # [C6r] kept inputs per microbatch in flight; the largest layer rebuilt once (in the base)
        layers_first = np.where(s == 1, nbc + int(has_pre) * layout.pre + int(has_post) * layout.post,
                                low_blocks + int(has_pre) * layout.pre)
        first_act = mbs * layers_first * act_bytes
        trunk_act = mbs * per_stage_blocks * act_bytes
        first_base = base_mem(first_params) + mbs * big_first
        trunk_base = base_mem(per_stage_blocks * p_b) + mbs * a_b
    else:
        first_act = mbs * np.where(s == 1, nbc * a_b + a_pre + a_post, low_blocks * a_b + a_pre)
        trunk_base = base_mem(per_stage_blocks * p_b)
        trunk_act = mbs * per_stage_blocks * a_b
        first_base = base_mem(first_params)
    shape_ok = s <= np.maximum(nbc + int(has_pre) + int(has_post), 1)
    out = (bott, fill, sync, s, shape_ok, first_base, first_act, trunk_base, trunk_act)
    shape = (s.shape[0], nbc.shape[1])  # rows (configs × stage counts) × layer counts: what they broadcast to
    full = tuple(a if a.shape == shape else np.broadcast_to(a, shape) for a in out)  # read only, never written
    edges = list(itertools.accumulate(sizes, initial=0))
    return [tuple(a[lo:hi] for a in full) for lo, hi in zip(edges[:-1], edges[1:])]
