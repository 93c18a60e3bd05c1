"""[C9] The outer synchronisation of DiLoCo-style training (issue #15): every formula of it lives here.

A plan with ``Plan.outer`` splits its pipelines into groups. Inside a group everything is as today
(``evaluate`` prices the group's pipelines as a plan of their own on the group's clusters, with the
group's share of the batch); the groups never exchange gradients. Every H inner steps the parameter
deltas are averaged across the groups and an outer SGD step with Nesterov momentum is applied.

Model (lock-step): every group runs the same H inner steps per outer round, so the slowest group paces
the round and the others wait for it at the outer exchange: ``t_inner = max_g t_g``. (The search
balances the groups' shares of the batch so that they take about as long.)

One outer round (H inner steps) takes

    T_round = H · t_inner + Σ_f exposed_f + Σ_f update_f

over the delta's fragments f (one without streaming). A fragment's sync is
``cross_f + bcast_f``: ``cross_f`` is a ring all-reduce among one holder per group of every layer
segment (layers cut at every stage start of every pipeline, as [C5] cuts them), each segment's ring
one flow per edge at the per-flow rate of the link between the two groups (the fastest cluster pair
of the two groups; the slowest group pair bounds the ring), the rings of all segments together
through a link's aggregate cap ([C5w], ``links.ring_time``) and each end's node NIC; the exchange
moves ``2(K−1)/K`` of the delta bytes per edge (fp8/int8 deltas are exchanged reduce-scatter then
all-gather, each part quantised with its per-block scales, so the same volume). ``bcast_f`` hands the
averaged delta to the other holders of the segment inside the group, priced as [C5]'s ring inside
the cluster (``links.ring_bandwidth``; an upper bound of a broadcast) plus the group's WAN ring when
the group spans clusters. ``exposed_f`` is the sync itself, or with ``overlap`` what is left of it
after the next H/F inner steps (``max(0, sync_f − H/F · t_inner)``; WAN contention with the inner
steps is not modelled). ``update_f``: the outer Nesterov step over the fragment's parameters, priced
as one inner optimizer step over them ([C6]'s profiled update time; both are an elementwise pass over
the parameters and their state).

Delta bytes per element: fp32 4, bf16 2, fp8/int8 1 plus one fp32 scale per ``block`` elements;
``native``: the training dtype.

Throughput: ``H · G · seq / T_round`` tokens/s; WAN bytes per inner step: the groups' own WAN
traffic (``wan_bytes_per_iteration`` of each group's plan) plus the outer round's WAN bytes over H;
outer synchronisations per 10⁹ tokens: ``1e9 / (H · G · seq)``. Fluid bound of the grouping: every
group at its own pace with no outer sync, ``Σ_g G_g · seq / t_g``.

GPU memory of the outer state (a copy of the parameters at the last outer step and the momentum,
8 bytes per parameter in fp32, kept on the device by ``hgopt/runner/outer.py``) is charged: a stage
whose peak [C6] plus the outer state of its layers exceeds its GPUs' memory makes the plan infeasible
(the stage's peak is its group closest to the limit, the state its groups' largest: exact when a stage's
groups are alike, conservative otherwise); it is reported as ``outer_state_bytes_per_gpu``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from hgopt.cost.comm import ring_edge_bytes
from hgopt.cost.evaluate import Evaluation, evaluate, wan_bytes_per_iteration
from hgopt.cost.links import ring_bandwidth, ring_time
from hgopt.cost.tables import CostTables, allreduce_time, build_tables
from hgopt.plan import DeltaPrecision, Plan, validate
from hgopt.spec import DTYPE_BYTES, Instance, Topology

__all__ = [
    "DELTA_ELEMENT_BYTES",
    "GroupCost",
    "OuterEvaluation",
    "delta_bytes",
    "evaluate_outer",
    "fragment_ranges",
    "group_instance",
    "group_plan",
    "outer_syncs_per_billion_tokens",
]

DELTA_ELEMENT_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}
SCALE_BYTES = 4.0
"""One fp32 scale per block of an fp8/int8 delta."""
OUTER_STATE_BYTES_PER_PARAM = 8.0
"""fp32 copy of the parameters at the last outer step + fp32 outer momentum."""


def delta_bytes(params: float, precision: DeltaPrecision | str, native_bytes: float, block: int) -> float:
    """[C9] Bytes of the delta of ``params`` parameters in ``precision`` (fp8/int8 with their scales)."""
    if params <= 0:
        return 0.0
    elem = native_bytes if precision == "native" else DELTA_ELEMENT_BYTES[precision]
    scales = math.ceil(params / block) * SCALE_BYTES if precision in ("fp8", "int8") else 0.0
    return params * elem + scales


def fragment_ranges(num_layers: int, fragments: int) -> list[tuple[int, int]]:
    """The layer ranges of the streamed fragments: ``fragments`` contiguous ranges of (nearly) equal
    layer counts, in order (fragment k is synchronised k·H/F steps after fragment 0)."""
    cuts = [k * num_layers // fragments for k in range(fragments + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def outer_syncs_per_billion_tokens(steps: int, global_batch: int, seq_len: int) -> float:
    """[C9] Outer synchronisations per 10⁹ tokens: one per H inner steps of G · seq tokens."""
    return 1e9 / (steps * global_batch * seq_len)


def group_plan(plan: Plan, pipelines: Sequence[int]) -> Plan:
    """The plan of one group: its pipelines, synchronous among themselves."""
    return dataclasses.replace(plan, pipelines=tuple(plan.pipelines[i] for i in pipelines), outer=None)


def group_instance(instance: Instance, clusters: Sequence[str], global_batch: int) -> Instance:
    """``instance`` restricted to ``clusters`` (and the links among them) training ``global_batch``."""
    keep = set(clusters)
    topo = Topology(clusters=tuple(c for c in instance.topology.clusters if c.name in keep),
                    links=tuple(lk for lk in instance.topology.links if lk.src in keep and lk.dst in keep))
    return dataclasses.replace(instance, name=f"{instance.name}[{'+'.join(clusters)}]", topology=topo,
                               job=dataclasses.replace(instance.job, global_batch=global_batch))


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupCost:
    pipelines: tuple[int, ...]
    clusters: tuple[str, ...]
    samples: int
    """Samples of one inner step of this group."""
    gpus: int
    inner_step_s: float
    """``evaluate``'s iteration time of the group's plan alone."""
    wan_bytes_per_step: float
    """WAN bytes of one inner step inside the group (boundaries and gradient rings across its clusters)."""
    feasible: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterEvaluation:
    steps: int
    precision: str
    groups: tuple[GroupCost, ...]
    inner_step_s: float
    """The slowest group's inner step (lock-step rounds)."""
    delta_bytes: float
    """Bytes of the whole model's delta in the exchange precision."""
    sync_s: float
    """One outer synchronisation of every fragment, nothing overlapped (cross-group ring + broadcast)."""
    exposed_sync_s: float
    """What of ``sync_s`` one round waits for (all of it without overlap)."""
    update_s: float
    round_s: float
    """H inner steps + exposed sync + outer update."""
    step_time_s: float
    """``round_s / H``: the amortised time of one inner step."""
    tokens_per_s: float
    fluid_tokens_per_s: float
    """Every group at its own pace, no outer sync (an upper bound of this grouping)."""
    wan_bytes_per_step: float
    outer_wan_bytes_per_round: float
    syncs_per_billion_tokens: float
    gpus_used: int
    outer_state_bytes_per_gpu: float
    """Largest per-GPU outer state (charged to GPU memory, see the module docstring)."""
    feasible: bool
    violations: tuple[str, ...]


