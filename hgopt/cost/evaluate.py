"""``evaluate(plan, instance)``: THE scorer. Every planner's plan is judged by this function alone.

The equations, with the labels used in comments ([C1]..[C7]), are in ``formulations/cost_model.md``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Literal
from dataclasses import asdict, dataclass, replace

from hgopt.cost.comm import ring_edge_bytes
from hgopt.cost.compute import optimizer_time, stage_times
from hgopt.cost.schedule import stage_ops
from hgopt.cost.gradsync import (
    Bucket,
    bucket_ready_time,
    bucket_schedule_starts,
    iteration_end,
)
from hgopt.cost.sharing import BoundaryMessage, CapFlow, RingPhase, earlier_backward_starts, shared_bucket_schedule
from hgopt.cost.memory import stage_memory_terms, zero_shards
from hgopt.cost.joint import Parts, joint_ends
from hgopt.cost.pieces import Message, Piece, compress, replay_pieces
import hgopt.cost.pipeline as _pipeline
from hgopt.cost.pipeline import (
    fill_time,
    in_flight,
    last_backward_ends,
    path_time,
    pipeline_bottleneck,
    pipeline_time,
    replay_shared_nics,
    replay_stage_ends,
    round_trip_pace,
)
from hgopt.cost.tables import (
    CostTables,
    GpuTpTable,
    bandwidth_bytes_per_s,
    build_tables,
    link_bytes_factor,
)
from hgopt.cost.links import flows_time, nic_time, replicas_per_node
from hgopt.plan import Pipeline, Plan, Stage, validate
from hgopt.spec import Bandwidth, Cluster, Instance, Topology
from hgopt.cost.segments import (  # [C5]/[C7o] moved out, re-exported
    SegmentsAndLoads,
    _capped_ring,
    segment_allreduce,
    segment_bucket_syncs,
    segment_buckets,
    segment_gather,
    segment_ring_flow,
    segment_sharded,
    segment_sync,
    SegmentSync,
)

__all__ = [
    "Evaluation",
    "PipelineReport",
    "SegmentSync",
    "StageReport",
    "boundary_cast_times",
    "boundary_latency",
    "boundary_nic_seconds",
    "evaluate",
    "quantisation_time",
    "segment_allreduce",
    "segment_bucket_syncs",
    "segment_buckets",
    "segment_gather",
    "segment_sharded",
    "segment_sync",
    "round_trip_bound",
    "stage_boundary_time",
    "wan_bytes_per_iteration",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReport:
    pipeline: int
    stage: int
    layers: tuple[int, int]
    clusters: tuple[str, ...]
    gpus: int
    layout: str
    """Replica groups as ``dp×[GPU@cluster tp t mbs b]``."""
    fwd_s: float
    bwd_s: float
    send_fwd_s: float
    """Seconds to send one microbatch's activations to the next stage (0 for the last stage)."""
    send_bwd_s: float
    """Seconds to send one microbatch's gradients back across the same boundary."""
    sync_s: float
    optimizer_s: float
    peak_memory_bytes: float
    """Peak per GPU of the replica group closest to its memory limit."""
    last_backward_end_s: float = 0.0
    """[C7o] When the backward of the last microbatch ends on this stage (the pipeline's closed form or
    replay; later by [C7c] where a backward message it waits for shares a capped link with a ring)."""
    sync_end_s: float = 0.0
    """[C7o] When this stage's last gradient bucket ends under the plan's gradient-sync setting ([C5w],
    [C7c] included)."""
    memory_capacity_bytes: float
    """Memory per GPU of that group's cluster."""
    oom: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineReport:
    index: int
    num_microbatches: int
    microbatch: int
    bottleneck_s: float
    fill_drain_s: float
    time_s: float
    stage_ends: tuple[float, ...] = ()
    """[C3x]/[C3n] Each stage's last backward end in the exact replay (``pipeline="replay"``); empty:
    the closed form's ``pipeline.last_backward_ends``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluation:
    iteration_time_s: float
    """THE iteration time of the plan as configured: [C7o] (``iteration_time_overlap_s``) when
    ``plan.overlap_grad_sync``, [C7] (every stage's sync after the slowest pipeline drains) when not.
    Every planner optimises it and every lower bound bounds it."""
    throughput_samples_per_s: float
    tokens_per_s: float
    pipeline_time_s: float
    sync_optimizer_time_s: float
    """``iteration_time_s − pipeline_time_s``: how long the iteration runs past the slowest pipeline's
    drain (with overlap: the exposed gradient sync and optimizer step; [C7]: max_s sync + optimizer)."""
    gpus_used: int
    feasible: bool
    violations: tuple[str, ...]
    pipelines: tuple[PipelineReport, ...]
    stages: tuple[StageReport, ...]
    iteration_time_overlap_s: float = math.inf
    """[C7o] The bucketed schedule under the plan's gradient-sync setting (``overlap_grad_sync``,
    ``grad_bucket_mb``): bucketed all-reduce per stage from its last backward, optimizer after its
    sync, the last optimizer step ends the iteration. Kept for compatibility: with overlap on (the
    default) it equals ``iteration_time_s``; with overlap off it is the bucketed schedule with every
    bucket starting at the stage's last backward, while ``iteration_time_s`` is [C7]."""

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["peak_memory_gb"] = [s.peak_memory_bytes / 1e9 for s in self.stages]
        return d


