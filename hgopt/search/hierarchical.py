"""The hierarchical heuristic (``--planner heuristic``): a fast search in the cluster-level plan
space — k identical pipelines, each crossing an ordered subset of clusters, every cluster hosting one
contiguous layer range as a local pipeline chosen by the intra-cluster DP. The design and its labels
[H1]..[H6] are in ``formulations/hierarchical.md``:

1. [H1] for each number of identical pipelines k and per-pipeline microbatch B (k·B·m = global batch);
2. [H3] order the clusters along the pipeline over the WAN matrix (bottleneck path, then total);
3. [H4] split the layers between the clusters by greedy marginal allocation on fast per-cluster
   estimates ([H2], ``hier_tables``), then pairwise layer moves; drop clusters while that helps;
4. [H5] realise the best few skeletons with ``best_local_plan`` (exact local pipelines) and score
   them with ``evaluate``; [H6] refine the best by moving single layers across cluster boundaries
   with exact local plans while the time budget lasts;
5. [H8] re-partition the layers over the realised stages globally (``repartition``);
6. [H9] try data parallelism across cluster groups (``groups``), outside the exact planner's space.

``heuristic_incumbent`` is the entry point for the exact planner's warm start.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from hgopt.cost import evaluate
from hgopt.cost.evaluate import stage_boundary_time
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, PlanResult, link_penalties
from hgopt.cost.memory import stage_memory, stage_memory_parts
from hgopt.cost.pipeline import in_flight, pipeline_time, trip_depth
from hgopt.search.baselines._common import BlockLayout, block_layout
from hgopt.search.hier_tables import MOST_STAGES, ClusterTable, cluster_tables, role_of
from hgopt.search.intra import LocalPlan, best_local_plan, local_plan_costs
from hgopt.search.groups import GroupedPlan, best_grouped_plan
from hgopt.search.repartition import repartition
from hgopt.spec import DTYPE_BYTES, Instance

__all__ = [
    "LINK_PRECISIONS",
    "HeuristicOptions",
    "HeuristicResult",
    "Skeleton",
    "grouped_alternative",
    "heuristic_incumbent",
    "allowed_link_precisions",
    "plan_heuristic",
    "realize",
    "run_heuristic",
]

log = logging.getLogger(__name__)
INF = math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class HeuristicOptions:
    time_limit_s: float | None = 10.0
    """Wall-clock cap; the fixed search usually ends far earlier (the refinement stops at it)."""
    finalists: int = 6
    """Skeletons realised with the exact intra-cluster DP [H5]."""
    refine_rounds: int = 3
    """Rounds of single-layer moves with exact local plans [H6]."""
    max_pipelines: int = 1024
    polish_extra: int = 1
    """Realised skeletons besides the best that also get their local plans polished [H6]."""
    screen: int = 32
    """Leading estimated skeletons re-ranked by an exact but DP-free realisation [H5]."""
    reorder: int = 2
    link_precision: str = "native"
    """Inter-cluster boundaries: 'native'/'fp32' (no compression), 'bf16', 'fp16' or 'fp8' (every
    such boundary compressed), or 'auto' (per boundary the fastest of native, bf16 and fp8) [H7]."""
    max_compressed_links: int | None = None
    """At most this many compressed inter-cluster boundaries per pipeline (None: no limit)."""
    link_penalty: tuple[tuple[str, float], ...] = ()
    """Seconds added to a boundary's cost when compressed to a precision (``link_penalty``) [H7]."""
    patience: int = 2
    """Per pipeline count, stop raising the microbatch after this many that did not improve."""
    kb_leaders: int = 3
    """(k, B) of the best coarse skeletons whose cluster sets are grown and pruned greedily [H4]."""
    repartition: bool = True
    """Re-partition the layers over all stages of the realised plans at once [H8]."""
    repartition_extra: int = 2
    """Realised skeletons besides the best whose stages are re-partitioned globally [H8]."""
    cross_cluster_dp: bool = True
    """Also try data parallelism across cluster groups [H9] (plans outside the exact planner's space)."""
    require_clusters: tuple[str, ...] = ()
    """Only skeletons whose pipelines use every one of these clusters (the CLI's why-not lines:
    the best plan that uses an idle cluster); implies no [H9] groups. (cli-explain)"""
    should_stop: Callable[[], bool] | None = field(default=None, compare=False)
    """Cooperative stop (SIGINT): checked wherever the time limit is. (cli-explain)"""
    """Leading estimated skeletons whose cluster order is improved by 2-opt on the estimate [H3]."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Skeleton:
    """A cluster-level decision: k identical pipelines of microbatch B crossing ``order`` with
    ``layers[i]`` layers on cluster ``order[i]``."""

    pipelines: int
    microbatch: int
    order: tuple[str, ...]
    layers: tuple[int, ...]
    weights: tuple[int, ...] = ()
    """Per cluster, the microbatch count the intra-cluster DP weighs its local bottleneck with
    (empty: the real m everywhere) [H6]."""
    links: tuple[str, ...] = ()
    """Precision of each inter-cluster boundary, forward and backward (empty: native) [H7]."""

    def ranges(self) -> list[tuple[int, int]]:
        cuts = list(itertools.accumulate(self.layers, initial=0))
        return list(zip(cuts, cuts[1:]))


@dataclass(frozen=True, kw_only=True, slots=True)
class HeuristicResult:
    plan: Plan | None
    skeleton: Skeleton | None
    iteration_time_s: float = INF
    """``evaluate(plan).iteration_time_s``."""
    search_time_s: float = 0.0
    realized: int = 0
    """Skeletons realised with exact local plans."""
    groups: tuple[tuple[str, ...], ...] = ()
    """[H9] When the plan trains on cluster groups in data parallel: the groups (``skeleton`` is
    then None); empty for a single family of identical pipelines."""


@dataclass(kw_only=True, slots=True)
class _Ctx:
    """Per-search caches (one search; never shared between calls)."""

    instance: Instance
    tables: CostTables
    layout: BlockLayout
    start: float
    tabs: dict[tuple[object, ...], ClusterTable] = field(default_factory=dict)
    links: dict[tuple[str, str, int, int], tuple[float, float]] = field(default_factory=dict)
    local: dict[tuple[object, ...], LocalPlan | None] = field(default_factory=dict)
    parts: dict[tuple[str, int, int], object] = field(default_factory=dict)
    subsets: dict[tuple[object, ...], object] = field(default_factory=dict)
    """[H4] estimated skeleton per (k, B, clusters, passes), and [C6] memory bounds per (k, clusters)."""
    allowed: tuple[str, ...] = ("native",)
    """Precisions an inter-cluster boundary may use (mixed-precision links)."""
    max_links: int | None = None
    penalty: dict[str, float] = field(default_factory=dict)
    """Seconds per boundary compressed to a precision [H7]."""
    """At most this many compressed inter-cluster boundaries per pipeline (None: no limit)."""

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# ---- public entry points ----------------------------------------------------------------------
def plan_heuristic(
    instance: Instance, *, tables: CostTables | None = None, options: HeuristicOptions = HeuristicOptions()
) -> HeuristicResult:
    """The hierarchical heuristic's best plan, scored by ``evaluate`` (plan None: nothing fits)."""
    ctx = _Ctx(instance=instance, tables=tables or build_tables(instance), layout=block_layout(instance),
               start=time.perf_counter(), allowed=allowed_link_precisions(instance, options.link_precision),
               max_links=_check_max_links(options.max_compressed_links), penalty=dict(options.link_penalty))
    raw = _skeleton_candidates(ctx, options)
    if options.require_clusters:  # why-not lines (cli-explain)
        raw = _requiring(ctx, raw, options.require_clusters)
    screened = _screen(ctx, raw, options)
    # realise the leaders by exact screening and by estimate (each ranking misses some good ones)
    lead = list(dict.fromkeys(_diverse(screened, options.finalists) + [sk for _, sk in raw[:2]]))
    est_of = {sk: e for e, sk in raw}
    estimates = [(est_of[sk], sk) for sk in lead] + [(e, sk) for e, sk in screened if sk not in set(lead)]
    realized = 0
    done: list[tuple[float, Skeleton, Plan]] = []
    for i, (est, sk) in enumerate(estimates):
        if i >= len(lead) and (done or _out_of_time(ctx, options)):
            break  # past the finalists, walk on only while nothing could be realised
        got = _realize_repaired(ctx, sk)
        if sk.weights:  # the estimate's local alternatives may not carry over: also try without
            plain = _realize_repaired(ctx, Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch,
                                                    order=sk.order, layers=sk.layers, links=sk.links))
            if plain is not None and (got is None or plain[0] < got[0]):
                got = plain
        table = _realize_table(ctx, sk)  # what the estimate itself describes, exactly costed
        if table is not None and (got is None or table[0] < got[0]):
            got = table
        realized += 1
        log.debug("heuristic: estimate %.4f s -> %s for %s", est, got and round(got[0], 4), sk)
        if got is not None:
            done.append(got)
    done.sort(key=lambda x: x[0])
    best: tuple[float, Skeleton, Plan] | None = None
    for rank, got in enumerate(done):
        best = _checked(ctx, _refine(ctx, got, options))
        if best is not None:
            best = _polish(ctx, best)
            for other in done[rank + 1 : rank + 1 + options.polish_extra]:  # polishing may reorder them
                alt = _checked(ctx, other)
                if alt is not None:
                    alt = _polish(ctx, alt)
                    if alt[0] < best[0]:
                        best = alt
            break
    if best is None:
        return HeuristicResult(plan=None, skeleton=None, search_time_s=ctx.elapsed(), realized=realized)
    if options.repartition:
        best = _repartitioned(ctx, best, done[: options.repartition_extra])
    t, sk, plan = best
    if options.cross_cluster_dp and len(instance.topology.clusters) > 1 and not options.require_clusters:
        grouped = best_grouped_plan(instance, ctx.tables, lambda sub: _sub_plan(ctx, sub, options), incumbent=t,
                                    allowed=ctx.allowed, out_of_time=lambda: _out_of_time(ctx, options))
        if grouped is not None:
            return _grouped_result(ctx, grouped, realized)
    plan = Plan(pipelines=plan.pipelines, planner="heuristic", instance=instance.name,
                meta=(("skeleton", _describe(sk)),))
    return HeuristicResult(plan=plan, skeleton=sk, iteration_time_s=t, search_time_s=ctx.elapsed(), realized=realized)


