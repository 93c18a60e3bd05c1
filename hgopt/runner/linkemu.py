"""``delay``-mode link emulation of the link model [C1]/[C4]/[C4w] (issue #10 item 2): per-node NICs,
per-flow node pairs and an aggregate cap per cluster pair, as :mod:`hgopt.simulate.resources` lays
them out. Pure Python, no torch: the runner's :class:`~hgopt.runner.comm.Wire` asks it when a message
would arrive, and tests check the delivery times it schedules (not elapsed time).

A point-to-point message of ``B`` bytes from rank ``r`` (node ``u``, cluster ``a``) to rank ``s``
(node ``v``, cluster ``b``), handed to ``send`` at ``now``, passes through *hops*, each a FIFO queue
with a rate (bytes/s) and the time it is next free:

- ``nic-out:u`` and ``nic-in:v`` at the cluster's ``inter_node`` rate (every rank of a node shares its
  NIC, one queue per direction) when ``u != v`` and the plan carries the NICs (``RunnerPlan.nics``);
- between clusters, ``link`` kind ``per_flow``: ``pair:u->v`` at the per-flow rate (one flow per node
  pair), plus ``agg:a->b`` at the aggregate cap when the link has one (shared by every flow a -> b);
  kind ``shared_pipe``: ``agg:a->b`` at the link's rate (one pipe for the whole direction).

Messages between one pair of ranks in one direction leave one after another (``chan:r->s``, one
connection per pair, as the simulator's channels). The message starts at ``t0 = max(now, chan free)``;
on each hop it ends at ``max(t0, hop free) + B / rate`` (and the hop is busy until then); it arrives one
latency after the last of those ends (the path's largest latency, as in the simulator). With ``n``
flows of one direction in flight together the aggregate hop serves them one after another at its cap,
so the last of them ends at ``n·B / aggregate`` whenever the cap binds and at ``B / per_flow``
otherwise: the makespan of ``min(n · per_flow, aggregate)`` sharing ([C4w]). Individual flows finish
in FIFO order rather than together (processor sharing): the same total, different order.

The hops' free times are shared by every rank of the run (one machine, one clock): a
:class:`FileLedger` in the run's output folder (``fcntl`` lock around a read-modify-write of a small
JSON map); tests use :class:`MemoryLedger`. A ledger left from an earlier run holds times in the past,
which change nothing."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hgopt.export.runner_plan import RunnerPlan

__all__ = ["LEDGER_FILE", "FileLedger", "Hop", "Ledger", "LinkEmulator", "MemoryLedger", "Route", "book", "reserve"]

LEDGER_FILE = "link-ledger.json"
"""The run's shared ledger, in its output folder."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hop:
    name: str
    bytes_per_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Route:
    """What one message from one rank to another passes through."""

    channel: str
    hops: tuple[Hop, ...]
    latency_s: float


def reserve(state: MutableMapping[str, float], route: Route, nbytes: float, now: float) -> float:
    """Book ``nbytes`` sent at ``now`` on every hop of ``route`` (updates ``state``: name -> time the
    hop or channel is next free); returns the arrival time (see the module docstring)."""
    start = max(now, state.get(route.channel, 0.0))
    done = start
    for h in route.hops:
        end = max(start, state.get(h.name, 0.0)) + nbytes / h.bytes_per_s
        state[h.name] = end
        done = max(done, end)
    state[route.channel] = done
    return done + route.latency_s


def book(state: MutableMapping[str, float], hop: Hop, nbytes: float, start: float) -> float:
    """``nbytes`` on ``hop`` from ``start`` on (after what is queued there): the time it ends."""
    end = max(start, state.get(hop.name, 0.0)) + nbytes / hop.bytes_per_s
    state[hop.name] = end
    return end


class Ledger(Protocol):
    def open(self) -> AbstractContextManager[MutableMapping[str, float]]:
        """Exclusive access to the shared free times."""


@dataclass(kw_only=True, slots=True)
class MemoryLedger:
    """One process's free times (tests)."""

    state: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def open(self) -> Iterator[MutableMapping[str, float]]:
        yield self.state


@dataclass(frozen=True, kw_only=True, slots=True)
class FileLedger:
    """Free times shared by the processes of one machine: a JSON map in ``path``, read and written under
    an exclusive ``flock``."""

    path: Path

    @contextmanager
    def open(self) -> Iterator[MutableMapping[str, float]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                raw = f.read()
                state: dict[str, float] = json.loads(raw) if raw else {}
                yield state
                f.seek(0)
                f.truncate()
                f.write(json.dumps(state).encode())
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class LinkEmulator:
    """The routes of one runner plan (see the module docstring)."""

    def __init__(self, rp: RunnerPlan) -> None:
        self.rp = rp
        info = {r.rank: r for r in rp.ranks()}
        self.node_of = {r: i.node for r, i in info.items()}
        self.cluster_of = {r: i.cluster for r, i in info.items()}
        self.nics = {n.cluster: n for n in rp.nics}

    def route(self, src: int, dst: int) -> Route | None:
        """The hops of a message ``src -> dst``; None where nothing is emulated (same node; same
        cluster when the plan carries no NIC figures)."""
        u, v = self.node_of[src], self.node_of[dst]
        a, b = self.cluster_of[src], self.cluster_of[dst]
        if u == v:
            return None
        hops: list[Hop] = []
        latency = 0.0
        for cluster, name in ((a, f"nic-out:{u}"), (b, f"nic-in:{v}")):
            if (nic := self.nics.get(cluster)) is not None:
                hops.append(Hop(name=name, bytes_per_s=nic.bytes_per_s))
                latency = max(latency, nic.latency_s)
        if a != b:
            link = self.rp.link(a, b)
            assert link is not None, "the export lists every pair of used clusters"
            latency = max(latency, link.latency_s)
            if link.kind == "per_flow":
                hops.append(Hop(name=f"pair:{u}->{v}", bytes_per_s=link.bytes_per_s))
                if link.aggregate_bytes_per_s is not None:
                    hops.append(Hop(name=f"agg:{a}->{b}", bytes_per_s=link.aggregate_bytes_per_s))
            else:
                hops.append(Hop(name=f"agg:{a}->{b}", bytes_per_s=link.bytes_per_s))
        elif not hops:
            return None
        return Route(channel=f"chan:{src}->{dst}", hops=tuple(hops), latency_s=latency)

    def aggregate_hop(self, a: str, b: str) -> Hop | None:
        """The hop every flow ``a -> b`` shares (a per-flow link's cap, a shared pipe), or None."""
        link = self.rp.link(a, b)
        if link is None:
            return None
        if link.kind == "per_flow":
            if link.aggregate_bytes_per_s is None:
                return None
            return Hop(name=f"agg:{a}->{b}", bytes_per_s=link.aggregate_bytes_per_s)
        return Hop(name=f"agg:{a}->{b}", bytes_per_s=link.bytes_per_s)
