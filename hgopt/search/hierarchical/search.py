"""The heuristic's orchestration: candidate skeletons → exact screening → realisation of the
finalists → refinement, polishing and re-partition → [H9] data parallelism across cluster groups."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from hgopt.cost import evaluate
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Plan
from hgopt.search.baselines._common import block_layout
from hgopt.search.groups import GroupedPlan, best_grouped_plan
from hgopt.search.mixed import best_mixed_plan
from hgopt.search.hierarchical.context import Ctx, out_of_time
from hgopt.search.hierarchical.links import allowed_link_precisions, check_max_links
from hgopt.search.hierarchical.objective import Scorer
from hgopt.search.hierarchical.realise import describe, realize_fast, realize_repaired, realize_table
from hgopt.search.hierarchical.records import Estimated, HeuristicOptions, HeuristicResult, Realised, Skeleton
from hgopt.search.hierarchical.refine import checked, polish, refine, repartitioned
from hgopt.search.hierarchical.skeletons import requiring, skeleton_candidates
from hgopt.spec import Instance


log = logging.getLogger(__name__)


def plan_heuristic(
    instance: Instance, *, tables: CostTables | None = None, options: HeuristicOptions = HeuristicOptions(),
    estimate_cache: dict[tuple[str, int, int], object] | None = None,
) -> HeuristicResult:
    """The hierarchical heuristic's best plan, scored by ``evaluate`` (plan None: nothing fits).
    ``estimate_cache``: the [H2] estimate cache of a search over an instance of the same model and
    ``tables`` (the [H9] groups' sub-instances share the whole search's; its keys name what differs)."""
    ctx = _context(instance, tables, options)
    if estimate_cache is not None:
        ctx.parts = estimate_cache
    score = ctx.score = Scorer(instance=instance, tables=ctx.tables, objective=options.objective,  # type: ignore[arg-type]
                               budget_usd_per_hour=options.budget_usd_per_hour)
    raw = skeleton_candidates(ctx, options)
    if options.require_clusters:  # why-not lines (cli-explain)
        raw = requiring(ctx, raw, options.require_clusters)
    screened = _screen(ctx, raw, options)
    # realise the leaders by exact screening and by estimate (each ranking misses some good ones)
    lead = list(dict.fromkeys(_diverse(screened, options.finalists) + [sk for _, sk in raw[:2]]))
    if not score.plain:  # [H10] also the leaders by estimated $ per iteration / within the budget
        lead = list(dict.fromkeys(lead + _diverse(sorted(raw, key=score.estimate_key), options.finalists)))
    est_of = {sk: e for e, sk in raw}
    estimates = [Estimated(est_of[sk], sk) for sk in lead] + [x for x in screened if x.skeleton not in set(lead)]
    realized = 0
    done: list[Realised] = []
    for i, (est, sk) in enumerate(estimates):
        if options.progress:  # progress (cli-explain)
            options.progress.report("realising skeletons", done=i, total=len(lead),
                                    incumbent_s=min((d.time_s for d in done), default=None))
        past = i >= len(lead)
        if (past and done) or ((past or done) and out_of_time(ctx, options)):
            break  # past the finalists, walk on only while nothing could be realised; at the limit, stop once one is
        got = realize_repaired(ctx, sk)
        if sk.weights:  # the estimate's local alternatives may not carry over: also try without
            plain = realize_repaired(ctx, Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch,
                                                   order=sk.order, layers=sk.layers, links=sk.links))
            if plain is not None and (got is None or plain.time_s < got.time_s):
                got = plain
        table = realize_table(ctx, sk)  # what the estimate itself describes, exactly costed
        if table is not None and (got is None or table.time_s < got.time_s):
            got = table
        realized += 1
        log.debug("heuristic: estimate %.4f s -> %s for %s", est, got and round(got.time_s, 4), sk)
        if got is not None:
            done.append(got)
            score.record(got.plan, got.time_s)
    done.sort(key=score.rank)  # [H10] by time, or by $ per iteration under the cost objective
    if options.progress and done:  # progress (cli-explain)
        options.progress.report("refining", incumbent_s=done[0].time_s, plan=done[0].plan)
    best: Realised | None = None
    for rank, got in enumerate(done):
        best = checked(ctx, refine(ctx, got, options))
        if best is not None:
            best = polish(ctx, best, options)
            if not score.plain:  # [H10] refining lowers the time, maybe with more GPUs: keep what the objective says
                base = checked(ctx, got)
                if base is not None and score.better(base, best):
                    best = base
            for other in done[rank + 1 : rank + 1 + options.polish_extra]:  # polishing may reorder them
                if out_of_time(ctx, options):
                    break
                alt = checked(ctx, other)
                if alt is not None:
                    alt = polish(ctx, alt, options)
                    score.record(alt.plan, alt.time_s)
                    if (alt.time_s < best.time_s) if score.plain else score.better(alt, best):
                        best = alt
            break
    if best is None:
        return HeuristicResult(plan=None, skeleton=None, search_time_s=ctx.elapsed(), realized=realized,
                               work=ctx.work, stopped=ctx.stopped)
    score.record(best.plan, best.time_s)
    if options.repartition and not out_of_time(ctx, options):
        again = repartitioned(ctx, best, done[: options.repartition_extra])
        score.record(again.plan, again.time_s)
        best = again if score.plain or score.better(again, best) else best
    t, sk, plan = best
    if options.progress:  # progress (cli-explain)
        options.progress.report("cluster groups [H9]", incumbent_s=t, plan=plan)
    if options.cross_cluster_dp and len(instance.topology.clusters) > 1 and not options.require_clusters:
        grouped = best_grouped_plan(instance, ctx.tables, lambda sub: _sub_plan(ctx, sub, options),
                                    incumbent=t if score.plain else math.inf,  # [H10] any grouped plan, then by $
                                    allowed=ctx.allowed, out_of_time=lambda: out_of_time(ctx, options))
        if grouped is not None:
            score.record(grouped.plan, grouped.iteration_time_s)
            if score.plain or score.better(Realised(grouped.iteration_time_s, sk, grouped.plan), best):
                return _mixed_or(ctx, options, _grouped_result(ctx, grouped, realized))
    plan = Plan(pipelines=plan.pipelines, planner="heuristic", instance=instance.name,
                meta=(("skeleton", describe(sk)),))
    if not score.within_budget(plan, t):  # [H10] the best ranks over the budget: so does every plan scored
        cheapest = score.cheapest_usd_per_hour()
        return HeuristicResult(plan=None, skeleton=None, search_time_s=ctx.elapsed(), realized=realized,
                               work=ctx.work, stopped=ctx.stopped, candidates=tuple(score.seen),
                               note=f"no plan within the budget of ${options.budget_usd_per_hour:g}/hour"
                                    + ("" if cheapest is None else f" (the cheapest found costs ${cheapest:.4g}/hour)"))
    return _mixed_or(ctx, options, HeuristicResult(
        plan=plan, skeleton=sk, iteration_time_s=t, search_time_s=ctx.elapsed(), realized=realized, work=ctx.work,
        stopped=ctx.stopped, candidates=tuple(score.seen)))


def _mixed_or(ctx: Ctx, options: HeuristicOptions, res: HeuristicResult) -> HeuristicResult:
    """[H11] (mixed) ``res``, or the mixed-stage family's plan (``hgopt.search.mixed``) when it is faster
    by ``evaluate``; tried with [H9] only, under the time objective, within the time limit."""
    if not (options.mixed_stages and options.cross_cluster_dp and not options.require_clusters
            and options.objective == "time" and options.budget_usd_per_hour is None and res.plan is not None
            and not out_of_time(ctx, options)):
        return res
    mixed = best_mixed_plan(ctx.instance, ctx.tables, stop=lambda: out_of_time(ctx, options))  # hetgap: stop/deadline
    if mixed is None or not mixed.iteration_time_s < res.iteration_time_s:
        return res
    if ctx.score is not None:
        ctx.score.record(mixed.plan, mixed.iteration_time_s)
    return dataclasses.replace(res, plan=mixed.plan, skeleton=None, iteration_time_s=mixed.iteration_time_s,
                               groups=(), search_time_s=ctx.elapsed(),
                               candidates=tuple(ctx.score.seen) if ctx.score is not None else res.candidates)


def _context(instance: Instance, tables: CostTables | None, options: HeuristicOptions) -> Ctx:
    """A fresh search context for ``instance`` under ``options``' link policy."""
    return Ctx(instance=instance, tables=tables or build_tables(instance), layout=block_layout(instance),
               start=time.perf_counter(), allowed=allowed_link_precisions(instance, options.link_precision),
               max_links=check_max_links(options.max_compressed_links), penalty=dict(options.link_penalty),
               neighbours=max(int(options.neighbours), 1))