def evaluate_outer(plan: Plan, instance: Instance, tables: CostTables | None = None) -> OuterEvaluation:
    """[C9] Throughput and traffic of ``plan`` (which must have ``plan.outer``) on ``instance``."""
    if plan.outer is None:
        raise ValueError("evaluate_outer: the plan has no outer synchronisation (use evaluate)")
    o = plan.outer
    tables = tables or build_tables(instance)
    violations = [str(v) for v in validate(plan, instance)]
    if violations:
        return _infeasible(plan, violations)
    topo = instance.topology
    groups: list[GroupCost] = []
    for members in o.groups:
        sub = group_plan(plan, members)
        clusters = tuple(sub.gpus_by_cluster())
        samples = sum(p.samples for p in sub.pipelines)
        inst_g = group_instance(instance, clusters, samples)
        ev = evaluate(sub, inst_g, tables)
        violations.extend(f"group {len(groups)}: {v}" for v in ev.violations)
        violations.extend(f"group {len(groups)}: {v}" for v in _outer_state_violations(sub, instance, tables, ev))
        wan = sum(wan_bytes_per_iteration(sub, inst_g, tables).values())
        groups.append(GroupCost(pipelines=tuple(members), clusters=clusters, samples=samples, gpus=sub.num_gpus(),
                                inner_step_s=ev.iteration_time_s, wan_bytes_per_step=wan, feasible=ev.feasible))
    shared = [c for i, g in enumerate(groups) for c in g.clusters if any(c in h.clusters for h in groups[i + 1 :])]
    if shared:
        violations.append(f"outer.groups: groups share cluster(s) {', '.join(sorted(set(shared)))} (the outer exchange "
                          "is priced over the links between the groups' clusters)")
    if any(not math.isfinite(g.inner_step_s) for g in groups) or shared:
        return _infeasible(plan, violations)
    native = DTYPE_BYTES[instance.model.dtype]
    K = len(groups)
    cuts = sorted({s.start for p in plan.pipelines for s in p.stages} | {tables.num_layers})
    params = _full_params(instance)
    t_inner = max(g.inner_step_s for g in groups)
    H, F = o.steps, o.fragments
    sync_total = exposed = update = round_wan = 0.0
    for lo, hi in fragment_ranges(tables.num_layers, F):
        segs = [(max(a, lo), min(b, hi)) for a, b in zip(cuts, cuts[1:]) if min(b, hi) > max(a, lo)]
        seg_bytes = [delta_bytes(float(params[b] - params[a]), o.precision, native, o.block) for a, b in segs]
        cross = _cross_group_time(topo, [g.clusters for g in groups], max(seg_bytes), sum(seg_bytes))
        bcast = max(_broadcast_time(plan, instance, tables, members, a, b, nb, native)
                    for members in o.groups for (a, b), nb in zip(segs, seg_bytes))
        sync = cross + bcast
        sync_total += sync
        exposed += max(0.0, sync - (H / F) * t_inner) if o.overlap else sync
        update += _update_time(plan, instance, tables, lo, hi)
        round_wan += sum(K * ring_edge_bytes(nb, K) for nb in seg_bytes)
        for members in o.groups:
            k_g = len(group_plan(plan, members).gpus_by_cluster())
            round_wan += sum(k_g * ring_edge_bytes(nb, k_g) for nb in seg_bytes) if k_g > 1 else 0.0
    round_s = H * t_inner + exposed + update
    G, seq = instance.job.global_batch, instance.job.seq_len
    state = max((OUTER_STATE_BYTES_PER_PARAM * float(tables.table(topo.cluster(g.cluster).gpu, g.tp).params[s.end]
                                                      - tables.table(topo.cluster(g.cluster).gpu, g.tp).params[s.start])
                 for p in plan.pipelines for s in p.stages for g in s.groups), default=0.0)
    return OuterEvaluation(
        steps=H, precision=o.precision, groups=tuple(groups), inner_step_s=t_inner,
        delta_bytes=delta_bytes(float(params[-1] - params[0]), o.precision, native, o.block),
        sync_s=sync_total, exposed_sync_s=exposed, update_s=update, round_s=round_s, step_time_s=round_s / H,
        tokens_per_s=H * G * seq / round_s,
        fluid_tokens_per_s=sum(g.samples * seq / g.inner_step_s for g in groups),
        wan_bytes_per_step=sum(g.wan_bytes_per_step for g in groups) + round_wan / H,
        outer_wan_bytes_per_round=round_wan,
        syncs_per_billion_tokens=outer_syncs_per_billion_tokens(H, G, seq),
        gpus_used=plan.num_gpus(), outer_state_bytes_per_gpu=state,
        feasible=not violations and all(g.feasible for g in groups), violations=tuple(violations),
    )