def evaluate(plan: Plan, instance: Instance, tables: CostTables | None = None, *,
             pipeline: Literal["closed", "replay"] | None = None) -> Evaluation:
    """Iteration time, throughput, per-stage breakdown and memory of ``plan`` on ``instance``.
    ``pipeline``: a 1F1B pipeline's time by the closed form or the exact replay (default
    ``pipeline.EVALUATE_1F1B``).

    A plan with structural violations is infeasible and gets an infinite iteration time; a plan that
    only runs out of memory is costed fully and flagged infeasible.
    """
    violations = [str(v) for v in validate(plan, instance)]
    if violations:
        return _infeasible(plan, violations)
    tables = tables or build_tables(instance)
    segs = _segments_and_loads(plan, instance, tables)  # [C5] segments and [C5w] loads, for both sync models
    sync = _stage_sync_times(plan, instance, tables, segs)
    zero = _zero_pieces(plan, tables)
    wan = _wan_loads(instance, tables, plan.pipelines)
    stage_reports: list[StageReport] = []
    pipe_reports: list[PipelineReport] = []
    first: dict[Pipeline, int] = {}  # identical pipelines get identical reports: compute once
    copies = Counter(plan.pipelines)  # identical pipelines share nodes [C4]
    joint = _joint_ends(instance, tables, copies)  # [C4j] pipelines sharing a cap: one timeline
    for pi, pipe in enumerate(plan.pipelines):
        if pipe in first:
            done = first[pipe]
            reports = [replace(r, pipeline=pi) for r in stage_reports if r.pipeline == done]
            pipe_reports.append(replace(pipe_reports[done], index=pi))
        else:
            first[pipe] = pi
            own = _wan_loads(instance, tables, (pipe,), copies[pipe]) if pipe in joint else wan  # [C4j]
            reports = [_stage_report(instance, tables, pipe, pi, si, sync[(pi, si)], own, copies[pipe], zero[(pi, si)])
                       for si in range(len(pipe.stages))]
            lat = [boundary_latency(instance, pipe, si) for si in range(len(pipe.stages) - 1)] + [(0.0, 0.0)]
            nics = _shared_nic_inputs(instance, tables, pipe, reports, lat, copies[pipe])
            report = _pipeline_report(pi, pipe, reports, lat, nics,
                                      exact=(pipeline or _pipeline.EVALUATE_1F1B) == "replay")
            # [C3s] a stage spanning clusters: replica by replica, each piece its own message
            ends = piece_timeline(instance, tables, pipe, copies[pipe], own) if spans_clusters(pipe) else None
            if ends is not None:
                report = replace(report, time_s=max(ends), stage_ends=tuple(ends))
            if pipe in joint:  # [C4j] the later of its own form and the joint timeline, stage by stage
                mine = list(report.stage_ends) or last_backward_ends(
                    report.time_s, [r.bwd_s for r in reports], [r.send_bwd_s for r in reports])
                ends = [max(a, b) for a, b in zip(mine, joint[pipe])]
                report = replace(report, time_s=max(ends), stage_ends=tuple(ends))
            pipe_reports.append(report)
        stage_reports.extend(reports)
    t_pipe = max(p.time_s for p in pipe_reports)
    stage_reports, t_overlap = _bucketed_sync(plan, instance, tables, pipe_reports, stage_reports, segs)
    # the headline: [C7o] with overlap (the runner's default), [C7] without
    t_iter = t_overlap if plan.overlap_grad_sync else t_pipe + max(s.sync_s + s.optimizer_s for s in stage_reports)
    t_tail = t_iter - t_pipe
    for s in stage_reports:
        if s.oom:
            violations.append(
                f"pipelines[{s.pipeline}].stages[{s.stage}]: needs {s.peak_memory_bytes / 1e9:.2f} GB per GPU, "
                f"{s.memory_capacity_bytes / 1e9:.2f} GB available (out of memory)"
            )
    samples = instance.job.global_batch
    return Evaluation(
        iteration_time_s=t_iter,
        throughput_samples_per_s=samples / t_iter,
        tokens_per_s=samples * instance.job.seq_len / t_iter,
        pipeline_time_s=t_pipe,
        sync_optimizer_time_s=t_tail,
        gpus_used=plan.num_gpus(),
        feasible=not violations,
        violations=tuple(violations),
        pipelines=tuple(pipe_reports),
        stages=tuple(stage_reports),
        iteration_time_overlap_s=t_overlap,
    )


def _infeasible(plan: Plan, violations: list[str]) -> Evaluation:
    return Evaluation(
        iteration_time_s=math.inf,
        throughput_samples_per_s=0.0,
        tokens_per_s=0.0,
        pipeline_time_s=math.inf,
        sync_optimizer_time_s=math.inf,
        gpus_used=plan.num_gpus(),
        feasible=False,
        violations=tuple(violations),
        pipelines=(),
        stages=(),
    )


# ---- pipeline time [C3] ----------------------------------------------------------------------
_NicInputs = tuple[list[float], list[float], list[tuple[float, ...]], list[tuple[float, ...]]]


def _shared_nic_inputs(inst: Instance, tables: CostTables, pipe: Pipeline, st: list[StageReport],
                       latency: Sequence[tuple[float, float]], copies: int) -> _NicInputs | None:
    """[C3n] The inputs of ``pipeline.replay_shared_nics`` for a 1F1B pipeline (delays: latency plus
    (de)quantisation; NIC seconds per boundary), or None when no stage's NIC can carry two messages
    at once: a middle stage s's outbound NIC carries its forward message to s + 1 (o^f_s) and its
    backward message to s − 1 (o^b_{s−1}), which start at least b_s (resp. f_s) apart, so they overlap
    only if o^f_s > b_s or o^b_{s−1} > f_s; its inbound NIC is taken as shared when one of its two
    messages is longer than min(f_s, b_s). Either also needs both messages to be NIC bound enough that
    half the NIC is slower than the message alone (2·nic > occupancy)."""
    S = len(st)
    if pipe.schedule != "1f1b" or S < 3:
        return None
    casts = [boundary_cast_times(inst, tables, pipe, i) for i in range(S - 1)]
    dly_f = [latency[i][0] + casts[i][0] for i in range(S - 1)] + [0.0]
    dly_b = [latency[i][1] + casts[i][1] for i in range(S - 1)] + [0.0]
    occ_f = [st[i].send_fwd_s - dly_f[i] for i in range(S - 1)]
    occ_b = [st[i].send_bwd_s - dly_b[i] for i in range(S - 1)]
    nic = [boundary_nic_seconds(inst, tables, pipe, i, copies) for i in range(S - 1)]

    def binds(w: float, occ: float) -> bool:
        return occ > 0 and 2.0 * w > occ

    shared = False
    for s in range(1, S - 1):
        f, b = st[s].fwd_s, st[s].bwd_s
        out_f, out_b = (nic[s][0][0], occ_f[s]), (nic[s - 1][1][0], occ_b[s - 1])
        in_f, in_b = (nic[s - 1][0][1], occ_f[s - 1]), (nic[s][1][1], occ_b[s])
        if binds(*out_f) and binds(*out_b) and (out_f[1] > b or out_b[1] > f):
            shared = True
        if binds(*in_f) and binds(*in_b) and max(in_f[1], in_b[1]) > min(f, b):
            shared = True
    if not shared:
        return None
    pad = [(0.0, 0.0, 1.0, 1.0)]
    return dly_f, dly_b, [n[0] for n in nic] + pad, [n[1] for n in nic] + pad


