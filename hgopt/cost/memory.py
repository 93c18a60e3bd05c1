"""Per-GPU memory of a stage [C6]: the one definition of its terms.

mem = 2·P·w + P·o / z + k·mbs·A + workspace, with P the parameters one GPU holds, w the bytes per
value of the training dtype (weights and gradients), o the optimizer bytes per parameter, z the ZeRO-1
shard count, k the in-flight microbatches (``hgopt.cost.pipeline.in_flight``), A the activation bytes
kept per sample. ``stage_memory`` is the numpy form the search uses (any argument may be an array),
``stage_memory_terms`` the per-term scalar form ``evaluate`` and the memory bench use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from hgopt.cost.tables import CostTables, GpuTpTable
from hgopt.spec import Cluster, Instance

__all__ = [
    "MemoryTerms",
    "max_in_flight",
    "max_in_flight_v",
    "range_params_act",
    "recompute_activation_bytes",
    "recompute_activations",
    "recompute_inputs_prefix",
    "recompute_largest_table",
    "recompute_largest_v",
    "stage_memory",
    "stage_memory_recompute",
    "stage_memory_parts",
    "stage_memory_terms",
    "sharded_optimizer_bytes",
    "zero_shards",
]

Num = TypeVar("Num", float, np.ndarray)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryTerms:
    """[C6] Bytes per GPU of one replica group of a stage."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    workspace: float

    @property
    def total(self) -> float:
        """The [C6] sum, in the order :func:`stage_memory` adds it (bit-identical)."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.workspace


def range_params_act(tab: GpuTpTable, lo: Num | int, hi: Num | int) -> tuple[Num, Num]:
    """Parameters held per GPU and activation bytes kept per sample of layers [lo, hi)."""
    return tab.params[hi] - tab.params[lo], tab.act_mem[hi] - tab.act_mem[lo]  # type: ignore[return-value]


def stage_memory(
    params: Num, act: Num, in_flight: Num | int, mbs: Num | int, *, dtype_bytes: float, optimizer_bytes: float,
    shards: Num | int = 1, workspace: float = 0.0,
) -> Num:
    """[C6] 2·P·w + P·o/z + k·mbs·A + workspace (elementwise)."""
    return 2.0 * params * dtype_bytes + params * optimizer_bytes / shards + in_flight * mbs * act + workspace  # type: ignore[return-value]


def zero_shards(sharded: bool, replicas: int) -> int:
    """[C6] The ZeRO-1 shard count of one sync segment's optimizer state on a stage of ``replicas``
    replicas, as the export holds it (``export/build.py`` ``_zero_level``): the replicas when the
    segment is sharded (``evaluate.segment_sharded``: every holder asks for ZeRO-1 and all hold one tp
    degree), else 1 (every holder keeps the full state: layers held at several tp degrees, or by a stage
    without ZeRO-1). hetgap: before, a ZeRO-1 stage was counted sharded over its replicas even where the
    export keeps the full state (a stage whose groups differ in tp)."""
    return replicas if sharded else 1


def sharded_optimizer_bytes(tab: GpuTpTable, pieces: Sequence[tuple[int, int, int]], optimizer_bytes: float) -> float:
    """[C6] Optimizer-state bytes per GPU of a stage holding its layers as sync segments ``pieces``
    ((lo, hi, shards) each, :func:`zero_shards`): Σ P(lo, hi)·o / shards."""
    return float(sum(float(tab.params[hi] - tab.params[lo]) * optimizer_bytes / z for lo, hi, z in pieces))


def stage_memory_terms(
    instance: Instance, tables: CostTables, cluster: Cluster, tp: int, lo: int, hi: int, mbs: int, in_flight: int,
    shards: int = 1, recompute: bool = False, pieces: Sequence[tuple[int, int, int]] | None = None,
) -> MemoryTerms:
    """[C6] The terms of one group (GPU type of ``cluster``, ``tp``, ``mbs``) holding layers [lo, hi);
    ``recompute``: activations as :func:`recompute_activation_bytes`; ``pieces``: the optimizer state
    per sync segment (:func:`sharded_optimizer_bytes`, then ``shards`` is not used)."""
    tab = tables.table(cluster.gpu, tp)
    params, act = range_params_act(tab, lo, hi)
    params, act = float(params), float(act)
    activations = (recompute_activation_bytes(instance, tab, lo, hi, mbs, in_flight) if recompute
                   else in_flight * mbs * act)
    optimizer = (params * tables.optimizer_bytes_per_param / shards if pieces is None
                 else sharded_optimizer_bytes(tab, pieces, tables.optimizer_bytes_per_param))
    return MemoryTerms(
        weights=params * tables.dtype_bytes,
        gradients=params * tables.dtype_bytes,
        optimizer=optimizer,
        activations=activations,
        workspace=instance.job.workspace_bytes,
    )


# ---- activation recomputation (hfrunner) [C6r] -------------------------------------------------------------
TOKEN_ID_BYTES = 8.0
"""An int64 token id: what the first layer keeps of its input per token."""


def recompute_inputs_prefix(instance: Instance) -> np.ndarray:
    """[C6r] (L+1,) prefix sums over layers of the bytes per sample a recomputing stage keeps of each
    layer's input: the previous layer's output (``activation_bytes``, whole on every tp rank), the
    token ids for layer 0."""
    layers = instance.model.layers
    per = [TOKEN_ID_BYTES * instance.model.seq_len] + [layer.activation_bytes for layer in layers[:-1]]
    return np.concatenate(([0.0], np.cumsum(np.array(per, dtype=float))))


def recompute_largest_table(tab: GpuTpTable) -> np.ndarray:
    """[C6r] Range-maximum table of the per-layer activation bytes per sample of ``tab``'s GPU and tp:
    row j holds the largest over layers [i, i + 2^j) at column i (-inf past the end), for
    :func:`recompute_largest_v`."""
    per = np.diff(tab.act_mem)
    n = len(per)
    rows = [per]
    while (1 << len(rows)) <= n:
        prev, w = rows[-1], 1 << (len(rows) - 1)
        rows.append(np.maximum(prev[:-w], prev[w:]))
    out = np.full((len(rows), n), -np.inf)
    for j, r in enumerate(rows):
        out[j, : len(r)] = r
    return out


def recompute_largest_v(table: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[C6r] Largest per-layer activation bytes over each range [lo, hi) (0 for an empty one), from
    :func:`recompute_largest_table` (a maximum: exactly the scalar form's)."""
    lo, hi = np.asarray(lo), np.asarray(hi)
    n = np.maximum(hi - lo, 1)
    j = np.floor(np.log2(n)).astype(np.int64)
    w = np.left_shift(1, j)
    cols = table.shape[1]
    a = table[j, np.clip(lo, 0, cols - 1)]
    b = table[j, np.clip(hi - w, 0, cols - 1)]
    return np.where(hi > lo, np.maximum(a, b), 0.0)


