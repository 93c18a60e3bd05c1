"""Intra-cluster dynamic programme: the best local pipeline of one cluster for a layer range.

The local plan space and its exactness are described in ``formulations/intra_dp.md``; the labels
[I1]..[I6] below refer to it. In short: a cluster hosting layers [start, end) of every pipeline runs
them as ``s`` local stages, each one :class:`~hgopt.plan.ReplicaGroup` of the same (tp, dp, mbs) with
dp·mbs = microbatch and ZeRO-1 over its dp replicas; ``best_local_plan`` returns the one minimising

    J = (m − 1)·bottleneck + fill + sync_opt                                            [I1]

where bottleneck and fill are what ``hgopt.cost.evaluate`` computes for the same stages [I2] and
sync_opt is the gradient sync + optimizer step of the pipeline's FIRST stage when the block holds
layer 0 (else 0): with the overlapped sync [C7o] stage s's tail starts at its last backward,
Σ_{i<s}(b_i + c^b_i) before the pipeline's end, so the iteration is T_p + max_s (tail_s − that) ≥
T_p + tail_0, and tail_0 is at least ``StageModel.first_tail`` (``gradsync.exposed_sync_floor``:
a ZeRO-1 stage's reduce-scatter buckets overlap its last backward, its all-gather follows the
optimizer step). J is a lower bound of evaluate. Two exact
searches are implemented: a closed form for ranges made of identical layers with at most one
different layer at each end (transformer blocks between embedding and head) [I4], and a Pareto
dynamic programme over layer positions for any range [I5]; the tests check both against brute force.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from hgopt.cost.comm import allreduce_time_v, gradient_bytes, transfer_time, transfer_time_v
from hgopt.cost.compute import optimizer_time, stage_compute_v, stage_times, stage_times_v
from hgopt.cost.gradsync import MIB, exposed_sync_floor
from hgopt.cost.links import least_allreduce_time_from, node_samples, ring_bandwidth
from hgopt.cost.memory import (
    max_in_flight,
    max_in_flight_v,
    range_params_act,
    recompute_inputs_prefix,
    recompute_largest_table,
    recompute_largest_v,
    stage_memory,
    stage_memory_recompute,
)
from hgopt.cost.pipeline import in_flight as in_flight_depth
from hgopt.cost.pipeline import pipeline_time, stage_fill, steady_weight, weighted_time
from hgopt.cost.tables import CostTables, GpuTpTable, build_tables, memoised
from hgopt.cost.tables import layer_classes as tables_layer_classes
from hgopt.plan import ReplicaGroup, Stage
from hgopt.search.sync_choice import DEFAULT_BUCKET_MB
from hgopt.spec import Cluster, Instance

__all__ = [
    "LocalConfig",
    "LocalPlan",
    "best_local_plan",
    "layer_classes",
    "local_configs",
    "local_plan_costs",
]

INF = math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalConfig:
    """One local stage's layout: ``dp`` replicas of ``tp`` GPUs, each with ``mbs`` samples; with
    ``recompute`` every stage of the local pipeline runs ``recompute: full`` ([C2r] time, [C6r] memory)."""

    tp: int
    dp: int
    mbs: int
    recompute: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalPlan:
    """A cluster's local pipeline for the layers [start, end) of one pipeline."""

    cluster: str
    start: int
    end: int
    stages: tuple[Stage, ...]
    """The cluster's local pipeline stages, one ReplicaGroup each (ZeRO-1 over its replicas)."""
    gpus: int
    """GPUs used by this pipeline's copy of the block."""
    bottleneck_s: float
    """max over local stages of max(fwd+bwd, intra-cluster send to the next local stage) [C3]."""
    fill_s: float
    """Sum over local stages of fwd+bwd plus the intra-cluster sends forward and backward [C3]."""
    sync_opt_s: float
    """[C7o] The tail the block contributes to the iteration's lower bound: its first local stage's
    intra-cluster gradient all-reduce + optimizer step [C5, C6] when the block holds layer 0 (that
    stage is the pipeline's first: its sync cannot hide behind an earlier stage's backward), else 0."""
    max_stages_after: float = INF
    """Largest number of pipeline stages after this block for which every local stage fits in
    memory (``inf``: any number) [C6]."""

    def objective(self, num_microbatches: int) -> float:
        """[I1] (m − 1)·bottleneck + fill + sync_opt."""
        return pipeline_time(num_microbatches, self.bottleneck_s, self.fill_s) + self.sync_opt_s


# --------------------------------------------------------------------------------------------
# The local plan space [I3]
# --------------------------------------------------------------------------------------------
def local_configs(instance: Instance, cluster: str, microbatch: int,
                  tables: CostTables | None = None) -> tuple[LocalConfig, ...]:
    """Every (tp, dp, mbs) a local stage of ``cluster`` may use: tp profiled for its GPU type and
    dividing the node size, dp a divisor of the microbatch, mbs = microbatch / dp [I3]; then, unless
    ``job.recompute`` is off, the same layouts with activation recomputation [I3r] — only those in
    which memory can bind: a layout whose stage holding the whole model with the most microbatches
    any plan keeps in flight (global batch / microbatch) fits without ZeRO is never better with
    recomputation (same partition, same memory feasibility, more compute), so it gets no variant.
    Ties go to the configuration listed first: without recomputation. Only for models whose layers
    all hand over the same bytes per sample (every transformer profile): then a recomputing layer's
    kept input is the same wherever it sits, except layer 0's (token ids), so identical layers still
    cost the same at every position but the first (the searches treat layer 0 as special)."""
    c = instance.topology.cluster(cluster)
    if tables is None:
        return _local_configs(instance, c, microbatch, build_tables(instance))
    # relaxspeed: memoised (every phase of every split asks for each cluster's configs)
    key = ("local_configs", c.gpu, c.gpus_per_node, c.gpu_memory_bytes, microbatch, instance.job.recompute,
           instance.job.global_batch, instance.job.workspace_bytes)
    return memoised(tables, key, lambda: _local_configs(instance, c, microbatch, tables))