def _sub_plan(ctx: _Ctx, sub: Instance, options: HeuristicOptions) -> tuple[Plan, float] | None:
    """[H9] One cluster group's plan for its share of the batch (single family, same link policy) and
    its pipeline time."""
    left = None if options.time_limit_s is None else max(options.time_limit_s - ctx.elapsed(), 0.1)
    res = plan_heuristic(sub, tables=ctx.tables, options=dataclasses.replace(
        options, cross_cluster_dp=False, time_limit_s=left, finalists=min(options.finalists, 4), polish_extra=0))
    if res.plan is None:
        return None
    return res.plan, evaluate(res.plan, sub, ctx.tables).pipeline_time_s


def _grouped_result(ctx: _Ctx, grouped: GroupedPlan, realized: int = 0) -> HeuristicResult:
    desc = "; ".join(f"{'+'.join(g)}: {n} samples" for g, n in zip(grouped.groups, grouped.shares))
    return HeuristicResult(plan=dataclasses.replace(grouped.plan, meta=(("groups", desc),)), skeleton=None,
                           iteration_time_s=grouped.iteration_time_s, search_time_s=ctx.elapsed(), realized=realized,
                           groups=grouped.groups)


def grouped_alternative(
    instance: Instance, incumbent_s: float, *, tables: CostTables | None = None,
    options: HeuristicOptions = HeuristicOptions(),
) -> HeuristicResult | None:
    """[H9] alone: the best plan with data parallelism across cluster groups that beats
    ``incumbent_s`` (e.g. the exact planner's plan, to tell its user that a plan outside its space is
    faster), or None."""
    ctx = _Ctx(instance=instance, tables=tables or build_tables(instance), layout=block_layout(instance),
               start=time.perf_counter(), allowed=allowed_link_precisions(instance, options.link_precision),
               max_links=_check_max_links(options.max_compressed_links), penalty=dict(options.link_penalty))
    if len(instance.topology.clusters) < 2:
        return None
    grouped = best_grouped_plan(instance, ctx.tables, lambda sub: _sub_plan(ctx, sub, options), incumbent=incumbent_s,
                                allowed=ctx.allowed, out_of_time=lambda: _out_of_time(ctx, options))
    return None if grouped is None else _grouped_result(ctx, grouped)


def _screen(ctx: _Ctx, estimates: list[tuple[float, Skeleton]], options: HeuristicOptions) -> list[tuple[float, Skeleton]]:
    """[H5] Exact screening: the leading `screen` estimated skeletons realised cheaply — each
    cluster's local pipeline as the estimate has it (config, stage count, even layers), costed
    exactly — and re-ranked by that exact time; the rest keep their estimates behind them."""
    head, tail = estimates[: options.screen], estimates[options.screen :]
    scored = []
    for est, sk in head:
        got = _realize_fast(ctx, sk)
        scored.append((min(got, est) if got is not None else est + 1e9, est, sk))
    scored.sort(key=lambda x: (x[0], x[1]))
    return [(est, sk) for _, est, sk in scored] + tail


def _diverse(ranked: list[tuple[float, Skeleton]], n: int, per_group: int = 2) -> list[Skeleton]:
    """[H5] The first ``n`` skeletons of ``ranked`` taking at most ``per_group`` of each (k·B, order):
    skeletons that differ only in how k·B samples per microbatch step are cut into k pipelines
    realise alike, and without this they can fill every finalist slot (seen on sailor-het-32+96,
    where the best plan's k·B = 16 ranked sixth behind five k·B = 32 variants)."""
    out: list[Skeleton] = []
    count: dict[tuple[int, tuple[str, ...]], int] = {}
    for _, sk in ranked:
        g = (sk.pipelines * sk.microbatch, sk.order)
        if count.get(g, 0) < per_group:
            count[g] = count.get(g, 0) + 1
            out.append(sk)
            if len(out) >= n:
                break
    return out


def _realize_fast(ctx: _Ctx, sk: Skeleton) -> float | None:
    """Exact time of the skeleton with the estimates' own local pipelines (no DP call)."""
    got = _realize_table(ctx, sk)
    return None if got is None else got[0]


def _realize_table(ctx: _Ctx, sk: Skeleton) -> tuple[float, Skeleton, Plan] | None:
    """The skeleton realised with each cluster's local pipeline as the estimate has it (its config,
    stage count and even layers), costed exactly."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    ranges = sk.ranges()
    out: list[LocalPlan] = []
    after = 0
    for i in reversed(range(len(sk.order))):
        lp = _table_local(ctx, sk, i, *ranges[i], after, sk.weights[i] if sk.weights else m)
        if lp is None:
            return None
        out.append(lp)
        after += len(lp.stages)
    plans = out[::-1]
    t = _decomposed(ctx, sk, plans)
    return (t, sk, _assemble(ctx, sk, plans)) if math.isfinite(t) else None


def heuristic_incumbent(
    instance: Instance, tables: CostTables | None = None, time_limit_s: float | None = 10.0,
    link_precision: str = "native", max_compressed_links: int | None = None,
) -> HeuristicResult:
    """Warm start for the exact planner: the heuristic's plan and its cluster-level skeleton (k, B,
    cluster order, layers per cluster, local weights, link precisions), whose local pipelines come
    from ``best_local_plan``. Data parallelism across cluster groups [H9] is left out: the warm start
    must lie in the exact planner's space (k identical pipelines)."""
    return plan_heuristic(instance, tables=tables, options=HeuristicOptions(
        time_limit_s=time_limit_s, link_precision=link_precision, max_compressed_links=max_compressed_links,
        cross_cluster_dp=False))


def realize(instance: Instance, tables: CostTables, sk: Skeleton) -> Plan | None:
    """The plan of a skeleton with exact local pipelines (``None`` when a cluster cannot host its
    range); ``meta['decomposed_s']`` holds the iteration time the heuristic computes for it from the
    local plans and the WAN boundaries (equal to ``evaluate``'s)."""
    ctx = _Ctx(instance=instance, tables=tables, layout=block_layout(instance), start=time.perf_counter())
    got = _realize_and_score(ctx, sk)
    if got is None:
        return None
    return Plan(pipelines=got[2].pipelines, planner="heuristic", instance=instance.name,
                meta=(("skeleton", _describe(sk)), ("decomposed_s", repr(got[0]))))


LINK_PRECISIONS = ("native", "fp32", "bf16", "fp16", "fp8", "auto")


