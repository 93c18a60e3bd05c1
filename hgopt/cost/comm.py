"""Numpy forms of the link primitives of ``hgopt.cost.tables`` [C1], [C5] for the search.

``bandwidth_bytes_per_s_v``, ``transfer_time_v`` and ``allreduce_time_v`` compute, element by
element, exactly what the scalar ``bandwidth_bytes_per_s``, ``transfer_time`` and ``allreduce_time``
compute (``tests/test_cost_kernel.py`` holds them equal); the scalar ones are re-exported here so
that callers need one import. A change of the link model goes into both forms, here and in tables.py.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from hgopt.cost.tables import U_RANGE, allreduce_time, bandwidth_bytes_per_s, ring_latency_s, transfer_time
from hgopt.spec import Bandwidth

Num = TypeVar("Num", float, np.ndarray)

__all__ = [
    "gradient_bytes",
    "ring_edge_bytes",
    "ring_latency_s",
    "allreduce_time",
    "allreduce_time_v",
    "bandwidth_bytes_per_s",
    "bandwidth_bytes_per_s_v",
    "transfer_time",
    "transfer_time_v",
]


def gradient_bytes(params: Num, dtype_bytes: float, factor: float = 1.0) -> Num:
    """[C5] Bytes all-reduced for ``params`` gradients in the training dtype, times the precision
    factor of the exchange (``tables.link_bytes_factor``)."""
    return params * dtype_bytes * factor  # type: ignore[return-value]


def ring_edge_bytes(nbytes: Num, n: int) -> Num:
    """[C5] Bytes each edge of a ring all-reduce of ``nbytes`` among ``n`` carries: 2(n − 1)/n · bytes."""
    return 0.0 * nbytes if n <= 1 else 2.0 * (n - 1) / n * nbytes  # type: ignore[return-value]


def bandwidth_bytes_per_s_v(bw: Bandwidth, nbytes: np.ndarray) -> np.ndarray:
    """:func:`bandwidth_bytes_per_s` per element of ``nbytes`` [C1]."""
    x = np.asarray(nbytes, dtype=float)
    if bw.curve is None:
        return np.full(x.shape, bw.gbyte_s * 1e9)
    c0, c1, c2 = bw.curve
    u = np.clip(np.log2(np.maximum(x, 1.0) / 1e6), *U_RANGE)
    return np.clip(c0 * u * u + c1 * u + c2, 0.01 * bw.gbyte_s, bw.gbyte_s) * 1e9


def transfer_time_v(bw: Bandwidth, nbytes: np.ndarray) -> np.ndarray:
    """:func:`transfer_time` per element of ``nbytes`` [C1]."""
    x = np.asarray(nbytes, dtype=float)
    return np.where(x > 0, bw.latency_s + x / bandwidth_bytes_per_s_v(bw, x), 0.0)


def allreduce_time_v(bw: Bandwidth, nbytes: np.ndarray, n: int) -> np.ndarray:
    """:func:`allreduce_time` per element of ``nbytes`` among ``n`` participants [C5]."""
    x = np.asarray(nbytes, dtype=float)
    if n <= 1:
        return np.zeros(x.shape)
    t = 2.0 * (n - 1) / n * x / bandwidth_bytes_per_s_v(bw, x / n) + ring_latency_s(bw.latency_s, n)
    return np.where(x > 0, t, 0.0)