def recompute_activations(inputs: Num, largest: Num, in_flight: Num | int, mbs: Num | int) -> Num:
    """[C6r] k·mbs·inputs + mbs·largest (elementwise): every microbatch in flight keeps its layers'
    inputs, one backward at a time rebuilds one layer's activations (the largest)."""
    return in_flight * mbs * inputs + mbs * largest  # type: ignore[return-value]


def recompute_activation_bytes(instance: Instance, tab: GpuTpTable, lo: int, hi: int, mbs: int,
                               in_flight: int) -> float:
    """[C6r] Activation bytes per GPU of layers [lo, hi) run with full recomputation (the runner:
    ``torch.utils.checkpoint`` per layer): :func:`recompute_activations` of the layers' kept inputs
    (:func:`recompute_inputs_prefix`) and their largest activations."""
    pre = recompute_inputs_prefix(instance)
    largest = float(np.max(np.diff(tab.act_mem[lo:hi + 1])))
    return float(recompute_activations(float(pre[hi] - pre[lo]), largest, in_flight, mbs))


def stage_memory_recompute(
    params: Num, inputs: Num, largest: Num, in_flight: Num | int, mbs: Num | int, *, dtype_bytes: float,
    optimizer_bytes: float, shards: Num | int = 1, workspace: float = 0.0,
) -> Num:
    """[C6] with [C6r] activations (elementwise): 2·P·w + P·o/z + (k·mbs·inputs + mbs·largest) +
    workspace, added in :func:`stage_memory`'s (and ``MemoryTerms.total``'s) order."""
    return (2.0 * params * dtype_bytes + params * optimizer_bytes / shards  # type: ignore[return-value]
            + recompute_activations(inputs, largest, in_flight, mbs) + workspace)


def stage_memory_parts(
    instance: Instance, tables: CostTables, cluster: Cluster, tp: int, lo: int, hi: int, mbs: int, in_flight: int
) -> tuple[float, float]:
    """[C6] (everything but the optimizer state, the optimizer state unsharded): with ZeRO-1 over z
    replicas the total is ``first + second / z``."""
    params, act = range_params_act(tables.table(cluster.gpu, tp), lo, hi)
    params, act = float(params), float(act)
    base = stage_memory(params, act, in_flight, mbs, dtype_bytes=tables.dtype_bytes, optimizer_bytes=0.0,
                        workspace=instance.job.workspace_bytes)
    return base, params * tables.optimizer_bytes_per_param


def max_in_flight_v(base: np.ndarray, act: np.ndarray, capacity: float, memory: object) -> np.ndarray:
    """Largest in-flight count k with ``memory(k) <= capacity`` per element (float array: -1 when
    even k = 0 does not fit, inf when activations are free). ``base`` = memory(0), ``act`` =
    memory(1) − memory(0); ``memory`` recomputes the exact [C6] sum so that the answer agrees with
    the comparison ``evaluate`` makes (the division may be one off)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(act > 0, np.floor((capacity - base) / np.where(act > 0, act, 1.0)), 0.0)
    k = np.maximum(k, 0.0)
    for _ in range(2):
        k = np.where((k > 0) & (memory(k) > capacity), k - 1, k)  # type: ignore[operator]
        k = np.where(memory(k + 1) <= capacity, k + 1, k)  # type: ignore[operator]
    k = np.where(act > 0, k, np.inf)
    return np.where(base > capacity, -1.0, k)


def max_in_flight(base: float, act: float, capacity: float, memory: object) -> float:
    """Scalar :func:`max_in_flight_v`."""
    if base > capacity:
        return -1
    if act <= 0:
        return np.inf
    k = int((capacity - base) // act)
    while k >= 0 and float(memory(k)) > capacity:  # type: ignore[operator]
        k -= 1
    while float(memory(k + 1)) <= capacity:  # type: ignore[operator]
        k += 1
    return k
