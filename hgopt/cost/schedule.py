"""Pipeline schedules as plain op lists: what one stage does, in order, during one step (the order the
runner executes, the simulator replays and the kernel's exact timelines [C3x]/[C3n] follow)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Op", "stage_ops"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    kind: Literal["F", "B"]
    microbatch: int


def stage_ops(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> tuple[Op, ...]:
    """``1f1b``: ``num_stages - stage - 1`` warm-up forwards, then alternate one forward and one
    backward, then the remaining backwards. ``gpipe``: every forward, then every backward."""
    m = num_microbatches
    if schedule == "gpipe":
        return tuple(Op(kind="F", microbatch=i) for i in range(m)) + tuple(Op(kind="B", microbatch=i) for i in range(m))
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r} (use 1f1b or gpipe)")
    warm = min(num_stages - stage - 1, m)
    ops = [Op(kind="F", microbatch=i) for i in range(warm)]
    for i in range(m - warm):
        ops += [Op(kind="F", microbatch=warm + i), Op(kind="B", microbatch=i)]
    ops += [Op(kind="B", microbatch=i) for i in range(m - warm, m)]
    return tuple(ops)
