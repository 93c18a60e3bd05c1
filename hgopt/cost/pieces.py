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

__all__ = ["Message", "Piece", "compress", "replay_pieces"]


@dataclass(frozen=True, slots=True)
class Message:
    """One piece's transfer in one direction: ``nbytes`` through ``resources`` ((key, bandwidth):
    messages with the same key share that bandwidth), arriving ``delay_s`` after its last byte."""

    nbytes: float
    resources: tuple[tuple[Hashable, Bandwidth], ...]
    delay_s: float
    weights: tuple[float, ...] = ()
    """Per resource, how many real messages this one stands for on one resource of that key (default
    1 each): a class of identical replicas is replayed once (``compress``)."""


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
    weights: tuple[float, ...]
    done: tuple[str, int, int, int, int]
    """(kind, stage, replica, microbatch, channel id) of the message"""
    delay: float
    rate: float = 0.0
    t_last: float = 0.0
    version: int = 0


@dataclass(slots=True)
class _Share:
    flows: set[int] = field(default_factory=set)
    count: float = 0.0
    """Real messages on it (the flows' weights)."""
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
            rate = min(rate, bandwidth_bytes_per_s(bw, sh.total) / sh.count)
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
                             bws=tuple(bw for _, bw in msg.resources),
                             weights=msg.weights or (1.0,) * len(msg.resources), done=done, delay=msg.delay_s,
                             t_last=now)
        touched: set[int] = set()
        for key, w in zip(f.keys, f.weights):
            sh = shares.setdefault(key, _Share())
            touched |= sh.flows
            sh.flows.add(k)
            sh.count += w
            sh.total += w * f.size
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
        for key, w in zip(f.keys, f.weights):
            sh = shares[key]
            sh.flows.discard(k)
            sh.count, sh.total = (sh.count - w, sh.total - w * f.size) if sh.flows else (0.0, 0.0)
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


def compress(times: Sequence[Sequence[tuple[float, float]]], pieces: Sequence[Piece]
             ) -> tuple[list[list[tuple[float, float]]], list[Piece]]:
    """The same replay with every class of interchangeable replicas replayed once: replicas of one
    stage with the same times whose pieces go to (come from) the same classes with the same bytes,
    delays and classes of resources, and resources carrying the same classes of messages (colour
    refinement until no class splits). One message per (sender class, receiver class, kind of piece)
    then stands for all of them; on a resource class it weighs the real messages it stands for per
    resource of the class, so the shares are the real ones. Stage by stage, the latest class's end is
    the latest replica's (``tests/test_spanning.py`` holds the two replays equal)."""
    reps = [(s, r) for s in range(len(times)) for r in range(len(times[s]))]
    ids: dict[object, int] = {}

    def intern(x: object) -> int:
        return ids.setdefault(x, len(ids))

    rc = {x: intern(("rep", x[0], times[x[0]][x[1]])) for x in reps}
    keys = {k: bw for p in pieces for m in (p.fwd, p.bwd) for k, bw in m.resources}
    kc = {k: intern(("res", bw, type(k).__name__ if not isinstance(k, tuple) else k[0])) for k, bw in keys.items()}

    def desc(p: Piece) -> tuple[object, ...]:
        return (rc[(p.boundary, p.src)], rc[(p.boundary + 1, p.dst)],
                tuple((m.nbytes, m.delay_s, tuple(kc[k] for k, _ in m.resources), m.weights) for m in (p.fwd, p.bwd)))

    n_classes = -1
    while True:
        d = [desc(p) for p in pieces]
        outs: dict[tuple[int, int], list[object]] = {x: [] for x in reps}
        ins: dict[tuple[int, int], list[object]] = {x: [] for x in reps}
        on: dict[Hashable, list[object]] = {k: [] for k in keys}
        for p, dp in zip(pieces, d):
            outs[(p.boundary, p.src)].append(dp)
            ins[(p.boundary + 1, p.dst)].append(dp)
            for side, m in enumerate((p.fwd, p.bwd)):
                for k, _ in m.resources:
                    on[k].append((side, dp))
        rc = {x: intern((rc[x], tuple(sorted(outs[x])), tuple(sorted(ins[x])))) for x in reps}
        kc = {k: intern((kc[k], tuple(sorted(on[k])))) for k in keys}
        n = len(set(rc.values())) + len(set(kc.values()))
        if n == n_classes:
            break
        n_classes = n
    first: dict[int, tuple[int, int]] = {}
    for x in reps:
        first.setdefault(rc[x], x)
    index: dict[int, int] = {}
    out_times: list[list[tuple[float, float]]] = [[] for _ in times]
    for c, (s, r) in first.items():
        index[c] = len(out_times[s])
        out_times[s].append(times[s][r])
    per_key_class: dict[int, int] = {}
    for k in keys:
        per_key_class[kc[k]] = per_key_class.get(kc[k], 0) + 1
    kinds: dict[tuple[object, ...], list[Piece]] = {}
    for p in pieces:
        kinds.setdefault(desc(p), []).append(p)
    out: list[Piece] = []
    for dp, ps in kinds.items():
        p0 = ps[0]
        msgs = []
        for side in (0, 1):
            m0 = p0.fwd if side == 0 else p0.bwd
            weight: dict[int, float] = {}
            for p in ps:
                m = p.fwd if side == 0 else p.bwd
                for (k, _), w in zip(m.resources, m.weights or (1.0,) * len(m.resources)):
                    weight[kc[k]] = weight.get(kc[k], 0.0) + w
            res = tuple((("class", kc[k]), bw) for k, bw in m0.resources)
            msgs.append(Message(nbytes=m0.nbytes, resources=res, delay_s=m0.delay_s,
                                weights=tuple(weight[kc[k]] / per_key_class[kc[k]] for k, _ in m0.resources)))
        out.append(Piece(boundary=p0.boundary, src=index[rc[(p0.boundary, p0.src)]],
                         dst=index[rc[(p0.boundary + 1, p0.dst)]], fwd=msgs[0], bwd=msgs[1]))
    return out_times, out
