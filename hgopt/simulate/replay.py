"""``simulate(plan, instance)``: replay one training step event by event, as the runner executes it.

Every replica of every stage runs its stage's operations in the runner's order
(:func:`hgopt.cost.schedule.stage_ops`, 1F1B or GPipe), one at a time, with the forward and backward
seconds of its own replica group from the cost kernel's tables ([C2]). A forward waits for every row
range of its microbatch from the previous stage's replicas, a backward for every gradient row range
from the next stage's replicas (the runner's pieces: replica after replica, group after group). Each
piece is a flow that starts when its sender's operation ends, passes through the link resources of
:mod:`hgopt.simulate.resources` (shared by processor sharing), and arrives one latency later plus the
kernel's (de)quantisation time for a compressed boundary ([C4q]).

Gradient synchronisation follows the shared semantics (COMMON.md / cost_model.md): per sync segment,
layers in reverse order packed into buckets of at most ``grad_bucket_mb`` MiB of the rank's gradient
bytes; each bucket is one all-reduce among all replicas that hold the segment, priced by the kernel's
segment all-reduce ([C5]), or in a ZeRO-1 sharded segment its reduce-scatter (``segment_bucket_syncs``;
after the optimizer step, one all-gather per sharded segment, ``segment_gather``); its cross-cluster ring runs as a flow on the
WAN pipes between its clusters (so concurrent rings and activation transfers share them, [C5w]). With
``overlap_grad_sync`` a bucket is ready once the stage's last backward has passed its layers (that
backward spread over its duration in proportion to the layers' profiled backward times), otherwise
when that backward ends; a replica's buckets run one after another and a bucket starts when every
holder is ready (a collective waits for its slowest participant). A replica's optimizer step follows
its last bucket; the iteration ends with the last optimizer step.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import SegmentSync, quantisation_time, segment_bucket_syncs, segment_gather, segment_ring_flow
from hgopt.cost.compute import stage_times
from hgopt.cost.tables import CostTables, link_bytes_factor
from hgopt.plan import Plan, Stage, validate
from hgopt.cost.schedule import Op, stage_ops
from hgopt.simulate.resources import Network, Resource
from hgopt.spec import Instance

__all__ = ["Event", "LinkUse", "Simulation", "StageUse", "simulate"]

@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """One interval of the step. ``kind``: F/B (compute of ``replica``), sendF/sendB (a row range
    leaving ``replica`` of ``stage`` towards ``peer`` of the next / previous stage, over
    ``resource``), sync (one gradient bucket, layers ``layers``), optimizer, gather (a ZeRO-1 all-gather
    of layers ``layers`` after the optimizer step)."""

    kind: str
    pipeline: int
    stage: int
    replica: int
    microbatch: int
    start: float
    end: float
    peer: int = -1
    rows: tuple[int, int] = (0, 0)
    """sendF/sendB: the rows [lo, hi) of the microbatch the piece carries."""
    resource: str = ""
    layers: tuple[int, int] = (0, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageUse:
    pipeline: int
    stage: int
    busy_s: float
    """Compute seconds (forwards + backwards) of the stage's busiest replica."""
    idle_s: float
    """Iteration time minus ``busy_s``."""
    compute_end_s: float
    """When the stage's last backward ends (latest replica)."""
    sync_end_s: float
    """When its last gradient bucket ends."""
    end_s: float
    """When its optimizer step ends (with ZeRO-1: its last all-gather)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkUse:
    name: str
    bytes: float
    """Bytes carried during the step (p2p transfers and the all-reduce rings' traffic)."""
    busy_s: float
    """Seconds with at least one flow on it."""
    utilisation: float
    """``busy_s`` / iteration time."""
    max_flows: int
    """Largest number of concurrent flows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Simulation:
    iteration_time_s: float
    pipeline_time_s: float
    """When the last backward of any stage ends."""
    stages: tuple[StageUse, ...]
    links: tuple[LinkUse, ...]
    events: tuple[Event, ...] = field(repr=False)

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not events:
            d.pop("events")
        return d


# ---- the replay ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Worker:
    pi: int
    si: int
    ri: int
    cluster: str
    fwd_s: float
    bwd_s: float
    optimizer_s: float
    ops: tuple[Op, ...]
    in_pieces: list[tuple[int, int, int]]
    """(replica of the previous stage, lo, hi) rows this replica receives."""
    out_pieces: list[tuple[int, int, int]]
    """(replica of the next stage, lo, hi) rows this replica sends."""
    bucket_frac: list[float] = field(default_factory=list)
    """Per bucket (sync order): fraction of the last backward after which its layers are done."""
    buckets: list[_Collective] = field(default_factory=list)
    ptr: int = 0
    running: bool = False
    arrived: dict[tuple[str, int], int] = field(default_factory=dict)
    ready_at: list[float] = field(default_factory=list)
    bptr: int = 0
    gathers: list[_Collective] = field(default_factory=list)
    """ZeRO-1 all-gathers after the optimizer step (ascending layers, the runner's order)."""
    gptr: int = 0
    busy: float = 0.0
    compute_end: float = 0.0
    sync_end: float = 0.0
    end: float = 0.0


@dataclass(slots=True)
class _Collective:
    layers: tuple[int, int]
    members: list[_Worker]
    intra_s: float
    inter_s: float
    wan: tuple[Resource, ...]
    wan_bytes: float
    chunk: float
    work: float = 0.0
    """[C5w] Its cross-cluster ring's bytes on the caps, at most ``limit`` bytes/s, then ``tail_s`` of
    latency off them (``evaluate.segment_ring_flow``)."""
    limit: float = math.inf
    tail_s: float = 0.0
    ready: int = 0
    start: float = 0.0
    gather: bool = False
    """A ZeRO-1 all-gather after the optimizer step (else a gradient bucket)."""


@dataclass(slots=True)
class _Flow:
    size: float
    """Message bytes the achieved bandwidth is looked up at."""
    rem: float
    resources: tuple[_Res, ...]
    counted: float
    on_done: Any
    limit: float = math.inf
    rate: float = 0.0
    t_last: float = 0.0
    version: int = 0


@dataclass(slots=True)
class _Res:
    res: Resource
    shared: bool
    """Has an aggregate cap: a flow's share depends on how many others there are."""
    flows: set[int] = field(default_factory=set)
    bytes: float = 0.0
    busy: float = 0.0
    since: float = 0.0
    max_flows: int = 0
    total: float = 0.0
    """Sum of the active flows' message sizes."""
    cache: dict[tuple[float, int, float], float] = field(default_factory=dict)

    def rate(self, size: float) -> float:
        key = (size, len(self.flows), self.total)
        r = self.cache.get(key)
        if r is None:
            if len(self.cache) > 4096:
                self.cache.clear()
            r = self.cache[key] = self.res.rate(size, len(self.flows), self.total)
        return r


class _Replay:
    def __init__(self, plan: Plan, inst: Instance, tables: CostTables) -> None:
        self.plan, self.inst, self.tables = plan, inst, tables
        self.heap: list[tuple[float, int, Any, tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.events: list[Event] = []
        self.flows: dict[int, _Flow] = {}
        self.fid = itertools.count()
        self.res: dict[Resource, _Res] = {}
        self.now = 0.0
        self.net = Network(plan, inst)
        self.channels: dict[tuple[int, ...], list[tuple[float, tuple[Resource, ...], Any]]] = {}
        ev = evaluate(plan, inst, tables)
        opt = {(s.pipeline, s.stage): s.optimizer_s for s in ev.stages}
        self.workers: dict[tuple[int, int, int], _Worker] = {}
        for pi, pipe in enumerate(plan.pipelines):
            S = len(pipe.stages)
            for si, st in enumerate(pipe.stages):
                ops = stage_ops(pipe.schedule, si, S, pipe.num_microbatches)
                for ri, (g, lo, hi) in enumerate(_replica_rows(st)):
                    f, b = _stage_times(tables.table(inst.topology.cluster(g.cluster).gpu, g.tp), g.mbs, st)
                    self.workers[(pi, si, ri)] = _Worker(
                        pi=pi, si=si, ri=ri, cluster=g.cluster, fwd_s=f, bwd_s=b, optimizer_s=opt[(pi, si)], ops=ops,
                        in_pieces=[] if si == 0 else _overlaps((lo, hi), _replica_rows(pipe.stages[si - 1])),
                        out_pieces=[] if si == S - 1 else _overlaps((lo, hi), _replica_rows(pipe.stages[si + 1])),
                    )
        self._build_sync()

    # ---- gradient buckets ----
    def _build_sync(self) -> None:
        plan, tables, inst = self.plan, self.tables, self.inst
        overlap = plan.overlap_grad_sync
        self.overlap = overlap
        cuts = sorted({s.start for p in plan.pipelines for s in p.stages} | {tables.num_layers})
        per_worker: dict[tuple[int, int, int], list[_Collective]] = {k: [] for k in self.workers}
        for lo, hi in reversed(list(zip(cuts, cuts[1:]))):
            holders = [(pi, si, s) for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)
                       if s.start <= lo and hi <= s.end]
            members = [w for w in self.workers.values() if any((w.pi, w.si) == (pi, si) for pi, si, _ in holders)]
            stages = [s for _, _, s in holders]
            # the kernel's buckets and their collectives: in ZeRO-1 sharded segments (every holder
            # asks, one tp degree, as the export decides) each bucket is a reduce-scatter, and the
            # segment's parameters are all-gathered after the optimizer step
            for (blo, bhi), seg in segment_bucket_syncs(inst, tables, stages, lo, hi, float(plan.grad_bucket_mb),
                                                        plan.grad_sync_precision):
                c = self._collective((blo, bhi), members, seg, gather=False)
                for w in members:
                    per_worker[(w.pi, w.si, w.ri)].append(c)
            if (ag := segment_gather(inst, tables, stages, lo, hi)) is not None:  # zero1ov: ZeRO-1 all-gather
                c = self._collective((lo, hi), members, ag, gather=True)
                for w in members:
                    w.gathers.insert(0, c)  # segments run last layers first here; the runner gathers ascending
        for key, cs in per_worker.items():
            w = self.workers[key]
            st = plan.pipelines[w.pi].stages[w.si]
            g = _replica_rows(st)[w.ri][0]
            tab = tables.table(inst.topology.cluster(g.cluster).gpu, g.tp)
            total = tab.times(g.mbs, st.start, st.end)[1]
            w.buckets = cs
            w.bucket_frac = [tab.times(g.mbs, c.layers[0], st.end)[1] / total if overlap and total > 0 else 1.0
                             for c in cs]

    def _collective(self, layers: tuple[int, int], members: list[_Worker], seg: SegmentSync,
                    gather: bool) -> _Collective:
        """One collective of ``members`` priced by the kernel's ``seg`` (a bucket's all-reduce or
        reduce-scatter, or a segment's ZeRO-1 all-gather: both carry intra, inter, wan_bytes and the
        clusters of the ring its WAN flow runs on)."""
        ring = segment_ring_flow(self.inst.topology, seg) if self.net.per_flow_links else None
        wan = self.net.ring(seg.clusters)
        work, limit, tail = (ring[0].nbytes, ring[0].limit, ring[1]) if ring else (0.0, math.inf, 0.0)
        if ring is None and wan and seg.inter > 0:  # the older one-pipe model: the pipe's whole rate
            work = seg.inter * min(r.rate(seg.wan_bytes / max(len(seg.clusters), 1), 1) for r in wan)
        return _Collective(layers=layers, members=members, intra_s=seg.intra, inter_s=seg.inter,
                           wan=wan if work > 0 else (), wan_bytes=seg.wan_bytes,
                           chunk=seg.wan_bytes / max(len(seg.clusters), 1), gather=gather,
                           work=work, limit=limit, tail_s=tail)

    # ---- event loop ----
    def push(self, t: float, fn: Any, *args: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn, args))

    def run(self) -> None:
        for w in self.workers.values():
            self.try_start(w)
        while self.heap:
            t, _, fn, args = heapq.heappop(self.heap)
            self.now = t
            fn(*args)
        stuck = [w for w in self.workers.values()
                 if w.ptr < len(w.ops) or w.bptr < len(w.buckets) or w.gptr < len(w.gathers)]
        assert not stuck, f"simulation deadlocked at {[(w.pi, w.si, w.ri) for w in stuck[:5]]}"

    def try_start(self, w: _Worker) -> None:
        if w.running or w.ptr >= len(w.ops):
            return
        op = w.ops[w.ptr]
        S = len(self.plan.pipelines[w.pi].stages)
        need = len(w.in_pieces) if op.kind == "F" else (len(w.out_pieces) if w.si < S - 1 else 0)
        if w.arrived.get((op.kind, op.microbatch), 0) < need:
            return
        w.running = True
        dur = w.fwd_s if op.kind == "F" else w.bwd_s
        if w.ptr == len(w.ops) - 1:  # the last backward: it produces the final gradients
            w.ready_at = [self.now + f * dur for f in w.bucket_frac]
            self.push(w.ready_at[0], self.bucket_ready, w)
        self.push(self.now + dur, self.op_end, w, op, self.now)

    def op_end(self, w: _Worker, op: Op, start: float) -> None:
        self.events.append(Event(kind=op.kind, pipeline=w.pi, stage=w.si, replica=w.ri, microbatch=op.microbatch,
                                 start=start, end=self.now))
        w.busy += self.now - start
        w.running = False
        w.ptr += 1
        if op.kind == "F" and w.out_pieces:
            self._send(w, op.microbatch, "F", w.si, w.out_pieces)
        elif op.kind == "B" and w.in_pieces:
            self._send(w, op.microbatch, "B", w.si - 1, w.in_pieces)
        if w.ptr == len(w.ops):
            w.compute_end = self.now
        self.try_start(w)

    # ---- point-to-point ----
    def _send(self, w: _Worker, mb: int, kind: str, boundary: int, pieces: list[tuple[int, int, int]]) -> None:
        pipe = self.plan.pipelines[w.pi]
        bound = pipe.boundary(boundary)
        prec = bound.fwd if kind == "F" else bound.bwd
        factor = link_bytes_factor(self.inst.model.dtype, prec)
        per_sample = float(self.tables.activation_bytes[pipe.stages[boundary].end - 1])
        dst_si = w.si + 1 if kind == "F" else w.si - 1
        for peer, lo, hi in pieces:
            dst = self.workers[(w.pi, dst_si, peer)]
            nbytes = (hi - lo) * per_sample * factor
            res = self.net.path(self.net.node_of[(w.pi, w.si, w.ri)], self.net.node_of[(w.pi, dst_si, peer)])
            quant = quantisation_time(self.inst, prec, factor, per_sample, [(w.cluster, dst.cluster, hi - lo)])
            delay = max(r.latency_s for r in res) + quant

            def done(start: float, t_bytes: float, dst: _Worker = dst, peer: int = peer,
                     res: tuple[Resource, ...] = res, delay: float = delay, rows: tuple[int, int] = (lo, hi)) -> None:
                self.events.append(Event(kind="send" + kind, pipeline=w.pi, stage=w.si, replica=w.ri, microbatch=mb,
                                         start=start, end=t_bytes + delay, peer=peer, rows=rows,
                                         resource="+".join(r.name for r in res)))
                self.push(t_bytes + delay, self.arrive, dst, kind, mb)

            if nbytes <= 0:
                self.push(self.now, self.arrive, dst, kind, mb)
                continue
            self.channel_send((w.pi, w.si, w.ri, dst_si, peer), nbytes, res, done)

    def channel_send(self, ch: tuple[int, ...], nbytes: float, res: tuple[Resource, ...], done: Any) -> None:
        """Messages between one pair of ranks in one direction leave in order, one after another (one
        connection / stream per pair: gloo's pair, nccl's p2p stream); different pairs share the
        resources."""
        queue = self.channels.setdefault(ch, [])
        queue.append((nbytes, res, done))
        if len(queue) == 1:
            self._channel_next(ch)

    def _channel_next(self, ch: tuple[int, ...]) -> None:
        nbytes, res, done = self.channels[ch][0]
        t0 = self.now

        def sent(t: float) -> None:
            self.channels[ch].pop(0)
            if self.channels[ch]:
                self._channel_next(ch)
            done(t0, t)

        self.start_flow(nbytes, nbytes, res, sent)

    def arrive(self, w: _Worker, kind: str, mb: int) -> None:
        w.arrived[(kind, mb)] = w.arrived.get((kind, mb), 0) + 1
        self.try_start(w)

    # ---- flows under processor sharing ----
    def start_flow(self, size: float, work: float, res: tuple[Resource, ...], on_done: Any,
                   counted: float | None = None, limit: float = math.inf) -> None:
        """A flow of ``work`` bytes looked up at message size ``size``; ``on_done(t)`` when its last
        byte is through. ``counted``: bytes it adds to the resources' totals (default ``work``);
        ``limit``: bytes/s it never exceeds (its own rate alone, e.g. a gradient ring's)."""
        fid = next(self.fid)
        states = tuple(self._state(r) for r in res)
        f = self.flows[fid] = _Flow(size=size, rem=work, resources=states,
                                    counted=work if counted is None else counted, on_done=on_done, t_last=self.now,
                                    limit=limit)
        touched: set[int] = set()
        for st in states:
            if not st.flows:
                st.since = self.now
            if st.shared:  # the others' shares change
                touched |= st.flows
            st.flows.add(fid)
            st.total += size
            st.max_flows = max(st.max_flows, len(st.flows))
        self._rerate(touched)
        self._rate(fid, f)

    def _state(self, r: Resource) -> _Res:
        st = self.res.get(r)
        if st is None:
            st = self.res[r] = _Res(res=r, shared=r.aggregate is not None)
        return st

    def _rerate(self, fids: set[int]) -> None:
        for fid in sorted(fids):
            f = self.flows[fid]
            rate = min(min((st.rate(f.size) for st in f.resources), default=math.inf), f.limit)
            if rate == f.rate:
                continue  # its completion event stands
            f.rem = max(f.rem - f.rate * (self.now - f.t_last), 0.0)
            f.t_last = self.now
            self._rate(fid, f, rate)

    def _rate(self, fid: int, f: _Flow, rate: float | None = None) -> None:
        f.rate = min(min((st.rate(f.size) for st in f.resources), default=math.inf), f.limit) if rate is None else rate
        f.version += 1
        eta = self.now if f.rem <= 0 or math.isinf(f.rate) else self.now + f.rem / f.rate
        self.push(eta, self.flow_end, fid, f.version)

    def flow_end(self, fid: int, version: int) -> None:
        f = self.flows.get(fid)
        if f is None or f.version != version:
            return
        del self.flows[fid]
        touched: set[int] = set()
        for st in f.resources:
            st.flows.discard(fid)
            st.total = st.total - f.size if st.flows else 0.0
            st.bytes += f.counted
            if not st.flows:
                st.busy += self.now - st.since
            if st.shared:
                touched |= st.flows
        self._rerate(touched)
        f.on_done(self.now)

    # ---- gradient sync ----
    def bucket_ready(self, w: _Worker) -> None:
        if w.bptr >= len(w.buckets):
            self._optimizer(w)
            return
        if self.now < w.ready_at[w.bptr]:  # previous bucket done before this one's layers are
            self.push(w.ready_at[w.bptr], self.bucket_ready, w)
            return
        self._member_ready(w.buckets[w.bptr])

    def _member_ready(self, c: _Collective) -> None:
        """One more member is ready for ``c``; the last one starts it (a collective waits for its slowest)."""
        c.ready += 1
        if c.ready == len(c.members):
            c.start = self.now
            self.push(self.now + c.intra_s, self.bucket_inter, c)

    def bucket_inter(self, c: _Collective) -> None:
        if c.inter_s <= 0 or not c.wan:  # nothing it shares: its own duration
            self.push(self.now + c.inter_s, self.bucket_end, c, self.now + c.inter_s)
            return
        self.start_flow(c.chunk, c.work, c.wan, lambda t: self.push(t + c.tail_s, self.bucket_end, c, t + c.tail_s),
                        counted=c.wan_bytes, limit=c.limit)

    def bucket_end(self, c: _Collective, t: float) -> None:
        """``c`` ended at ``t``: each member moves on to its next bucket (or its optimizer step), or
        after a ZeRO-1 all-gather (zero1ov) to its next all-gather."""
        for w in c.members:
            if w.ri == 0:
                self.events.append(Event(kind="gather" if c.gather else "sync", pipeline=w.pi, stage=w.si,
                                         replica=0, microbatch=-1, start=c.start, end=t, layers=c.layers))
            if c.gather:
                w.gptr += 1
                w.end = t
                self.push(t, self.gather_ready, w)
            else:
                w.bptr += 1
                w.sync_end = t
                self.push(t, self.bucket_ready, w)

    def _optimizer(self, w: _Worker) -> None:
        w.end = self.now + w.optimizer_s
        if w.ri == 0:
            self.events.append(Event(kind="optimizer", pipeline=w.pi, stage=w.si, replica=0, microbatch=-1,
                                     start=self.now, end=w.end))
        if w.gathers:  # zero1ov: then its ZeRO-1 all-gathers, each once every member has stepped
            self.push(w.end, self.gather_ready, w)

    def gather_ready(self, w: _Worker) -> None:
        if w.gptr >= len(w.gathers):
            return
        self._member_ready(w.gathers[w.gptr])

    # ---- results ----
    def result(self) -> Simulation:
        T = max(w.end for w in self.workers.values())
        stages = []
        for pi, p in enumerate(self.plan.pipelines):
            for si in range(len(p.stages)):
                ws = [w for w in self.workers.values() if (w.pi, w.si) == (pi, si)]
                busy = max(w.busy for w in ws)
                stages.append(StageUse(pipeline=pi, stage=si, busy_s=busy, idle_s=T - busy,
                                       compute_end_s=max(w.compute_end for w in ws),
                                       sync_end_s=max(w.sync_end for w in ws), end_s=max(w.end for w in ws)))
        links = tuple(LinkUse(name=r.name, bytes=st.bytes, busy_s=st.busy, utilisation=st.busy / T if T > 0 else 0.0,
                              max_flows=st.max_flows) for r, st in sorted(self.res.items(), key=lambda x: x[0].name))
        return Simulation(iteration_time_s=T, pipeline_time_s=max(w.compute_end for w in self.workers.values()),
                          stages=tuple(stages), links=links,
                          events=tuple(sorted(self.events, key=lambda e: (e.start, e.pipeline, e.stage, e.replica))))


def simulate(plan: Plan, instance: Instance, tables: CostTables | None = None) -> Simulation:
    """Replay one step of ``plan`` on ``instance`` (module docstring). Raises ValueError for a plan
    with structural violations (out of memory is not checked here: ``evaluate`` does)."""
    violations = validate(plan, instance)
    if violations:
        raise ValueError(f"cannot simulate an invalid plan: {'; '.join(str(v) for v in violations)}")
    rp = _Replay(plan, instance, tables or build_tables(instance))
    rp.run()
    return rp.result()


# ---- helpers -------------------------------------------------------------------------------------
def _stage_times(tab: Any, mbs: int, stage: Stage) -> tuple[float, float]:
    """Forward and backward seconds of one replica of ``stage``: the kernel's [C2] / [C2r] times."""
    return stage_times(tab, mbs, stage.start, stage.end, stage.recompute == "full")


def _replica_rows(stage: Stage) -> list[tuple[Any, int, int]]:
    """(replica group, first row, end row) of every replica, group after group (the runner's layout)."""
    out, lo = [], 0
    for g in stage.groups:
        for _ in range(g.dp):
            out.append((g, lo, lo + g.mbs))
            lo += g.mbs
    return out


def _overlaps(rows: tuple[int, int], other: list[tuple[Any, int, int]]) -> list[tuple[int, int, int]]:
    lo, hi = rows
    return [(j, max(lo, a), min(hi, b)) for j, (_, a, b) in enumerate(other) if max(lo, a) < min(hi, b)]
