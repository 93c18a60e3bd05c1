"""[C5w] / [C7c] Capped link directions shared over time by gradient rings and pipeline messages.

A link direction with an aggregate cap is shared by processor sharing among the flows that are on it
at each moment (links.py, [C4w]): each of n concurrent flows moves at most at the cap's rate / n (the
rate read at the sum of the flows' message sizes, as the simulator reads it) and at most at its own
rate alone (``CapFlow.limit``). :class:`FluidLinks` runs that fluid model event by event (a flow's
share changes only when a flow starts or ends), and :func:`shared_bucket_schedule` uses it for a plan's
gradient buckets ([C7o]) and the last microbatch's backward messages ([C7c]): only the rings and
messages that are on a capped direction at the same time share it ([C5w]), not every ring of the
iteration. Pure functions over plain numbers; ``evaluate._contended_sync`` feeds them a plan.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

from hgopt.cost.gradsync import Bucket
from hgopt.cost.schedule import Op
from hgopt.cost.tables import bandwidth_bytes_per_s
from hgopt.spec import Bandwidth

__all__ = ["BoundaryMessage", "CapFlow", "FluidLinks", "RingPhase", "earlier_backward_starts", "shared_bucket_schedule"]

_TOL = 1e-12


@dataclass(frozen=True, kw_only=True, slots=True)
class CapFlow:
    """``flows`` equal flows of ``nbytes`` each over the capped directions ``dirs``."""

    nbytes: float
    limit: float
    """Bytes/s each flow reaches alone (its per-flow rate; inf: only the caps limit it)."""
    dirs: tuple[Hashable, ...]
    flows: int = 1
    size: float = -1.0
    """Message size each flow counts in a cap's sum of sizes (default ``nbytes``)."""

    @property
    def message(self) -> float:
        return self.nbytes if self.size < 0 else self.size


class FluidLinks:
    """Processor sharing of capped directions over time (module docstring). ``at(t, fn)`` calls
    ``fn()`` at time t; ``start(flow, done)`` puts a flow on its directions now and calls
    ``done(t)`` when its last byte is through; ``run()`` until nothing is left."""

    def __init__(self, caps: Mapping[Hashable, Bandwidth]) -> None:
        self.caps = caps
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._active: dict[int, list[object]] = {}  # id -> [remaining bytes, flow, done]

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def start(self, flow: CapFlow, done: Callable[[float], None]) -> None:
        if flow.nbytes <= 0:
            self.at(self.now, lambda: done(self.now))
            return
        self._active[next(self._seq)] = [flow.nbytes, flow, done]

    def _rates(self) -> dict[int, float]:
        count: dict[Hashable, int] = {}
        total: dict[Hashable, float] = {}
        for _, f, _ in self._active.values():
            for d in f.dirs:  # type: ignore[attr-defined]
                count[d] = count.get(d, 0) + f.flows  # type: ignore[attr-defined]
                total[d] = total.get(d, 0.0) + f.flows * f.message  # type: ignore[attr-defined]
        share = {d: bandwidth_bytes_per_s(self.caps[d], total[d]) / n for d, n in count.items()}
        return {i: min([f.limit] + [share[d] for d in f.dirs])  # type: ignore[attr-defined]
                for i, (_, f, _) in self._active.items()}

    def run(self) -> None:
        while self._heap or self._active:
            rates = self._rates() if self._active else {}
            finish = {i: self.now + v[0] / rates[i] for i, v in self._active.items()}  # type: ignore[operator]
            t_c = min(finish.values(), default=math.inf)
            t_e = self._heap[0][0] if self._heap else math.inf
            t = min(t_c, t_e)
            for i, v in self._active.items():
                v[0] = max(v[0] - rates[i] * (t - self.now), 0.0)  # type: ignore[operator]
            self.now = t
            if t_c <= t_e:
                done = [i for i, ft in finish.items() if ft - t_c <= _TOL * max(1.0, abs(t_c))]
                for i in done:
                    _, _, cb = self._active.pop(i)
                    cb(t)  # type: ignore[operator]
            else:
                _, _, fn = heapq.heappop(self._heap)
                fn()


