"""Why a plan looks the way it does, as a frozen record the commands only format.

:func:`explain` reads ``evaluate``'s per-stage reports (memory, times) and the plan: per stage the
peak memory per GPU against its capacity; per cluster the GPUs used, the busy share (the GPUs'
compute seconds over the iteration time) and the MFU (model FLOPs over the iteration time at the
GPUs' datasheet peak); the dollars per iteration and per million tokens from ``cost_per_gpu_hour``
(and WAN egress where a link has ``egress_usd_per_gb``); and, with :func:`why_not`, for every idle
cluster the best plan the heuristic finds when it must use that cluster, and for every partly used
one the plan's skeleton with that cluster's block re-planned by the intra-cluster DP on more of its
GPUs (``hgopt.search.more_gpus``), and how much slower and costlier each is. :func:`infeasibility` names the binding constraint of a planner that found no plan,
with numbers from ``evaluate`` on the smallest replica layout of each cluster.

No cost formula lives here: times and memory are ``evaluate``'s and the cost tables'
(``CostTables.table(gpu, tp).times``); this module only sums them up."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from hgopt.cost import CostTables, Evaluation, StageReport, build_tables, evaluate
from hgopt.cost.money import Money, money
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Instance
from hgopt.jsonable import json_safe

__all__ = ["ClusterUse", "Explanation", "Money", "StageUse", "WhyNot", "explain", "infeasibility", "why_not"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageUse:
    pipeline: int
    stage: int
    layers: tuple[int, int]
    """[start, end)."""
    clusters: tuple[str, ...]
    gpus: int
    peak_memory_bytes: float
    """Per GPU, of the replica group closest to its limit (``evaluate``)."""
    memory_capacity_bytes: float
    oom: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterUse:
    name: str
    gpu: str
    gpus: int
    gpus_used: int
    busy_share: float | None
    """Compute (forward + backward) seconds of the cluster's used GPUs per iteration over
    GPUs used × iteration time; None when the cluster is idle."""
    mfu: float | None
    """Model FLOPs (3 × forward, no recomputation) its GPUs run per iteration over GPUs used ×
    iteration time × datasheet peak FLOP/s; None with ``mfu_note`` saying why."""
    mfu_note: str = ""
    usd_per_gpu_hour: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class WhyNot:
    cluster: str
    gpus_used: int
    gpus: int
    alternative_s: float | None
    """Iteration time (``evaluate``) of the best plan found that uses the cluster; None: none found."""
    slower: float | None
    """alternative / this plan's iteration time − 1."""
    alternative_usd_per_iteration: float | None
    costlier: float | None
    """alternative $ / this plan's $ − 1 (None without prices)."""
    planner: str
    alternative_gpus: tuple[tuple[str, int], ...] = ()
    note: str = ""
    alternative_plan: Plan | None = None
    """The alternative itself (``--json`` writes it in the plan file format)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    iteration_time_s: float
    tokens_per_iteration: int
    stages: tuple[StageUse, ...]
    clusters: tuple[ClusterUse, ...]
    mfu: float | None
    """Of all used GPUs together."""
    mfu_note: str
    money: Money
    why_not: tuple[WhyNot, ...] = ()
    why_not_note: str = ""
    """Why there are no why-not lines although some cluster is idle or partly used (e.g. no time left)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = json_safe(asdict(self))  # type: ignore[assignment]
        for w, d in zip(self.why_not, out["why_not"]):
            d["alternative_plan"] = None if w.alternative_plan is None else w.alternative_plan.to_dict()
        return out