def _local_configs(instance: Instance, c: Cluster, microbatch: int, tables: CostTables) -> tuple[LocalConfig, ...]:
    tps = [tp for tp in instance.model.tps(c.gpu) if c.gpus_per_node % tp == 0]
    dps = [dp for dp in range(1, microbatch + 1) if microbatch % dp == 0]
    plain = tuple(LocalConfig(tp=tp, dp=dp, mbs=microbatch // dp) for tp in tps for dp in dps)
    if instance.job.recompute == "off" or len({layer.activation_bytes for layer in instance.model.layers[:-1]}) > 1:
        return plain
    deepest = max(1, instance.job.global_batch // microbatch)
    return plain + tuple(replace(cfg, recompute=True) for cfg in plain
                         if _memory_binds(instance, tables, c, cfg, deepest))


def _memory_binds(instance: Instance, tables: CostTables, c: Cluster, cfg: LocalConfig, in_flight: int) -> bool:
    """[I3r] The whole model on one stage of ``cfg`` with ``in_flight`` microbatches, no ZeRO, does
    not fit ([C6], the largest memory any stage of ``cfg`` can need)."""
    tab = tables.table(c.gpu, cfg.tp)
    params, act = range_params_act(tab, 0, tables.num_layers)
    mem = stage_memory(float(params), float(act), in_flight, cfg.mbs, dtype_bytes=tables.dtype_bytes,
                       optimizer_bytes=tables.optimizer_bytes_per_param, workspace=instance.job.workspace_bytes)
    return bool(mem > c.gpu_memory_bytes)


def layer_classes(instance: Instance) -> tuple[int, ...]:
    """Class id per layer (:attr:`hgopt.cost.tables.CostTables.layer_classes`, which planners read
    from the tables built once per search)."""
    return tables_layer_classes(instance.model)


# --------------------------------------------------------------------------------------------
# Vectorised stage costs of one (cluster, config) [I2]
# --------------------------------------------------------------------------------------------
class StageModel:
    """Costs of local stages [lo, hi) of one cluster and config, as numpy arrays; every formula
    mirrors ``hgopt.cost.evaluate`` operation by operation [I2]."""

    def __init__(
        self, instance: Instance, tables: CostTables, cluster: Cluster, cfg: LocalConfig, replicas: int
    ) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.tab: GpuTpTable = tables.table(cluster.gpu, cfg.tp)
        self.dtype_bytes = tables.dtype_bytes
        self.opt_bytes = tables.optimizer_bytes_per_param
        self.workspace = instance.job.workspace_bytes
        self.capacity = cluster.gpu_memory_bytes
        self.act_bytes = tables.activation_bytes
        self.tables = tables
        if cfg.recompute:  # [C6r] kept layer inputs (prefix sums) and the largest layer per range
            self._inputs = memoised(tables, ("recompute_inputs", instance.model.seq_len), lambda: recompute_inputs_prefix(instance))
            self._largest = memoised(tables, ("recompute_largest", cluster.gpu, cfg.tp),
                                     lambda: recompute_largest_table(self.tab))
        n = replicas * cfg.dp
        self.ring = n
        self.ring_bw = ring_bandwidth(cluster.intra_node, cluster.inter_node, cluster.gpus_per_node, n, cfg.tp, cfg.tp)  # links
        # relaxspeed: memo keys (``tables.memo``) naming what each cost depends on besides the tables: compute
        # the GPU, tp, mbs and recomputation; memory also dp (ZeRO-1 shards), the GPU's memory and the
        # workspace; sends and the sync floor the cluster (its links) and the ring (replicas · dp)
        self.key_compute = (cluster.gpu, cfg.tp, cfg.mbs, cfg.recompute)
        self.key_memory = (*self.key_compute, cfg.dp, cluster.gpu_memory_bytes, self.workspace)
        self.key_ring = (cluster, cfg.tp, n, cfg.mbs, cfg.recompute)

    def compute(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """fwd + bwd seconds [C2] (with recomputation the backward repeats the forward [C2r])."""
        return stage_compute_v(self.tab, self.cfg.mbs, lo, hi, self.cfg.recompute)

    def compute_memo(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """relaxspeed: :meth:`compute`, memoised by the config's compute key (read-only; for the ranges every
        split asks for: trunk tables, special layers; not per block option)."""
        lo_a, hi_a = np.asarray(lo), np.asarray(hi)
        return memoised(self.tables, ("compute", self.key_compute, _akey(lo_a), _akey(hi_a)),
                        lambda: self.compute(lo_a, hi_a))

    def send_memo(self, hi: np.ndarray) -> np.ndarray:
        """relaxspeed: :meth:`send`, memoised by the cluster and ring (read-only)."""
        hi_a = np.asarray(hi)
        return memoised(self.tables, ("send", self.key_ring, _akey(hi_a)), lambda: self.send(hi_a))

    def send(self, hi: np.ndarray) -> np.ndarray:
        """Seconds to send one microbatch's activations from a stage ending at ``hi`` to the next
        local stage: mbs samples over the cluster's inter-node link [C4] (same both directions)."""
        per_sample = self.act_bytes[np.asarray(hi) - 1]
        node = node_samples(self.cluster.gpus_per_node, self.cfg.tp, self.ring, self.cfg.mbs)  # links: shared NIC
        return transfer_time_v(self.cluster.inter_node, node * per_sample * 1.0)

    def sync_opt(self, lo: np.ndarray, hi: np.ndarray, zero: bool = True) -> np.ndarray:
        """Intra-cluster all-reduce of the stage's gradients among all its replicas [C5] plus the
        optimizer step, sharded over the stage's dp replicas with ZeRO-1 (``zero``) [C6]."""
        t = self.tab
        shard = gradient_bytes(t.params[hi] - t.params[lo], self.dtype_bytes)
        sync = allreduce_time_v(self.ring_bw, shard, self.ring)
        return sync + optimizer_time(t, lo, hi, self.cfg.dp if zero else 1)

    def first_tail(self, lo: np.ndarray, hi: np.ndarray, monotone: bool = False) -> np.ndarray:
        """[C7o] A floor of what a ZeRO-1 stage [lo, hi) that is its pipeline's first adds after the
        pipeline's end (its last backward ends there), for every plan whose ``grad_bucket_mb`` is at
        least 25 MiB (``sync_choice.DEFAULT_BUCKET_MB``: every planner's plan, ``choose_sync``), ZeRO-1
        on or off, then the optimizer step (sharded). Where the stage's gradients fit in one 25 MiB
        bucket they are one bucket under every such cap, ready when the backward ends: the whole [C5]
        all-reduce (ZeRO-1: reduce-scatter + all-gather, the same), exact as evaluate prices it.
        Otherwise ``gradsync.exposed_sync_floor`` with ``zero`` (reduce-scatter buckets overlapped with
        the backward plus the all-gather, or all-reduce buckets; the intra ring's [C5] time in one piece,
        the last bucket — ready only when the backward ends — at least the all-reduce of layer lo's
        gradients, which it holds whole: ``links.least_allreduce_time_from``, gaps3). ``monotone``: the sync part made
        non-decreasing in ``hi`` (its least value over every [lo, h), h >= hi), so that the tail of a
        range bounds every first stage holding it (``blocks.cheap_bounds``). relaxspeed: memoised by the
        cluster, ring and dp (read-only)."""
        lo_a, hi_a = np.asarray(lo), np.asarray(hi)
        return memoised(self.tables, ("first_tail", self.key_ring, self.cfg.dp, monotone, _akey(lo_a), _akey(hi_a)),
                        lambda: self._first_tail(lo_a, hi_a, monotone))

    def _first_tail(self, lo_a: np.ndarray, hi_a: np.ndarray, monotone: bool) -> np.ndarray:
        if lo_a.ndim == 1 and lo_a.shape == hi_a.shape and lo_a.size and (lo_a == lo_a[0]).all():
            u = int(lo_a[0])  # one start (the tables' ranges): no masks
            return self._sync_floor_from(u)[int(monotone)][hi_a - u - 1] + optimizer_time(self.tab, lo_a, hi_a, self.cfg.dp)
        out = np.empty(np.broadcast(lo_a, hi_a).shape)
        lo_b, hi_b = np.broadcast_to(lo_a, out.shape), np.broadcast_to(hi_a, out.shape)
        for u in np.unique(lo_b):
            at = lo_b == u
            out[at] = self._sync_floor_from(int(u))[int(monotone)][hi_b[at] - int(u) - 1]
        return out + optimizer_time(self.tab, lo_a, hi_a, self.cfg.dp)

    def _sync_floor_from(self, lo: int) -> tuple[np.ndarray, np.ndarray]:
        """``first_tail``'s sync floor of [lo, h) for h = lo + 1 .. L, and its suffix minimum (cached per lo)."""
        return memoised(self.tables, ("sync_floor", self.key_ring, lo), lambda: self._sync_floor(lo))

    def _sync_floor(self, lo: int) -> tuple[np.ndarray, np.ndarray]:
        t = self.tab
        hi = np.arange(lo + 1, len(t.params))
        los = np.full_like(hi, lo)
        nbytes = gradient_bytes(t.params[hi] - t.params[los], self.dtype_bytes)
        sync = allreduce_time_v(self.ring_bw, nbytes, self.ring)
        back = stage_times_v(t, self.cfg.mbs, los, hi, self.cfg.recompute)[1]
        # gaps3: the last bucket holds layer lo whole (buckets never split a layer), so it all-reduces
        # at least that layer's bytes (``links.least_allreduce_time_from``; before: its latency terms only)
        last = least_allreduce_time_from(self.ring_bw, float(gradient_bytes(t.params[lo + 1] - t.params[lo],
                                                                             self.dtype_bytes)), self.ring)
        floor = np.asarray(exposed_sync_floor(sync, back, np.full_like(sync, last), zero=True))
        floor = np.where(nbytes <= DEFAULT_BUCKET_MB * MIB, sync, floor)  # one bucket: the whole ring
        return floor, np.minimum.accumulate(floor[::-1])[::-1]

    def memory(self, lo: np.ndarray, hi: np.ndarray, in_flight: np.ndarray | int, zero: bool = True) -> np.ndarray:
        """Peak bytes per GPU with ``in_flight`` microbatches kept [C6] (optimizer state sharded over
        the dp replicas with ZeRO-1, ``zero``; with recomputation the activations of [C6r])."""
        t = self.tab
        if self.cfg.recompute:
            return stage_memory_recompute(
                t.params[hi] - t.params[lo], self._inputs[hi] - self._inputs[lo], recompute_largest_v(self._largest, lo, hi),
                in_flight, self.cfg.mbs, dtype_bytes=self.dtype_bytes, optimizer_bytes=self.opt_bytes,
                shards=self.cfg.dp if zero else 1, workspace=self.workspace)
        return stage_memory(t.params[hi] - t.params[lo], t.act_mem[hi] - t.act_mem[lo], in_flight, self.cfg.mbs,
                            dtype_bytes=self.dtype_bytes, optimizer_bytes=self.opt_bytes,
                            shards=self.cfg.dp if zero else 1, workspace=self.workspace)

    def max_in_flight_v(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`max_in_flight` (float array: -1, a count, or inf) [C6]; read-only (shared)."""
        lo_a, hi_a = np.asarray(lo), np.asarray(hi)
        return memoised(self.tables, ("max_in_flight_v", self.key_memory, _akey(lo_a), _akey(hi_a)),
                        lambda: self._max_in_flight_v(lo_a, hi_a))

    def _max_in_flight_v(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        base = self.memory(lo, hi, 0)
        return max_in_flight_v(base, self.memory(lo, hi, 1) - base, self.capacity, lambda k: self.memory(lo, hi, k))

    def max_in_flight(self, lo: int, hi: int) -> float:
        """Largest in-flight count for which the stage fits (``inf`` when activations are free;
        -1 when even the weights do not fit) [C6]."""
        return memoised(self.tables, ("max_in_flight", self.key_memory, lo, hi), lambda: self._max_in_flight(lo, hi))

    def _max_in_flight(self, lo: int, hi: int) -> float:
        if self.cfg.recompute:  # the same [C6r] sum on Python floats (the scalar path is hot in [I5])
            t = self.tab
            params = float(t.params[hi] - t.params[lo])
            inputs, big = float(self._inputs[hi] - self._inputs[lo]), float(np.max(np.diff(t.act_mem[lo:hi + 1])))
            mem = lambda k: stage_memory_recompute(  # noqa: E731
                params, inputs, big, k, self.cfg.mbs, dtype_bytes=self.dtype_bytes, optimizer_bytes=self.opt_bytes,
                shards=self.cfg.dp, workspace=self.workspace)
            base_r = float(mem(0))
            return max_in_flight(base_r, float(mem(1)) - base_r, self.capacity, mem)
        lo_a, hi_a = np.array(lo), np.array(hi)
        base = float(self.memory(lo_a, hi_a, 0))
        act = float(self.memory(lo_a, hi_a, 1)) - base
        return max_in_flight(base, act, self.capacity, lambda k: self.memory(lo_a, hi_a, k))


def _akey(a: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    """relaxspeed: an exact memo key of an array (dtype, shape, bytes)."""
    return a.dtype.str, a.shape, a.tobytes()


# --------------------------------------------------------------------------------------------
# Exact numbers of a given local pipeline [I2]
# --------------------------------------------------------------------------------------------
def local_plan_costs(
    instance: Instance,
    tables: CostTables,
    cluster: str,
    stages: tuple[Stage, ...],
    *,
    replicas: int = 1,
    num_microbatches: int | None = None,
) -> LocalPlan:
    """The LocalPlan numbers of ``stages`` (consecutive, one ReplicaGroup each, all in ``cluster``,
    ZeRO-1), computed with the scalar functions ``evaluate`` uses [I2]. With ``num_microbatches``,
    ``max_stages_after`` accounts for the in-flight cap m."""
    c = instance.topology.cluster(cluster)
    fill = bottleneck = sync_opt = 0.0
    dmax: float = INF
    for j, st in enumerate(stages):
        g = st.groups[0]
        assert len(st.groups) == 1 and g.cluster == cluster and st.zero == 1, st
        recompute = st.recompute == "full"
        sm = StageModel(instance, tables, c, LocalConfig(tp=g.tp, dp=g.dp, mbs=g.mbs, recompute=recompute), replicas)
        f, b = stage_times(sm.tab, g.mbs, st.start, st.end, recompute)
        send = 0.0
        if j + 1 < len(stages):
            nxt = stages[j + 1].groups[0]
            per_sample = float(tables.activation_bytes[st.end - 1])
            node = max(node_samples(c.gpus_per_node, x.tp, replicas * x.dp, x.mbs) for x in (g, nxt))  # links: NIC
            send = transfer_time(c.inter_node, node * per_sample * 1.0)
        fill += f + b + send + send
        bottleneck = max(bottleneck, f + b, send)
        if j == 0 and st.start == 0:  # [C7o] only the pipeline's first stage's tail (see sync_opt_s)
            sync_opt = float(sm.first_tail(np.array([st.start]), np.array([st.end]))[0])
        k = sm.max_in_flight(st.start, st.end)
        if num_microbatches is None or k < num_microbatches:
            dmax = min(dmax, _stages_after_allowed(k, len(stages) - j))
    return LocalPlan(
        cluster=cluster,
        start=stages[0].start,
        end=stages[-1].end,
        stages=stages,
        gpus=sum(s.gpus for s in stages),
        bottleneck_s=bottleneck,
        fill_s=fill,
        sync_opt_s=sync_opt,
        max_stages_after=dmax,
    )


def _stages_after_allowed(max_in_flight: float, r: int) -> float:
    """A stage with ``r`` stages from it to the block's end (itself included) keeps
    min(r + d, m) microbatches in flight with d stages after the block; it fits for every
    d <= max_in_flight − r (and always once the cap m is reached; see callers) [C6]."""
    if max_in_flight == INF:
        return INF
    return max_in_flight - r


# --------------------------------------------------------------------------------------------
# The search [I4, I5]
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class _Choice:
    """A candidate local pipeline found by a search: its objective and its stage bounds."""

    value: float
    cfg: LocalConfig
    bounds: tuple[int, ...]


def best_local_plan(
    instance: Instance,
    tables: CostTables,
    cluster: str,
    start: int,
    end: int,
    *,
    microbatch: int,
    num_microbatches: int,
    gpu_budget: int,
    stages_before: int = 0,
    stages_after: int = 0,
    replicas: int = 1,
    min_gpus: int = 0,
) -> LocalPlan | None:
    """The local pipeline of ``cluster`` for layers [start, end) minimising [I1]
    (m − 1)·bottleneck + fill + sync_opt, or ``None`` when nothing fits in ``gpu_budget`` GPUs
    and the GPU memory.

    ``stages_before``/``stages_after``: pipeline stages outside this cluster before/after the block
    (1F1B keeps min(stages to the end, m) microbatches in flight, so only ``stages_after`` changes
    memory). ``replicas``: identical pipelines whose copies of these stages sit in this cluster and
    all-reduce their gradients together (the ring has replicas·dp members). ``min_gpus``: only local
    pipelines using at least that many GPUs (the CLI's why-not lines for a partly used cluster).
    """
    _check_args(instance, cluster, start, end, microbatch, num_microbatches, gpu_budget, stages_before,
                stages_after, replicas)
    if not 0 <= min_gpus <= gpu_budget:  # (cli: min_gpus)
        raise ValueError(f"min_gpus: must be in [0, gpu_budget = {gpu_budget}], got {min_gpus}")
    best: _Choice | None = None
    c = instance.topology.cluster(cluster)
    classes = tables.layer_classes or layer_classes(instance)
    # [I6] configs in order of their lower bound (m − 1)·W/s_max + W (W: the range's compute), so
    # that the incumbent prunes the others and, inside a config, the small stage counts
    # (ties go to the config listed first by local_configs, as without the pruning)
    todo = []
    for idx, cfg in enumerate(local_configs(instance, cluster, microbatch, tables)):
        if cfg.gpus > gpu_budget:
            continue
        sm = StageModel(instance, tables, c, cfg, replicas)
        s_max = min(gpu_budget // cfg.gpus, end - start)
        s_min = max(1, -(-min_gpus // cfg.gpus))  # (cli: min_gpus)
        if s_min > s_max:
            continue
        work = float(sm.compute(np.array([start]), np.array([end]))[0])
        todo.append((pipeline_time(num_microbatches, work / s_max, work), idx, work, sm, s_max, s_min))
    todo.sort(key=lambda x: (x[0], x[1]))
    best_idx = -1
    for lb, idx, work, sm, s_max, s_min in todo:
        if best is not None and lb > best.value:
            break
        found = _search_range(classes, sm, start, end, s_max, stages_after, num_microbatches,
                              incumbent=best.value if best is not None else INF, work=work, s_min=s_min)
        if found is not None and (best is None or found.value < best.value
                                  or (found.value == best.value and idx < best_idx)):
            best, best_idx = found, idx
    if best is None:
        return None
    return local_plan_costs(instance, tables, cluster, _stages(cluster, best.cfg, best.bounds), replicas=replicas,
                            num_microbatches=num_microbatches)


def _check_args(
    instance: Instance, cluster: str, start: int, end: int, microbatch: int, m: int, budget: int,
    before: int, after: int, replicas: int,
) -> None:
    names = [c.name for c in instance.topology.clusters]
    if cluster not in names:
        raise ValueError(f"cluster: unknown cluster {cluster!r} (clusters: {', '.join(names)})")
    if not 0 <= start < end <= instance.model.num_layers:
        raise ValueError(f"start/end: [{start}, {end}) is not a non-empty layer range of {instance.model.num_layers} layers")
    for name, v, lo in (("microbatch", microbatch, 1), ("num_microbatches", m, 1), ("gpu_budget", budget, 0),
                        ("stages_before", before, 0), ("stages_after", after, 0), ("replicas", replicas, 1)):
        if v < lo:
            raise ValueError(f"{name}: must be >= {lo}, got {v}")


def _stages(cluster: str, cfg: LocalConfig, bounds: tuple[int, ...]) -> tuple[Stage, ...]:
    group = ReplicaGroup(cluster=cluster, tp=cfg.tp, dp=cfg.dp, mbs=cfg.mbs)
    rc = "full" if cfg.recompute else "none"
    return tuple(Stage(start=lo, end=hi, groups=(group,), zero=1, recompute=rc) for lo, hi in zip(bounds, bounds[1:]))


def _search_range(
    classes: tuple[int, ...], sm: StageModel, start: int, end: int, s_max: int, d: int, m: int,
    incumbent: float = INF, work: float = 0.0, s_min: int = 1,
) -> _Choice | None:
    """Best partition of [start, end) for one config over every stage count <= s_max that can beat
    ``incumbent``: with s stages the objective is at least (m − 1)·work/s + work (the
    bottleneck is at least the mean stage compute, the fill at least the whole compute ``work``) [I6],
    so stage counts are tried from the most down and stop once that bound exceeds the best; none
    below ``s_min``."""
    if sm.cfg.recompute and start == 0:  # [C6r] layer 0 keeps token ids, not an activation: its own class
        classes = (-1, *classes[1:])
    geo = TrunkGeometry.for_range(classes, start, end)
    if geo is None:
        return _generic_best(sm, start, end, s_max, d, m, s_min)
    tc = TrunkCosts(sm, geo, geo.trunk)
    best: _Choice | None = None
    for s in range(s_max, s_min - 1, -1):  # ties go to the fewest stages, as in ascending order
        if pipeline_time(m, work / s, work) > min(incumbent, best.value if best is not None else INF):
            break
        sol = solve_trunk(tc, s, d, m, np.array([geo.trunk]))
        if sol is None or not sol.feasible[0]:
            continue
        if best is None or sol.value[0] <= best.value:
            best = _Choice(value=float(sol.value[0]), cfg=sm.cfg, bounds=sol.bounds(0))
    return best


# ---- [I4] closed form for identical layers between at most one special layer at each end ----------
@dataclass(frozen=True, kw_only=True, slots=True)
class TrunkGeometry:
    """Where a block's layers are: ``p`` special leading layers from ``first`` (always together in
    the first local stage), a run of identical trunk layers starting at ``t0``, ``q`` special
    trailing layers ending at ``last_end`` (together in the last local stage). ``whole(n)`` is the
    block's layer range when it holds n trunk layers. Ranges found by ``for_range`` have p, q <= 1,
    where keeping the special layer in the end stage loses nothing."""

    p: int
    q: int
    first: int
    t0: int
    last_end: int
    trunk: int
    """Trunk layers of the range (for a single range) or the largest count considered."""
    anchor: str = "start"
    """How ``whole(n)`` places the block: at ``first``/``t0`` ('start') or ending at ``last_end`` ('end')."""
    pipeline_first: bool = True
    """The block holds layer 0, so its first local stage is the pipeline's first: the only stage whose
    tail [C7o] the objective counts (``LocalPlan.sync_opt_s``)."""

    def whole(self, n: int) -> tuple[int, int]:
        if self.anchor == "start":
            lo = self.first if self.p else self.t0
            return lo, lo + self.p + n + self.q
        return self.last_end - self.q - n - self.p, self.last_end

    @staticmethod
    def for_range(classes: tuple[int, ...], start: int, end: int) -> TrunkGeometry | None:
        """The geometry of [start, end) when it is trunk-shaped, else None (use [I5])."""
        n = end - start
        if n < 3:
            return None
        inner = set(classes[start + 1 : end - 1])
        if len(inner) != 1:
            return None
        k = next(iter(inner))
        p = int(classes[start] != k)
        q = int(classes[end - 1] != k)
        return TrunkGeometry(p=p, q=q, first=start, t0=start + p, last_end=end, trunk=n - p - q,
                             pipeline_first=start == 0)


class TrunkCosts:
    """Cost arrays of the stage kinds of a trunk-shaped block for one config: trunk stages of x
    layers, the special first stage with x0 trunk layers, the special last stage with xl."""

    def __init__(self, sm: StageModel, geo: TrunkGeometry, xmax: int) -> None:
        self.sm, self.geo, self.xmax = sm, geo, xmax
        x = np.arange(xmax + 1)
        lo_t, hi_t = np.full_like(x, geo.t0), geo.t0 + x
        # relaxspeed: the arrays are the StageModel's memoised ones (read-only, shared across splits); the
        # tails (t_so, f_so) are computed when first read (``__getattr__``: the relaxation reads none)
        self.t_comp = sm.compute_memo(lo_t, hi_t)
        self.t_send = float(sm.send_memo(np.array([geo.t0 + 1]))[0]) if xmax >= 1 else 0.0
        self.t_lo, self.t_hi = lo_t, hi_t
        if geo.p:
            lo0, hi0 = np.full_like(x, geo.first), geo.first + geo.p + x
            self.f_comp, self.f_send = sm.compute_memo(lo0, hi0), sm.send_memo(hi0)
            self.f_lo, self.f_hi = lo0, hi0
        if geo.q:
            lol, hil = geo.last_end - geo.q - x, np.full_like(x, geo.last_end)
            self.l_comp = sm.compute_memo(lol, hil)
            self.l_lo, self.l_hi = lol, hil

        self._kmax: dict[str, np.ndarray] = {}
        self._lead: dict[int, int] = {}

    def leading_cap(self, in_flight: int) -> int:
        """Most trunk layers x such that trunk stages of 1..x layers all fit at ``in_flight`` (cached)."""
        if in_flight not in self._lead:
            self._lead[in_flight] = _leading_true(self.cap("t", in_flight))
        return self._lead[in_flight]

    def __getattr__(self, name: str) -> np.ndarray:
        """The first-stage tails of trunk stages (``t_so``) and of the special first stage (``f_so``, with
        a prefix only), computed on first use."""
        if name == "t_so" or (name == "f_so" and self.geo.p):
            kind = name[0]
            value = self.sm.first_tail(self.__dict__[f"{kind}_lo"], self.__dict__[f"{kind}_hi"])
            setattr(self, name, value)
            return value
        raise AttributeError(name)

    def kmax(self, kind: str) -> np.ndarray:
        """Most in-flight microbatches per x for a stage of ``kind`` ('t', 'f', 'l') [C6]."""
        if kind not in self._kmax:
            lo, hi = getattr(self, f"{kind}_lo"), getattr(self, f"{kind}_hi")
            self._kmax[kind] = self.sm.max_in_flight_v(lo, hi)
        return self._kmax[kind]

    def cap(self, kind: str, in_flight: int) -> np.ndarray:
        """Feasibility mask over x of a stage of ``kind`` ('t', 'f', 'l') at ``in_flight``."""
        ok = self.kmax(kind) >= in_flight
        if kind == "t":
            ok = ok.copy()
            ok[0] = False  # a trunk stage holds at least one layer
        return ok


@dataclass(frozen=True, kw_only=True, slots=True)
class TrunkSolution:
    """Per trunk count n (arrays): the best partition's objective and shape."""

    feasible: np.ndarray
    value: np.ndarray
    bottleneck: np.ndarray
    fill: np.ndarray
    sync_opt: np.ndarray
    x0: np.ndarray
    xl: np.ndarray
    counts: tuple[np.ndarray, ...]
    """Trunk layers of each trunk stage, front to back (arrays over n)."""
    geo: TrunkGeometry
    ns: np.ndarray
    s: int

    def bounds(self, i: int) -> tuple[int, ...]:
        """Layer boundaries of the partition for ns[i]."""
        lo, _ = self.geo.whole(int(self.ns[i]))
        out = [lo]
        s, p, q = self.s, self.geo.p, self.geo.q
        if s == 1:
            return (lo, lo + p + int(self.ns[i]) + q)
        if p:
            out.append(out[-1] + p + int(self.x0[i]))
        for cnt in self.counts:
            out.append(out[-1] + int(cnt[i]))
        if q:
            out.append(out[-1] + int(self.xl[i]) + q)
        return tuple(out)


def solve_trunk(tc: TrunkCosts, s: int, d: int, m: int, ns: np.ndarray, *, front: bool = False,
                weight: float | None = None) -> TrunkSolution | None:
    """[I4] For every trunk count in ``ns``: the partition of the block into ``s`` stages minimising
    [I1] with ``d`` stages after the block. Trunk stages only matter through their largest layer
    count (costs grow with it), which memory caps per position make a small covering problem.
    ``front``: give the extra trunk layers to the earliest stages memory allows (instead of the
    latest), which shortens the 1F1B round trip of the later stages [C3]. ``weight``: the bottleneck's
    weight in [I1] (default m − 1; the MILP's block options pass their objective's, [C3b])."""
    geo, w = tc.geo, steady_weight(m) if weight is None else weight
    infl = in_flight_depth(np.full(s, s + d), np.arange(s), m).tolist()  # [C6] in-flight microbatches of local stage i
    if s == 1:
        return _solve_single(tc, infl[0], w, ns)
    has_f, has_l = bool(geo.p), bool(geo.q)
    t_idx = list(range(int(has_f), s - int(has_l)))
    kt = len(t_idx)
    X = tc.xmax
    caps = [tc.leading_cap(infl[i]) for i in t_idx]
    if kt and min(caps) < 1:
        return None
    xs = np.arange(X + 1)
    g = np.minimum(np.array(caps, dtype=np.int64)[:, None], xs[None, :]).sum(axis=0) if kt else np.zeros(X + 1, dtype=np.int64)
    # choose the special stages' trunk layers on a grid: axis 0 = x0, axis 1 = xl, axis 2 = n
    x0 = np.arange(X + 1) if has_f else np.zeros(1, dtype=np.int64)
    xl = np.arange(X + 1) if has_l else np.zeros(1, dtype=np.int64)
    X0, XL, N = np.meshgrid(x0, xl, ns, indexing="ij")
    mid = N - X0 - XL
    ok = mid >= kt
    if kt == 0:
        ok &= mid == 0
    midc = np.clip(mid, 0, X)
    xm = np.searchsorted(g, midc, side="left") if kt else np.zeros_like(midc)
    ok &= xm <= X
    xm = np.minimum(xm, X)
    T = np.zeros(mid.shape)
    S = np.zeros(mid.shape)
    F = np.zeros(mid.shape)
    sends = np.zeros(mid.shape)
    if kt:
        T = np.maximum(T, tc.t_comp[xm])
        if kt >= 2 or has_l:
            T = np.maximum(T, tc.t_send)
        F = F + tc.t_comp[midc]
        sends = sends + tc.t_send * (s - 1 - int(has_f))
    if has_f:
        okf = tc.cap("f", infl[0])
        ok &= okf[X0]
        T = np.maximum(T, np.maximum(tc.f_comp[X0], tc.f_send[X0]))
        F = F + tc.f_comp[X0]
        sends = sends + tc.f_send[X0]
    if has_l:
        okl = tc.cap("l", infl[-1])
        ok &= okl[XL]
        T = np.maximum(T, tc.l_comp[XL])
        F = F + tc.l_comp[XL]
    if geo.pipeline_first:  # [C7o] the tail of the pipeline's first stage (LocalPlan.sync_opt_s)
        S = tc.f_so[X0] if has_f else tc.t_so[_trunk_counts(caps, midc, xm, front=front)[0]]
    F = stage_fill(F, sends, sends)
    J = np.where(ok, weighted_time(w, T, F) + S, INF)
    flat = J.reshape(-1, J.shape[2])
    arg = np.argmin(flat, axis=0)
    cols = np.arange(J.shape[2])
    pick = lambda a: a.reshape(-1, a.shape[2])[arg, cols]  # noqa: E731
    best_mid, best_xm = pick(midc), pick(xm)
    counts = _trunk_counts(caps, best_mid, best_xm, front=front)
    return TrunkSolution(
        feasible=np.isfinite(pick(J)), value=pick(J), bottleneck=pick(T), fill=pick(F), sync_opt=pick(S),
        x0=pick(X0), xl=pick(XL), counts=counts, geo=geo, ns=ns, s=s,
    )


def _solve_single(tc: TrunkCosts, in_flight: int, w: float, ns: np.ndarray) -> TrunkSolution:
    """One stage holding the whole block, for every n."""
    sm, geo = tc.sm, tc.geo
    lo = np.array([geo.whole(int(n))[0] for n in ns])
    hi = np.array([geo.whole(int(n))[1] for n in ns])
    ok = (sm.memory(lo, hi, in_flight) <= sm.capacity) & (hi > lo)
    T = sm.compute(lo, hi)
    S = sm.first_tail(lo, hi) if geo.pipeline_first else np.zeros(len(ns))  # [C7o] tail of stage 0
    J = np.where(ok, weighted_time(w, T, T) + S, INF)
    z = np.zeros(len(ns), dtype=np.int64)
    return TrunkSolution(feasible=ok, value=J, bottleneck=T, fill=T, sync_opt=S, x0=z, xl=z, counts=(),
                         geo=geo, ns=ns, s=1)


def _leading_true(mask: np.ndarray) -> int:
    """Largest x such that mask[1..x] are all True (0 when mask[1] is False)."""
    bad = np.flatnonzero(~mask[1:])
    return int(bad[0]) if bad.size else len(mask) - 1


def _trunk_counts(caps: list[int], mid: np.ndarray, xm: np.ndarray, *, front: bool = False) -> tuple[np.ndarray, ...]:
    """Trunk layers per trunk stage: one each, the rest filled up to min(cap, xm) from the back
    (later stages keep fewer microbatches in flight) or, with ``front``, from the front."""
    kt = len(caps)
    if not kt:
        return ()
    # relaxspeed: all stages at once. Filling stage after stage in ``order``, stage i gets
    # min(room_i, what is left) with room_i = max(min(cap_i, xm) − 1, 0), so the layers given before it are
    # min(Σ_{j before i} room_j, L) with L = max(mid − kt, 0), and its share is min(room_i, max(L − Σ_{j before i} room_j, 0))
    order = np.arange(kt) if front else np.arange(kt)[::-1]
    cp = np.asarray(caps, dtype=np.int64)[order].reshape((kt,) + (1,) * np.ndim(mid))
    room = np.clip(np.minimum(cp, xm) - 1, 0, None)
    before = np.cumsum(room, axis=0) - room
    add = np.minimum(room, np.clip(np.clip(mid - kt, 0, None) - before, 0, None))
    ones = np.ones_like(mid)
    counts: list[np.ndarray] = [ones] * kt
    for k, i in enumerate(order.tolist()):
        counts[i] = ones + add[k]
    return tuple(counts)


# ---- [I5] Pareto dynamic programme over layer positions, any range --------------------------------
def _generic_best(sm: StageModel, start: int, end: int, s_max: int, d: int, m: int, s_min: int = 1) -> _Choice | None:
    """Exact [I1] for any layers: suffixes [l, end) split into r stages keep their Pareto set of
    (bottleneck, first stage's tail, sends); fill = compute of the range (additive) + 2·sends."""
    front, comp = _generic_fronts(sm, start, end, s_max, d, m)
    best: _Choice | None = None
    for r in range(max(s_min, 1), s_max + 1):  # (cli: min_gpus)
        for i, (t, sv, sd, _, _) in enumerate(front[r].get(start, []) if r < len(front) else []):
            # [C7o] the tail of the pipeline's first stage (LocalPlan.sync_opt_s)
            val = pipeline_time(m, t, stage_fill(comp[(start, end)], sd, sd)) + (sv if start == 0 else 0.0)
            if best is None or val < best.value:
                best = _Choice(value=val, cfg=sm.cfg, bounds=_walk(front, r, start, i))
    return best


def generic_stage_points(sm: StageModel, start: int, end: int, s_max: int, d: int, m: int
                         ) -> tuple[float, list[list[tuple[float, float, float]]]]:
    """[I5] (compute of [start, end), per stage count r = 1..s_max the Pareto points (bottleneck T,
    first stage's tail U, sends Σc) of its partitions into r local stages with ``d`` stages after): every
    partition's (T, U, fill = compute + 2·sends) is dominated by one point, so min over the points of
    w·T + fill + U is the least of that objective over the partitions for any weight w ≥ 0 (replay3
    [R0s]: the stage-count bounds take w per r). U is 0 unless ``start`` is 0."""
    front, comp = _generic_fronts(sm, start, end, s_max, d, m)
    pts = [[(t, sv if start == 0 else 0.0, sd) for t, sv, sd, _, _ in (front[r].get(start, []) if r < len(front) else [])]
           for r in range(1, s_max + 1)]
    return comp[(start, end)], pts


def _generic_fronts(sm: StageModel, start: int, end: int, s_max: int, d: int, m: int
                    ) -> tuple[list[dict[int, list[tuple[float, float, float, int, int]]]], dict[tuple[int, int], float]]:
    """[I5]'s Pareto fronts front[r][lo] (suffixes [lo, end) in r stages) for r = 1..s_max, and the compute
    of every range."""
    comp, so, snd, fit = _range_costs(sm, start, end)
    # front[r][l] = list of (T, S, sends, h, index into front[r-1][h])
    front: list[dict[int, list[tuple[float, float, float, int, int]]]] = [{}]
    front.append({lo: [(comp[(lo, end)], so[(lo, end)], 0.0, end, -1)]
                  for lo in range(start, end) if fit[(lo, end)] >= in_flight_depth(1 + d, 0, m)})
    for r in range(2, s_max + 1):
        front.append(_extend(front[r - 1], r, start, end, d, m, comp, so, snd, fit))
    return front, comp


RangeCosts = tuple[dict[tuple[int, int], float], dict[tuple[int, int], float], dict[int, float],
                   dict[tuple[int, int], float]]


def _range_costs(sm: StageModel, start: int, end: int) -> RangeCosts:
    """[I5]'s inputs for every sub-range [lo, hi) of [start, end): compute, first-stage tail, send out of
    hi, most microbatches in flight. relaxspeed: each memoised by what it depends on (``StageModel``'s
    keys), so splits of one microbatch size share the compute and memory tables (the dicts are shared:
    read only)."""
    n = end - start
    los, his = np.triu_indices(n + 1, 1)
    los, his = los + start, his + start
    pairs = lambda: list(zip(los.tolist(), his.tolist()))  # noqa: E731
    tabs = sm.tables
    comp = memoised(tabs, ("range_compute", sm.key_compute, start, end),
                    lambda: dict(zip(pairs(), sm.compute(los, his).tolist())))
    so = memoised(tabs, ("range_tail", sm.key_ring, sm.cfg.dp, start, end),
                  lambda: dict(zip(pairs(), sm.first_tail(los, his).tolist())))
    snd = memoised(tabs, ("range_send", sm.key_ring, start, end),
                   lambda: dict(zip(range(start + 1, end + 1), sm.send(np.arange(start + 1, end + 1)).tolist())))

    def fits() -> dict[tuple[int, int], float]:
        if sm.cfg.recompute:  # [C6r] the scalar path (its own float sums)
            return {(lo, hi): sm.max_in_flight(lo, hi) for lo, hi in pairs()}
        # [C6] every range at once: the same largest count that fits (replan speed)
        return dict(zip(pairs(), sm.max_in_flight_v(los, his).tolist()))

    fit = memoised(tabs, ("range_fit", sm.key_memory, start, end), fits)
    return comp, so, snd, fit


def _extend(
    prev: dict[int, list[tuple[float, float, float, int, int]]], r: int, start: int, end: int, d: int, m: int,
    comp: dict[tuple[int, int], float], so: dict[tuple[int, int], float], snd: dict[int, float],
    fit: dict[tuple[int, int], float],
) -> dict[int, list[tuple[float, float, float, int, int]]]:
    out: dict[int, list[tuple[float, float, float, int, int]]] = {}
    need = in_flight_depth(r + d, 0, m)
    for lo in range(start, end - r + 1):
        cands = []
        for h, entries in prev.items():
            if h <= lo or fit[(lo, h)] < need:
                continue
            e1 = max(comp[(lo, h)], snd[h])
            s_lh, sn = so[(lo, h)], snd[h]
            # S: the first stage's tail; (t if t > e1 else e1) is max(e1, t)
            cands.extend([(t if t > e1 else e1, s_lh, sd + sn, h, i) for i, (t, _, sd, _, _) in enumerate(entries)])
        if cands:
            out[lo] = _pareto(cands)
    return out


def _pareto(cands: list[tuple[float, float, float, int, int]]) -> list[tuple[float, float, float, int, int]]:
    """Points not dominated in (T, S, sends), lowest T first."""
    cands.sort()
    kept: list[tuple[float, float, float, int, int]] = []
    # sorted: every kept point's T is already <= c's, so c is dominated iff a kept point has S and
    # sends <= c's: kept's (S, sends) staircase answers that (S ascending, sends strictly descending)
    fs: list[float] = []
    fd: list[float] = []
    for c in cands:
        s, sd = c[1], c[2]
        i = bisect.bisect_right(fs, s)
        if i and fd[i - 1] <= sd:
            continue
        kept.append(c)
        j = k = bisect.bisect_left(fs, s)
        while k < len(fs) and fd[k] >= sd:
            k += 1
        fs[j:k] = [s]
        fd[j:k] = [sd]
    return kept


def _walk(front: list[dict[int, list[tuple[float, float, float, int, int]]]], r: int, lo: int, i: int) -> tuple[int, ...]:
    out = [lo]
    while r >= 1:
        _, _, _, h, j = front[r][lo][i]
        out.append(h)
        lo, i, r = h, j, r - 1
    return tuple(out)


def iter_stage_counts(budget: int, cfg: LocalConfig, layers: int) -> Iterable[int]:
    """Local stage counts to consider for a config: 1 .. min(budget // gpus, layers)."""
    return range(1, min(budget // cfg.gpus, layers) + 1)
