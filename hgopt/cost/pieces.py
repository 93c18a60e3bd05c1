"""[C3s] The exact timeline of one pipeline replica by replica: stages whose replicas span clusters.

[C3]/[C3x]/[C3n] reduce a stage to one forward and one backward time (its slowest replica group's) and a
boundary to one send time (its slowest piece: the largest node-pair flow, the fullest NIC, a capped
link's whole load). Where a stage's replicas sit in different clusters, the runner does not run that
way: every replica runs its stage's operations in the runner's order (``schedule.stage_ops``) with its
own group's times, a forward waits only for the row ranges of its own samples from the previous stage's
replicas that hold them, a backward only for its rows' gradients from the next stage's, and each piece
(one replica pair's rows) is a message of its own. The slow pieces of successive boundaries then need
not line up, and the pieces on a capped link do not all run at once.

:func:`replay_pieces` replays that, with the link model of [C1]/[C4]/[C4w] applied per message: a
message passes through resources (its sender's node NIC out, its receiver's node NIC in, the node
pair's per-flow bandwidth across clusters, the link direction's aggregate cap), each shared equally by
the messages on it at the same time (processor sharing; a resource's bandwidth is looked up at the
summed size of the messages on it, as ``links.flows_time`` prices a link's load); a message moves at
the smallest of its shares and arrives its delay (latency, (de)quantisation) after its last byte. The
messages between one pair of replicas in one direction leave one after another, in order (one
connection per pair). ``evaluate`` builds the inputs (``evaluate.piece_timeline``); the simulator
replays the same order independently, with gradient sync on the same links as well.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from hgopt.cost.tables import bandwidth_bytes_per_s
from hgopt.spec import Bandwidth

__all__ = ["Message", "Piece", "replay_pieces"]


@dataclass(frozen=True, slots=True)
class Message:
    """One piece's transfer in one direction: ``nbytes`` through ``resources`` ((key, bandwidth):
    messages with the same key share that bandwidth), arriving ``delay_s`` after its last byte."""

    nbytes: float
    resources: tuple[tuple[Hashable, Bandwidth], ...]
    delay_s: float


@dataclass(frozen=True, slots=True)
class Piece:
    """The rows replica ``src`` of stage ``boundary`` hands to replica ``dst`` of stage ``boundary + 1``:
    activations forward (``fwd``), their gradients back (``bwd``)."""

    boundary: int
    src: int
    dst: int
    fwd: Message
    bwd: Message


@dataclass(slots=True)
class _Flow:
    size: float
    rem: float
    keys: tuple[Hashable, ...]
    bws: tuple[Bandwidth, ...]
    done: tuple[str, int, int, int, int]
    """(kind, stage, replica, microbatch, channel id) of the message"""
    delay: float
    rate: float = 0.0
    t_last: float = 0.0
    version: int = 0


@dataclass(slots=True)
class _Share:
    flows: set[int] = field(default_factory=set)
    total: float = 0.0


def replay_pieces(
    orders: Sequence[Sequence[tuple[str, int]]],
    times: Sequence[Sequence[tuple[float, float]]],
    pieces: Sequence[Piece],
) -> list[list[float]]:
    """[C3s] When each replica of each stage ends its last operation. ``orders[s]``: stage s's
    operations ((kind "F"/"B", microbatch), the runner's order); ``times[s][r]``: replica r's forward
    and backward seconds; ``pieces``: every replica pair of every boundary whose rows overlap (module
    docstring). F(s, r, i) waits for every piece of boundary s − 1 into r, B(s, r, i) for every piece
    of boundary s out of r. Event driven, O(messages · concurrent messages)."""
    S = len(orders)
    ins: list[list[list[Piece]]] = [[[] for _ in times[s]] for s in range(S)]
    outs: list[list[list[Piece]]] = [[[] for _ in times[s]] for s in range(S)]
    for p in pieces:
        outs[p.boundary][p.src].append(p)
        ins[p.boundary + 1][p.dst].append(p)
    ptr = [[0] * len(times[s]) for s in range(S)]
    busy = [[False] * len(times[s]) for s in range(S)]
    clock = [[0.0] * len(times[s]) for s in range(S)]
    got: dict[tuple[str, int, int, int], int] = {}
    heap: list[tuple[float, int, int, tuple[object, ...]]] = []  # (time, seq, event kind, args)
    seq = itertools.count()
    flows: dict[int, _Flow] = {}
    shares: dict[Hashable, _Share] = {}
    channels: dict[int, list[tuple[Message, tuple[str, int, int, int, int]]]] = {}
    channel_of: dict[tuple[str, int, int, int], int] = {}
    fid = itertools.count()
    now = 0.0
    OP_END, FLOW_END, ARRIVE = 0, 1, 2

    def try_start(s: int, r: int) -> None:
        if busy[s][r] or ptr[s][r] >= len(orders[s]):
            return
        kind, i = orders[s][ptr[s][r]]
        need = len(ins[s][r]) if kind == "F" else len(outs[s][r])
        if got.get((kind, s, r, i), 0) < need:
            return
        busy[s][r] = True
        heapq.heappush(heap, (now + times[s][r][0 if kind == "F" else 1], next(seq), OP_END, (s, r)))

    def rate_of(f: _Flow) -> float:
        rate = math.inf
        for key, bw in zip(f.keys, f.bws):
            sh = shares[key]
            rate = min(rate, bandwidth_bytes_per_s(bw, sh.total) / len(sh.flows))
        return rate

    def schedule(k: int, f: _Flow) -> None:
        f.version += 1
        eta = now if f.rem <= 0 or math.isinf(f.rate) else now + f.rem / f.rate
        heapq.heappush(heap, (eta, next(seq), FLOW_END, (k, f.version)))

    def rerate(ks: set[int]) -> None:
        for k in sorted(ks):
            f = flows[k]
            rate = rate_of(f)
            if rate == f.rate:
                continue
            f.rem = max(f.rem - f.rate * (now - f.t_last), 0.0)
            f.t_last, f.rate = now, rate
            schedule(k, f)

    def start_flow(msg: Message, done: tuple[str, int, int, int, int]) -> None:
        k = next(fid)
        f = flows[k] = _Flow(size=msg.nbytes, rem=msg.nbytes, keys=tuple(key for key, _ in msg.resources),
                             bws=tuple(bw for _, bw in msg.resources), done=done, delay=msg.delay_s, t_last=now)
        touched: set[int] = set()
        for key in f.keys:
            sh = shares.setdefault(key, _Share())
            touched |= sh.flows
            sh.flows.add(k)
            sh.total += f.size
        rerate(touched)
        f.rate = rate_of(f)
        schedule(k, f)

    def send(msg: Message, done: tuple[str, int, int, int, int]) -> None:
        if msg.nbytes <= 0:
            heapq.heappush(heap, (now + msg.delay_s, next(seq), ARRIVE, done[:4]))
            return
        queue = channels.setdefault(done[4], [])
        queue.append((msg, done))
        if len(queue) == 1:
            start_flow(msg, done)

    def op_end(s: int, r: int) -> None:
        kind, i = orders[s][ptr[s][r]]
        clock[s][r] = now
        busy[s][r] = False
        ptr[s][r] += 1
        if kind == "F":
            for p in outs[s][r]:
                send(p.fwd, ("F", s + 1, p.dst, i, _channel(channel_of, ("F", s, r, p.dst))))
        else:
            for p in ins[s][r]:
                send(p.bwd, ("B", s - 1, p.src, i, _channel(channel_of, ("B", s, r, p.src))))
        try_start(s, r)

    def flow_end(k: int, version: int) -> None:
        f = flows.get(k)
        if f is None or f.version != version:
            return
        del flows[k]
        touched: set[int] = set()
        for key in f.keys:
            sh = shares[key]
            sh.flows.discard(k)
            sh.total = sh.total - f.size if sh.flows else 0.0
            touched |= sh.flows
        rerate(touched)
        heapq.heappush(heap, (now + f.delay, next(seq), ARRIVE, f.done[:4]))
        queue = channels[f.done[4]]
        queue.pop(0)
        if queue:
            start_flow(*queue[0])

    def arrive(kind: str, s: int, r: int, i: int) -> None:
        got[(kind, s, r, i)] = got.get((kind, s, r, i), 0) + 1
        try_start(s, r)

    for s in range(S):
        for r in range(len(times[s])):
            try_start(s, r)
    while heap:
        now, _, ev, args = heapq.heappop(heap)
        if ev == OP_END:
            op_end(*args)  # type: ignore[arg-type]
        elif ev == FLOW_END:
            flow_end(*args)  # type: ignore[arg-type]
        else:
            arrive(*args)  # type: ignore[arg-type]
    if any(ptr[s][r] < len(orders[s]) for s in range(S) for r in range(len(times[s]))):
        raise ValueError("the schedule deadlocks")
    return clock


def _channel(ids: dict[tuple[str, int, int, int], int], key: tuple[str, int, int, int]) -> int:
    return ids.setdefault(key, len(ids))