def _pipeline_report(index: int, pipe: Pipeline, st: list[StageReport],
                     latency: Sequence[tuple[float, float]] | None = None,
                     nics: _NicInputs | None = None, exact: bool = False) -> PipelineReport:
    """[C3] composition of one pipeline; for 1F1B [C3c] (``pipeline.closed_time``): max([C3], [C3p]) capped by
    the exact timeline [C3x] where it exceeds the floor R_0 + (m − 1)·max(t, occupancy) the bounds are built
    on, and [C3n] where NIC sharing can matter. ``latency``: per boundary (fwd, bwd) latency parts of the
    sends (``boundary_latency``)."""
    m = pipe.num_microbatches
    t = [s.fwd_s + s.bwd_s for s in st]
    fwd, bwd = [s.fwd_s for s in st], [s.bwd_s for s in st]
    send_f, send_b = [s.send_fwd_s for s in st], [s.send_bwd_s for s in st]
    bottleneck = pipeline_bottleneck(pipe.schedule, fwd, bwd, send_f, send_b, m)
    fill = fill_time(t, send_f, send_b)
    time_s = pipeline_time(m, bottleneck, fill)
    lat_f = [a for a, _ in latency] if latency is not None else None
    lat_b = [b for _, b in latency] if latency is not None else None
    if exact and pipe.schedule == "1f1b" and len(st) > 1:  # [C3x] / [C3n]: the exact timeline
        ends = (replay_shared_nics(stage_ops, "1f1b", fwd, bwd, send_f, send_b, m, *nics) if nics is not None
                else replay_stage_ends(stage_ops, "1f1b", fwd, bwd, send_f, send_b, m, lat_f, lat_b))
        return PipelineReport(index=index, num_microbatches=m, microbatch=pipe.microbatch, bottleneck_s=bottleneck,
                              fill_drain_s=fill, time_s=max(ends), stage_ends=tuple(ends))
    if pipe.schedule == "1f1b" and len(st) > 1:  # [C3c] max([C3], [C3p]) capped by [C3x] above the floor
        fluid = max(time_s, path_time(fwd, bwd, send_f, send_b, m, lat_f, lat_b))
        time_s = _pipeline.closed_time(stage_ops, fwd, bwd, send_f, send_b, m, fluid, lat_f, lat_b)
    if nics is not None:  # [C3n]: a stage's NIC carries both its boundaries' messages, per direction
        time_s = max(time_s, max(replay_shared_nics(stage_ops, "1f1b", fwd, bwd, send_f, send_b, m, *nics)))
    return PipelineReport(
        index=index,
        num_microbatches=m,
        microbatch=pipe.microbatch,
        bottleneck_s=bottleneck,
        fill_drain_s=fill,
        time_s=time_s,
    )


def round_trip_bound(st: list[StageReport], m: int) -> float:
    """[C3] The 1F1B round-trip pace of a pipeline's stage reports (``pipeline.round_trip_pace``)."""
    return round_trip_pace([s.fwd_s + s.bwd_s for s in st], [s.send_fwd_s for s in st],
                           [s.send_bwd_s for s in st], m)


# ---- one stage: compute [C2], boundary [C4], optimizer [C6-opt], memory [C6] ------------------------
def _stage_report(
    inst: Instance,
    tables: CostTables,
    pipe: Pipeline,
    pi: int,
    si: int,
    sync_s: float,
    wan: dict[tuple[str, str], float],
    copies: int = 1,
    pieces: tuple[tuple[int, int, int], ...] | None = None,
) -> StageReport:
    stage = pipe.stages[si]
    topo = inst.topology
    fwd = bwd = opt = 0.0
    peak, cap, oom = 0.0, math.inf, False
    n_stages = len(pipe.stages)
    depth = in_flight(n_stages, si, pipe.num_microbatches, pipe.schedule)
    for g in stage.groups:
        cluster = topo.cluster(g.cluster)
        tab = tables.table(cluster.gpu, g.tp)
        recompute = stage.recompute == "full"  # hfrunner: [C2r]/[C6r]
        f, b = stage_times(tab, g.mbs, stage.start, stage.end, recompute)
        fwd, bwd = max(fwd, f), max(bwd, b)
        # hetgap: the optimizer state per sync segment, sharded only where the export shards it ([C6])
        segs = pieces if pieces is not None else ((stage.start, stage.end, stage.replicas if stage.zero else 1),)
        opt = max(opt, sum(float(optimizer_time(tab, lo, hi, z)) for lo, hi, z in segs))
        mem = stage_memory_terms(inst, tables, cluster, g.tp, stage.start, stage.end, g.mbs, depth,
                                 recompute=recompute, pieces=segs).total
        if mem > cluster.gpu_memory_bytes:
            oom = True
        if mem / cluster.gpu_memory_bytes > peak / cap:  # report the group closest to its limit
            peak, cap = mem, cluster.gpu_memory_bytes
    send_f = send_b = 0.0
    if si + 1 < n_stages:
        send_f, send_b = stage_boundary_time(inst, tables, pipe, si, wan, copies)
    layout = ", ".join(f"{g.dp}x[{_where(topo.cluster(g.cluster))} tp{g.tp} mbs{g.mbs}]" for g in stage.groups)
    return StageReport(
        pipeline=pi,
        stage=si,
        layers=(stage.start, stage.end),
        clusters=stage.clusters(),
        gpus=stage.gpus,
        layout=layout,
        fwd_s=fwd,
        bwd_s=bwd,
        send_fwd_s=send_f,
        send_bwd_s=send_b,
        sync_s=sync_s,
        optimizer_s=opt,
        peak_memory_bytes=peak,
        memory_capacity_bytes=cap,
        oom=oom,
    )


def _where(cluster: Cluster) -> str:
    """``GPU@cluster``, or just the cluster's name when it already names the GPU type."""
    return cluster.name if cluster.gpu in cluster.name else f"{cluster.gpu}@{cluster.name}"


@dataclass(frozen=True, slots=True)
class _Flows:
    """Who sends how many samples to whom across one stage boundary (forward direction)."""

    per_sample: float
    cross: dict[tuple[str, str], int]
    """(sending cluster, receiving cluster) -> samples per microbatch"""
    pieces: list[tuple[str, str, int]]
    """(sender, receiver, largest block between one pair of replicas)"""
    node_samples: list[tuple[str, int]]
    """(cluster, samples) per node of either stage that sends or receives across the boundary"""
    cross_flow_max: dict[tuple[str, str], int]
    """(sending cluster, receiving cluster) -> samples of the largest node-pair flow between them"""
    src_nodes: int = 0
    """``node_samples[:src_nodes]`` are stage si's nodes, the rest stage si + 1's."""


