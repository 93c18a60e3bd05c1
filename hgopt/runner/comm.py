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

Emulation: an emulated transfer carries a small header with the time at which the data would
arrive over the emulated link; the receiver, once the bytes are in, waits until then. In ``delay`` mode
the header is the message's id in :mod:`hgopt.runner.linkemu`'s ledger, which every rank of the run
shares (the link model: per-node NICs shared by a node's ranks, a per-flow hop per node pair, an
aggregate cap or a shared pipe per direction, processor sharing as in the simulator), and the
receiver waits until the ledger says the message has arrived; every transfer between two nodes is
emulated, inside a cluster too when the plan carries the NICs. In ``netns`` mode the kernel shapes the bandwidth of
cross-cluster transfers, so only the latency is added. All ranks of an emulation share one machine,
hence one clock."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner.codec import WireSpec
from hgopt.runner.linkemu import Ledger, LinkEmulator, MemoryLedger, send, wait_arrival

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
    ledger: Ledger | None = None
    """``delay`` mode: the header is the message's id in this ledger (else its arrival time)."""

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        if self.header is not None:
            arrival = float(self.header[0])
            if self.ledger is not None:
                arrival = wait_arrival(self.ledger, int(arrival), time.time, time.sleep)
            delay = arrival - time.time()
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
    ledger: Ledger = field(default_factory=MemoryLedger)
    """``delay`` mode: the hops' free times, shared by every rank of the run (a FileLedger)."""
    _works: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    _emu: LinkEmulator | None = None

    def __post_init__(self) -> None:
        if self.mode == "delay":
            self._emu = LinkEmulator(self.plan)

    @property
    def emulator(self) -> LinkEmulator | None:
        """``delay`` mode: the plan's link routes (None in the other modes)."""
        return self._emu

    def _group(self, direction: str) -> Any:
        return self.backward_group if direction == "bwd" else None

    def _emulated(self, me: int, peer: int) -> bool:
        if self._emu is not None:
            return self._emu.route(me, peer) is not None
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
        if self._emu is not None:
            route = self._emu.route(me, dst)
            assert route is not None
            with self.ledger.open() as state:
                return float(send(state, route, nbytes, time.time()))  # the message's id
        link = self.plan.link(self.cluster_of[me], self.cluster_of[dst])
        assert link is not None, "the export lists every pair of used clusters"
        return time.time() + link.latency_s

    def recv(self, specs: list[WireSpec], me: int, src: int, microbatch: int, direction: str) -> Pending:
        group = self._group(direction)
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in specs]
        works = [dist.irecv(b, src, group=group, tag=tag(microbatch, direction, slot)) for slot, b in enumerate(bufs)]
        header = None
        if self._emulated(me, src):
            header = torch.empty(1, dtype=torch.float64, device=self.device)
            works.append(dist.irecv(header, src, group=group, tag=tag(microbatch, direction, _SLOTS - 1)))
        return Pending(works=works, buffers=bufs, header=header, ledger=self.ledger if self._emu is not None else None)

    def wait_sends(self) -> None:
        for w, _ in self._works:
            w.wait()
        self._works.clear()