def _outer_state_violations(sub: Plan, instance: Instance, tables: CostTables, ev: Evaluation) -> list[str]:
    """[C9] Stages whose peak memory [C6] plus the outer state of their layers does not fit their GPUs."""
    topo, out = instance.topology, []
    for r in ev.stages:
        st = sub.pipelines[r.pipeline].stages[r.stage]
        state = max(OUTER_STATE_BYTES_PER_PARAM * float(tables.table(topo.cluster(g.cluster).gpu, g.tp).params[st.end]
                                                        - tables.table(topo.cluster(g.cluster).gpu, g.tp).params[st.start])
                    for g in st.groups)
        if r.peak_memory_bytes + state > r.memory_capacity_bytes:
            out.append(f"pipeline {r.pipeline} stage {r.stage}: peak {r.peak_memory_bytes / 1e9:.1f} GB + outer state "
                       f"{state / 1e9:.1f} GB exceeds {r.memory_capacity_bytes / 1e9:.1f} GB per GPU")
    return out


def _full_params(instance: Instance) -> list[float]:
    """Prefix sums of the full (unsharded) parameters per layer (the model profile's counts)."""
    out = [0.0]
    for layer in instance.model.layers:
        out.append(out[-1] + float(layer.params))
    return out


def _cross_group_time(topo: Topology, groups: Sequence[Sequence[str]], own_bytes: float, total_bytes: float) -> float:
    """The ring among one holder per group: each pair of groups over its fastest cluster pair (both
    directions), the slowest such pair bounding the ring ([C5], [C5w]); every end's node NIC carries
    its segment's ring ([C5])."""
    K = len(groups)
    if K < 2 or own_bytes <= 0:
        return 0.0
    pair_t = []
    for i, A in enumerate(groups):
        for B in groups[i + 1 :]:
            pair_t.append(min(max(ring_time(topo.link_spec(a, b), own_bytes, K, total_bytes),
                                  ring_time(topo.link_spec(b, a), own_bytes, K, total_bytes))
                              for a in A for b in B))
    nic = max(allreduce_time(topo.cluster(c).inter_node, own_bytes, K) for g in groups for c in g)
    return max(max(pair_t), nic)


