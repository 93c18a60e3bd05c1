"""Point-to-point transfers between stages: non-blocking sends and receives, a count of the bytes
actually handed to ``send`` per boundary, and emulated cross-cluster delivery delays.

Matching does not rely on tags (nccl ignores them; gloo gets them anyway). Two ranks that exchange
boundary tensors are leaders of consecutive stages of one pipeline, so between them activations flow
one way and gradients the other. Activations travel on the default process group and gradients on a
second one (``backward``), so on each (group, pair of ranks) there is one sender and one receiver. The
sender issues its messages in microbatch order (its forwards, or its backwards, run in microbatch
order in 1F1B and GPipe), and the receiver posts its receives in the same order (the same schedule);
every message is the same list of tensors (payload, fp8 scale, emulation header) on both sides. So the
i-th send on a (group, pair) is the i-th receive, which is the in-order matching nccl provides. Keeping
the directions on separate groups also keeps nccl from queueing a posted gradient receive in front
of an activation send on the one stream of a pair (the lookahead receives would deadlock there).

Emulation: a cross-cluster transfer carries a small header with the time at which the data would
arrive over the emulated link; the receiver, once the bytes are in, waits until then. In ``delay`` mode
that time is ``max(now, link free) + bytes / bandwidth + latency`` (the sender's own queue onto the
link is modelled); in ``netns`` mode the kernel shapes the bandwidth, so only the latency is added. All
ranks of an emulation share one machine, hence one clock."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

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
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Receive buffers and emulation headers are allocated here."""
    backward_group: Any = None
    """Process group of gradient (``bwd``) transfers; None: the default group (tests of one direction)."""
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes handed to send, per ``p<i>.b<k>.<fwd|bwd>`` (and ``….wan`` for the cross-cluster part)."""
    _works: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    _link_free: dict[str, float] = field(default_factory=dict)

    def _group(self, direction: str) -> Any:
        return self.backward_group if direction == "bwd" else None

    def _emulated(self, me: int, peer: int) -> bool:
        return self.mode != "off" and self.cluster_of[me] != self.cluster_of[peer]

    def send(self, tensors: list[torch.Tensor], me: int, dst: int, microbatch: int, direction: str, key: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.sent[f"{key}.{direction}"] += nbytes
        if self.cluster_of[me] != self.cluster_of[dst]:
            self.sent[f"{key}.{direction}.wan"] += nbytes
        group = self._group(direction)
        for slot, t in enumerate(tensors):
            self._works.append((dist.isend(t, dst, group=group, tag=tag(microbatch, direction, slot)), t))
        if self._emulated(me, dst):
            header = torch.tensor([self._arrival(me, dst, nbytes)], dtype=torch.float64, device=self.device)
            self._works.append((dist.isend(header, dst, group=group, tag=tag(microbatch, direction, _SLOTS - 1)), header))

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
        group = self._group(direction)
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        works = [dist.irecv(b, src, group=group, tag=tag(microbatch, direction, slot)) for slot, b in enumerate(bufs)]
        header = None
        if self._emulated(me, src):
            header = torch.empty(1, dtype=torch.float64, device=self.device)
            works.append(dist.irecv(header, src, group=group, tag=tag(microbatch, direction, _SLOTS - 1)))
        return Pending(works=works, buffers=bufs, header=header)

    def wait_sends(self) -> None:
        for w, _ in self._works:
            w.wait()
        self._works.clear()
