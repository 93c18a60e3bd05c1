"""[H5] Skeletons realised with exact local pipelines (``best_local_plan`` or the estimate's own
alternative made exact), assembled into k identical pipelines and scored by ``evaluate``."""

from __future__ import annotations

import math
import time
from typing import Sequence

from hgopt.cost.memory import stage_memory_parts
from hgopt.cost.pipeline import in_flight
from hgopt.cost.tables import CostTables
from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search.baselines._common import block_layout
from hgopt.search.hier_tables import role_of
from hgopt.search.hierarchical.context import Ctx, evaluated
from hgopt.search.hierarchical.estimates import alt_tables, round_up
from hgopt.search.hierarchical.records import INF, Realised, Skeleton
from hgopt.search.intra import LocalPlan, best_local_plan, local_plan_costs
from hgopt.spec import Instance


def realize(instance: Instance, tables: CostTables, sk: Skeleton) -> Plan | None:
    """The plan of a skeleton with exact local pipelines (``None`` when a cluster cannot host its
    range); ``meta['decomposed_s']`` holds the iteration time the heuristic computes for it from the
    local plans and the WAN boundaries (equal to ``evaluate``'s)."""
    ctx = Ctx(instance=instance, tables=tables, layout=block_layout(instance), start=time.perf_counter())
    got = realize_and_score(ctx, sk)
    if got is None:
        return None
    return Plan(pipelines=got.plan.pipelines, planner="heuristic", instance=instance.name,
                meta=(("skeleton", describe(sk)), ("decomposed_s", repr(got.time_s))))


def realize_and_score(ctx: Ctx, sk: Skeleton) -> Realised | None:
    """Exact local pipelines for ``sk`` and the plan's iteration time by the [C3]/[C7] decomposition
    (local bottlenecks, fills and sync from the intra-cluster DP, WAN boundaries as ``evaluate``
    costs them); the final plan is checked with ``evaluate`` itself."""
    ctx.work += 1  # (work_limit) one skeleton realised
    locals_ = local_plans(ctx, sk)
    if locals_ is None:
        return None
    t = decomposed(ctx, sk, locals_)
    if not math.isfinite(t):
        return None  # out of memory: a fill-leaning local pipeline is checked at its weight only
    return Realised(t, sk, assemble(ctx, sk, locals_))


def realize_repaired(ctx: Ctx, sk: Skeleton, tries: int = 3) -> Realised | None:
    """Realise ``sk``; when a cluster cannot host its range (the estimates saw fewer stages after
    it than the exact local plans make, so less memory in flight), move one layer at a time from
    that cluster to a neighbour and try again."""
    got = realize_and_score(ctx, sk)
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
                if (r := realize_and_score(ctx, cand)) is not None:
                    options.append(r)
        if options:
            return min(options, key=lambda x: x.time_s)
        if len(sk.order) < 2 or sk.layers[bad] <= 1:
            return None
        j = bad + 1 if bad + 1 < len(sk.order) else bad - 1
        layers = list(sk.layers)
        layers[bad] -= 1
        layers[j] += 1
        sk = Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch, order=sk.order, layers=tuple(layers),
                      weights=sk.weights, links=sk.links)
        got = realize_and_score(ctx, sk)
    return got


def _first_failing(ctx: Ctx, sk: Skeleton) -> int | None:
    """The cluster (from the back) whose exact local plan does not fit."""
    ranges = sk.ranges()
    after = 0
    for i in reversed(range(len(sk.order))):
        lp = local_plan(ctx, sk, i, *ranges[i], after, weight=sk.weights[i] if sk.weights else None)
        if lp is None:
            return i
        after += len(lp.stages)
    return None


def realize_table(ctx: Ctx, sk: Skeleton) -> Realised | None:
    """The skeleton realised with each cluster's local pipeline as the estimate has it (its config,
    stage count and even layers), costed exactly."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    ranges = sk.ranges()
    out: list[LocalPlan] = []
    after = 0
    for i in reversed(range(len(sk.order))):
        lp = table_local(ctx, sk, i, *ranges[i], after, sk.weights[i] if sk.weights else m)
        if lp is None:
            return None
        out.append(lp)
        after += len(lp.stages)
    plans = out[::-1]
    t = decomposed(ctx, sk, plans)
    return Realised(t, sk, assemble(ctx, sk, plans)) if math.isfinite(t) else None


def realize_fast(ctx: Ctx, sk: Skeleton) -> float | None:
    """Exact time of the skeleton with the estimates' own local pipelines (no DP call)."""
    got = realize_table(ctx, sk)
    return None if got is None else got.time_s


