"""Cost tables and the primitive cost functions (pure functions over numpy arrays).

``build_tables(instance)`` turns a model profile into prefix-sum arrays so that the compute time and
memory of any contiguous layer range is O(1). Every planner and the scorer read costs from here;
the equations are in ``formulations/cost_model.md`` (labels in brackets refer to it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from hgopt.spec import DTYPE_BYTES, Bandwidth, Instance, ModelProfile

__all__ = [
    "CostTables",
    "GpuTpTable",
    "allreduce_time",
    "bandwidth_bytes_per_s",
    "ring_latency_s",
    "build_tables",
    "link_bytes_factor",
    "memoised",
    "transfer_time",
]

MEMO_MAX_ENTRIES = 200_000
"""relaxspeed: ``CostTables.memo`` is emptied when it holds more entries than this (memory stays bounded;
values are recomputed, the same floats, after that); 0 turns the memo off (tests compare both ways)."""

U_RANGE = (-10.0, 14.0)
"""Clamp of u = log2(bytes / 1e6) in the bandwidth curve [C1]."""
_U_MIN, _U_MAX = U_RANGE


def bandwidth_bytes_per_s(bw: Bandwidth, nbytes: float) -> float:
    """Achieved bytes/s for one message of ``nbytes`` [C1]."""
    if bw.curve is None:
        return bw.gbyte_s * 1e9
    c0, c1, c2 = bw.curve
    u = min(max(math.log2(max(nbytes, 1.0) / 1e6), _U_MIN), _U_MAX)
    gbs = c0 * u * u + c1 * u + c2
    return min(max(gbs, 0.01 * bw.gbyte_s), bw.gbyte_s) * 1e9


def transfer_time(bw: Bandwidth, nbytes: float) -> float:
    """Seconds to send ``nbytes`` point to point: latency + bytes / achieved bandwidth [C1]."""
    if nbytes <= 0:
        return 0.0
    return bw.latency_s + nbytes / bandwidth_bytes_per_s(bw, nbytes)


def ring_latency_s(latency_s: float, n: int) -> float:
    """[C5] The latency part of a ring all-reduce among ``n``: 2(n − 1) steps (reduce-scatter, then
    all-gather), each paying one hop's ``latency_s``."""
    return 2.0 * (n - 1) * latency_s