def allowed_link_precisions(instance: Instance, link_precision: str) -> tuple[str, ...]:
    """[H7] What an inter-cluster boundary may use under ``--link-precision``; precisions that are
    not narrower than the training dtype compress nothing and are dropped."""
    if link_precision not in LINK_PRECISIONS:
        raise ValueError(f"--link-precision: must be one of {', '.join(LINK_PRECISIONS)}, got {link_precision!r}")
    native = DTYPE_BYTES[instance.model.dtype]
    wanted = {"native": (), "fp32": (), "auto": ("bf16", "fp8")}.get(link_precision, (link_precision,))
    narrower = tuple(p for p in wanted if DTYPE_BYTES[p] < native)
    if link_precision == "auto":
        return ("native", *narrower)
    return narrower or ("native",)


def _check_max_links(n: int | None) -> int | None:
    if n is not None and n < 0:
        raise ValueError(f"--max-compressed-links: must be >= 0, got {n}")
    return n


def _describe(sk: Skeleton) -> str:
    parts = ", ".join(f"{c}:{n}" for c, n in zip(sk.order, sk.layers))
    return (f"k={sk.pipelines} B={sk.microbatch} [{parts}]" + (f" weights={list(sk.weights)}" if sk.weights else "")
            + (f" links={list(sk.links)}" if sk.links else ""))


def _out_of_time(ctx: _Ctx, options: HeuristicOptions) -> bool:
    if options.should_stop is not None and options.should_stop():  # (cli-explain)
        return True
    return options.time_limit_s is not None and ctx.elapsed() >= options.time_limit_s


def _requiring(ctx: _Ctx, raw: list[tuple[float, Skeleton]], need: tuple[str, ...]) -> list[tuple[float, Skeleton]]:
    """(cli-explain) The estimated skeletons that use every cluster of ``need``; when none does, the
    clusters of the best few skeletons of each (k, B) plus ``need``, and ``need`` alone, split anew."""
    names = [c.name for c in ctx.instance.topology.clusters]
    for n in need:
        if n not in names:
            raise ValueError(f"require_clusters: unknown cluster {n!r} (clusters: {', '.join(names)})")
    keep = [(e, sk) for e, sk in raw if set(need) <= set(sk.order)]
    if keep:
        return keep
    out = []
    for e, sk in raw[:12]:
        for sub in (set(sk.order) | set(need), set(need)):
            got = _best_for_subset(ctx, sk.pipelines, sk.microbatch, tuple(n for n in names if n in sub))
            if got is not None and set(need) <= set(got[1].order):
                out.append(got)
    return sorted(dict.fromkeys(out), key=lambda x: x[0])


# ---- [H1] pipelines and microbatch --------------------------------------------------------------
def _pipeline_counts(instance: Instance, options: HeuristicOptions) -> list[int]:
    """Powers of two k dividing the global batch with at least one cluster giving each pipeline a GPU."""
    G = instance.job.global_batch
    most = max(c.num_gpus for c in instance.topology.clusters)
    out, k = [], 1
    while k <= min(most, options.max_pipelines, G):
        if G % k == 0:
            out.append(k)
        k *= 2
    return out


