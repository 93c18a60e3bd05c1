"""Stage compute and optimizer-step times from the prefix-sum tables [C2], [C6-opt].

``stage_times`` (scalar) and ``stage_compute_v`` (numpy, over arrays of layer ranges) are the same
formula: per-layer profile times summed over [lo, hi), linear in the microbatch size between
profiled sizes and proportional to it outside them. ``optimizer_time`` is the update seconds of the
range divided by the ZeRO-1 shard count.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from hgopt.cost.tables import CostTables, GpuTpTable

__all__ = ["forward_share_of", "interp_rows", "optimizer_share", "optimizer_time", "stage_compute_v", "stage_times", "stage_times_v"]

Num = TypeVar("Num", float, np.ndarray)


def stage_times(tab: GpuTpTable, mbs: int, lo: int, hi: int, recompute: bool = False) -> tuple[float, float]:
    """Forward and backward seconds of layers [lo, hi) at microbatch ``mbs`` [C2]. ``recompute``
    (a plan stage's ``recompute: full``, hfrunner): the backward runs the forward again first [C2r]."""
    f, b = tab.times(mbs, lo, hi)
    return (f, b + f) if recompute else (f, b)


def interp_rows(xs: np.ndarray, rows: np.ndarray, x: float) -> np.ndarray:
    """[C2] ``GpuTpTable.times``' interpolation applied to every column of ``rows`` (rows: profiled
    microbatch sizes ``xs``)."""
    if x <= xs[0]:
        return rows[0] * x / xs[0]
    if x >= xs[-1]:
        return rows[-1] * x / xs[-1]
    j = int(np.searchsorted(xs, x, side="right")) - 1
    if xs[j] == x:
        return rows[j]
    slope = (rows[j + 1] - rows[j]) / (xs[j + 1] - xs[j])
    return slope * (x - xs[j]) + rows[j]


def stage_times_v(tab: GpuTpTable, mbs: int, lo: np.ndarray, hi: np.ndarray,
                  recompute: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """:func:`stage_times` for arrays of ranges [lo, hi) (``recompute``: [C2r])."""
    f = interp_rows(tab.mbs, tab.fwd[:, hi] - tab.fwd[:, lo], mbs)
    b = interp_rows(tab.mbs, tab.bwd[:, hi] - tab.bwd[:, lo], mbs)
    return (f, b + f) if recompute else (f, b)


def stage_compute_v(tab: GpuTpTable, mbs: int, lo: np.ndarray, hi: np.ndarray, recompute: bool = False) -> np.ndarray:
    """fwd + bwd seconds of arrays of ranges [lo, hi) [C2] (``recompute``: the backward repeats the
    forward [C2r])."""
    f, b = stage_times_v(tab, mbs, lo, hi, recompute)
    return f + b


def optimizer_share(update_s: Num, shards: Num | int = 1) -> Num:
    """[C6] One replica's optimizer-step seconds when ``shards`` ZeRO-1 replicas split ``update_s``."""
    return update_s / shards  # type: ignore[return-value]


def optimizer_time(tab: GpuTpTable, lo: Num | int, hi: Num | int, shards: Num | int = 1) -> Num:
    """Optimizer-step seconds of layers [lo, hi), sharded over ``shards`` ZeRO-1 replicas [C6]."""
    return optimizer_share(tab.update[hi] - tab.update[lo], shards)  # type: ignore[return-value]


def forward_share_of(tables: CostTables, max_mbs: int) -> tuple[float, float]:
    """[C3b] (ρ, E) (``pipeline.forward_share``) valid for every stage ``evaluate`` can report with
    replica groups of microbatch size at most ``max_mbs``: the largest ρ of any (GPU, tp) table's
    profiled row, and E the largest excess of a row at those ρ scaled as ``GpuTpTable.times`` scales
    the row to mbs ≤ ``max_mbs`` (recomputation only lengthens the backward [C2r])."""
    from hgopt.cost.pipeline import forward_share

    rows = [(np.diff(tab.fwd[k]), np.diff(tab.bwd[k]), float(tab.mbs[k]), tab)
            for tab in tables.by_gpu_tp.values() for k in range(len(tab.mbs))]
    rho = max((forward_share(f.tolist(), b.tolist())[0] for f, b, _, _ in rows), default=1.0)
    excess = 0.0
    for tab in tables.by_gpu_tp.values():
        e = np.array([float(np.maximum(np.diff(tab.fwd[k]) - rho * (np.diff(tab.fwd[k]) + np.diff(tab.bwd[k])), 0.0).sum())
                      for k in range(len(tab.mbs))])
        excess = max(excess, max(float(interp_rows(tab.mbs, e, x)) for x in range(1, max(max_mbs, 1) + 1)))
    return rho, excess