# ---- the plan itself ----------------------------------------------------------------------------
def explain(plan: Plan, instance: Instance, ev: Evaluation | None = None, tables: CostTables | None = None,
            why: tuple[WhyNot, ...] = ()) -> Explanation:
    """Memory, utilisation, MFU and dollars of ``plan`` (``ev``: its evaluation, computed when omitted)."""
    tables = tables or build_tables(instance)
    ev = ev or evaluate(plan, instance, tables)
    T = ev.iteration_time_s
    stages = tuple(StageUse(pipeline=s.pipeline, stage=s.stage, layers=s.layers, clusters=s.clusters, gpus=s.gpus,
                            peak_memory_bytes=s.peak_memory_bytes, memory_capacity_bytes=s.memory_capacity_bytes,
                            oom=s.oom) for s in ev.stages)
    used = plan.gpus_by_cluster()
    busy: dict[str, float] = {}
    flops: dict[str, float] = {}
    layer_flops = _layer_flops(instance)
    for p in plan.pipelines:
        for s in p.stages:
            for g in s.groups:
                busy[g.cluster] = busy.get(g.cluster, 0.0) + g.gpus * p.num_microbatches * _group_compute_s(
                    instance, tables, s, g)
                if layer_flops is not None:
                    flops[g.cluster] = flops.get(g.cluster, 0.0) + 3.0 * sum(layer_flops[s.start:s.end]) \
                        * g.samples * p.num_microbatches
    clusters = []
    peak_total = flops_total = 0.0
    missing_peak: list[str] = []
    for c in instance.topology.clusters:
        n = used.get(c.name, 0)
        share = busy.get(c.name, 0.0) / (n * T) if n and math.isfinite(T) and T > 0 else None
        mfu, note = None, ""
        if n:
            peak = _peak_flops(c.gpu, instance.job.precision)
            if layer_flops is None:
                note = "n/a: the model profile has no per-layer FLOPs"
            elif peak is None:
                note = f"n/a: no datasheet peak FLOP/s for GPU {c.gpu!r} in {instance.job.precision} (hgopt/profiles/gpus.py)"
                missing_peak.append(c.gpu)
            elif math.isfinite(T) and T > 0:
                mfu = flops.get(c.name, 0.0) / (n * T * peak)
                peak_total += n * peak
                flops_total += flops.get(c.name, 0.0)
        clusters.append(ClusterUse(name=c.name, gpu=c.gpu, gpus=c.num_gpus, gpus_used=n, busy_share=share, mfu=mfu,
                                   mfu_note=note, usd_per_gpu_hour=c.cost_per_gpu_hour))
    if layer_flops is None:
        mfu_all, mfu_note = None, "n/a: the model profile has no per-layer FLOPs"
    elif missing_peak:
        mfu_all, mfu_note = None, f"n/a: no datasheet peak FLOP/s for {', '.join(sorted(set(missing_peak)))}"
    else:
        mfu_all, mfu_note = (flops_total / (T * peak_total) if peak_total > 0 and math.isfinite(T) else None), ""
    tokens = instance.job.global_batch * instance.job.seq_len
    return Explanation(iteration_time_s=T, tokens_per_iteration=tokens, stages=stages, clusters=tuple(clusters),
                       mfu=mfu_all, mfu_note=mfu_note, money=_money(plan, instance, tables, T, tokens), why_not=why)


def _group_compute_s(instance: Instance, tables: CostTables, s: Stage, g: ReplicaGroup) -> float:
    """Forward + backward seconds of one microbatch on one GPU of group ``g`` (the cost tables' [C2])."""
    f, b = tables.table(instance.topology.cluster(g.cluster).gpu, g.tp).times(g.mbs, s.start, s.end)
    return f + b


def _layer_flops(instance: Instance) -> list[float] | None:
    """Forward FLOPs per sample of every layer (``LayerProfile.flops``), or None when the profile
    does not give them for every layer."""
    out = [getattr(layer, "flops", None) for layer in instance.model.layers]
    if any(v is None for v in out):
        return None
    return [float(v) for v in out]  # type: ignore[arg-type]


def _peak_flops(gpu: str, dtype: str) -> float | None:
    from hgopt.profiles.gpus import gpu_spec

    try:
        return gpu_spec(gpu).peak_flops(dtype)
    except (KeyError, ValueError):
        return None


def _money(plan: Plan, instance: Instance, tables: CostTables, T: float, tokens: int) -> Money:
    return money(plan, instance, tables, T, tokens)


# ---- why not the other clusters -------------------------------------------------------------------
MIN_SEARCH_S = 0.2
"""An idle cluster whose share of the why-not time is below this is not searched (said so)."""