def _boundary_flows(inst: Instance, tables: CostTables, pipe: Pipeline, si: int, copies: int = 1,
                    nodes: bool = True) -> _Flows:
    """[C4] The node-pair flows of boundary si -> si + 1 of ``copies`` identical pipelines from the
    plan's placement (see :func:`_node_pieces`); both stages sit on different nodes, so every flow
    crosses a NIC."""
    src, dst = pipe.stages[si], pipe.stages[si + 1]
    cross: dict[tuple[str, str], int] = {}
    pieces: list[tuple[str, str, int]] = []
    for a_cluster, a_lo, a_hi, a_mbs in _sample_blocks(src):
        for b_cluster, b_lo, b_hi, b_mbs in _sample_blocks(dst):
            n = min(a_hi, b_hi) - max(a_lo, b_lo)
            if n <= 0:
                continue
            pieces.append((a_cluster, b_cluster, min(a_mbs, b_mbs, n)))
            if a_cluster != b_cluster:
                cross[(a_cluster, b_cluster)] = cross.get((a_cluster, b_cluster), 0) + n
    per_sample = float(tables.activation_bytes[src.end - 1])
    if not nodes:  # the links' loads need only the samples between clusters
        return _Flows(per_sample=per_sample, cross=cross, pieces=pieces, node_samples=[], cross_flow_max={})
    topo = inst.topology
    na, nb = _node_pieces(topo, src, copies), _node_pieces(topo, dst, copies)
    flow: dict[tuple[tuple[str, int, int], tuple[str, int, int]], int] = {}
    node_a: dict[tuple[str, int, int], int] = {}
    node_b: dict[tuple[str, int, int], int] = {}
    for c in range(copies):  # sweep copy c: both sides tile [0, microbatch) in order
        pa, pb = na[c], nb[c]
        i = j = 0
        while i < len(pa) and j < len(pb):
            (ka, alo, ahi), (kb, blo, bhi) = pa[i], pb[j]
            n = min(ahi, bhi) - max(alo, blo)
            if n > 0:
                flow[(ka, kb)] = flow.get((ka, kb), 0) + n
                node_a[ka] = node_a.get(ka, 0) + n
                node_b[kb] = node_b.get(kb, 0) + n
            if ahi <= bhi:
                i += 1
            else:
                j += 1
    flow_max: dict[tuple[str, str], int] = {}
    for (ka, kb), n in flow.items():
        if ka[0] != kb[0]:
            flow_max[(ka[0], kb[0])] = max(flow_max.get((ka[0], kb[0]), 0), n)
    node_list = [(k[0], n) for k, n in node_a.items()] + [(k[0], n) for k, n in node_b.items()]
    return _Flows(per_sample=per_sample, cross=cross, pieces=pieces, node_samples=node_list, cross_flow_max=flow_max,
                  src_nodes=len(node_a))


def _node_pieces(topo: Topology, stage: Stage, copies: int) -> list[list[tuple[tuple[str, int, int], int, int]]]:
    """Per copy of the pipeline, its stage's node pieces ((cluster, group, node), first sample, end
    sample) in sample order [C4]. Placement: the replicas of group g of every copy (copy after copy,
    replica after replica) fill nodes of ``gpus_per_node`` GPUs, ``gpus_per_node // tp`` replicas per
    node, each group on nodes of its own (so identical pipelines share nodes and their NICs, as the
    runner packs them); a microbatch's samples are laid out group after group, replica after replica."""
    out: list[list[tuple[tuple[str, int, int], int, int]]] = []
    for c in range(copies):
        row, lo = [], 0
        for gi, g in enumerate(stage.groups):
            per_node = replicas_per_node(topo.cluster(g.cluster).gpus_per_node, g.tp)
            r = 0
            while r < g.dp:
                node = (c * g.dp + r) // per_node
                n = min(g.dp - r, (node + 1) * per_node - (c * g.dp + r))
                row.append(((g.cluster, gi, node), lo + r * g.mbs, lo + (r + n) * g.mbs))
                r += n
            lo += g.samples
        out.append(row)
    return out


def _wan_loads(inst: Instance, tables: CostTables, pipes: tuple[Pipeline, ...], copies: int = 1) -> dict[tuple[str, str], float]:
    """[C4w] Bytes per microbatch on each direction of each inter-cluster link, summed over every
    boundary of every pipeline (activations forward, their gradients backward): what the link's
    aggregate cap is shared by."""
    load: dict[tuple[str, str], float] = {}
    for pipe, count in Counter(pipes).items():
        for si in range(len(pipe.stages) - 1):
            flows = _boundary_flows(inst, tables, pipe, si, nodes=False)
            bound = pipe.boundary(si)
            f_fwd = link_bytes_factor(inst.model.dtype, bound.fwd)
            f_bwd = link_bytes_factor(inst.model.dtype, bound.bwd)
            for (a, b), n in flows.cross.items():
                load[(a, b)] = load.get((a, b), 0.0) + count * copies * n * flows.per_sample * f_fwd
                load[(b, a)] = load.get((b, a), 0.0) + count * copies * n * flows.per_sample * f_bwd
    return load


def _joint_ends(inst: Instance, tables: CostTables, copies: Counter[Pipeline]) -> dict[Pipeline, list[float]]:
    """[C4j] Per stage the last backward end of each pipeline that shares a capped link direction with a
    different pipeline, its group (with identical copies) replayed in one timeline (``joint.joint_ends``)."""
    pipes = list(copies)
    loads = [_wan_loads(inst, tables, (p,), copies[p]) for p in pipes]
    capped = {d for load in loads for d in load if inst.topology.link_spec(*d).aggregate is not None}
    ends = joint_ends(loads, capped, [len(p.stages) for p in pipes],
                      lambda i, off: _piece_parts(inst, tables, pipes[i], copies[pipes[i]], {}, off), PIECE_REPLAY_OPS)
    return {pipes[i]: e for i, e in ends.items()}


def stage_boundary_time(
    inst: Instance,
    tables: CostTables,
    pipe: Pipeline,
    si: int,
    wan_loads: dict[tuple[str, str], float] | None = None,
    copies: int = 1,
) -> tuple[float, float]:
    """Seconds to move one microbatch's activations (forward) and gradients (backward) from stage
    ``si`` to ``si + 1`` [C4]: the slowest of (a) every node's NIC carrying what the node's GPUs send
    or receive (``inter_node`` is per node, shared by its GPUs) and (b) every inter-cluster link
    direction, priced per flow (largest node-pair flow at the per-flow bandwidth) and, where the link
    has an aggregate cap, the link's total load (``wan_loads``: every boundary of every pipeline that
    crosses it [C4w]; when omitted, this pipeline's) at the cap. The pipeline is one of ``copies``
    identical ones, whose replicas share nodes (and the links' loads when ``wan_loads`` is omitted). A
    compressed boundary adds its (de)quantisation time [C4q]."""
    flows = _boundary_flows(inst, tables, pipe, si, copies)
    loads = wan_loads if wan_loads is not None else _wan_loads(inst, tables, (pipe,), copies)
    bound = pipe.boundary(si)
    topo = inst.topology
    out = []
    for prec, backward in ((bound.fwd, False), (bound.bwd, True)):
        factor = link_bytes_factor(inst.model.dtype, prec)
        nbytes = flows.per_sample * factor
        t = 0.0
        for c, n in flows.node_samples:
            t = max(t, nic_time(topo.cluster(c).inter_node, n * nbytes))
        for (a, b), n in flows.cross_flow_max.items():
            channel = (b, a) if backward else (a, b)
            t = max(t, flows_time(topo.link_spec(*channel), n * nbytes, loads.get(channel, 0.0)))
        pieces = [(b, a, n) for a, b, n in flows.pieces] if backward else flows.pieces
        out.append(t + quantisation_time(inst, prec, factor, flows.per_sample, pieces))
    return out[0], out[1]