def _broadcast_time(plan: Plan, instance: Instance, tables: CostTables, members: Sequence[int], lo: int, hi: int,
                    nbytes: float, native: float) -> float:
    """The averaged delta of layers [lo, hi) to every holder in one group: [C5]'s ring inside each
    cluster over its holders (per tp shard), plus the group's WAN ring when it spans clusters."""
    topo = instance.topology
    per_cluster: dict[str, list[tuple[int, int]]] = {}
    for i in members:
        for s in plan.pipelines[i].stages:
            if s.start <= lo and hi <= s.end:
                for g in s.groups:
                    per_cluster.setdefault(g.cluster, []).append((g.tp, g.dp))
    t = 0.0
    for name, held in per_cluster.items():
        c = topo.cluster(name)
        n = sum(dp for _, dp in held)
        tp_min, tp_max = min(tp for tp, _ in held), max(tp for tp, _ in held)
        bw = ring_bandwidth(c.intra_node, c.inter_node, c.gpus_per_node, n, tp_max, tp_min)
        t = max(t, allreduce_time(bw, nbytes / tp_min, n))
    names = tuple(per_cluster)
    if len(names) > 1:
        t += max(ring_time(topo.link_spec(a, b), nbytes, len(names)) for a in names for b in names if a != b)
    return t


def _update_time(plan: Plan, instance: Instance, tables: CostTables, lo: int, hi: int) -> float:
    """The outer step over layers [lo, hi) on the slowest holder: [C6]'s profiled optimizer-step
    seconds of the part of its stage inside [lo, hi)."""
    t = 0.0
    for p in plan.pipelines:
        for s in p.stages:
            a, b = max(s.start, lo), min(s.end, hi)
            if b <= a:
                continue
            for g in s.groups:
                tab = tables.table(instance.topology.cluster(g.cluster).gpu, g.tp)
                t = max(t, float(tab.update[b] - tab.update[a]))
    return t


def _infeasible(plan: Plan, violations: list[str]) -> OuterEvaluation:
    o = plan.outer
    assert o is not None
    return OuterEvaluation(steps=o.steps, precision=o.precision, groups=(), inner_step_s=math.inf, delta_bytes=0.0,
                           sync_s=math.inf, exposed_sync_s=math.inf, update_s=math.inf, round_s=math.inf,
                           step_time_s=math.inf, tokens_per_s=0.0, fluid_tokens_per_s=0.0, wan_bytes_per_step=0.0,
                           outer_wan_bytes_per_round=0.0, syncs_per_billion_tokens=math.nan,
                           gpus_used=plan.num_gpus(), outer_state_bytes_per_gpu=0.0, feasible=False,
                           violations=tuple(violations))
