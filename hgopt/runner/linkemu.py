"""``delay``-mode link emulation of the link model [C1]/[C4]/[C4w] (issue #10 item 2): per-node NICs,
per-flow node pairs and an aggregate cap per cluster pair, as :mod:`hgopt.simulate.resources` lays
them out and shares them. Pure Python, no torch: the runner's :class:`~hgopt.runner.comm.Wire` registers
each message here and its receiver asks when it arrives; tests check the delivery times the model
computes (not elapsed time).

A point-to-point message of ``B`` bytes from rank ``r`` (node ``u``, cluster ``a``) to rank ``s``
(node ``v``, cluster ``b``), handed to ``send`` at ``now``, passes through *hops*, each a rate
(bytes/s):

- ``nic-out:u`` and ``nic-in:v`` at the cluster's ``inter_node`` rate (every rank of a node shares its
  NIC, one per direction) when ``u != v`` and the plan carries the NICs (``RunnerPlan.nics``);
- between clusters, ``link`` kind ``per_flow``: ``pair:u->v`` at the per-flow rate (one flow per node
  pair), plus ``agg:a->b`` at the aggregate cap when the link has one (shared by every flow a -> b);
  kind ``shared_pipe``: ``agg:a->b`` at the link's rate (one pipe for the whole direction).

Sharing is the simulator's (processor sharing): the messages in flight on a hop share it equally, and a
message moves at the smallest of its hops' shares (``rate / messages on the hop``), recomputed whenever
a message starts or ends; it arrives one latency (its path's largest) after its last byte. Messages
between one pair of ranks in one direction leave one after another (channel ``chan:r->s``, one
connection per pair, as the simulator's channels): a message is in flight from the end of the one
before it on its channel. n equal flows behind a cap thus move at ``min(per_flow, aggregate / n)``
each, ``min(n · per_flow, aggregate)`` together ([C4w]).

The state (messages in flight, bytes left, the time it was advanced to) is shared by every rank of the
run (one machine, one clock): a :class:`FileLedger` in the run's output folder (``fcntl`` lock around a
read-modify-write of a small JSON document); tests use :class:`MemoryLedger`. Every access first
advances the fluid model to its own ``now`` (event by event, so completion times are exact whatever the
polling times); a caller whose ``now`` is older than the ledger's (it waited for the lock) is taken at
the ledger's time. A ledger left from an earlier run is removed by rank 0 before the run starts."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hgopt.export.runner_plan import RunnerPlan

__all__ = ["LEDGER_FILE", "FileLedger", "Hop", "Ledger", "LinkEmulator", "MemoryLedger", "Route", "advance",
           "deliveries", "poll", "send", "wait_arrival"]

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


LedgerState = MutableMapping[str, Any]
"""``t``: time advanced to; ``msgs``: id -> message; ``chans``: channel -> ids in order; ``next``: next id;
``carried``: bytes every hop and channel has been given over the run (what the run put on each link)."""
_EPS = 1e-9


def _active(state: LedgerState) -> list[str]:
    """Messages in flight: the first unfinished one of each channel."""
    out = []
    for ids in state.get("chans", {}).values():
        if ids:
            out.append(ids[0])
    return out


def _rates(state: LedgerState, active: list[str]) -> dict[str, float]:
    msgs = state["msgs"]
    load: dict[str, int] = {}
    for i in active:
        for name, _ in msgs[i]["hops"]:
            load[name] = load.get(name, 0) + 1
    return {i: min(rate / load[name] for name, rate in msgs[i]["hops"]) for i in active}


def advance(state: LedgerState, now: float) -> float:
    """Move the fluid model to ``now`` (or stay at the ledger's time, if later), finishing messages on
    the way, each at its exact time; returns the time advanced to."""
    msgs, chans = state.setdefault("msgs", {}), state.setdefault("chans", {})
    t = float(state.get("t", now))
    while True:
        active = _active(state)
        if not active:
            break
        rates = _rates(state, active)
        dt = min(msgs[i]["left"] / rates[i] for i in active)
        if t + dt > now:  # nothing more finishes by now
            if now > t:
                for i in active:
                    msgs[i]["left"] -= rates[i] * (now - t)
                t = now
            break
        t += dt
        for i in active:
            msgs[i]["left"] -= rates[i] * dt
            if msgs[i]["left"] <= _EPS * max(1.0, msgs[i]["bytes"]):
                msgs[i]["left"] = 0.0
                msgs[i]["done"] = t
                chans[msgs[i]["chan"]].pop(0)
                if not chans[msgs[i]["chan"]]:
                    del chans[msgs[i]["chan"]]
    state["t"] = max(t, now)
    return float(state["t"])


def send(state: LedgerState, route: Route, nbytes: float, now: float) -> int:
    """Register a message of ``nbytes`` handed to send at ``now``; its id."""
    t = advance(state, now)
    i = int(state.get("next", 0))
    state["next"] = i + 1
    msg = {"hops": [[h.name, h.bytes_per_s] for h in route.hops], "bytes": float(nbytes), "left": float(nbytes),
           "chan": route.channel, "lat": route.latency_s, "done": None}
    state["msgs"][str(i)] = msg
    carried = state.setdefault("carried", {})
    for name in (route.channel, *(h.name for h in route.hops)):
        carried[name] = carried.get(name, 0.0) + float(nbytes)
    if nbytes <= 0 and not state["chans"].get(route.channel):
        msg["done"] = t
    else:
        state["chans"].setdefault(route.channel, []).append(str(i))
        if nbytes <= 0:
            msg["left"] = 0.0
    return i


def poll(state: LedgerState, msg_id: int, now: float) -> tuple[float | None, float]:
    """(arrival time, or None while the message is in flight or queued; seconds until the ledger's next
    event at the present shares: the first time any message in flight ends). Before that event no
    share grows (a new message only shrinks them), so nothing can end sooner: a waiter that sleeps
    that long wakes no later than its message ends. An arrived message is forgotten."""
    advance(state, now)
    key = str(msg_id)
    msg = state["msgs"][key]
    if msg["done"] is not None:
        del state["msgs"][key]
        return float(msg["done"]) + float(msg["lat"]), 0.0
    active = _active(state)
    rates = _rates(state, active)
    return None, min(state["msgs"][i]["left"] / rates[i] for i in active)


def wait_arrival(ledger: "Ledger", msg_id: int, clock: Callable[[], float], sleep: Callable[[float], None],
                 poll_s: float = 0.05) -> float:
    """Block until message ``msg_id`` has arrived, looking at the ledger at its next event (at most
    every ``poll_s``); its arrival time (the caller sleeps until then)."""
    while True:
        with ledger.open() as state:
            arrival, nxt = poll(state, msg_id, clock())
        if arrival is not None:
            return arrival
        sleep(min(max(nxt, 1e-4), poll_s))


def deliveries(routes: list[tuple[Route, float, float]]) -> list[float]:
    """Arrival times of messages (route, bytes, send time), sent in that order, under the model (for
    tests and small checks)."""
    state: dict[str, Any] = {}
    ids = [send(state, r, b, t) for r, b, t in routes]
    advance(state, max(t for _, _, t in routes) + 1e12)
    return [float(state["msgs"][str(i)]["done"]) + float(state["msgs"][str(i)]["lat"]) for i in ids]


class Ledger(Protocol):
    def open(self) -> AbstractContextManager[LedgerState]:
        """Exclusive access to the shared free times."""


@dataclass(kw_only=True, slots=True)
class MemoryLedger:
    """One process's free times (tests)."""

    state: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def open(self) -> Iterator[LedgerState]:
        yield self.state


@dataclass(frozen=True, kw_only=True, slots=True)
class FileLedger:
    """Free times shared by the processes of one machine: a JSON map in ``path``, read and written under
    an exclusive ``flock``."""

    path: Path

    @contextmanager
    def open(self) -> Iterator[LedgerState]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                f.seek(0)
                raw = f.read()
                state: dict[str, Any] = json.loads(raw) if raw else {}
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
