"""Bucketed gradient synchronisation overlapped with the last backward [C7o] (COMMON.md semantics).

Pure functions over plain numbers; ``hgopt.cost.evaluate`` feeds them a plan's stages. A stage's
gradients are synchronised per sync segment [C5] in buckets of consecutive layers, last layer first,
each at most ``cap_bytes`` (a larger layer is its own bucket). A bucket is ready once the last
microbatch's backward has passed all its layers (overlap on) or once that backward ends (off); it
starts when every holder has it ready and has finished its previous bucket, and holds all of them
for its [C5] duration. A stage's optimizer step follows its last bucket; the iteration ends with the
last optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence, TypeVar

import numpy as np

Num = TypeVar("Num", float, np.ndarray)

__all__ = ["Bucket", "bucket_ranges", "bucket_ready_time", "bucket_schedule", "bucket_schedule_starts",
           "exposed_sync_floor", "iteration_end"]

MIB = float(2**20)
"""``grad_bucket_mb`` is in MiB, as torch DDP's ``bucket_cap_mb``."""


def bucket_ranges(layer_bytes: Sequence[float], lo: int, hi: int, cap_bytes: float) -> list[tuple[int, int]]:
    """Buckets of the layers [lo, hi) (``layer_bytes[l]``: gradient bytes of layer l), walking from
    the last layer down and closing a bucket before it would exceed ``cap_bytes``; in that order."""
    out: list[tuple[int, int]] = []
    end, size = hi, 0.0
    for layer in range(hi - 1, lo - 1, -1):
        b = float(layer_bytes[layer])
        if size > 0 and size + b > cap_bytes:
            out.append((layer + 1, end))
            end, size = layer + 1, 0.0
        size += b
    if end > lo:
        out.append((lo, end))
    return out


def bucket_ready_time(backward_end: float, backward_s: float, done_fraction: float, overlap: bool) -> float:
    """When a bucket of a stage is ready: the backward of the last microbatch runs over
    [end − b, end] and has passed the bucket's layers after ``done_fraction`` of it (by profiled
    backward time, last layer first); without overlap, at the end."""
    if not overlap:
        return backward_end
    return backward_end - backward_s + backward_s * done_fraction


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """One all-reduce: its layers, seconds, and the time it is ready at each holder."""

    layers: tuple[int, int]
    duration_s: float
    ready: Mapping[Hashable, float]


def bucket_schedule(buckets: Sequence[Bucket], backward_end: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """When each holder's gradient sync ends: ``buckets`` in descending layer order (every holder
    meets its buckets in that order), each starting once every holder has it ready and is done with
    its previous bucket; never before the holder's last backward ends (``backward_end``, also the
    answer for a holder without buckets)."""
    return bucket_schedule_starts(buckets, backward_end)[0]


def bucket_schedule_starts(
    buckets: Sequence[Bucket], backward_end: Mapping[Hashable, float]
) -> tuple[dict[Hashable, float], dict[Hashable, float]]:
    """:func:`bucket_schedule`, and when each holder's first bucket starts (holders with buckets only)."""
    free = {h: -math.inf for h in backward_end}
    first: dict[Hashable, float] = {}
    for bk in buckets:
        t0 = max(max(bk.ready[h], free[h]) for h in bk.ready)
        for h in bk.ready:
            free[h] = t0 + bk.duration_s
            first.setdefault(h, t0)
    return {h: max(free[h], backward_end[h]) for h in backward_end}, first


def iteration_end(sync_end: Mapping[Hashable, float], optimizer_s: Mapping[Hashable, float]) -> float:
    """[C7o] The last optimizer step's end: max over stages of sync end + optimizer seconds."""
    return max(sync_end[h] + optimizer_s[h] for h in sync_end)


def exposed_sync_floor(sync_s: Num, backward_s: Num, last_bucket_s: Num, *, one_bucket: bool,
                       overlap: bool = True) -> Num:
    """[C7o] A lower bound of how long a stage's gradient sync runs past the end of its last backward
    (``bucket_schedule``'s end minus ``backward_end``), for the bounds of the search.

    ``sync_s``: at most the sum of the stage's bucket durations (e.g. its [C5] time in one piece, when
    splitting it into buckets can only add latency terms); ``last_bucket_s``: at most the duration of
    its last bucket (the one holding its first layer, ready only when the backward ends);
    ``backward_s``: the stage's backward of one microbatch (the earliest bucket is ready no earlier
    than its start). One bucket (a ZeRO-1 stage, or overlap off): the whole sync runs after the
    backward, exactly ``sync_s``. Otherwise max(last bucket, sync − backward). Elementwise."""
    if one_bucket or not overlap:
        return sync_s
    return np.maximum(last_bucket_s, sync_s - backward_s)  # type: ignore[return-value]
