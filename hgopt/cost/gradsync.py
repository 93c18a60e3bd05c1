"""Bucketed gradient synchronisation overlapped with the last backward [C7o] (COMMON.md semantics).

Pure functions over plain numbers; ``hgopt.cost.evaluate`` feeds them a plan's stages. A stage's
gradients are synchronised per sync segment [C5] in buckets of consecutive layers, last layer first,
each at most ``cap_bytes`` (a larger layer is its own bucket). A bucket is ready once the last
microbatch's backward has passed all its layers (overlap on) or once that backward ends (off); it
starts when every holder has it ready and has finished its previous bucket, and holds all of them
for its [C5] duration. A stage's optimizer step follows its last bucket; the iteration ends with the
last optimizer step.

ZeRO-1 (a sharded segment, ``evaluate.segment_sharded``), as Megatron's distributed optimizer with
``overlap_grad_reduce``: the same buckets, each a ring **reduce-scatter** (every holder keeps its
slice of each bucket), then the optimizer step on the slices, then one ring **all-gather** of the
segment's updated parameters among its holders (:func:`step_ends`). A ring reduce-scatter and a ring
all-gather are the two halves of a ring all-reduce ((n − 1) steps of bytes/n chunks each, the
bandwidth taken at the same chunk size), so each costs :data:`ZERO_PHASE` of [C5]'s all-reduce of the
same bytes, latency terms included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence, TypeVar

import numpy as np

Num = TypeVar("Num", float, np.ndarray)

__all__ = ["ZERO_PHASE", "Bucket", "bucket_ranges", "bucket_ready_time", "bucket_schedule",
           "bucket_schedule_starts", "bucket_start_times", "exposed_sync_floor", "iteration_end", "step_ends"]

MIB = float(2**20)
"""``grad_bucket_mb`` is in MiB, as torch DDP's ``bucket_cap_mb``."""

ZERO_PHASE = 0.5
"""[C7o] A ring reduce-scatter (or all-gather) of x bytes among n: (n − 1)/n · x / B + (n − 1)·latency,
exactly half of the ring all-reduce 2(n − 1)/n · x / B + 2(n − 1)·latency ([C5], ``allreduce_time``)."""


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
    for bk, t0 in zip(buckets, bucket_start_times(buckets)):
        for h in bk.ready:
            free[h] = t0 + bk.duration_s
            first.setdefault(h, t0)
    return {h: max(free[h], backward_end[h]) for h in backward_end}, first


def bucket_start_times(buckets: Sequence[Bucket]) -> list[float]:
    """When each of ``buckets`` (in sync order) starts: once every holder has it ready and has finished
    its previous bucket (the one schedule of :func:`bucket_schedule`)."""
    free: dict[Hashable, float] = {}
    out = []
    for bk in buckets:
        t0 = max(max(bk.ready[h], free.get(h, -math.inf)) for h in bk.ready)
        for h in bk.ready:
            free[h] = t0 + bk.duration_s
        out.append(t0)
    return out


def step_ends(sync_end: Mapping[Hashable, float], optimizer_s: Mapping[Hashable, float],
              gathers: Sequence[tuple[float, Sequence[Hashable]]] = ()) -> dict[Hashable, float]:
    """[C7o] When each stage's step ends: its optimizer step right after its sync, then the ZeRO-1
    all-gathers ``gathers`` ((seconds, holders) per sharded segment, in the runner's order: ascending
    layers), each a collective that starts once every holder has stepped and finished its previous
    all-gather (:func:`bucket_schedule` with the optimizer's end as the ready time)."""
    stepped = {h: sync_end[h] + optimizer_s[h] for h in sync_end}
    if not gathers:
        return stepped
    return bucket_schedule([Bucket(layers=(0, 0), duration_s=d, ready={h: stepped[h] for h in hs}) for d, hs in gathers],
                           stepped)


def iteration_end(sync_end: Mapping[Hashable, float], optimizer_s: Mapping[Hashable, float],
                  gathers: Sequence[tuple[float, Sequence[Hashable]]] = ()) -> float:
    """[C7o] The last step's end: max over stages of :func:`step_ends` (sync end + optimizer seconds,
    then the ZeRO-1 all-gathers)."""
    return max(step_ends(sync_end, optimizer_s, gathers).values())


def exposed_sync_floor(sync_s: Num, backward_s: Num, last_bucket_s: Num, *, one_bucket: bool = False,
                       overlap: bool = True, zero: bool = False) -> Num:
    """[C7o] A lower bound of how long a stage's gradient sync runs past the end of its last backward
    (``bucket_schedule``'s end minus ``backward_end``; for ZeRO-1 plus the all-gather after the
    optimizer step, :func:`step_ends`), for the bounds of the search.

    ``sync_s``: at most the sum of the stage's bucket all-reduce durations (e.g. its [C5] time in one
    piece, when splitting it into buckets can only add latency terms); ``last_bucket_s``: at most the
    all-reduce duration of its last bucket (the one holding its first layer, ready only when the
    backward ends); ``backward_s``: at least the stage's backward of one microbatch (the earliest
    bucket is ready no earlier than its start). One bucket or overlap off: the whole sync runs after
    the backward, ``sync_s`` (for ZeRO-1 reduce-scatter + all-gather, the same). Otherwise
    max(last bucket, sync − backward). ``zero``: the stage asks for ZeRO-1 — its segments are reduce-
    scattered (each bucket :data:`ZERO_PHASE` of its all-reduce) and all-gathered after the optimizer
    step (ZERO_PHASE of ``sync_s``) when every holder asks too, else all-reduced: the smaller of the two
    floors. Elementwise."""
    if one_bucket or not overlap:
        return sync_s
    plain = np.maximum(last_bucket_s, sync_s - backward_s)
    if not zero:
        return plain  # type: ignore[return-value]
    h = ZERO_PHASE
    sharded = np.maximum(h * last_bucket_s, h * sync_s - backward_s) + h * sync_s
    return np.minimum(plain, sharded)  # type: ignore[return-value]