def _microbatches(instance: Instance, k: int) -> list[int]:
    """Divisors B of the samples per pipeline, from 1 up to what the biggest cluster's share of GPUs
    can hold at the largest profiled microbatch size per replica."""
    per_pipe = instance.job.global_batch // k
    top = max((c.num_gpus // k) * max(max(instance.model.mbss(c.gpu, t)) for t in instance.model.tps(c.gpu))
              for c in instance.topology.clusters)
    return [b for b in range(1, min(per_pipe, max(top, 1)) + 1) if per_pipe % b == 0]


def _skeleton_candidates(ctx: _Ctx, options: HeuristicOptions) -> list[tuple[float, Skeleton]]:
    """[H1]-[H4] estimated skeletons, best first. Coarse pass: every (k, B) on all usable clusters
    (both directions of the path) and on each cluster alone. For the (k, B) of the best coarse
    skeletons: greedy cluster adding and dropping, the best subsets tried with the other (k, B),
    and order improvement of the leaders."""
    inst = ctx.instance
    coarse: list[tuple[float, Skeleton]] = []
    for k in _pipeline_counts(inst, options):
        names = tuple(c.name for c in inst.topology.clusters if c.num_gpus // k >= 1)
        best_k, worse = math.inf, 0
        for B in _microbatches(inst, k):
            here = [got for sub in [names] + ([(n,) for n in names] if len(names) > 1 else [])
                    if (got := _best_for_subset(ctx, k, B, sub, passes=1)) is not None]
            coarse.extend(here)
            top = min((e for e, _ in here), default=math.inf)
            # larger microbatches only get worse once two in a row did not improve (early stop)
            worse = 0 if top < best_k else worse + 1
            best_k = min(best_k, top)
            if worse >= options.patience:
                break
    coarse.sort(key=lambda x: x[0])
    out = list(coarse)
    kbs = list(dict.fromkeys((sk.pipelines, sk.microbatch) for _, sk in coarse))[: options.kb_leaders]
    for k, B in kbs:
        names = tuple(c.name for c in inst.topology.clusters if c.num_gpus // k >= 1)
        if len(names) > 1:
            out.extend(_add_clusters(ctx, k, B, names))
        got = _best_for_subset(ctx, k, B, names)
        if got is not None:
            out.append(got)
            out.extend(_drop_clusters(ctx, got[1], got[0]))
    out.extend(_cross(ctx, out, options))
    out.sort(key=lambda x: x[0])
    unique: dict[Skeleton, float] = {}
    for est, sk in out:
        unique.setdefault(sk, est)
    ranked = [(e, s) for s, e in unique.items()]
    for e, sk in [_improve_order(ctx, e, s) for e, s in ranked[: options.reorder]]:
        unique.setdefault(sk, e)
    ranked = sorted(((e, s) for s, e in unique.items()), key=lambda x: x[0])
    leaders = list(dict.fromkeys((s.pipelines, s.microbatch, s.order) for _, s in ranked))[: 2 * options.finalists]
    for e, sk in [_improve_split(ctx, e, s) for e, s in ranked if (s.pipelines, s.microbatch, s.order) in leaders]:
        unique.setdefault(sk, e)
    return sorted(((e, s) for s, e in unique.items()), key=lambda x: x[0])


def _improve_split(ctx: _Ctx, est: float, sk: Skeleton, max_moves: int = 48) -> tuple[float, Skeleton]:
    """[H4] Single-layer moves between any two clusters, each judged with the two clusters' local
    alternatives ([H6]) re-chosen: the split was found with the default alternatives only, and some
    gains (a cluster relaying a few layers over several local stages, which lowers the 1F1B
    round-trip pace) appear only with the others. An accepted move is re-costed with every cluster's
    alternative re-chosen and the stages after each cluster it implies (memory in flight)."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    C = len(sk.order)
    if C < 2:
        return est, sk
    wan = _wan(ctx, sk.order, sk.pipelines * sk.microbatch, sk.links)  # [C4w]: k pipelines share the WAN
    after = [_round_up(C - 1 - i) for i in range(C)]
    best = (est, sk)
    ws = list(sk.weights) if sk.weights else [m] * C
    for _ in range(max_moves):
        tabs = [_tables(ctx, n, role_of(i, C), sk.pipelines, sk.microbatch, m, after[i]) for i, n in enumerate(sk.order)]
        layers = best[1].layers
        vals = [{w: (float(t.bottleneck[c]), float(t.fill[c]), float(t.sync_opt[c]), int(t.stages[c]))
                 for w, t in tb.items()} for tb, c in zip(tabs, layers)]
        top: tuple[float, int, int, int, int] | None = None
        for i, j in itertools.permutations(range(C), 2):
            if layers[i] <= 1:
                continue
            vi = {w: (float(t.bottleneck[layers[i] - 1]), float(t.fill[layers[i] - 1]), float(t.sync_opt[layers[i] - 1]),
                      int(t.stages[layers[i] - 1])) for w, t in tabs[i].items()}
            vj = {w: (float(t.bottleneck[layers[j] + 1]), float(t.fill[layers[j] + 1]), float(t.sync_opt[layers[j] + 1]),
                      int(t.stages[layers[j] + 1])) if layers[j] + 1 < len(t.fill) else (INF, INF, INF, 0)
                  for w, t in tabs[j].items()}
            base = [v[w] for v, w in zip(vals, ws)]
            for wi, a in vi.items():
                for wj, b in vj.items():
                    base[i], base[j] = a, b
                    e = _combine(base, m, wan)
                    if top is None or e < top[0]:
                        top = (e, i, j, wi, wj)
        if top is None or top[0] >= best[0] - 1e-12:
            break
        cand = list(layers)
        cand[top[1]] -= 1
        cand[top[2]] += 1
        stages = [int(t[w].stages[c]) for t, w, c in zip(tabs, ws, cand)]
        after = [_round_up(sum(stages[i + 1 :])) for i in range(C)]
        tabs = [_tables(ctx, n, role_of(i, C), sk.pipelines, sk.microbatch, m, after[i]) for i, n in enumerate(sk.order)]
        e, chosen = _choose_weights(ctx, sk.order, tabs, cand, sk.pipelines * sk.microbatch, m, sk.links)
        if e >= best[0] - 1e-12:
            break
        ws = list(chosen)
        best = (e, Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch, order=sk.order, layers=tuple(cand),
                            weights=() if all(w == m for w in ws) else tuple(ws), links=sk.links))
    return best


def _improve_order(ctx: _Ctx, est: float, sk: Skeleton, rounds: int = 2) -> tuple[float, Skeleton]:
    """[H3] Reorder by 2-opt moves (reverse a run of clusters) judged by the full
    split estimate, not the WAN path cost alone (a cluster's position also decides what it holds
    and how many stages follow it)."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    best = (est, sk)
    C = len(sk.order)
    for _ in range(rounds):
        order = best[1].order
        moves = {order[:i] + order[i:j][::-1] + order[j:] for i in range(C - 1) for j in range(i + 2, C + 1)}
        moves.discard(order)
        moves.discard(order[::-1])  # the split already tries both directions
        improved = False
        for cand in sorted(moves):
            got = _split_order(ctx, sk.pipelines, sk.microbatch, m, cand, passes=1)
            if got is not None and got[0] < best[0] - 1e-12:
                full = _split_order(ctx, sk.pipelines, sk.microbatch, m, cand, passes=2)
                if full is not None and full[0] < best[0] - 1e-12:
                    best, improved = full, True
        if not improved:
            break
    return best


def _cross(ctx: _Ctx, found: list[tuple[float, Skeleton]], options: HeuristicOptions) -> list[tuple[float, Skeleton]]:
    """[H4] The best cluster subsets found for some (k, B), tried with every other (k, B)."""
    found = sorted(found, key=lambda x: x[0])
    subsets = list(dict.fromkeys(frozenset(sk.order) for _, sk in found))[: options.finalists]
    kbs = list(dict.fromkeys((sk.pipelines, sk.microbatch) for _, sk in found))
    out = []
    for sub in subsets:
        for k, B in kbs:
            names = tuple(c.name for c in ctx.instance.topology.clusters if c.name in sub)
            if any(ctx.instance.topology.cluster(n).num_gpus // k < 1 for n in names):
                continue
            got = _best_for_subset(ctx, k, B, names, passes=1)
            if got is not None:
                out.append(got)
    return out


def _add_clusters(ctx: _Ctx, k: int, B: int, names: tuple[str, ...]) -> list[tuple[float, Skeleton]]:
    """[H4] From the best single cluster, add the cluster that lowers the estimate most, while one does."""
    singles = [got for n in names if (got := _best_for_subset(ctx, k, B, (n,), passes=1)) is not None]
    if not singles:
        return []
    out = list(singles)
    est, sk = min(singles, key=lambda x: x[0])
    while len(sk.order) < len(names):
        trials = [got for n in names if n not in sk.order
                  if (got := _best_for_subset(ctx, k, B, (*sk.order, n), passes=1)) is not None]
        if not trials:
            break
        best = min(trials, key=lambda x: x[0])
        if best[0] >= est:
            break
        out.append(best)
        est, sk = best
    return out


def _drop_clusters(ctx: _Ctx, sk: Skeleton, est: float) -> list[tuple[float, Skeleton]]:
    """[H4] Remove clusters one at a time while the estimate improves."""
    out: list[tuple[float, Skeleton]] = []
    names = sk.order
    while len(names) > 1:
        trials = []
        for drop in names:
            got = _best_for_subset(ctx, sk.pipelines, sk.microbatch, tuple(n for n in names if n != drop), passes=1)
            if got is not None:
                trials.append(got)
        if not trials:
            break
        best = _best_for_subset(ctx, sk.pipelines, sk.microbatch, min(trials, key=lambda x: x[0])[1].order)
        if best is None:
            break
        out.append(best)
        if best[0] >= est:
            break
        est, names = best[0], best[1].order
    return out


# ---- [H3] cluster order --------------------------------------------------------------------------
def _link_times(ctx: _Ctx, a: str, b: str, B: int, cut: int, prec: str = "native") -> tuple[float, float]:
    """(forward, backward) seconds for B samples per microbatch crossing a → b after layer cut−1 in
    precision ``prec``, as ``evaluate`` computes them ([C4], [C4q]). Callers pass B = k · microbatch:
    the k identical pipelines share the link ([C4w])."""
    key = (a, b, B, cut, prec)
    if key not in ctx.links:
        one = lambda c, lo, hi: Stage(start=lo, end=hi, groups=(ReplicaGroup(cluster=c, dp=B),))  # noqa: E731
        pipe = Pipeline(stages=(one(a, 0, cut), one(b, cut, ctx.tables.num_layers)), num_microbatches=1,
                        boundaries=(Boundary(fwd=prec, bwd=prec),))  # type: ignore[arg-type]
        ctx.links[key] = stage_boundary_time(ctx.instance, ctx.tables, pipe, 0)
    return ctx.links[key]


def _best_link(ctx: _Ctx, a: str, b: str, B: int, cut: int, m: int) -> tuple[str, float, float]:
    """[H7] The allowed precision with the smallest (m − 1)·max(fwd, bwd) + fwd + bwd on a → b."""
    best: tuple[float, str, float, float] | None = None
    for prec in ctx.allowed:
        f, bw = _link_times(ctx, a, b, B, cut, prec)
        score = pipeline_time(m, max(f, bw), f + bw) + ctx.penalty.get(prec, 0.0)
        if best is None or score < best[0] - 1e-15:
            best = (score, prec, f, bw)
    assert best is not None
    return best[1], best[2], best[3]


def _link_choice(ctx: _Ctx, order: Sequence[str], B: int, m: int, cuts: Sequence[int]) -> tuple[str, ...]:
    """[H7] Precision per inter-cluster boundary: each boundary's best allowed one; with a limit on
    compressed links, only the boundaries where compression gains most keep it."""
    if ctx.allowed == ("native",):
        return ()
    picks = []
    for a, b, cut in zip(order, order[1:], cuts):
        prec, f, bw = _best_link(ctx, a, b, B, cut, m)
        nf, nb = _link_times(ctx, a, b, B, cut, "native")
        gain = pipeline_time(m, max(nf, nb), nf + nb) - pipeline_time(m, max(f, bw), f + bw) - ctx.penalty.get(prec, 0.0)
        picks.append((prec, gain))
    if ctx.max_links is not None:
        keep = {i for i, _ in sorted(((i, g) for i, (p, g) in enumerate(picks) if p != "native"),
                                     key=lambda x: -x[1])[: ctx.max_links]}
        picks = [(p if i in keep else "native", g) for i, (p, g) in enumerate(picks)]
    out = tuple(p for p, _ in picks)
    return () if all(p == "native" for p in out) else out


def _order(ctx: _Ctx, names: tuple[str, ...], B: int, m: int) -> tuple[str, ...]:
    """Cluster order minimising (m − 1)·slowest WAN boundary + sum of WAN boundary times, at the
    block boundary's activation size: exhaustive up to 5 clusters, else greedy + 2-opt."""
    if len(names) <= 5:
        return _best_of(ctx, list(itertools.permutations(names)), B, m)
    return _two_opt(ctx, _greedy_path(ctx, names, B, m), B, m)


def _path_cost(ctx: _Ctx, order: Sequence[str], B: int, m: int) -> float:
    cut = ctx.layout.pre + max(ctx.layout.blocks // 2, 1)  # a block boundary
    cut = min(max(cut, 1), ctx.tables.num_layers - 1) if ctx.tables.num_layers > 1 else 1
    worst = total = 0.0
    for a, b in zip(order, order[1:]):
        _, f, bw = _best_link(ctx, a, b, B, cut, m)
        worst, total = max(worst, f, bw), total + f + bw
    return pipeline_time(m, worst, total)


def _best_of(ctx: _Ctx, orders: Sequence[tuple[str, ...]], B: int, m: int) -> tuple[str, ...]:
    return min(orders, key=lambda o: (_path_cost(ctx, o, B, m), o))


def _greedy_path(ctx: _Ctx, names: tuple[str, ...], B: int, m: int) -> tuple[str, ...]:
    best: tuple[float, tuple[str, ...]] | None = None
    pair = {(a, b): _path_cost(ctx, (a, b), B, m) for a in names for b in names if a != b}
    for start in names:
        path, left = [start], set(names) - {start}
        while left:
            nxt = min(sorted(left), key=lambda n: pair[(path[-1], n)])
            path.append(nxt)
            left.remove(nxt)
        cost = _path_cost(ctx, path, B, m)
        if best is None or cost < best[0]:
            best = (cost, tuple(path))
    assert best is not None
    return best[1]


def _two_opt(ctx: _Ctx, order: tuple[str, ...], B: int, m: int) -> tuple[str, ...]:
    best, cost = order, _path_cost(ctx, order, B, m)
    improved = True
    while improved:
        improved = False
        for i in range(len(best) - 1):
            for j in range(i + 2, len(best) + 1):
                cand = best[:i] + best[i:j][::-1] + best[j:]
                c = _path_cost(ctx, cand, B, m)
                if c < cost - 1e-12:
                    best, cost, improved = cand, c, True
    return best


# ---- [H2, H4] layer split on the estimates ------------------------------------------------------
def _weights(m: int) -> tuple[int, ...]:
    """Bottleneck weights of the local alternatives [H6]: the real m; fill/sync-leaning ones (for a
    cluster whose bottleneck is not the pipeline's); a bottleneck-leaning one (for a cluster whose
    gradient sync hides under another cluster's)."""
    return tuple(dict.fromkeys((m, max(1, m // 8), 1, 4 * m + 4, MOST_STAGES)))


def _tables(ctx: _Ctx, name: str, role: str, k: int, B: int, m: int, after: int) -> dict[int, ClusterTable]:
    key = (_alike(ctx, name), role, k, B, after)
    if key not in ctx.tabs:
        c = ctx.instance.topology.cluster(name)
        ctx.tabs[key] = cluster_tables(ctx.instance, ctx.tables, ctx.layout, c, role,  # type: ignore[arg-type]
                                       microbatch=B, num_microbatches=m, gpu_budget=c.num_gpus // k,
                                       replicas=k, stages_after=after, weights=_weights(m),
                                       cache=ctx.parts)  # type: ignore[arg-type]
    return ctx.tabs[key]  # type: ignore[return-value]


def _alike(ctx: _Ctx, name: str) -> object:
    """What a cluster's estimates [H2] read of it: clusters that agree on all of it share tables."""
    key = ("alike", name)
    if key not in ctx.subsets:
        c = ctx.instance.topology.cluster(name)
        ctx.subsets[key] = (c.gpu, c.gpus_per_node, c.num_gpus, c.gpu_memory_bytes, c.intra_node, c.inter_node)
    return ctx.subsets[key]


def _table(ctx: _Ctx, name: str, role: str, k: int, B: int, m: int, after: int) -> ClusterTable:
    return _tables(ctx, name, role, k, B, m, after)[m]


def _choose_weights(
    ctx: _Ctx, order: tuple[str, ...], tabs: Sequence[dict[int, ClusterTable]], layers: Sequence[int], B: int, m: int,
    links: Sequence[str] = (),
) -> tuple[float, tuple[int, ...]]:
    """[H6] Per cluster, the local alternative (bottleneck weight) that lowers the pipeline's
    estimate, by coordinate descent; returns (estimate, weights)."""
    wan = _wan(ctx, order, B, links)
    ws = [m] * len(order)

    val = [{w: (float(t.bottleneck[n]), float(t.fill[n]), float(t.sync_opt[n]), int(t.stages[n]))
            for w, t in tb.items()} for tb, n in zip(tabs, layers)]

    def est(choice: Sequence[int]) -> float:
        return _combine([v[w] for v, w in zip(val, choice)], m, wan)

    cur = est(ws)
    improved = True
    while improved:
        improved = False
        for i, tb in enumerate(tabs):
            for w in tb:
                if w == ws[i]:
                    continue
                trial = ws[:i] + [w] + ws[i + 1 :]
                t = est(trial)
                if t < cur - 1e-12:
                    ws, cur, improved = trial, t, True
    return cur, tuple(ws)


def _best_for_subset(
    ctx: _Ctx, k: int, B: int, names: tuple[str, ...], passes: int = 2
) -> tuple[float, Skeleton] | None:
    """Order ``names``, split the layers on the estimates (with ``passes`` = 2 a second time with
    the stages after each cluster that the first split implies) and return (estimate, skeleton)."""
    key = (k, B, names, passes)
    if key in ctx.subsets:
        return ctx.subsets[key]
    got = None
    if _can_hold(ctx, k, names):
        m = ctx.instance.job.global_batch // (k * B)
        order = _order(ctx, names, k * B, m)  # WAN load of the k pipelines [C4w]
        orders = (order, order[::-1]) if passes > 1 else (order,)  # the coarse pass keeps one direction
        found = [g for o in dict.fromkeys(orders) if (g := _split_order(ctx, k, B, m, o, passes)) is not None]
        got = min(found, key=lambda x: x[0]) if found else None
    ctx.subsets[key] = got
    return got


def _can_hold(ctx: _Ctx, k: int, names: tuple[str, ...]) -> bool:
    """[C6] memory bound: every pipeline keeps each parameter's weight and gradient at least once and
    its optimizer state at least once in total (ZeRO-1 shards it over a stage's replicas), so the
    GPU memory one pipeline gets, Σ_c ⌊n_c / k⌋ · (capacity_c − workspace), must hold
    P · (2·w + o), P the fewest parameters of one model replica over the profiled tp degrees."""
    key = ("hold", k, names)
    if key not in ctx.subsets:
        inst, tb = ctx.instance, ctx.tables
        room = sum((c.num_gpus // k) * max(c.gpu_memory_bytes - inst.job.workspace_bytes, 0.0)
                   for c in inst.topology.clusters if c.name in names)
        need = stage_memory(min(tp * float(t.params[-1]) for (gpu, tp), t in tb.by_gpu_tp.items()), 0.0, 0, 0,
                            dtype_bytes=tb.dtype_bytes, optimizer_bytes=tb.optimizer_bytes_per_param)
        ctx.subsets[key] = room >= need  # type: ignore[assignment]
    return bool(ctx.subsets[key])


def _split_order(
    ctx: _Ctx, k: int, B: int, m: int, order: tuple[str, ...], passes: int
) -> tuple[float, Skeleton] | None:
    """The layer split of one cluster order (both directions of a path cost the same on symmetric
    links, but the first cluster also holds the embedding and the last the head)."""
    after = [_round_up(len(order) - 1 - i) for i in range(len(order))]
    links = _link_choice(ctx, order, k * B, m, [_block_cut(ctx)] * (len(order) - 1))
    got = None
    for _ in range(passes):
        tabs = [_table(ctx, n, role_of(i, len(order)), k, B, m, after[i]) for i, n in enumerate(order)]
        split = _split(ctx, order, tabs, k * B, m, links, start=got[1].layers if got else None,
                       steps=(1, 2, 4) if passes > 1 else (1,))
        if split is None:
            return got
        est, layers = split
        est2, ws = _choose_weights(ctx, order, [_tables(ctx, n, role_of(i, len(order)), k, B, m, after[i])
                                                for i, n in enumerate(order)], layers, k * B, m, links)
        got = (est2, Skeleton(pipelines=k, microbatch=B, order=order, layers=layers,
                              weights=() if all(w == m for w in ws) else ws, links=links))
        chosen = [_tables(ctx, n, role_of(i, len(order)), k, B, m, after[i])[ws[i]] for i, n in enumerate(order)]
        stages = [int(t.stages[n]) for t, n in zip(chosen, layers)]
        new_after = [_round_up(sum(stages[i + 1 :])) for i in range(len(order))]
        if new_after == after:
            break
        after = new_after
    return got


def _round_up(d: int) -> int:
    """Stages after a cluster, rounded up to a power of two for the estimates (more stages after
    means more microbatches in flight, so rounding up is the cautious side) — keeps tables shared."""
    return 0 if d <= 0 else 1 << (d - 1).bit_length()


def _block_cut(ctx: _Ctx) -> int:
    """A layer boundary inside the blocks (where the estimates cost WAN transfers)."""
    cut = ctx.layout.pre + max(ctx.layout.blocks // 2, 1)
    return min(max(cut, 1), max(ctx.tables.num_layers - 1, 1))


def _wan(
    ctx: _Ctx, order: Sequence[str], B: int, links: Sequence[str] = ()
) -> tuple[float, float, tuple[float, ...]]:
    """(slowest WAN send, sum of WAN sends both ways, per boundary forward + backward) of the
    pipeline at a block boundary's activation size (exact cut sizes are costed when realised), with
    the boundaries' precisions ``links`` (empty: native)."""
    cut = _block_cut(ctx)
    worst = total = 0.0
    per = []
    for i, (a, b) in enumerate(zip(order, order[1:])):
        f, bw = _link_times(ctx, a, b, B, cut, links[i] if links else "native")
        worst, total = max(worst, f, bw), total + f + bw
        per.append(f + bw)
    return worst, total, tuple(per)


@dataclass(frozen=True, slots=True)
class _Lists:
    """A cluster table as Python lists (fast scalar access in the split loops)."""

    bott: list[float]
    fill: list[float]
    sync: list[float]
    stages: list[int]


def _lists(tb: ClusterTable) -> _Lists:
    return _Lists(tb.bottleneck.tolist(), tb.fill.tolist(), tb.sync_opt.tolist(), tb.stages.tolist())


def _combine(vals: Sequence[tuple[float, float, float, int]], m: int, wan: tuple[float, float, tuple[float, ...]]) -> float:
    """[H4] The [C3]/[C7] form over clusters, from (bottleneck, fill, sync_opt, local stages) per
    cluster: (m − 1)·pace + Σ fill + WAN trips + max sync_opt, the pace being the slowest stage or
    link or the 1F1B round trip of a suffix over the microbatches it can hold in flight — suffixes
    from a cluster's first and from its last local stage — or of the window of a cluster's last and
    the next cluster's first local stage around their WAN link (local stages taken as equal; the
    exact pace of every window is ``evaluate``'s, [C3])."""
    bott, fill, sync = wan[0], wan[1], 0.0
    trip, count, head = 0.0, 0, -1.0
    for i in range(len(vals) - 1, -1, -1):
        b, f, s_, k = vals[i]
        bott = max(bott, b)
        fill += f
        sync = max(sync, s_)
        link = wan[2][i] if i < len(wan[2]) else 0.0
        if k:  # the suffix from the cluster's last local stage (one stage and its WAN link)
            bott = max(bott, (f / k + link + trip) / trip_depth(1 + count, m))
            if head >= 0.0:  # the window of that stage and the next cluster's first stage
                bott = max(bott, (f / k + link + head) / trip_depth(2, m))
        head = f / k if k else -1.0
        trip += f + link
        count += k
        if count:
            bott = max(bott, trip / trip_depth(count, m))
    return pipeline_time(m, bott, fill) + sync


def _estimate(t: Sequence[_Lists], n: Sequence[int], m: int, wan: tuple[float, float, tuple[float, ...]]) -> float:
    """``_combine`` on the tables at the layer counts ``n`` (written out: it runs in the split's loops)."""
    bott, fill, sync = wan[0], wan[1], 0.0
    trip, count, head = 0.0, 0, -1.0
    per = wan[2]
    last = len(per)
    for i in range(len(t) - 1, -1, -1):
        ti, ni = t[i], n[i]
        b, f, s_ = ti.bott[ni], ti.fill[ni], ti.sync[ni]
        if b > bott:
            bott = b
        fill += f
        if s_ > sync:
            sync = s_
        link = per[i] if i < last else 0.0
        k = ti.stages[ni]
        if k:  # the suffix from the cluster's last local stage (one stage and its WAN link)
            pace = (f / k + link + trip) / trip_depth(count + 1, m)
            if pace > bott:
                bott = pace
            if head >= 0.0:  # the window of that stage and the next cluster's first stage
                pace = (f / k + link + head) / trip_depth(2, m)
                if pace > bott:
                    bott = pace
        head = f / k if k else -1.0
        trip += f + link
        count += k
        if count:
            pace = trip / trip_depth(count, m)
            if pace > bott:
                bott = pace
    return pipeline_time(m, bott, fill) + sync


def _split(
    ctx: _Ctx, order: tuple[str, ...], tabs: Sequence[ClusterTable], B: int, m: int, links: Sequence[str] = (),
    start: Sequence[int] | None = None, steps: tuple[int, ...] = (1,),
) -> tuple[float, tuple[int, ...]] | None:
    """[H4] Layers per cluster: from the smallest bottleneck cap that holds all layers (and from
    ``start``, e.g. the previous pass's split), surplus layers taken back and missing ones added
    where the estimate changes least, then layers moved between any two clusters (1, 2 or 4 at a
    time) while that lowers the estimate; the better of the starts."""
    L = ctx.tables.num_layers
    t = [_lists(tb) for tb in tabs]
    lo = []
    for ti in t:
        ok = [n for n in range(1, L + 1) if math.isfinite(ti.fill[n])]
        if not ok:
            return None
        lo.append(ok[0])
    if sum(lo) > L:
        return None
    wan = _wan(ctx, order, B, links)
    starts = [_cap_start(t, lo, L)]
    if start is not None and len(start) == len(t) and sum(start) == L and all(a >= b for a, b in zip(start, lo)):
        starts.append(list(start))
    got = [r for n0 in starts if (r := _descend(t, n0, lo, L, m, wan, steps)) is not None]
    return min(got) if got else None


def _descend(
    t: Sequence[_Lists], n: list[int], lo: Sequence[int], L: int, m: int, wan: tuple[float, float, tuple[float, ...]],
    steps: tuple[int, ...] = (1,),
) -> tuple[float, tuple[int, ...]] | None:
    n = list(n)
    while sum(n) > L:  # the cap start may overshoot: take layers back where that helps most
        i = _cheapest_shrink(t, n, lo, m, wan)
        if i is None:
            return None
        n[i] -= 1
    for _ in range(L - sum(n)):
        i = _cheapest_growth(t, n, m, wan, L)
        if i is None:
            return None
        n[i] += 1
    cur = _estimate(t, n, m, wan)
    improved = True
    while improved and math.isfinite(cur):
        improved = False
        for step in steps:
            for i, j in itertools.permutations(range(len(n)), 2):
                if n[i] - step < lo[i] or n[j] + step > L:
                    continue
                n[i] -= step
                n[j] += step
                est = _estimate(t, n, m, wan)
                if est < cur - 1e-12:
                    cur, improved = est, True
                else:
                    n[i] += step
                    n[j] -= step
    return (cur, tuple(n)) if math.isfinite(cur) else None


def _cheapest_growth(t: Sequence[_Lists], n: Sequence[int], m: int, wan: tuple[float, float], L: int) -> int | None:
    """The cluster whose one more layer raises the estimate least (maxima of the others kept by a
    top-two scan, so each step is O(clusters))."""
    bott = [ti.bott[ni] for ti, ni in zip(t, n)]
    sync = [ti.sync[ni] for ti, ni in zip(t, n)]
    fill = sum(ti.fill[ni] for ti, ni in zip(t, n)) + wan[1]
    b1, b2 = _top_two(bott)
    s1, s2 = _top_two(sync)
    best: tuple[float, int] | None = None
    for i, ti in enumerate(t):
        if n[i] + 1 > L:
            continue
        ob = b2 if bott[i] == b1 else b1
        os_ = s2 if sync[i] == s1 else s1
        est = (pipeline_time(m, max(ob, ti.bott[n[i] + 1], wan[0]), fill - ti.fill[n[i]] + ti.fill[n[i] + 1])
               + max(os_, ti.sync[n[i] + 1]))
        if math.isfinite(est) and (best is None or est < best[0]):
            best = (est, i)
    return None if best is None else best[1]


def _cap_start(t: Sequence[_Lists], lo: Sequence[int], L: int) -> list[int]:
    """Smallest bottleneck cap at which the clusters can hold every layer (binary search over the
    estimated bottleneck values), and each cluster's largest layer count under it (the bottleneck
    taken as its running maximum over n, so that the count is monotone in the cap)."""
    runs = []
    for ti, low in zip(t, lo):
        b = [ti.bott[n] if math.isfinite(ti.fill[n]) else math.inf for n in range(low, L + 1)]
        runs.append((low, list(itertools.accumulate(b, max))))
    caps = sorted({v for _, r in runs for v in r if math.isfinite(v)})

    def counts(cap: float) -> list[int]:
        return [max(low, low + bisect.bisect_right(r, cap) - 1) for low, r in runs]

    a, b = 0, len(caps) - 1
    if not caps or sum(counts(caps[b])) < L:
        return list(lo)
    while a < b:
        mid = (a + b) // 2
        if sum(counts(caps[mid])) >= L:
            b = mid
        else:
            a = mid + 1
    return counts(caps[a])


def _cheapest_shrink(
    t: Sequence[_Lists], n: Sequence[int], lo: Sequence[int], m: int, wan: tuple[float, float]
) -> int | None:
    best: tuple[float, int] | None = None
    for i in range(len(n)):
        if n[i] - 1 < lo[i]:
            continue
        trial = list(n)
        trial[i] -= 1
        est = _estimate(t, trial, m, wan)
        if best is None or est < best[0]:
            best = (est, i)
    return None if best is None else best[1]


def _top_two(values: Sequence[float]) -> tuple[float, float]:
    a = b = 0.0
    for v in values:
        if v > a:
            a, b = v, a
        elif v > b:
            b = v
    return a, b


# ---- [H5] exact local pipelines ----------------------------------------------------------------
def _local(
    ctx: _Ctx, sk: Skeleton, i: int, lo: int, hi: int, after: int, weight: int | None = None
) -> LocalPlan | None:
    """Cluster ``sk.order[i]``'s local pipeline for [lo, hi): the intra-cluster DP's at the real m,
    or, for another ``weight`` [H6], the estimate's alternative for that weight made exact (so that
    what the estimates chose is what gets realised)."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    if weight is None or weight == m:
        return _dp_local(ctx, sk, i, lo, hi, after, m)
    return _table_local(ctx, sk, i, lo, hi, after, weight)


def _dp_local(ctx: _Ctx, sk: Skeleton, i: int, lo: int, hi: int, after: int, w: int) -> LocalPlan | None:
    """``best_local_plan`` weighing the local bottleneck with ``w`` microbatches (the real m, or in
    polishing another count: smaller asks for less fill and gradient sync, larger for a faster local
    stage). The DP checks memory at ``w``, so plans for other counts are kept only if they fit."""
    name = sk.order[i]
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    key = ("dp", name, lo, hi, sk.pipelines, sk.microbatch, after, w)
    if key in ctx.local:
        return ctx.local[key]
    if w == m:
        # a plan found with fewer stages after it that still fits with ``after`` is optimal here too
        # (more stages after only tighten memory)
        for k2, lp in ctx.local.items():
            if k2[0] == "dp" and k2[1:6] == key[1:6] and k2[7] == w and k2[6] <= after \
                    and lp is not None and lp.max_stages_after >= after:
                ctx.local[key] = lp
                return lp
    c = ctx.instance.topology.cluster(name)
    ctx.local[key] = best_local_plan(
        ctx.instance, ctx.tables, name, lo, hi, microbatch=sk.microbatch, num_microbatches=w,
        gpu_budget=c.num_gpus // sk.pipelines, stages_before=i, stages_after=after, replicas=sk.pipelines)
    return ctx.local[key]


def _table_local(ctx: _Ctx, sk: Skeleton, i: int, lo: int, hi: int, after: int, w: int) -> LocalPlan | None:
    """[H6] The estimate's local pipeline for weight ``w`` (its tp, dp and local stage count; the
    layers split as evenly as possible), costed exactly. It can hold more local stages than the DP
    would choose: extra stages pay only through the 1F1B round trip, which the DP's local objective
    does not see."""
    name = sk.order[i]
    key = ("table", name, lo, hi, sk.pipelines, sk.microbatch, after, w)
    if key in ctx.local:
        return ctx.local[key]
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    tabs = _tables(ctx, name, role_of(i, len(sk.order)), sk.pipelines, sk.microbatch, m, _round_up(after))
    tab = tabs.get(w)
    n = hi - lo
    lp = None
    if tab is not None and tab.tp is not None and tab.dp is not None and int(tab.stages[n]) >= 1:
        s, tp, dp = int(tab.stages[n]), int(tab.tp[n]), int(tab.dp[n])
        cuts = [lo + (n * j) // s for j in range(s + 1)]
        group = ReplicaGroup(cluster=name, tp=tp, dp=dp, mbs=sk.microbatch // dp)
        stages = tuple(Stage(start=a, end=b, groups=(group,), zero=1) for a, b in zip(cuts, cuts[1:]))
        lp = local_plan_costs(ctx.instance, ctx.tables, name, stages, replicas=sk.pipelines, num_microbatches=m)
    ctx.local[key] = lp
    return lp


def _local_plans(ctx: _Ctx, sk: Skeleton) -> list[LocalPlan] | None:
    """Exact local pipelines back to front (the stages after a cluster set its memory). When a
    cluster cannot fit with the stages the later clusters chose, the later clusters are redone
    with as few local stages as the DP gives (bottleneck weight 1) and the cluster tried again."""
    ranges = sk.ranges()
    out: list[LocalPlan] = []
    after = 0
    compact = False
    for i in reversed(range(len(sk.order))):
        lp = _local(ctx, sk, i, *ranges[i], after, weight=sk.weights[i] if sk.weights else None)
        if lp is None and not compact and out:
            compact = True
            redo: list[LocalPlan] = []
            after = 0
            for j in reversed(range(i + 1, len(sk.order))):
                few = _local(ctx, sk, j, *ranges[j], after, weight=1)
                cur = out[len(sk.order) - 1 - j]
                pick = few if few is not None and len(few.stages) < len(cur.stages) else cur
                redo.append(pick)
                after += len(pick.stages)
            out = redo
            lp = _local(ctx, sk, i, *ranges[i], after, weight=sk.weights[i] if sk.weights else None)
        if lp is None:
            return None
        out.append(lp)
        after += len(lp.stages)
    plans = out[::-1]
    if compact and not _fits(ctx, _assemble(ctx, sk, plans)):
        return None  # weight-1 plans were checked for memory with one microbatch in flight only
    return plans


def _pipeline(ctx: _Ctx, sk: Skeleton, locals_: Sequence[LocalPlan]) -> Pipeline:
    """One pipeline: the local stages in cluster order, inter-cluster boundaries in ``sk.links``."""
    stages = tuple(s for lp in locals_ for s in lp.stages)
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    if not sk.links:
        return Pipeline(stages=stages, num_microbatches=m)
    bounds = []
    for i, lp in enumerate(locals_):
        bounds += [Boundary()] * (len(lp.stages) - 1)
        if i + 1 < len(locals_):
            bounds.append(Boundary(fwd=sk.links[i], bwd=sk.links[i]))  # type: ignore[arg-type]
    return Pipeline(stages=stages, num_microbatches=m, boundaries=tuple(bounds))


def _assemble(ctx: _Ctx, sk: Skeleton, locals_: Sequence[LocalPlan]) -> Plan:
    pipe = _pipeline(ctx, sk, locals_)
    return Plan(pipelines=(pipe,) * sk.pipelines, planner="heuristic", instance=ctx.instance.name)


def _realize_repaired(ctx: _Ctx, sk: Skeleton, tries: int = 3) -> tuple[float, Skeleton, Plan] | None:
    """Realise ``sk``; when a cluster cannot host its range (the estimates saw fewer stages after
    it than the exact local plans make, so less memory in flight), move one layer at a time from
    that cluster to a neighbour and try again."""
    got = _realize_and_score(ctx, sk)
    for _ in range(tries):
        if got is not None:
            return got
        bad = _first_failing(ctx, sk)
        if bad is None:
            return None
        options = []
        for j in (bad + 1, bad - 1):
            if 0 <= j < len(sk.order) and sk.layers[bad] > 1:
                layers = list(sk.layers)
                layers[bad] -= 1
                layers[j] += 1
                cand = Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch, order=sk.order,
                                layers=tuple(layers), weights=sk.weights, links=sk.links)
                if (r := _realize_and_score(ctx, cand)) is not None:
                    options.append(r)
        if options:
            return min(options, key=lambda x: x[0])
        if len(sk.order) < 2 or sk.layers[bad] <= 1:
            return None
        j = bad + 1 if bad + 1 < len(sk.order) else bad - 1
        layers = list(sk.layers)
        layers[bad] -= 1
        layers[j] += 1
        sk = Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch, order=sk.order, layers=tuple(layers),
                      weights=sk.weights, links=sk.links)
        got = _realize_and_score(ctx, sk)
    return got


def _first_failing(ctx: _Ctx, sk: Skeleton) -> int | None:
    """The cluster (from the back) whose exact local plan does not fit."""
    ranges = sk.ranges()
    after = 0
    for i in reversed(range(len(sk.order))):
        lp = _local(ctx, sk, i, *ranges[i], after, weight=sk.weights[i] if sk.weights else None)
        if lp is None:
            return i
        after += len(lp.stages)
    return None


def _realize_and_score(ctx: _Ctx, sk: Skeleton) -> tuple[float, Skeleton, Plan] | None:
    """Exact local pipelines for ``sk`` and the plan's iteration time by the [C3]/[C7] decomposition
    (local bottlenecks, fills and sync from the intra-cluster DP, WAN boundaries as ``evaluate``
    costs them); the final plan is checked with ``evaluate`` itself."""
    locals_ = _local_plans(ctx, sk)
    if locals_ is None:
        return None
    t = _decomposed(ctx, sk, locals_)
    if not math.isfinite(t):
        return None  # out of memory: a fill-leaning local pipeline is checked at its weight only
    return t, sk, _assemble(ctx, sk, locals_)


def _fits(ctx: _Ctx, plan: Plan) -> bool:
    """[C6] memory of every stage of the (identical) pipelines, as ``evaluate`` checks it."""
    pipe = plan.pipelines[0]
    S, m = len(pipe.stages), pipe.num_microbatches
    for si, st in enumerate(pipe.stages):
        for g in st.groups:
            c = ctx.instance.topology.cluster(g.cluster)
            base, opt = stage_memory_parts(ctx.instance, ctx.tables, c, g.tp, st.start, st.end, g.mbs,
                                           in_flight(S, si, m, pipe.schedule))
            if base + opt / (st.replicas if st.zero else 1) > c.gpu_memory_bytes:
                return False
    return True


def _decomposed(ctx: _Ctx, sk: Skeleton, locals_: Sequence[LocalPlan]) -> float:
    """The iteration time of the k identical pipelines scored by ``evaluate`` itself (their WAN
    boundaries share the links [C4w]; their all-reduce rings span the k pipelines' replicas); inf when
    a stage is out of memory."""
    ev = evaluate(_assemble(ctx, sk, locals_), ctx.instance, ctx.tables)
    return ev.iteration_time_s if ev.feasible else INF


def _polish(ctx: _Ctx, got: tuple[float, Skeleton, Plan]) -> tuple[float, Skeleton, Plan]:
    """[H6] Per cluster, the local pipelines the DP finds when it weighs its bottleneck differently
    and the estimates' alternatives made exact; coordinate descent over the combination on the
    exact decomposition (a plan out of memory scores inf), kept if ``evaluate`` confirms it."""
    sk = got[1]
    base = _local_plans(ctx, sk)
    if base is None:
        return got
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    ranges = sk.ranges()
    alts: list[list[LocalPlan]] = []
    after = 0
    for i in reversed(range(len(sk.order))):
        opts = [base[i]]
        for w in sorted((set(_weights(m)) | {max(1, m // 4)}) - {m}):
            for lp in (_dp_local(ctx, sk, i, *ranges[i], after, w) if w != MOST_STAGES else None,
                       _table_local(ctx, sk, i, *ranges[i], after, w)):
                if lp is not None and all(lp.stages != o.stages for o in opts):
                    opts.append(lp)
        dp_m = _dp_local(ctx, sk, i, *ranges[i], after, m)
        if dp_m is not None and all(dp_m.stages != o.stages for o in opts):
            opts.append(dp_m)
        alts.append(opts)
        after += len(base[i].stages)
    alts.reverse()
    pick = list(base)
    cur = _decomposed(ctx, sk, pick)
    improved = True
    while improved:
        improved = False
        for i, opts in enumerate(alts):
            for lp in opts:
                trial = pick[:i] + [lp] + pick[i + 1 :]
                t = _decomposed(ctx, sk, trial)
                if t < cur - 1e-12:
                    pick, cur, improved = trial, t, True
    if pick == base:
        return got
    plan = _assemble(ctx, sk, pick)
    ev = evaluate(plan, ctx.instance, ctx.tables)
    if ev.feasible and ev.iteration_time_s < got[0]:
        return ev.iteration_time_s, sk, plan
    return got


def _checked(ctx: _Ctx, got: tuple[float, Skeleton, Plan]) -> tuple[float, Skeleton, Plan] | None:
    """The realised plan scored by ``evaluate`` (None when it is infeasible there)."""
    ev = evaluate(got[2], ctx.instance, ctx.tables)
    if not ev.feasible:
        log.warning("heuristic: realised plan infeasible by evaluate: %s", "; ".join(ev.violations[:2]))
        return None
    if abs(ev.iteration_time_s - got[0]) > 1e-9 * max(1.0, ev.iteration_time_s):
        log.debug("heuristic: decomposition %.9g s, evaluate %.9g s", got[0], ev.iteration_time_s)
    return ev.iteration_time_s, got[1], got[2]


# ---- [H8] global re-partition ------------------------------------------------------------------
def _repartitioned(
    ctx: _Ctx, best: tuple[float, Skeleton, Plan], others: Sequence[tuple[float, Skeleton, Plan]]
) -> tuple[float, Skeleton, Plan]:
    """[H8] The best plan and the other realised finalists with every stage's layer range re-chosen
    at once (stage hardware kept), scored by ``evaluate``; the best of all."""
    for _, sk, plan in [best, *others]:
        got = repartition(plan, ctx.instance, ctx.tables)
        if got is not None and got.iteration_time_s < best[0] - 1e-12:
            best = (got.iteration_time_s, _skeleton_of(sk, got.plan), got.plan)
    return best


def _skeleton_of(sk: Skeleton, plan: Plan) -> Skeleton:
    """``sk`` with its per-cluster layer counts read from ``plan``'s (first) pipeline."""
    count: dict[str, int] = {}
    for st in plan.pipelines[0].stages:
        c = st.groups[0].cluster
        count[c] = count.get(c, 0) + st.num_layers
    return dataclasses.replace(sk, layers=tuple(count[c] for c in sk.order))


# ---- [H6] refinement with exact local plans ----------------------------------------------------
def _refine(
    ctx: _Ctx, best: tuple[float, Skeleton, Plan], options: HeuristicOptions
) -> tuple[float, Skeleton, Plan]:
    """Move one layer across each cluster boundary (both ways) while that lowers ``evaluate``."""
    for _ in range(options.refine_rounds):
        improved = False
        sk = best[1]
        for i in range(len(sk.order) - 1):
            for step in (1, -1):
                layers = list(best[1].layers)
                layers[i] += step
                layers[i + 1] -= step
                if min(layers) < 1:
                    continue
                cand = Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch, order=sk.order, layers=tuple(layers),
                                weights=sk.weights, links=sk.links)
                got = _realize_and_score(ctx, cand)
                if got is not None and got[0] < best[0] - 1e-12:
                    best, improved = got, True
                if _out_of_time(ctx, options):
                    return best
        if not improved:
            break
    return best


# ---- registry adapter ------------------------------------------------------------------------------
def run_heuristic(instance: Instance, options: PlanOptions) -> PlanResult:
    """``heuristic`` for the planner registry: a plan without a bound."""
    t0 = time.perf_counter()
    extra = dict(options.extra)
    links = extra.get("max_compressed_links")
    try:
        max_links = None if links in (None, "") else int(links)
    except ValueError:
        raise ValueError(f"--max-compressed-links: expected an integer, got {links!r}") from None
    res = plan_heuristic(instance, options=HeuristicOptions(
        time_limit_s=options.time_limit_s, link_precision=extra.get("link_precision", "native"),
        max_compressed_links=max_links, link_penalty=tuple(link_penalties(extra).items()),
        require_clusters=tuple(n for n in extra.get("require_clusters", "").split(",") if n),  # (cli-explain)
        should_stop=options.progress.stop_requested if options.progress else None))  # (cli-explain)
    elapsed = time.perf_counter() - t0
    space = ("k identical pipelines over an ordered subset of clusters, one contiguous layer range per "
             "cluster, local pipelines by the intra-cluster DP; or data parallelism across cluster groups, "
             "each group such pipelines")
    if res.plan is None:
        return PlanResult(planner="heuristic", status="infeasible", plan=None, search_time_s=elapsed,
                          plan_space=space, notes=("no skeleton could be realised",))
    return PlanResult(planner="heuristic", status="heuristic", plan=res.plan, iteration_time_s=res.iteration_time_s,
                      search_time_s=elapsed, plan_space=space, notes=tuple(f"{k}: {v}" for k, v in res.plan.meta))