def why_not(plan: Plan, instance: Instance, ev: Evaluation, *, time_limit_s: float = 10.0,
            extra: dict[str, str] | None = None, tables: CostTables | None = None) -> tuple[WhyNot, ...]:
    """For every cluster ``plan`` leaves idle: the best plan the hierarchical heuristic finds when
    its pipelines must use that cluster (``require_clusters``; ``extra``: the same link settings
    as the plan's search). For every cluster it uses only part of: the plan's skeleton with that
    cluster's block re-planned by the intra-cluster DP with as many more of its GPUs as fit
    (``hgopt.search.more_gpus.use_more``). Each alternative is scored by ``evaluate``, with how much
    slower / costlier it is. Partly used clusters go first (DP calls, no search; within half of
    ``time_limit_s`` when some cluster is idle); the idle ones share what is left."""
    import time

    deadline = time.monotonic() + time_limit_s
    tables = tables or build_tables(instance)
    used = plan.gpus_by_cluster()
    base_usd = _money(plan, instance, tables, ev.iteration_time_s, 1).usd_per_iteration
    partly = [c for c in instance.topology.clusters if 0 < used.get(c.name, 0) < c.num_gpus]
    idle = [c for c in instance.topology.clusters if used.get(c.name, 0) == 0]
    got: dict[str, WhyNot] = {}
    first = time.monotonic() + time_limit_s / 2 if idle else deadline  # leave the idle ones half at least
    for c in partly:
        got[c.name] = _more_of(plan, instance, tables, ev, base_usd, c.name, first)
    for j, c in enumerate(idle):
        each = (deadline - time.monotonic()) / (len(idle) - j)
        if each < MIN_SEARCH_S:
            got[c.name] = _none(c.name, 0, c.num_gpus, "heuristic",
                                f"not searched: the {time_limit_s:.3g} s for why-not lines ran out (--why-not-time)")
            continue
        log.info("why not %s: the heuristic's best plan that uses it (%d of %d idle clusters)", c.name, j + 1, len(idle))
        got[c.name] = _using_idle(instance, tables, ev, base_usd, c.name, each, extra)
    return tuple(got[c.name] for c in instance.topology.clusters if c.name in got)


def _none(cluster: str, n: int, total: int, planner: str, note: str) -> WhyNot:
    return WhyNot(cluster=cluster, gpus_used=n, gpus=total, alternative_s=None, slower=None,
                  alternative_usd_per_iteration=None, costlier=None, planner=planner, note=note)


def _scored(instance: Instance, tables: CostTables, ev: Evaluation, base_usd: float | None, cluster: str, n: int,
            alt: Plan, t: float, planner: str, note: str = "") -> WhyNot:
    usd = _money(alt, instance, tables, t, 1).usd_per_iteration
    return WhyNot(cluster=cluster, gpus_used=n, gpus=instance.topology.cluster(cluster).num_gpus, alternative_s=t,
                  slower=t / ev.iteration_time_s - 1.0, alternative_usd_per_iteration=usd,
                  costlier=(usd / base_usd - 1.0) if usd is not None and base_usd else None, planner=planner,
                  alternative_gpus=tuple(alt.gpus_by_cluster().items()), note=note, alternative_plan=alt)


def _more_of(plan: Plan, instance: Instance, tables: CostTables, ev: Evaluation, base_usd: float | None,
             cluster: str, deadline: float) -> WhyNot:
    """A partly used cluster: ``use_more``'s plan (the same skeleton, the cluster's block re-planned
    by the intra-cluster DP under a GPU floor), scored by ``evaluate``."""
    from hgopt.search.more_gpus import use_more

    planner = "intra-cluster DP"
    log.info("why not more of %s: its block re-planned with more GPUs", cluster)
    r = use_more(plan, instance, cluster, tables=tables, deadline=deadline)
    if r.plan is None:
        return _none(cluster, r.gpus_used, r.gpus, planner, f"no plan uses more of it: {r.note}")
    alt_ev = evaluate(r.plan, instance, tables)
    return _scored(instance, tables, ev, base_usd, cluster, r.gpus_used, r.plan, alt_ev.iteration_time_s, planner,
                   note=r.note)


def _using_idle(instance: Instance, tables: CostTables, ev: Evaluation, base_usd: float | None, cluster: str,
                limit_s: float, extra: dict[str, str] | None) -> WhyNot:
    """An idle cluster: the heuristic's best plan whose pipelines use it, scored by ``evaluate``."""
    from hgopt.search import PlanOptions, get_planner

    total = instance.topology.cluster(cluster).num_gpus
    ex = {k: v for k, v in (extra or {}).items() if k in ("link_precision", "max_compressed_links", "link_penalty")}
    ex["require_clusters"] = cluster
    try:
        res = get_planner("heuristic")(instance, PlanOptions(time_limit_s=limit_s, extra=ex))
    except ValueError as exc:
        return _none(cluster, 0, total, "heuristic", f"the heuristic declines: {exc}")
    alt = res.plan
    alt_ev = evaluate(alt, instance, tables) if alt is not None else None
    if alt is None or alt_ev is None or not alt_ev.feasible or cluster not in alt.gpus_by_cluster():
        return _none(cluster, 0, total, "heuristic", "the heuristic found no plan that uses it (memory or batch "
                     "divisibility: " + _single_cluster_reason(instance, tables, cluster) + ")")
    return _scored(instance, tables, ev, base_usd, cluster, 0, alt, alt_ev.iteration_time_s, "heuristic")


