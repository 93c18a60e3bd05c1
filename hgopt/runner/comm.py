"""Point-to-point transfers between stages: non-blocking sends and receives with tags, a count of the
bytes actually handed to ``send`` per boundary, and emulated cross-cluster delivery delays.

Emulation: a cross-cluster transfer carries a small header with the time at which the data would
arrive over the emulated link; the receiver, once the bytes are in, waits until then. In ``delay`` mode
that time is ``max(now, link free) + bytes / bandwidth + latency`` (the sender's own queue onto the
link is modelled); in ``netns`` mode the kernel shapes the bandwidth, so only the latency is added. All
ranks of an emulation share one machine, hence one clock."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner.codec import WireSpec

__all__ = ["Pending", "Wire", "tag"]

_SLOTS = 4  # wire tensors per transfer (at most 2) + the emulation header


def tag(microbatch: int, direction: str, slot: int) -> int:
    return (microbatch * 2 + (direction == "bwd")) * _SLOTS + slot


@dataclass(kw_only=True, slots=True)
class Pending:
    """Posted receives of one transfer."""

    works: list[dist.Work]
    buffers: list[torch.Tensor]
    header: torch.Tensor | None = None

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        if self.header is not None:
            delay = float(self.header[0]) - time.time()
            if delay > 0:
                time.sleep(delay)
        return self.buffers


@dataclass(kw_only=True, slots=True)
class Wire:
    plan: RunnerPlan
    cluster_of: dict[int, str]
    mode: str = "off"
    """``off``, ``delay`` or ``netns`` (already resolved)."""
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes handed to send, per ``p<i>.b<k>.<fwd|bwd>`` (and ``….wan`` for the cross-cluster part)."""
    _works: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    _link_free: dict[str, float] = field(default_factory=dict)

    def _emulated(self, me: int, peer: int) -> bool:
        return self.mode != "off" and self.cluster_of[me] != self.cluster_of[peer]

    def send(self, tensors: list[torch.Tensor], me: int, dst: int, microbatch: int, direction: str, key: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.sent[f"{key}.{direction}"] += nbytes
        if self.cluster_of[me] != self.cluster_of[dst]:
            self.sent[f"{key}.{direction}.wan"] += nbytes
        for slot, t in enumerate(tensors):
            self._works.append((dist.isend(t, dst, tag=tag(microbatch, direction, slot)), t))
        if self._emulated(me, dst):
            header = torch.tensor([self._arrival(me, dst, nbytes)], dtype=torch.float64)
            self._works.append((dist.isend(header, dst, tag=tag(microbatch, direction, _SLOTS - 1)), header))

    def _arrival(self, me: int, dst: int, nbytes: int) -> float:
        link = self.plan.link(self.cluster_of[me], self.cluster_of[dst])
        assert link is not None, "the export lists every pair of used clusters"
        now = time.time()
        if self.mode == "netns":
            return now + link.latency_s
        done = max(now, self._link_free.get(self.cluster_of[dst], 0.0)) + nbytes / link.bytes_per_s
        self._link_free[self.cluster_of[dst]] = done
        return done + link.latency_s

    def recv(self, specs: list[WireSpec], me: int, src: int, microbatch: int, direction: str) -> Pending:
        bufs = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
        works = [dist.irecv(b, src, tag=tag(microbatch, direction, slot)) for slot, b in enumerate(bufs)]
        header = None
        if self._emulated(me, src):
            header = torch.empty(1, dtype=torch.float64)
            works.append(dist.irecv(header, src, tag=tag(microbatch, direction, _SLOTS - 1)))
        return Pending(works=works, buffers=bufs, header=header)

    def wait_sends(self) -> None:
        for w, _ in self._works:
            w.wait()
        self._works.clear()