def boundary_nic_seconds(inst: Instance, tables: CostTables, pipe: Pipeline, si: int,
                         copies: int = 1) -> tuple[tuple[float, float, float, float], tuple[float, float, float, float]]:
    """[C3n] What boundary si's messages need of the node NICs at its ends: per direction (seconds of the
    sending node's outbound NIC, of the receiving node's inbound NIC, flows on the first, flows on the
    second), without latency, on the fullest node of each side (the NIC part of [C4]'s ``nic_time``).
    Forward: stage si sends, stage si + 1 receives; backward the other way. A flow is one replica pair
    whose rows overlap (the runner's pieces), summed over the ``copies`` identical pipelines that share
    the nodes. A stage's outbound NIC also carries its other boundary's messages (``replay_shared_nics``)."""
    flows = _boundary_flows(inst, tables, pipe, si, nodes=False)
    topo = inst.topology
    samples: list[dict[tuple[str, int, int], int]] = [{}, {}]
    pieces: list[dict[tuple[str, int, int], int]] = [{}, {}]
    for c in range(copies):  # both sides tile the microbatch's rows in order: sweep them
        pa, pb = _replica_nodes(topo, pipe.stages[si], c), _replica_nodes(topo, pipe.stages[si + 1], c)
        i = j = 0
        while i < len(pa) and j < len(pb):
            (ka, alo, ahi), (kb, blo, bhi) = pa[i], pb[j]
            n = min(ahi, bhi) - max(alo, blo)
            if n > 0:
                for side, key in ((0, ka), (1, kb)):
                    samples[side][key] = samples[side].get(key, 0) + n
                    pieces[side][key] = pieces[side].get(key, 0) + 1
            if ahi <= bhi:
                i += 1
            else:
                j += 1
    bound = pipe.boundary(si)
    out = []
    for prec, backward in ((bound.fwd, False), (bound.bwd, True)):
        nbytes = flows.per_sample * link_bytes_factor(inst.model.dtype, prec)
        res = []
        for side in ((1, 0) if backward else (0, 1)):  # (sender, receiver)
            best = (0.0, 1.0)
            for key, n in samples[side].items():
                nic = topo.cluster(key[0]).inter_node
                best = max(best, (nic_time(nic, n * nbytes) - nic.latency_s, float(pieces[side][key])))
            res.append(best)
        out.append((res[0][0], res[1][0], res[0][1], res[1][1]))
    return out[0], out[1]


PIECE_REPLAY_OPS = 50_000
"""[C3s] The most operations (classes of interchangeable replicas of every stage, ``pieces.compress``,
times 2m) a pipeline with a spanning stage is replayed piece by piece for (``piece_timeline``); a
larger one keeps the stage-level [C3]/[C3x]/[C3n] composition (a work limit, so the verdict does not
depend on the machine)."""


def spans_clusters(pipe: Pipeline) -> bool:
    """[C3s] Whether a stage of ``pipe`` (1F1B or GPipe) has replica groups in more than one cluster: its
    pieces then run on different links and the stage-level form does not describe the runner."""
    return len(pipe.stages) > 1 and any(len(st.clusters()) > 1 for st in pipe.stages)


def piece_timeline(inst: Instance, tables: CostTables, pipe: Pipeline, copies: int = 1,
                   wan_loads: dict[tuple[str, str], float] | None = None, *, classes: bool = True) -> list[float] | None:
    """[C3s] Each stage's last backward end (latest replica) in the replica-by-replica replay
    (``pieces.replay_pieces``) of ``copies`` identical pipelines, or None when it is larger than
    ``PIECE_REPLAY_OPS``. Replicas, rows and nodes as the runner lays them out (:func:`_replica_nodes`,
    copies on shared nodes); each replica's forward/backward seconds are its own group's [C2]; each
    piece (replica pair with overlapping rows) is a message per direction through its sender's NIC
    out, its receiver's NIC in and, across clusters, the node pair's per-flow bandwidth and the link
    direction's aggregate cap [C4]/[C4w]; a cap is shared with the other pipelines' boundaries in
    proportion to their load on it (``wan_loads``: every pipeline's [C4w] load; when omitted, this
    pipeline's). Delay: the largest latency on the way plus the piece's (de)quantisation [C4q]."""
    own = _wan_loads(inst, tables, (pipe,), copies)
    share = {k: (v / wan_loads[k] if wan_loads and wan_loads.get(k, 0.0) > 0 else 1.0) for k, v in own.items()}
    orders, times, pieces = _piece_parts(inst, tables, pipe, copies, share)
    if classes:  # interchangeable replicas replayed once (``classes=False``: every replica, for tests)
        times, pieces = compress(times, pieces)
    if 2 * pipe.num_microbatches * sum(len(t) for t in times) > PIECE_REPLAY_OPS:
        return None
    return [max(e) for e in replay_pieces(orders, times, pieces)]


def _piece_parts(inst: Instance, tables: CostTables, pipe: Pipeline, copies: int,
                 share: dict[tuple[str, str], float], offset: int = 0) -> Parts:
    """[C3s] The replica-by-replica replay's inputs of ``copies`` identical pipelines (``piece_timeline``);
    ``offset``: added to the stage numbers in the messages' resource keys (pipelines replayed together
    [C4j] keep their NICs apart)."""
    S, m = len(pipe.stages), pipe.num_microbatches
    reps = [[r for c in range(copies) for r in _replica_nodes(inst.topology, st, c)] for st in pipe.stages]
    topo = inst.topology
    times = []
    for st in pipe.stages:
        row = []
        for g in st.groups:
            tab = tables.table(topo.cluster(g.cluster).gpu, g.tp)
            f, b = stage_times(tab, g.mbs, st.start, st.end, st.recompute == "full")
            row += [(float(f), float(b))] * g.dp
        times.append(row * copies)
    pieces = []
    for si in range(S - 1):
        per_sample = float(tables.activation_bytes[pipe.stages[si].end - 1])
        bound = pipe.boundary(si)
        precs = [(prec, link_bytes_factor(inst.model.dtype, prec)) for prec in (bound.fwd, bound.bwd)]
        n_a = len(reps[si]) // copies
        n_b = len(reps[si + 1]) // copies
        for c in range(copies):
            pa, pb = reps[si][c * n_a:(c + 1) * n_a], reps[si + 1][c * n_b:(c + 1) * n_b]
            i = j = 0
            while i < len(pa) and j < len(pb):
                (ka, alo, ahi), (kb, blo, bhi) = pa[i], pb[j]
                n = min(ahi, bhi) - max(alo, blo)
                if n > 0:
                    a, b = (offset + si, *ka), (offset + si + 1, *kb)
                    msgs = [_piece_message(inst, ends, n, per_sample, prec, factor, share)
                            for ends, (prec, factor) in zip(((a, b), (b, a)), precs)]
                    pieces.append(Piece(boundary=si, src=c * n_a + i, dst=c * n_b + j, fwd=msgs[0], bwd=msgs[1]))
                if ahi <= bhi:
                    i += 1
                else:
                    j += 1
    orders = [[(op.kind, op.microbatch) for op in stage_ops(pipe.schedule, s, S, m)] for s in range(S)]
    return orders, times, pieces