def _sub_plan(ctx: Ctx, sub: Instance, options: HeuristicOptions) -> tuple[Plan, float] | None:
    """[H9] One cluster group's plan for its share of the batch (single family, same link policy) and
    its pipeline time."""
    if out_of_time(ctx, options):
        return None  # the time limit: no further group is planned
    left = None if options.time_limit_s is None else max(options.time_limit_s - ctx.elapsed(), 0.1)
    res = plan_heuristic(sub, tables=ctx.tables, options=dataclasses.replace(
        options, cross_cluster_dp=False, time_limit_s=left, finalists=min(options.finalists, 4), polish_extra=0,
        objective="time", budget_usd_per_hour=None,  # [H10] groups are rated by time; the whole plan is priced
        progress=None),  # (cli-explain) a group's times are not the plan's: no heartbeat from here
        estimate_cache=ctx.parts)
    if res.plan is None:
        return None
    return res.plan, evaluate(res.plan, sub, ctx.tables).pipeline_time_s


def _grouped_result(ctx: Ctx, grouped: GroupedPlan, realized: int = 0) -> HeuristicResult:
    desc = "; ".join(f"{'+'.join(g)}: {n} samples" for g, n in zip(grouped.groups, grouped.shares))
    return HeuristicResult(plan=dataclasses.replace(grouped.plan, meta=(("groups", desc),)), skeleton=None,
                           iteration_time_s=grouped.iteration_time_s, search_time_s=ctx.elapsed(), realized=realized,
                           groups=grouped.groups, work=ctx.work, stopped=ctx.stopped,
                           candidates=tuple(ctx.score.seen) if ctx.score is not None else ())