@dataclass(frozen=True, kw_only=True, slots=True)
class RingPhase:
    """A gradient bucket's collective: ``intra_s`` of rings inside the clusters, then its cross-cluster
    ring, ``inter_s`` alone; ``flow``: that ring on the capped directions it crosses, followed by
    ``tail_s`` off them (its latency; None: it shares none and takes ``inter_s``)."""

    intra_s: float
    inter_s: float
    flow: CapFlow | None = None
    tail_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundaryMessage:
    """The last microbatch's backward message over one pipeline boundary: sent by stage ``sender``
    when its last backward ends (``start_s`` uncontended, later by the sender's own delay), received
    by stage ``receiver``, whose last backward (and its buckets' ready times) moves by the sender's
    delay plus how much later the message is through than without rings (the latest of its
    ``parts``, one per capped direction it crosses). ``earlier``: the earlier microbatches' backward
    messages over the boundary that may still be on the link then, (uncontended start, parts) in
    time order; each leaves after the one before it (one connection per rank pair, as the runner
    and the simulator send them), the last message after them all; they move nothing else."""

    start_s: float
    sender: Hashable
    receiver: Hashable
    parts: tuple[CapFlow, ...] = ()
    earlier: tuple[tuple[float, tuple[CapFlow, ...]], ...] = ()
    slack_s: float = 0.0
    """How much later than the message arrives alone the receiver's last backward starts anyway (it
    moves only by what goes beyond: max(0, sender's delay + the message's − slack))."""


class _Boundary:
    """One boundary's messages on ``links``: the earlier ones from their starts (they do not move with
    the sender's delay: it moves only its last backward), each after the one before it is through;
    the last one from its start + the sender's delay (``release``) and after them; ``done`` gets the
    end of each of its parts."""

    def __init__(self, links: FluidLinks, msg: BoundaryMessage, done: Callable[[list[float]], None]) -> None:
        self.links, self.msg, self.done = links, msg, done
        self.free: float | None = None if msg.earlier else -math.inf  # when the earlier ones are through
        self.shift: float | None = None
        if msg.earlier:
            links.at(msg.earlier[0][0], lambda: self._go(0))

    def release(self, shift: float) -> None:
        self.shift = shift
        self._last()

    def _last(self) -> None:
        if self.free is None or self.shift is None:
            return
        self.links.at(max(self.msg.start_s + self.shift, self.free), lambda: self._put(self.msg.parts, self.done))

    def _go(self, q: int) -> None:
        def through(_: list[float]) -> None:
            if q + 1 < len(self.msg.earlier):
                self.links.at(max(self.msg.earlier[q + 1][0], self.links.now), lambda: self._go(q + 1))
            else:
                self.free = self.links.now
                self._last()
        self._put(self.msg.earlier[q][1], through)

    def _put(self, parts: tuple[CapFlow, ...], done: Callable[[list[float]], None]) -> None:
        ends = [self.links.now] * len(parts)
        left = [len(parts)]
        if not parts:
            done(ends)
            return

        def part_done(pj: int, t: float) -> None:
            ends[pj] = t
            left[0] -= 1
            if left[0] == 0:
                done(ends)

        for pj, part in enumerate(parts):
            self.links.start(part, lambda t, pj=pj: part_done(pj, t))  # type: ignore[misc]