def _piece_message(inst: Instance, ends: tuple[tuple[int, str, int, int], tuple[int, str, int, int]], samples: int,
                   per_sample: float, prec: str, factor: float, share: dict[tuple[str, str], float]) -> Message:
    """[C3s] One piece's message from node ``ends[0]`` to node ``ends[1]`` ((stage, cluster, group, node):
    every (stage, group) on nodes of its own)."""
    topo = inst.topology
    (sa, a, ga, na), (sb, b, gb, nb) = ends
    src_nic, dst_nic = topo.cluster(a).inter_node, topo.cluster(b).inter_node
    res: list[tuple[object, Bandwidth]] = [(("out", sa, a, ga, na), src_nic), (("in", sb, b, gb, nb), dst_nic)]
    lat = max(src_nic.latency_s, dst_nic.latency_s)
    if a != b:
        link = topo.link_spec(a, b)
        res.append((("pair", sa, a, ga, na, sb, b, gb, nb), link.bandwidth))
        lat = max(lat, link.bandwidth.latency_s)
        if link.aggregate is not None:
            f = share.get((a, b), 1.0)
            res.append((("cap", a, b), link.aggregate if f >= 1.0 else link.aggregate.scaled(f)))
            lat = max(lat, link.aggregate.latency_s)
    quant = quantisation_time(inst, prec, factor, per_sample, [(a, b, samples)])
    return Message(nbytes=samples * per_sample * factor, resources=tuple(res), delay_s=lat + quant)