def allreduce_time(bw: Bandwidth, nbytes: float, n: int) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` participants: 2(n-1)/n · bytes / B + 2(n-1)·latency,
    the bandwidth taken at the ring's chunk size bytes/n [C5]."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    chunk = nbytes / n
    return 2.0 * (n - 1) / n * nbytes / bandwidth_bytes_per_s(bw, chunk) + ring_latency_s(bw.latency_s, n)


def link_bytes_factor(native: str, precision: str) -> float:
    """Bytes sent in ``precision`` per byte of the training dtype."""
    if precision == "native":
        return 1.0
    return DTYPE_BYTES[precision] / DTYPE_BYTES[native]


@dataclass(frozen=True, slots=True)
class GpuTpTable:
    """Prefix sums over layers for one (GPU type, tp): rows are the profiled microbatch sizes."""

    mbs: np.ndarray  # (k,) profiled microbatch sizes, ascending
    fwd: np.ndarray  # (k, L+1) prefix sums of forward seconds
    bwd: np.ndarray  # (k, L+1)
    update: np.ndarray  # (L+1,) prefix sums of optimizer-step seconds
    params: np.ndarray  # (L+1,) prefix sums of parameters held per GPU (one tp shard)
    act_mem: np.ndarray  # (L+1,) prefix sums of activation bytes per sample per GPU

    def times(self, mbs: int, lo: int, hi: int) -> tuple[float, float]:
        """Forward and backward seconds of layers [lo, hi) for a microbatch of ``mbs`` samples [C2]."""
        f = self.fwd[:, hi] - self.fwd[:, lo]
        b = self.bwd[:, hi] - self.bwd[:, lo]
        return _interp(self.mbs, f, mbs), _interp(self.mbs, b, mbs)


def _interp(xs: np.ndarray, ys: np.ndarray, x: float) -> float:
    """Piecewise-linear in mbs between profiled points; proportional to mbs outside them [C2]."""
    if x <= xs[0]:
        return float(ys[0] * x / xs[0])
    if x >= xs[-1]:
        return float(ys[-1] * x / xs[-1])
    return float(np.interp(x, xs, ys))


@dataclass(frozen=True, slots=True)
class CostTables:
    """All per-instance numeric tables. Build once with :func:`build_tables`, read many times."""

    num_layers: int
    dtype_bytes: float
    optimizer_bytes_per_param: float
    activation_bytes: np.ndarray  # (L,) boundary output bytes per sample after each layer
    by_gpu_tp: dict[tuple[str, int], GpuTpTable]
    layer_classes: tuple[int, ...] = ()
    """Class id per layer: layers with the same id have identical profile entries (timings,
    parameters, activations, per-tp memory), so they cost the same wherever they sit."""
    memo: dict[Hashable, object] = field(default_factory=dict, compare=False, repr=False, hash=False)
    """relaxspeed: a cache of pure functions of these tables (``memoised``): the searches build one
    ``CostTables`` per plan call and read it for every batch split, and much of a split's per-config work
    (stage compute, memory caps, sync floors) depends only on the microbatch size or the cluster, not on
    the split. Every key names all the inputs besides the tables themselves."""

    def table(self, gpu: str, tp: int) -> GpuTpTable:
        return self.by_gpu_tp[(gpu, tp)]


T = TypeVar("T")


def memoised(tables: CostTables, key: Hashable, compute: Callable[[], T]) -> T:
    """relaxspeed: ``compute()``, cached in ``tables.memo`` under ``key`` (which must name every input of
    ``compute`` other than ``tables``). numpy arrays in the value are made read-only, so that a caller
    that would modify a shared value fails instead of changing another caller's numbers."""
    if MEMO_MAX_ENTRIES <= 0:
        return compute()
    memo = tables.memo
    try:
        return memo[key]  # type: ignore[return-value]
    except KeyError:
        pass
    value = compute()
    for a in (value if isinstance(value, tuple) else (value,)):
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    if len(memo) >= MEMO_MAX_ENTRIES:
        memo.clear()
    memo[key] = value
    return value


def optimizer_bytes_per_param(model: ModelProfile, precision: str, optimizer: str) -> float:
    """Optimizer state (+ fp32 master weights when training in 16 bit) per parameter [C6]."""
    if model.optimizer_bytes_per_param is not None:
        return model.optimizer_bytes_per_param
    states = 8.0 if optimizer == "adam" else 4.0
    master = 0.0 if precision == "fp32" else 4.0
    return states + master


def build_tables(instance: Instance) -> CostTables:
    model = instance.model
    L = model.num_layers
    params1 = np.array([layer.params for layer in model.layers], dtype=float)
    act1 = np.array([layer.act_mem_bytes for layer in model.layers], dtype=float)
    overrides = {m.tp: m for m in model.tp_memory}
    by: dict[tuple[str, int], GpuTpTable] = {}
    for gpu in model.gpu_types():
        for tp in model.tps(gpu):
            entries = sorted((t for t in model.timings if t.gpu == gpu and t.tp == tp), key=lambda t: t.mbs)
            if tp in overrides:
                params = np.array(overrides[tp].params, dtype=float)
                act = np.array(overrides[tp].act_mem_bytes, dtype=float)
            else:
                params, act = params1 / tp, act1 / tp
            by[(gpu, tp)] = GpuTpTable(
                mbs=np.array([t.mbs for t in entries], dtype=float),
                fwd=_prefix(np.array([t.fwd for t in entries], dtype=float)),
                bwd=_prefix(np.array([t.bwd for t in entries], dtype=float)),
                update=_prefix(np.array(entries[0].update, dtype=float)),
                params=_prefix(params),
                act_mem=_prefix(act),
            )
    return CostTables(
        num_layers=L,
        dtype_bytes=DTYPE_BYTES[model.dtype],
        optimizer_bytes_per_param=optimizer_bytes_per_param(model, instance.job.precision, instance.job.optimizer),
        activation_bytes=np.array([layer.activation_bytes for layer in model.layers], dtype=float),
        by_gpu_tp=by,
        layer_classes=layer_classes(model),
    )


def layer_classes(model: ModelProfile) -> tuple[int, ...]:
    """See :attr:`CostTables.layer_classes`."""
    ids: dict[tuple[object, ...], int] = {}
    out = []
    for i, layer in enumerate(model.layers):
        key = (
            layer.params,
            layer.activation_bytes,
            layer.act_mem_bytes,
            tuple((t.gpu, t.tp, t.mbs, t.fwd[i], t.bwd[i], t.update[i]) for t in model.timings),
            tuple((m.tp, m.params[i], m.act_mem_bytes[i]) for m in model.tp_memory),
        )
        out.append(ids.setdefault(key, len(ids)))
    return tuple(out)


def _prefix(a: np.ndarray) -> np.ndarray:
    pad = [(0, 0)] * (a.ndim - 1) + [(1, 0)]
    return np.cumsum(np.pad(a, pad), axis=-1)