def grouped_alternative(
    instance: Instance, incumbent_s: float, *, tables: CostTables | None = None,
    options: HeuristicOptions = HeuristicOptions(),
) -> HeuristicResult | None:
    """[H9] alone: the best plan with data parallelism across cluster groups that beats
    ``incumbent_s`` (e.g. the exact planner's plan, to tell its user that a plan outside its space is
    faster), or None."""
    ctx = _context(instance, tables, options)
    if len(instance.topology.clusters) < 2:
        return None
    grouped = best_grouped_plan(instance, ctx.tables, lambda sub: _sub_plan(ctx, sub, options), incumbent=incumbent_s,
                                allowed=ctx.allowed, out_of_time=lambda: out_of_time(ctx, options))
    return None if grouped is None else _grouped_result(ctx, grouped)


def _screen(ctx: Ctx, estimates: list[Estimated], options: HeuristicOptions) -> list[Estimated]:
    """[H5] Exact screening: the leading `screen` estimated skeletons realised cheaply — each
    cluster's local pipeline as the estimate has it (config, stage count, even layers), costed
    exactly — and re-ranked by that exact time; the rest keep their estimates behind them."""
    head, tail = estimates[: options.screen], estimates[options.screen :]
    scored = []
    for est, sk in head:
        got = realize_fast(ctx, sk)
        scored.append((min(got, est) if got is not None else est + 1e9, est, sk))
    scored.sort(key=lambda x: (x[0], x[1]))
    return [Estimated(est, sk) for _, est, sk in scored] + tail


def _diverse(ranked: list[Estimated], n: int, per_group: int = 2) -> list[Skeleton]:
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