def _replica_nodes(topo: Topology, stage: Stage, copy: int) -> list[tuple[tuple[str, int, int], int, int]]:
    """Every replica of ``stage`` in copy ``copy`` of its pipeline: ((cluster, group, node), first row,
    end row), rows group after group, replica after replica, nodes as :func:`_node_pieces` places them."""
    out, lo = [], 0
    for gi, g in enumerate(stage.groups):
        per_node = replicas_per_node(topo.cluster(g.cluster).gpus_per_node, g.tp)
        for d in range(g.dp):
            out.append(((g.cluster, gi, (copy * g.dp + d) // per_node), lo, lo + g.mbs))
            lo += g.mbs
    return out


def boundary_latency(inst: Instance, pipe: Pipeline, si: int) -> tuple[float, float]:
    """[C4] The latency part of boundary si's send times (forward, backward): the largest latency of the
    NICs and inter-cluster links its flows cross (the rest of a send occupies the link; a message
    behind it on the same pair need not wait for the latency). What [C3x]'s replay and the simulator
    (``Resource.latency_s`` of a flow's path) take as latency."""
    topo = inst.topology
    src = {g.cluster for g in pipe.stages[si].groups}
    dst = {g.cluster for g in pipe.stages[si + 1].groups}
    nic = max(topo.cluster(c).inter_node.latency_s for c in src | dst)

    def link(a: str, b: str) -> float:
        lk = topo.link_spec(a, b)
        return max(lk.bandwidth.latency_s, lk.aggregate.latency_s if lk.aggregate is not None else 0.0)

    fwd = max([nic] + [link(a, b) for a in src for b in dst if a != b])
    bwd = max([nic] + [link(b, a) for a in src for b in dst if a != b])
    return fwd, bwd


def boundary_cast_times(inst: Instance, tables: CostTables, pipe: Pipeline, si: int) -> tuple[float, float]:
    """[C4q] The (de)quantisation seconds alone of boundary si (forward, backward)."""
    flows = _boundary_flows(inst, tables, pipe, si, nodes=False)
    bound = pipe.boundary(si)
    out = []
    for prec, backward in ((bound.fwd, False), (bound.bwd, True)):
        factor = link_bytes_factor(inst.model.dtype, prec)
        pieces = [(b, a, n) for a, b, n in flows.pieces] if backward else flows.pieces
        out.append(quantisation_time(inst, prec, factor, flows.per_sample, pieces))
    return out[0], out[1]


def quantisation_time(
    inst: Instance, prec: str, factor: float, per_sample: float, pieces: list[tuple[str, str, int]]
) -> float:
    """[C4q] Casting to a narrower precision is memory bound: the sender reads the native tensor
    (twice for fp8: once for the per-tensor scale) and writes the packed one; the receiver reads the
    packed tensor and writes the native one. ``pieces`` are (sender, receiver, samples)."""
    if factor >= 1.0:
        return 0.0
    reads = 2.0 if prec == "fp8" else 1.0
    worst = 0.0
    for a, b, n in pieces:
        nbytes = n * per_sample
        send = nbytes * (reads + factor) / (inst.topology.cluster(a).memory_bandwidth_gbyte_s * 1e9)
        recv = nbytes * (factor + 1.0) / (inst.topology.cluster(b).memory_bandwidth_gbyte_s * 1e9)
        worst = max(worst, send + recv)
    return worst


def _sample_blocks(stage: Stage) -> list[tuple[str, int, int, int]]:
    """(cluster, first sample, end sample, mbs) of each replica group's block of the microbatch."""
    out, lo = [], 0
    for g in stage.groups:
        out.append((g.cluster, lo, lo + g.samples, g.mbs))
        lo += g.samples
    return out


def _zero_pieces(plan: Plan, tables: CostTables) -> dict[tuple[int, int], tuple[tuple[int, int, int], ...]]:
    """hetgap [C6]: per (pipeline, stage) its layers as sync segments (lo, hi, ZeRO-1 shards): the stage's
    replicas where the segment is sharded (``segment_sharded`` over every holder, the export's rule), else
    1 (``memory.zero_shards``)."""
    cuts = sorted({s.start for p in plan.pipelines for s in p.stages} | {tables.num_layers})
    every = [s for p in plan.pipelines for s in p.stages]
    sharded = {(lo, hi): segment_sharded([s for s in every if s.start <= lo and hi <= s.end])
               for lo, hi in zip(cuts, cuts[1:])}
    out = {}
    for pi, p in enumerate(plan.pipelines):
        for si, st in enumerate(p.stages):
            merged: list[tuple[int, int, int]] = []  # adjacent segments of one shard count as one piece
            for (lo, hi), sh in sharded.items():
                if st.start <= lo and hi <= st.end:
                    z = zero_shards(st.zero == 1 and sh, st.replicas)
                    if merged and merged[-1][2] == z:
                        merged[-1] = (merged[-1][0], hi, z)
                    else:
                        merged.append((lo, hi, z))
            out[(pi, si)] = tuple(merged)
    return out


# ---- gradient synchronisation [C5] ---------------------------------------------------------------
def _stage_sync_times(plan: Plan, inst: Instance, tables: CostTables,
                      segs_loads: SegmentsAndLoads | None = None) -> dict[tuple[int, int], float]:
    """All-reduce seconds per (pipeline, stage) [C5]. Layers are cut into segments at every stage
    boundary of every pipeline, so each segment has one fixed set of replicas that hold it. A stage
    all-reduces its segments one after another; their cross-cluster rings also share each WAN link
    with every other segment's ring over it, all running after the drain [C5w]. ``segs_loads``:
    ``_segments_and_loads`` of ``plan`` when the caller has it."""
    segs, load = segs_loads or _segments_and_loads(plan, inst, tables)
    by_range = {}
    for p in set(plan.pipelines):
        for s in p.stages:
            mine = [v for (lo, hi), v in segs.items() if s.start <= lo and hi <= s.end]
            own = sum(v.intra + v.inter for v in mine)
            by_range[(s.start, s.end)] = max(own, _shared_sync(inst.topology, mine, load))
    return {(pi, si): by_range[(s.start, s.end)] for pi, p in enumerate(plan.pipelines) for si, s in enumerate(p.stages)}


def _shared_sync(topo: Topology, mine: list[SegmentSync], load: dict[frozenset[str], float]) -> float:
    """[C5w] The least time a stage holding the segments ``mine`` needs for its sync when every segment's
    rings over a capped link run together: Σ intra + ring(aggregate, load(pair), k), for each pair of
    each of its segments' clusters (0 without a capped link)."""
    intra = sum(v.intra for v in mine)
    return max((intra + max(_capped_ring(topo.link_spec(a, b), load[pair], len(v.clusters))
                            for a, b in (sorted(pair), sorted(pair, reverse=True)))
                for v in mine for pair in v.pairs()), default=0.0)


def _segments_and_loads(
    plan: Plan, inst: Instance, tables: CostTables
) -> tuple[dict[tuple[int, int], SegmentSync], dict[frozenset[str], float]]:
    """[C5] Every sync segment's all-reduce and [C5w] the gradient bytes all-reduced over each
    unordered cluster pair (a ring over k clusters counted on each of its pairs)."""
    cuts = sorted({s.start for p in plan.pipelines for s in p.stages} | {tables.num_layers})
    segs: dict[tuple[int, int], SegmentSync] = {}
    stages = [s for p in plan.pipelines for s in p.stages]
    load: dict[frozenset[str], float] = {}
    for lo, hi in zip(cuts, cuts[1:]):
        holders = [s for s in stages if s.start <= lo and hi <= s.end]
        seg = segs[(lo, hi)] = segment_sync(inst, tables, holders, lo, hi, plan.grad_sync_precision)
        for pair in seg.pairs():
            load[pair] = load.get(pair, 0.0) + seg.wan_bytes
    return segs, load


def _bucketed_sync(
    plan: Plan, inst: Instance, tables: CostTables, pipes: list[PipelineReport], stages: list[StageReport],
    segs_loads: SegmentsAndLoads | None = None,
) -> tuple[list[StageReport], float]:
    """[C7o] Per stage the end of its last backward (``pipeline.last_backward_ends``) and of its last
    gradient bucket (``gradsync.bucket_schedule``); each bucket priced by [C5] for its layers
    (``segment_allreduce``); the iteration ends with the last optimizer step. Identical pipelines
    have identical times, so each is scheduled once (its replicas still count in the rings)."""
    first: dict[Pipeline, int] = {}
    for pi, pipe in enumerate(plan.pipelines):
        first.setdefault(pipe, pi)
    report = {(r.pipeline, r.stage): r for r in stages}
    ends: dict[tuple[int, int], float] = {}
    for pr in pipes:
        if first[plan.pipelines[pr.index]] != pr.index:
            continue
        st = [report[(pr.index, si)] for si in range(len(plan.pipelines[pr.index].stages))]
        ends_of = list(pr.stage_ends) or last_backward_ends(pr.time_s, [r.bwd_s for r in st], [r.send_bwd_s for r in st])
        for r, e in zip(st, ends_of):
            ends[(r.pipeline, r.stage)] = e
    where = {(pi, si): st for pi in first.values() for si, st in enumerate(plan.pipelines[pi].stages)}
    every = [st for p in plan.pipelines for st in p.stages]
    slowest: dict[tuple[int, int], tuple[GpuTpTable, int, float]] = {}  # the group setting the stage's backward
    for key, st in where.items():
        tab, mbs = max(((tables.table(inst.topology.cluster(g.cluster).gpu, g.tp), g.mbs) for g in st.groups),
                       key=lambda tm: tm[0].times(tm[1], st.start, st.end)[1])
        slowest[key] = (tab, mbs, tab.times(mbs, st.start, st.end)[1])
    cuts = sorted({s.start for p in plan.pipelines for s in p.stages} | {tables.num_layers})
    segs, load = segs_loads or _segments_and_loads(plan, inst, tables)
    buckets: list[Bucket] = []
    phases: list[RingPhase] = []  # per bucket: its rings, the cross-cluster one on the caps [C5w]
    gathers: list[tuple[float, list[tuple[int, int]]]] = []  # ZeRO-1 all-gathers, ascending layers
    for lo, hi in reversed(list(zip(cuts, cuts[1:]))):
        keys = [k for k, st in where.items() if st.start <= lo and hi <= st.end]
        holders = [st for st in every if st.start <= lo and hi <= st.end]
        gather = segment_gather(inst, tables, holders, lo, hi)
        if gather is not None:
            gathers.insert(0, (gather.intra + gather.inter, keys))
        for (x, y), seg in segment_bucket_syncs(inst, tables, holders, lo, hi, plan.grad_bucket_mb,
                                                plan.grad_sync_precision):
            ready = {}
            for k in keys:
                st = where[k]
                tab, mbs, total = slowest[k]
                done = tab.times(mbs, x, st.end)[1] / total if total > 0 else 1.0
                ready[k] = bucket_ready_time(ends[k], report[k].bwd_s, done, plan.overlap_grad_sync)
            buckets.append(Bucket(layers=(x, y), duration_s=seg.intra + seg.inter, ready=ready))
            ring = segment_ring_flow(inst.topology, seg)
            phases.append(RingPhase(intra_s=seg.intra, inter_s=seg.inter, flow=ring and ring[0], tail_s=ring[1] if ring else 0.0))
    # [C5w] / [C7c]: the rings over a capped link share it with the rings and the last backward
    # messages on it at the same moment (processor sharing, hgopt/cost/sharing.py)
    ends, sync_end, _ = _contended_sync(plan, inst, tables, first, ends, buckets, phases,
                                        op_times={k: (report[k].fwd_s, report[k].bwd_s, report[k].send_bwd_s) for k in where})
    rep = {pi: first[p] for pi, p in enumerate(plan.pipelines)}
    out = [replace(r, last_backward_end_s=ends[(rep[r.pipeline], r.stage)], sync_end_s=sync_end[(rep[r.pipeline], r.stage)])
           for r in stages]
    return out, iteration_end(sync_end, {k: report[k].optimizer_s for k in sync_end}, gathers)


# ---- [C5w] / [C7c] rings and the last backward sends sharing capped links ----------------------------
def _contended_sync(plan: Plan, inst: Instance, tables: CostTables, first: dict[Pipeline, int],
                    ends: dict[tuple[int, int], float], buckets: list[Bucket], phases: list[RingPhase],
                    op_times: dict[tuple[int, int], tuple[float, float, float]] | None = None,
                    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """[C5w] / [C7c] The bucket schedule ([C7o], ``gradsync.bucket_schedule_starts``: each stage's sync
    end and first bucket start) and each stage's last backward end, where the buckets' cross-cluster
    rings cross directions of links with an aggregate cap (``segment_ring_flow``): there every ring
    is a flow that shares the cap, moment by moment, with the other rings on it and with the last
    microbatch's backward messages of every pipeline on it (``_last_backward_messages``), by processor
    sharing (``sharing.shared_bucket_schedule``). A message late by δ (against the messages alone)
    moves the last backward of the stage it feeds and of every stage before it by δ, and their
    buckets with it. With overlap an early bucket can start while an earlier microbatch's backward
    message is still on the link: those messages are on it too (each
    boundary's messages one after another, ``sharing.earlier_backward_starts``), and move only the messages after them. A stage whose
    last backward did not wait for the message (it starts later than the message arrives alone) moves
    only by the part of the delay beyond that slack. ``op_times``: each stage's forward, backward and
    backward-receive seconds (None: the last messages only, no slack). Without a capped link under
    any cross-cluster ring this is the plain schedule.
    It is never earlier than the schedule without sharing (every bound of the uncontended [C7o]
    stays one). Returns (ends, sync_end, first_start)."""
    if not any(ph.flow is not None for ph in phases):
        sync_end, first_start = bucket_schedule_starts(buckets, ends)
        return ends, sync_end, first_start
    topo = inst.topology
    used = {d for ph in phases if ph.flow is not None for d in ph.flow.dirs}
    caps = {d: topo.link_spec(*d).aggregate for d in used}
    copies = Counter(plan.pipelines)
    horizon = min((r for bk, ph in zip(buckets, phases) if ph.flow is not None for r in bk.ready.values()), default=math.inf)
    messages = []
    for pipe, pi in first.items():
        for j in reversed(range(len(pipe.stages) - 1)):
            parts = tuple(CapFlow(nbytes=total / n, limit=bandwidth_bytes_per_s(per_flow, total / n), dirs=(d,), flows=n)
                          for d, total, n, per_flow in _last_backward_messages(inst, tables, pipe, j, copies[pipe])
                          if d in used and total > 0)
            earlier: tuple[tuple[float, tuple[CapFlow, ...]], ...] = ()
            slack = 0.0
            if parts and op_times is not None:
                slack = max(0.0, ends[(pi, j)] - op_times[(pi, j)][1] - ends[(pi, j + 1)] - op_times[(pi, j)][2])
                least = max(max(p.nbytes / p.limit,
                                p.flows * p.message / bandwidth_bytes_per_s(caps[p.dirs[0]], p.flows * p.message))  # type: ignore[arg-type]
                            for p in parts)
                starts = earlier_backward_starts(stage_ops(pipe.schedule, j + 1, len(pipe.stages), pipe.num_microbatches),
                                                 ends[(pi, j + 1)], *op_times[(pi, j + 1)][:2], least, horizon - least)
                earlier = tuple((t, parts) for t in starts)
            messages.append(BoundaryMessage(start_s=ends[(pi, j + 1)], sender=(pi, j + 1), receiver=(pi, j), parts=parts,
                                            earlier=earlier, slack_s=slack))
    return shared_bucket_schedule(buckets, phases, ends, caps, messages)  # type: ignore[arg-type]


def _last_backward_messages(inst: Instance, tables: CostTables, pipe: Pipeline, si: int,
                            copies: int) -> list[tuple[tuple[str, str], float, int, Bandwidth]]:
    """[C7c] The backward message of the last microbatch over boundary si (stage si + 1 to si, sent when
    stage si + 1's last backward ends) of ``copies`` identical pipelines, per direction of a link with
    an aggregate cap: its bytes, its flows (one per replica pair whose rows overlap, the runner's
    pieces) and the link's per-flow bandwidth."""
    topo = inst.topology
    flows = _boundary_flows(inst, tables, pipe, si, nodes=False)
    nbytes = flows.per_sample * link_bytes_factor(inst.model.dtype, pipe.boundary(si).bwd)
    pairs: Counter[tuple[str, str]] = Counter()
    pa, pb = _replica_nodes(topo, pipe.stages[si], 0), _replica_nodes(topo, pipe.stages[si + 1], 0)
    i = j = 0
    while i < len(pa) and j < len(pb):
        (ka, alo, ahi), (kb, blo, bhi) = pa[i], pb[j]
        if min(ahi, bhi) > max(alo, blo) and ka[0] != kb[0]:
            pairs[(kb[0], ka[0])] += 1
        if ahi <= bhi:
            i += 1
        else:
            j += 1
    out = []
    for (a, b), n in flows.cross.items():
        link = topo.link_spec(b, a)
        if link.aggregate is None:
            continue
        out.append(((b, a), copies * n * nbytes, copies * max(pairs[(b, a)], 1), link.bandwidth))
    return out


# ---- WAN traffic per iteration (for egress prices) --------------------------------------------------
def wan_bytes_per_iteration(plan: Plan, inst: Instance, tables: CostTables | None = None) -> dict[tuple[str, str], float]:
    """Bytes one iteration sends over each directed inter-cluster link: every pipeline's boundary
    activations and their gradients ([C4w] loads per microbatch, ``_wan_loads``, times its m) plus each
    sync segment's cross-cluster ring ([C5], ``segment_allreduce``'s WAN bytes; ring c_0 → c_1 → … →
    c_0 in the segment's cluster order, each edge 2(k − 1)/k of them)."""
    tables = tables or build_tables(inst)
    out: dict[tuple[str, str], float] = {}
    for pipe, count in Counter(plan.pipelines).items():
        for link, nbytes in _wan_loads(inst, tables, (pipe,)).items():
            out[link] = out.get(link, 0.0) + count * pipe.num_microbatches * nbytes
    cuts = sorted({s.start for p in plan.pipelines for s in p.stages} | {tables.num_layers})
    stages = [s for p in plan.pipelines for s in p.stages]
    for lo, hi in zip(cuts, cuts[1:]):
        holders = [s for s in stages if s.start <= lo and hi <= s.end]
        seg = segment_sync(inst, tables, holders, lo, hi, plan.grad_sync_precision)
        k = len(seg.clusters)
        for i, a in enumerate(seg.clusters):
            b = seg.clusters[(i + 1) % k]
            out[(a, b)] = out.get((a, b), 0.0) + ring_edge_bytes(seg.wan_bytes, k)
    return out