def shared_bucket_schedule(
    buckets: Sequence[Bucket], phases: Sequence[RingPhase], backward_end: Mapping[Hashable, float],
    caps: Mapping[Hashable, Bandwidth], messages: Sequence[BoundaryMessage] = (),
) -> tuple[dict[Hashable, float], dict[Hashable, float], dict[Hashable, float]]:
    """[C7o] with [C5w] / [C7c]: the bucket schedule of ``gradsync.bucket_start_times`` (a bucket starts
    once every holder has it ready and is done with its previous one; ``buckets`` in sync order), each
    bucket's cross-cluster ring a flow on the capped directions it crosses, sharing them with the
    rings and ``messages`` on them at the same time (:class:`FluidLinks`). A message's delay (how
    much later it is through than with the messages alone) moves its receiver's last backward and
    buckets, and, added up, the stages before it (messages in any order; a stage that receives no
    message moves only with its sender). Only ever later than the schedule without sharing.

    Returns (each holder's last backward end, its last bucket's end (at least that), its first
    bucket's start (holders with buckets only))."""
    base_end: dict[int, list[float]] = {}  # per message, its parts' ends with the messages alone
    if messages:
        base = FluidLinks(caps)
        for mi, msg in enumerate(messages):
            if msg.parts:
                _Boundary(base, msg, lambda ends, mi=mi: base_end.__setitem__(mi, ends)).release(0.0)  # type: ignore[misc]
        base.run()

    links = FluidLinks(caps)
    shift: dict[Hashable, float] = {}
    receivers = {m.receiver for m in messages}
    by_sender: dict[Hashable, list[int]] = {}
    for mi, m in enumerate(messages):
        by_sender.setdefault(m.sender, []).append(mi)
    mine: dict[Hashable, list[int]] = {h: [] for h in backward_end}
    for i, bk in enumerate(buckets):
        for h in bk.ready:
            mine[h].append(i)
    pos = {h: 0 for h in mine}
    busy = {h: False for h in mine}
    pending = [len(bk.ready) for bk in buckets]
    last_end: dict[Hashable, float] = {}
    first: dict[Hashable, float] = {}

    def try_holder(h: Hashable) -> None:
        if h not in shift or busy[h] or pos[h] >= len(mine[h]):
            return
        i = mine[h][pos[h]]
        busy[h] = True
        links.at(buckets[i].ready[h] + shift[h], lambda: arrive(i))

    def arrive(i: int) -> None:
        pending[i] -= 1
        if pending[i] == 0:
            for h in buckets[i].ready:
                first.setdefault(h, links.now)
            links.at(links.now + phases[i].intra_s, lambda: wan(i))

    def wan(i: int) -> None:
        ph = phases[i]
        if ph.flow is None or ph.inter_s <= 0:
            links.at(links.now + max(ph.inter_s, 0.0), lambda: end(i, links.now))
        else:
            links.start(ph.flow, lambda t: links.at(t + ph.tail_s, lambda: end(i, links.now)))

    def end(i: int, t: float) -> None:
        for h in buckets[i].ready:
            busy[h] = False
            pos[h] += 1
            last_end[h] = t
            try_holder(h)

    def known(h: Hashable, s: float) -> None:
        shift[h] = s
        try_holder(h)
        for mi in by_sender.get(h, []):
            send(mi, s)

    def through(mi: int, ends: list[float]) -> None:
        msg, s = messages[mi], shift[messages[mi].sender]
        late = max(e - b - s for e, b in zip(ends, base_end[mi]))
        known(msg.receiver, max(0.0, s + max(late, 0.0) - msg.slack_s))

    boundaries = {mi: _Boundary(links, m, lambda ends, mi=mi: through(mi, ends))  # type: ignore[misc]
                  for mi, m in enumerate(messages) if m.parts}

    def send(mi: int, s: float) -> None:
        if mi in boundaries:
            boundaries[mi].release(s)
        else:
            known(messages[mi].receiver, s)

    for h in backward_end:
        if h not in receivers:
            links.at(0.0, lambda h=h: known(h, 0.0))  # type: ignore[misc]
    links.run()
    ends = {h: e + shift.get(h, 0.0) for h, e in backward_end.items()}
    sync_end = {h: max(last_end.get(h, -math.inf), ends[h]) for h in backward_end}
    return ends, sync_end, first


def earlier_backward_starts(ops: Sequence[Op], last_end: float, fwd_s: float, bwd_s: float,
                            message_s: float, after: float) -> list[float]:
    """[C7c] When a stage's backward messages before its last one leave: each when its backward ends,
    its operations ``ops`` (the runner's order, ``schedule.stage_ops``; the last one its last
    backward) taken back to back up to that backward's end ``last_end`` (the latest they can end: a
    wait between them only moves them earlier), and through (``message_s`` alone) before the next one
    leaves, as the uncontended schedule has the last one leave at ``last_end``; those that leave at
    ``after`` or later, in time order."""
    out = []
    t = last_end - bwd_s
    nxt = last_end
    for op in reversed(ops[:-1]):
        if op.kind == "B":
            start = min(t, nxt - message_s)
            if start < after:
                break
            out.append(start)
            nxt = start
        t -= bwd_s if op.kind == "B" else fwd_s
    return out[::-1]
