"""``metis``: the search of Metis (Um et al., "Metis: Fast Automatic Distributed Training on
Heterogeneous GPUs", USENIX ATC'24), implemented here from the paper's and README's description.

Metis's plan space, as published:

- **Device-type ordering.** The GPUs are listed by device type; Metis tries every ordering of the
  device types along the pipeline. Inside a type the nodes keep their hostfile order (here: the
  instance's cluster order). Metis knows device types, not regions.
- **Device groups.** The ordered device list is cut into consecutive device groups, one per
  pipeline stage, each a power of two in size. A group may straddle two device types (a
  heterogeneous stage).
- **Intra-stage (dp, tp).** Each stage picks dp × tp = group size; Metis prefers data parallelism
  over tensor parallelism: the smallest tp with which the stage fits in memory.
- **Data load balancer.** A stage's share of each microbatch is split over its replicas in
  proportion to their speed (so a fast GPU type gets more samples than a slow one).
- **Layer load balancer.** Layers are split over the stages in proportion to each stage's compute
  power (sum of its replicas' speeds), then moved between neighbours until every stage fits in memory.
- **Cost estimate.** Metis knows one inter-node bandwidth per node (its cluster file gives
  ``inter_bandwidth`` and ``intra_bandwidth`` per node, no matrix between regions) and does not
  compress links. It therefore plans on a *view* of the instance in which every link between two
  clusters is replaced by the slower of the two clusters' inter-node bandwidths, with no latency;
  its estimate of a candidate is ``evaluate`` on that view (same profiles, same pipeline formula —
  Metis also costs a 1F1B pipeline as (m − 1)·slowest stage + one trip, plus the DP all-reduce).
  The plan it picks is then scored by the caller with ``evaluate`` on the real topology.

Bounding the search (the published search is exhaustive over its space): at most ``max_stages``
stages; the group sizes of one plan lie within a factor ``2**scale_variance`` of each other (Metis's
SCALE_VARIANCE knob); all orderings of the group sizes are tried only up to ``max_permute_len``
stages (Metis's MAX_PERMUTE_LEN), beyond that only ascending and descending sizes; the groups use the
devices maximally (what is left is smaller than the smallest group); the per-replica microbatch never
exceeds the largest profiled batch size (Metis's MAX_PROFILED_BATCH_SIZE); and a wall-clock limit.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from hgopt.cost import evaluate
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.cost.memory import stage_memory, stage_memory_parts
from hgopt.cost.pipeline import in_flight
from hgopt.search.baselines._common import Budget, split_capped
from hgopt.spec import Bandwidth, Cluster, Instance, Link, Topology

__all__ = ["MetisOptions", "metis_view", "plan_metis"]

log = logging.getLogger(__name__)

Segment = tuple[Cluster, int]
"""(cluster, GPUs of that cluster) inside one device group."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MetisOptions:
    time_limit_s: float | None = 30.0
    """Wall-clock limit of the search; the best plan found so far is returned."""
    max_stages: int = 16
    """Deepest pipeline tried."""
    scale_variance: int = 1
    """Group sizes of one plan lie within a factor 2**scale_variance of each other."""
    max_permute_len: int = 4
    """Every ordering of the group sizes is tried up to this many stages; beyond, sorted only."""
    bandwidth: str = "node"
    """What Metis is told as each node's inter-node bandwidth (see :func:`metis_view`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _StageDraft:
    segments: tuple[Segment, ...]
    tp: int


def metis_view(instance: Instance, bandwidth: str = "node") -> Instance:
    """The instance as Metis sees it: one inter-node bandwidth per node and no matrix between regions.

    ``bandwidth="node"`` (the default, Metis's cluster file as written for the machines): every
    inter-cluster link is the slower inter-node bandwidth of its two ends, without latency.
    ``bandwidth="slowest-link"`` (a user who knows the job spans regions and enters the slowest WAN
    link as every node's inter-node bandwidth): every link between nodes — inside a cluster too — is
    that slowest inter-cluster bandwidth, without latency. Either way Metis cannot tell a fast link
    from a slow one."""
    topo = instance.topology
    if bandwidth not in ("node", "slowest-link"):
        raise ValueError(f"metis bandwidth: must be 'node' or 'slowest-link', got {bandwidth!r}")
    clusters = topo.clusters
    if bandwidth == "slowest-link" and topo.links:
        slow = min((link.bandwidth for link in topo.links), key=lambda b: b.gbyte_s)
        one = Bandwidth(gbyte_s=slow.gbyte_s, latency_s=0.0, curve=slow.curve)
        clusters = tuple(dataclasses.replace(c, inter_node=one) for c in clusters)
    links = tuple(
        Link(src=a.name, dst=b.name, bandwidth=_slower(a.inter_node, b.inter_node))
        for a in clusters
        for b in clusters
        if a.name != b.name
    )
    return Instance(
        name=instance.name,
        model=instance.model,
        topology=Topology(clusters=clusters, links=links),
        job=instance.job,
        description=instance.description,
        source=instance.source,
    )


def _slower(a: Bandwidth, b: Bandwidth) -> Bandwidth:
    pick = a if a.gbyte_s <= b.gbyte_s else b
    return Bandwidth(gbyte_s=pick.gbyte_s, latency_s=0.0, curve=pick.curve)


def plan_metis(
    instance: Instance, *, tables: CostTables | None = None, options: MetisOptions = MetisOptions()
) -> Plan | None:
    """Metis's best plan by its own estimate (``None``: nothing in its space fits)."""
    if options.max_stages < 1 or options.scale_variance < 0 or options.max_permute_len < 1:
        raise ValueError("metis options: max_stages and max_permute_len must be >= 1, scale_variance >= 0")
    tables = tables or build_tables(instance)
    view = metis_view(instance, options.bandwidth)
    budget = Budget(options.time_limit_s)
    best: tuple[float, Plan] | None = None
    tried, complete = 0, True
    for groups in _device_groups(instance, tables, options):
        stages = _intra_stage(instance, groups)
        stages = None if stages is None else _resolve_tp(instance, tables, stages)
        if stages is None:
            continue
        for B in _microbatches(instance, stages):
            plan = _balanced_plan(instance, tables, stages, B)
            tried += 1
            if plan is None:
                continue
            ev = evaluate(plan, view, tables)
            if ev.feasible and (best is None or ev.iteration_time_s < best[0]):
                best = (ev.iteration_time_s, plan)
        if budget.exhausted():
            complete = False
            break
    log.debug("metis: %d candidates in %.2f s (%s)", tried, budget.elapsed(), "complete" if complete else "time limit")
    if best is None:
        return None
    meta = (
        ("metis_estimate_s", f"{best[0]:.6g}"),
        ("candidates", str(tried)),
        ("search", "complete" if complete else "stopped at time limit"),
    )
    return Plan(pipelines=best[1].pipelines, planner="metis", instance=instance.name, meta=meta)


# ---- inter-stage: device-type orderings and power-of-two device groups ---------------------------
def _device_groups(
    instance: Instance, tables: CostTables, opt: MetisOptions
) -> Iterator[tuple[tuple[Segment, ...], ...]]:
    """Every (device-type ordering, group-size sequence) as stages' device segments; pipelines too
    short to hold the model's weights, gradients and optimizer state are skipped."""
    clusters = instance.topology.clusters
    types = tuple(dict.fromkeys(c.gpu for c in clusters))
    total = sum(c.num_gpus for c in clusters)
    max_stages = min(opt.max_stages, instance.model.num_layers)
    fewest = min_stages(instance, tables)
    size_seqs = [seq for ms in _size_multisets(total, max_stages, opt.scale_variance) if len(ms) >= fewest
                 for seq in _orderings(ms, opt)]
    size_seqs.sort(key=lambda seq: (len(seq), seq))
    for order in itertools.permutations(types):
        devices = [(c, c.num_gpus) for t in order for c in clusters if c.gpu == t]
        for seq in size_seqs:
            yield _cut(devices, seq)


def min_stages(instance: Instance, tables: CostTables) -> int:
    """A lower bound on the stages of any plan that fits (Metis keeps the whole optimizer state on
    every replica): each layer needs at least its weights + gradients + optimizer state per GPU at
    the best (GPU type, tp) over the room a GPU of that type has; the stages together hold them all."""
    L = tables.num_layers
    need = [math.inf] * L
    per_param = stage_memory(1.0, 0.0, 0, 0, dtype_bytes=tables.dtype_bytes,
                             optimizer_bytes=tables.optimizer_bytes_per_param)  # [C6] bytes per parameter
    for c in instance.topology.clusters:
        room = c.gpu_memory_bytes - instance.job.workspace_bytes
        if room <= 0:
            continue
        for tp in instance.model.tps(c.gpu):
            params = tables.table(c.gpu, tp).params
            for layer in range(L):
                need[layer] = min(need[layer], float(params[layer + 1] - params[layer]) * per_param / room)
    total = sum(need)
    return max(1, math.ceil(total - 1e-9)) if math.isfinite(total) else L + 1


def _size_multisets(total: int, max_stages: int, variance: int) -> Iterator[tuple[int, ...]]:
    """Multisets (descending) of powers of two within a factor 2**variance of the smallest, with at
    least one of the smallest, at most ``max_stages`` parts, sum <= total and total - sum < smallest."""
    k = 0
    while (1 << k) <= total:
        sizes = [1 << (k + j) for j in range(variance + 1)]
        for counts in _counts(sizes, max_stages, total):
            s = sum(n * c for n, c in zip(sizes, counts))
            if counts[0] >= 1 and total - s < sizes[0]:
                yield tuple(n for n, c in sorted(zip(sizes, counts), reverse=True) for _ in range(c))
        k += 1


def _counts(sizes: Sequence[int], max_parts: int, cap: int) -> Iterator[tuple[int, ...]]:
    if not sizes:
        yield ()
        return
    for c in range(0, min(max_parts, cap // sizes[0]) + 1):
        for rest in _counts(sizes[1:], max_parts - c, cap - c * sizes[0]):
            yield (c, *rest)


def _orderings(multiset: tuple[int, ...], opt: MetisOptions) -> list[tuple[int, ...]]:
    if len(multiset) <= opt.max_permute_len:
        return sorted(set(itertools.permutations(multiset)))
    return sorted({multiset, multiset[::-1]})


def _cut(devices: Sequence[Segment], sizes: Sequence[int]) -> tuple[tuple[Segment, ...], ...]:
    """Consecutive groups of ``sizes`` GPUs from the ordered device list."""
    out, i, used = [], 0, 0  # device index, GPUs of devices[i] already taken
    for size in sizes:
        segs: list[Segment] = []
        need = size
        while need:
            c, n = devices[i]
            take = min(need, n - used)
            segs.append((c, take))
            need -= take
            used += take
            if used == n:
                i, used = i + 1, 0
        out.append(tuple(segs))
    return tuple(out)


# ---- intra-stage: (dp, tp), data and layer load balancing -----------------------------------------
def _tps(instance: Instance, segments: Sequence[Segment]) -> list[int]:
    """TP degrees every segment of a group can use: profiled, inside a node, dividing the segment."""
    common = set.intersection(*(set(instance.model.tps(c.gpu)) for c, _ in segments))
    return sorted(t for t in common if all(c.gpus_per_node % t == 0 and n % t == 0 for c, n in segments))


def _intra_stage(instance: Instance, groups: Sequence[tuple[Segment, ...]]) -> list[_StageDraft] | None:
    """Smallest tp per stage (Metis prefers data parallelism); raised later if memory requires."""
    out = []
    for segs in groups:
        tps = _tps(instance, segs)
        if not tps:
            return None
        out.append(_StageDraft(segments=segs, tp=tps[0]))
    return out


def _microbatches(instance: Instance, stages: Sequence[_StageDraft]) -> list[int]:
    """Divisors B of the global batch with every replica getting 1..max profiled samples."""
    G = instance.job.global_batch
    lo = max(sum(n for _, n in s.segments) // s.tp for s in stages)
    hi = min(
        sum(n // s.tp * max(instance.model.mbss(c.gpu, s.tp)) for c, n in s.segments) for s in stages
    )
    return [b for b in range(lo, min(hi, G) + 1) if G % b == 0]


def _replica_speed(instance: Instance, tables: CostTables, gpu: str, tp: int, mbs: int) -> float:
    """Samples per second of one replica running the whole model."""
    f, b = tables.table(gpu, tp).times(mbs, 0, tables.num_layers)
    return mbs / (f + b)


def _split_batch(
    instance: Instance, tables: CostTables, stage: _StageDraft, B: int
) -> tuple[tuple[ReplicaGroup, ...], float] | None:
    """Data load balancer: the stage's replica groups with samples ∝ replica speed, and the stage's
    compute power (samples/s on the whole model)."""
    reps = [(c, n // stage.tp) for c, n in stage.segments]
    dp = sum(r for _, r in reps)
    guess = max(1, B // dp)
    speeds = [_replica_speed(instance, tables, c.gpu, stage.tp, guess) for c, _ in reps]
    caps = [max(instance.model.mbss(c.gpu, stage.tp)) for c, r in reps for _ in range(r)]
    split = split_capped(B, [v for v, (_, r) in zip(speeds, reps) for _ in range(r)], caps)
    if split is None:
        return None
    groups: list[ReplicaGroup] = []
    i = 0
    for c, r in reps:
        mine = split[i : i + r]
        i += r
        for mbs in sorted(set(mine), reverse=True):
            groups.append(ReplicaGroup(cluster=c.name, tp=stage.tp, dp=mine.count(mbs), mbs=mbs))
    return tuple(groups), sum(v * r for v, (_, r) in zip(speeds, reps))


def _resolve_tp(instance: Instance, tables: CostTables, drafts: list[_StageDraft]) -> list[_StageDraft] | None:
    """Metis prefers data parallelism: raise the tp of a stage only while it is out of memory with
    its compute-proportional layers at one sample per replica (more samples only add activations)."""
    drafts = list(drafts)
    while True:
        B = max(sum(n for _, n in d.segments) // d.tp for d in drafts)
        split = [_split_batch(instance, tables, d, B) for d in drafts]
        if any(s is None for s in split):
            return drafts
        cuts = _proportional_cuts(tables, [s[1] for s in split if s is not None])
        if cuts is None:
            return None
        over = _oom_stages(instance, tables, [s[0] for s in split if s is not None], cuts,
                           instance.job.global_batch // B)
        if not over:
            return drafts
        raised = _raise_tp(instance, drafts, over)
        if raised is None:
            return drafts  # the layer balancer may still move layers out of the full stages
        drafts = raised


def _balanced_plan(instance: Instance, tables: CostTables, drafts: list[_StageDraft], B: int) -> Plan | None:
    """Data and layer load balancers for microbatch B, then layers moved out of stages that are out
    of memory; ``None`` when that does not make every stage fit."""
    split = [_split_batch(instance, tables, d, B) for d in drafts]
    if any(s is None for s in split):
        return None
    groups = [s[0] for s in split if s is not None]
    cuts = _proportional_cuts(tables, [s[1] for s in split if s is not None])
    if cuts is None:
        return None
    m = instance.job.global_batch // B
    cuts = _repair_memory(instance, tables, groups, cuts, m)
    if _oom_stages(instance, tables, groups, cuts, m):
        return None
    stages = tuple(Stage(start=a, end=b, groups=g) for (a, b), g in zip(zip(cuts, cuts[1:]), groups))
    return Plan(pipelines=(Pipeline(stages=stages, num_microbatches=m),), planner="metis", instance=instance.name)


def _proportional_cuts(tables: CostTables, power: Sequence[float]) -> list[int] | None:
    """Layer boundaries giving each stage a share of the model's compute ∝ its power."""
    L, S = tables.num_layers, len(power)
    if S > L:
        return None
    ref = min(tables.by_gpu_tp, key=lambda k: (k[1], k[0]))
    tab = tables.by_gpu_tp[ref]
    work = tab.fwd[0] + tab.bwd[0]  # prefix sums of the reference per-layer time, length L + 1
    total, acc, cuts = float(work[-1]), 0.0, [0]
    for s in range(S - 1):
        acc += power[s] / sum(power)
        target = acc * total
        j = int(min(range(1, L), key=lambda x: abs(float(work[x]) - target)))
        j = max(j, cuts[-1] + 1)
        j = min(j, L - (S - 1 - s))
        cuts.append(j)
    cuts.append(L)
    return cuts


def _stage_oom(
    instance: Instance, tables: CostTables, groups: Sequence[ReplicaGroup], lo: int, hi: int, in_flight: int
) -> float:
    """Largest (memory needed − capacity) over the stage's replica groups; > 0 means out of memory."""
    worst = -math.inf
    for g in groups:
        c = instance.topology.cluster(g.cluster)
        base, opt = stage_memory_parts(instance, tables, c, g.tp, lo, hi, g.mbs, in_flight)
        worst = max(worst, base + opt - c.gpu_memory_bytes)
    return worst


def _oom_stages(
    instance: Instance, tables: CostTables, groups: Sequence[Sequence[ReplicaGroup]], cuts: Sequence[int], m: int
) -> list[int]:
    S = len(groups)
    return [s for s in range(S) if _stage_oom(instance, tables, groups[s], cuts[s], cuts[s + 1], in_flight(S, s, m)) > 0]


def _repair_memory(
    instance: Instance, tables: CostTables, groups: Sequence[Sequence[ReplicaGroup]], cuts: list[int], m: int
) -> list[int]:
    """Move single layers from a stage out of memory to the neighbour with the most room."""
    S, cuts = len(groups), list(cuts)
    for _ in range(tables.num_layers):
        over = _oom_stages(instance, tables, groups, cuts, m)
        if not over:
            break
        s = over[0]
        options = []
        if s > 0 and cuts[s + 1] - cuts[s] > 1:  # give the first layer to the previous stage
            trial = cuts[:s] + [cuts[s] + 1] + cuts[s + 1 :]
            options.append(trial)
        if s + 1 < S and cuts[s + 1] - cuts[s] > 1:  # give the last layer to the next stage
            trial = cuts[: s + 1] + [cuts[s + 1] - 1] + cuts[s + 2 :]
            options.append(trial)
        if not options:
            break
        cuts = min(options, key=lambda c: max(
            _stage_oom(instance, tables, groups[k], c[k], c[k + 1], in_flight(S, k, m)) for k in range(S)
        ))
    return cuts


def _raise_tp(instance: Instance, drafts: Sequence[_StageDraft], over: Sequence[int]) -> list[_StageDraft] | None:
    """The next larger tp for every stage out of memory (``None`` when one is already at its largest)."""
    out = list(drafts)
    for s in over:
        tps = [t for t in _tps(instance, drafts[s].segments) if t > drafts[s].tp]
        if not tps:
            return None
        out[s] = _StageDraft(segments=drafts[s].segments, tp=tps[0])
    return out