# ---- why there is no plan ---------------------------------------------------------------------------
def infeasibility(instance: Instance, tables: CostTables | None = None) -> tuple[str, ...]:
    """Lines naming what keeps a plan from fitting, with ``evaluate``'s numbers: per cluster, the
    smallest replica layout it can host (the largest profiled tp, as many pipeline stages as its
    GPUs and the layers allow, the smallest profiled microbatch size) and that layout's fullest
    stage's memory per GPU against the GPU's memory."""
    tables = tables or build_tables(instance)
    lines = []
    fits = []
    for c in instance.topology.clusters:
        msg, ok = _smallest_replica(instance, tables, c.name)
        lines.append(msg)
        if ok:
            fits.append(c.name)
    biggest = max(instance.topology.clusters, key=lambda c: c.gpu_memory_bytes)
    no_tp = [c for c in instance.topology.clusters if not _usable_tps(instance, c.name)]
    if len(no_tp) == len(instance.topology.clusters):  # deadline3: the GPU count binds, not memory
        lines.append("GPU count binds: every stage runs tp GPUs of one node, and no cluster has a profiled tp that "
                     "divides its GPUs per node and fits its GPUs (" + "; ".join(
                         f"{c.name}: {c.gpus_per_node} GPUs per node, {c.num_gpus} GPUs, profiled tp "
                         f"{list(instance.model.tps(c.gpu))}" for c in no_tp) + ")")
        return tuple(lines)
    if not fits:
        pooled, pooled_ok = _pooled_replica(instance, tables)
        alone = (f"no cluster holds a replica on its own (the largest GPU, {biggest.gpu} in {biggest.name}, has "
                 f"{biggest.gpu_memory_bytes / 1e9:.1f} GB)")
        if pooled_ok:
            lines.append(f"{alone}; but {pooled}: memory alone does not rule a plan out (see the planners' notes)")
        else:
            lines.append(f"memory binds: {alone}; " + (pooled or "a pipeline across clusters pools their memory, "
                                                                 "and the planners found none that fits"))
    else:
        lines.append(f"memory does not bind on {', '.join(fits)} (a replica fits there); the planners' notes say "
                     "what else did")
    return tuple(lines)