def local_plans(ctx: Ctx, sk: Skeleton) -> list[LocalPlan] | None:
    """Exact local pipelines back to front (the stages after a cluster set its memory). When a
    cluster cannot fit with the stages the later clusters chose, the later clusters are redone
    with as few local stages as the DP gives (bottleneck weight 1) and the cluster tried again."""
    ranges = sk.ranges()
    out: list[LocalPlan] = []
    after = 0
    compact = False
    for i in reversed(range(len(sk.order))):
        lp = local_plan(ctx, sk, i, *ranges[i], after, weight=sk.weights[i] if sk.weights else None)
        if lp is None and not compact and out:
            compact = True
            redo: list[LocalPlan] = []
            after = 0
            for j in reversed(range(i + 1, len(sk.order))):
                few = local_plan(ctx, sk, j, *ranges[j], after, weight=1)
                cur = out[len(sk.order) - 1 - j]
                pick = few if few is not None and len(few.stages) < len(cur.stages) else cur
                redo.append(pick)
                after += len(pick.stages)
            out = redo
            lp = local_plan(ctx, sk, i, *ranges[i], after, weight=sk.weights[i] if sk.weights else None)
        if lp is None:
            return None
        out.append(lp)
        after += len(lp.stages)
    plans = out[::-1]
    if compact and not fits(ctx, assemble(ctx, sk, plans)):
        return None  # weight-1 plans were checked for memory with one microbatch in flight only
    return plans


def local_plan(
    ctx: Ctx, sk: Skeleton, i: int, lo: int, hi: int, after: int, weight: int | None = None
) -> LocalPlan | None:
    """Cluster ``sk.order[i]``'s local pipeline for [lo, hi): the intra-cluster DP's at the real m,
    or, for another ``weight`` [H6], the estimate's alternative for that weight made exact (so that
    what the estimates chose is what gets realised)."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    if weight is None or weight == m:
        return dp_local(ctx, sk, i, lo, hi, after, m)
    return table_local(ctx, sk, i, lo, hi, after, weight)


def dp_local(ctx: Ctx, sk: Skeleton, i: int, lo: int, hi: int, after: int, w: int) -> LocalPlan | None:
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


def table_local(ctx: Ctx, sk: Skeleton, i: int, lo: int, hi: int, after: int, w: int) -> LocalPlan | None:
    """[H6] The estimate's local pipeline for weight ``w`` (its tp, dp and local stage count; the
    layers split as evenly as possible), costed exactly. It can hold more local stages than the DP
    would choose: extra stages pay only through the 1F1B round trip, which the DP's local objective
    does not see."""
    name = sk.order[i]
    key = ("table", name, lo, hi, sk.pipelines, sk.microbatch, after, w)
    if key in ctx.local:
        return ctx.local[key]
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    tabs = alt_tables(ctx, name, role_of(i, len(sk.order)), sk.pipelines, sk.microbatch, m, round_up(after))
    tab = tabs.get(w)
    n = hi - lo
    lp = None
    if tab is not None and tab.tp is not None and tab.dp is not None and int(tab.stages[n]) >= 1:
        s, tp, dp = int(tab.stages[n]), int(tab.tp[n]), int(tab.dp[n])
        cuts = [lo + (n * j) // s for j in range(s + 1)]
        group = ReplicaGroup(cluster=name, tp=tp, dp=dp, mbs=sk.microbatch // dp)
        rc = "full" if tab.recompute is not None and int(tab.recompute[n]) else "none"  # hfrec: [I3r]
        stages = tuple(Stage(start=a, end=b, groups=(group,), zero=1, recompute=rc) for a, b in zip(cuts, cuts[1:]))
        lp = local_plan_costs(ctx.instance, ctx.tables, name, stages, replicas=sk.pipelines, num_microbatches=m)
    ctx.local[key] = lp
    return lp


def _pipeline(ctx: Ctx, sk: Skeleton, locals_: Sequence[LocalPlan]) -> Pipeline:
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


def assemble(ctx: Ctx, sk: Skeleton, locals_: Sequence[LocalPlan]) -> Plan:
    pipe = _pipeline(ctx, sk, locals_)
    return Plan(pipelines=(pipe,) * sk.pipelines, planner="heuristic", instance=ctx.instance.name)


def fits(ctx: Ctx, plan: Plan) -> bool:
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


def decomposed(ctx: Ctx, sk: Skeleton, locals_: Sequence[LocalPlan]) -> float:
    """The iteration time of the k identical pipelines scored by ``evaluate`` itself (their WAN
    boundaries share the links [C4w]; their all-reduce rings span the k pipelines' replicas); inf when
    a stage is out of memory."""
    ev = evaluated(ctx, assemble(ctx, sk, locals_))
    return ev.iteration_time_s if ev.feasible else INF


def describe(sk: Skeleton) -> str:
    parts = ", ".join(f"{c}:{n}" for c, n in zip(sk.order, sk.layers))
    return (f"k={sk.pipelines} B={sk.microbatch} [{parts}]" + (f" weights={list(sk.weights)}" if sk.weights else "")
            + (f" links={list(sk.links)}" if sk.links else ""))