def _pp_choices(most: int) -> list[int]:
    """Pipeline depths tried for the smallest replica: ``most``, then halving down to 1 (more stages
    hold fewer layers each but keep more microbatches in flight under 1F1B)."""
    out = [most]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def _fullest(instance: Instance, tables: CostTables, stages: list[Stage], mbs: int) -> tuple[StageReport, bool] | None:
    """``evaluate``'s stage closest to its memory limit in one pipeline of ``stages`` (and whether
    every stage fits); None when the layout is not a valid plan."""
    plan = Plan(pipelines=(Pipeline(stages=tuple(stages), num_microbatches=instance.job.global_batch // mbs),),
                planner="explain")
    ev = evaluate(plan, instance, tables)
    if not ev.stages:
        return None
    worst = max(ev.stages, key=lambda s: s.peak_memory_bytes / s.memory_capacity_bytes)
    return worst, not any(s.oom for s in ev.stages)


def _even(name: str, tp: int, mbs: int, lo: int, hi: int, pp: int) -> list[Stage]:
    cuts = [lo + round(j * (hi - lo) / pp) for j in range(pp + 1)]
    return [Stage(start=a, end=b, groups=(ReplicaGroup(cluster=name, tp=tp, dp=1, mbs=mbs),), zero=0)
            for a, b in zip(cuts, cuts[1:])]


def _pooled_replica(instance: Instance, tables: CostTables) -> tuple[str, bool]:
    """One pipeline across every cluster (in the topology's order), each cluster's share of the layers
    in proportion to its GPU memory, split there evenly over its largest profiled tp and a depth of
    its most stages halved 0, 1, 2 ... times (the layout closest to fitting is reported), by
    ``evaluate``; ("", False) when the clusters share no profiled microbatch size."""
    layouts = []
    for c in instance.topology.clusters:
        tps = [t for t in instance.model.tps(c.gpu) if c.gpus_per_node % t == 0 and t <= c.num_gpus]
        if tps:
            layouts.append((c, max(tps)))
    common = set.intersection(*(set(instance.model.mbss(c.gpu, tp)) for c, tp in layouts)) if layouts else set()
    L, G = instance.model.num_layers, instance.job.global_batch
    if not common or len(layouts) < 2 or len(layouts) > L or G % min(common):
        return "", False
    mbs = min(common)
    mem = [c.num_gpus * c.gpu_memory_bytes for c, _ in layouts]
    cuts = [0]
    for i in range(len(layouts)):  # proportional shares, every cluster at least one layer
        want = round(L * sum(mem[: i + 1]) / sum(mem))
        cuts.append(min(max(want, cuts[-1] + 1), L - (len(layouts) - 1 - i)))
    best: tuple[float, StageReport, bool, int] | None = None
    most = max(max(1, min(c.num_gpus // tp, hi - lo)) for (c, tp), lo, hi in zip(layouts, cuts, cuts[1:]))
    for halve in range(len(_pp_choices(most))):
        stages: list[Stage] = []
        for (c, tp), lo, hi in zip(layouts, cuts, cuts[1:]):
            stages += _even(c.name, tp, mbs, lo, hi, max(1, min(c.num_gpus // tp, hi - lo) >> halve))
        got = _fullest(instance, tables, stages, mbs)
        if got is not None:
            ratio = got[0].peak_memory_bytes / got[0].memory_capacity_bytes
            if best is None or ratio < best[0]:
                best = (ratio, got[0], got[1], len(stages))
    if best is None:
        return "", False
    _, worst, ok, n = best
    c = instance.topology.cluster(worst.clusters[0])
    return (f"one pipeline over all {len(layouts)} clusters (layers by GPU memory, largest tp, {n} stages, "
            f"microbatch size {mbs}) needs {worst.peak_memory_bytes / 1e9:.1f} GB per GPU on its fullest stage "
            f"({worst.clusters[0]}, {c.gpu} with {worst.memory_capacity_bytes / 1e9:.1f} GB): "
            + ("fits" if ok else "does not fit"), ok)


def _single_cluster_reason(instance: Instance, tables: CostTables, name: str) -> str:
    return _smallest_replica(instance, tables, name)[0]


def _usable_tps(instance: Instance, name: str) -> list[int]:
    """deadline3: the profiled tp sizes a stage on cluster ``name`` can use (dividing its GPUs per node,
    at most its GPUs)."""
    c = instance.topology.cluster(name)
    return [t for t in instance.model.tps(c.gpu) if c.gpus_per_node % t == 0 and t <= c.num_gpus]


def _smallest_replica(instance: Instance, tables: CostTables, name: str) -> tuple[str, bool]:
    """The cluster's replica closest to fitting among: its largest profiled tp, its smallest profiled
    microbatch size, layers split evenly over ``_pp_choices(most stages)``; by ``evaluate``."""
    c = instance.topology.cluster(name)
    tps = _usable_tps(instance, name)
    if not tps:
        return (f"{name}: the model has no profiled tp for {c.gpu} that divides its {c.gpus_per_node} GPUs per node "
                f"and fits its {c.num_gpus} GPUs (profiled: {list(instance.model.tps(c.gpu))})", False)
    tp = max(tps)
    mbs = min(instance.model.mbss(c.gpu, tp))
    L, G = instance.model.num_layers, instance.job.global_batch
    off = ""
    if G % mbs:  # deadline3: the planners' microbatch sizes are the divisors of G ([C2] extrapolates the profile)
        profiled, mbs = mbs, max(d for d in range(1, mbs) if G % d == 0)
        off = (f" (the global batch {G} is no multiple of the smallest profiled microbatch size {profiled}: "
               f"{mbs} is its largest divisor below it, extrapolated as the planners do)")
    best: tuple[float, StageReport, bool, int] | None = None
    for pp in _pp_choices(max(1, min(c.num_gpus // tp, L))):
        got = _fullest(instance, tables, _even(name, tp, mbs, 0, L, pp), mbs)
        if got is not None:
            ratio = got[0].peak_memory_bytes / got[0].memory_capacity_bytes
            if best is None or ratio < best[0]:
                best = (ratio, got[0], got[1], pp)
    if best is None:
        return f"{name}: no replica layout is a valid plan here", False
    _, worst, ok, pp = best
    return (f"{name}: the smallest replica (tp {tp} x pp {pp}, microbatch size {mbs}{off}) needs "
            f"{worst.peak_memory_bytes / 1e9:.1f} GB per GPU on its fullest stage; {c.gpu} has "
            f"{worst.memory_capacity_bytes / 1e9:.1f} GB: " + ("fits" if ok else "does not fit"), ok)
