"""The planner ``milp`` as registered: the MILP planner (``hgopt.search.milp``) with the hierarchical
heuristic's plan as its warm start and the heuristic's data parallelism across cluster groups [H9]
as the check for a faster plan outside its space. The wiring lives here so that neither planner
imports the other.

Under a link policy that compresses (``--link-precision`` bf16/fp16/fp8/auto), whose space contains
the native one, a native search runs first on ``NARROW_SHARE`` of the time limit and its best plan
joins the heuristic's as the wider search's warm start: the wider search then never returns a plan
slower than the narrower one found.

Under ``--objective cost`` or ``--budget`` (``PlanOptions.objective`` / ``budget_usd_per_hour``) the
search is ``hgopt.search.milp_cost.plan_milp_cost`` (same plan space, $ objective / budget rows),
warm-started by the heuristic under the same objective and budget."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from hgopt.cost import build_tables, evaluate
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.progress import Progress
from hgopt.search import PlanOptions, PlanResult
from hgopt.search.hierarchical import HeuristicOptions, grouped_alternative, heuristic_incumbent
from hgopt.search.blocks import LinkPolicy
from hgopt.search.master import OUTSIDE_WHEN_OFF, certify, grouped_bound, name_outside
from hgopt.search.milp import WarmStart, link_policy, plan_milp
from hgopt.search.milp_cost import cost_goal, plan_milp_cost
from hgopt.search.mixed import MixedPlan, best_mixed_plan, compute_floor
from hgopt.search.mixed_bound import MixedBound, mixed_bound
from hgopt.search.sync_choice import choose_sync
from hgopt.search.work import GROUPED_QUERY_S, PHASE_SLACK, counted_stop, mixed_pair_work
from hgopt.spec import Instance

__all__ = ["GROUPED_BOUND_DEFAULT", "GROUPED_SHARE", "NARROW_SHARE", "WARM_START_WORK_PER_S", "plan_exact", "priced_warm_work", "warm_start_work"]

log = logging.getLogger(__name__)

NARROW_SHARE = 0.3
"""Share of the time limit the native-link search takes before a wider link policy's search."""

GROUPED_BOUND_DEFAULT = "auto"
"""colgen: whether the certificate covers data parallelism across cluster groups unless
``PlanOptions.extra["grouped_bound"]`` says otherwise ("off": k identical pipelines alone, grouped plans
named outside; "auto": "on" when the heuristic's grouped plan [H9] beats the k-identical result, which it
then is, else "off"). "auto" by default: the grouped bound [G2]-[G6] is valid but weak where its
per-group phase does not finish (``default``: 2.69 s against a 5.62 s optimum over k identical
pipelines), so it is applied where a grouped plan is the answer; elsewhere the plan space names
grouped plans as not bounded. colgen3: "on" stays off by default because even the finished
per-group phase (the share tables, ``master.ShareTable``) is weak there: 3.274 s on ``default``
(partition a100 | v100 + gh, 2,993 cheap_bounds calls, ~25 s CPU), a 42 % gap; the per-group bound
does not couple a group's pipeline time with its first stage's cross-group sync (bench/RESULTS.md)."""

GROUPED_SHARE = 0.1
"""colgen: share of the time limit the grouped space's bound (``hgopt.search.master``) may take after
the k-identical search (which runs on the rest); at its deadline it falls back to rate floors, still a
bound."""

WARM_START_WORK_PER_S = 150
"""Work units (``HeuristicOptions.work_limit``: subsets split, skeletons realised) the warm start's
heuristic may do per second of its time share. A full search on one core does 300-1200 a second
(scale-16r 773 units in 1.8 CPU s), so whenever the planner gets at least about half a core the
work limit, not the clock, ends the warm start, and the same input and ``--time-limit`` give the
same warm start (and the same plan, when the MILP phase's own limits are also not the clock's)."""


PRICED_WARM_WORK_PER_S = 17
"""costmilp: work units per second of its share for each heuristic run of the cost / budget warm
start ([H10] runs the heuristic once per node-count vector it tries, each up to this work):
geo-3r-gpt1.3b with 204 units (a 12 s share) ends by the work limit in about 8 s on a loaded core
(200 units find its 8-H100 plan, 50 only the 16-H100 one)."""


def priced_warm_work(seconds: float) -> int:
    """costmilp: the work limit of each heuristic run of the cost / budget warm start."""
    return max(30, math.ceil(PRICED_WARM_WORK_PER_S * seconds))


def warm_start_work(seconds: float) -> int:
    """The warm start's work limit for a time share of ``seconds``."""
    return max(50, math.ceil(WARM_START_WORK_PER_S * seconds))


def plan_exact(instance: Instance, options: PlanOptions) -> PlanResult:
    """``plan_milp`` warm-started by the heuristic (and, under a compressing link policy, by the
    native search's plan), with the outside-space note."""
    t0 = time.perf_counter()
    hard = t0 + options.time_limit_s  # determinism: the wall clock is the watchdog; the phases count work
    cuts: list[str] = []  # determinism: sub-phases the wall clock, not their work, ended
    work = _work_of(options)
    policy = options.extra.get("link_precision", "native") or "native"
    links = link_policy(instance, options.extra)
    # sigint: the sub-searches below see the search's stop flag, their reports are not the search's
    quiet = options.progress.stop_only() if options.progress is not None else None
    goal = cost_goal(instance, options)  # costmilp: --objective cost / --budget (hgopt.search.milp_cost)
    if goal is not None:
        return plan_milp_cost(instance, options, goal, warm_start=_priced_warm_start(dataclasses.replace(
            options, objective=goal.objective, budget_usd_per_hour=goal.budget_usd_per_hour), quiet))
    # mixed: the mixed-stage family first (deterministic, ~0.1-0.3 s where a fast pool exists), so a MILP
    # that runs to the limit does not leave it untried; its time comes out of the MILP's share
    early = _mixed_family(instance, options)
    early_bound = _early_mixed_bound(instance, options, early, t0)  # hetgap: before the MILP takes the limit
    narrow: Plan | None = None
    narrow_note: tuple[str, ...] = ()
    pre_search = links.compresses and options.extra.get("warm_start", "heuristic") == "heuristic"
    if pre_search:
        extra = {k: v for k, v in options.extra.items() if k not in ("link_precision", "max_compressed_links",
                                                                     "link_penalty")}
        first = plan_milp(instance, dataclasses.replace(
            options, time_limit_s=NARROW_SHARE * options.time_limit_s, work_limit_s=NARROW_SHARE * work,
            extra={**extra, "outside_check": "off"}, progress=quiet),
            warm_start=_heuristic_warm_start("native", None, quiet, hard, cuts,
                                             min(10.0, 0.2 * NARROW_SHARE * options.time_limit_s)))
        narrow = first.plan
        narrow_note = tuple(n for n in first.notes if n.startswith("stopped by the time limit"))  # determinism
        if narrow is not None:
            narrow_note += (f"warm start of this search: the native-link search's plan ({first.iteration_time_s:.6g} s, "
                           f"{first.status}, {first.search_time_s:.1f} s) against the heuristic's under "
                           f"--link-precision {policy}",)
    left = max(options.time_limit_s - (time.perf_counter() - t0), 0.05)
    # determinism: the k-identical search's work is a fixed function of the limit: what the native pre-search
    # and the early [H11b] bound may take comes off it by their shares, not by the clock
    work_left = (work * (1 - NARROW_SHARE * pre_search)
                 - (MIXED_BOUND_SHARE * work if early_bound is not None else 0.0))
    heuristic = _heuristic_warm_start(policy if links.compresses else "native",
                                      links.max_compressed if links.compresses else None, quiet, hard, cuts,
                                      min(10.0, 0.2 * options.time_limit_s))

    def warm(inst: Instance, tables: CostTables, seconds: float) -> Plan | None:
        cands = [p for p in (heuristic(inst, tables, seconds), narrow) if p is not None]
        scored = [(ev.iteration_time_s + links.plan_penalty(p.pipelines), i, p) for i, p in enumerate(cands)
                  if (ev := evaluate(p, inst, tables)).feasible]
        return min(scored)[2] if scored else None

    found: list[tuple[Plan, float]] = []  # colgen: the grouped plan [H9] is inside the certificate's space

    def outside(inst: Instance, tables: CostTables, incumbent_s: float, seconds: float) -> tuple[float, str] | None:
        # determinism: ended by its work units (a fixed function of the limit), the clock its watchdog
        alt = grouped_alternative(inst, incumbent_s, tables=tables, options=HeuristicOptions(
            time_limit_s=seconds, work_limit=warm_start_work(min(10.0, 0.2 * work)), link_precision=policy,
            progress=quiet))
        if alt is None or alt.plan is None:
            return None
        found.append((alt.plan, alt.iteration_time_s))
        return alt.iteration_time_s, dict(alt.plan.meta).get("groups", "")

    # colgen: the k-identical search leaves GROUPED_SHARE of the time to the grouped space's bound
    share = 0.0 if options.extra.get("grouped_bound", GROUPED_BOUND_DEFAULT) == "off" else GROUPED_SHARE
    res = plan_milp(instance, dataclasses.replace(options, time_limit_s=left * (1 - share),
                                                  work_limit_s=max(work_left, 0.0) * (1 - share)),
                    warm_start=warm, outside=outside)
    res = _with_grouped_bound(instance, options, res, policy, links, t0, found[-1] if found else None)
    res = _with_mixed_stages(instance, options, res, t0, early, early_bound)
    cut_note = tuple(f"stopped by the time limit: the wall clock ended the {c} before its work limit — the same input, "
                     "limit and seed may give another plan on a faster or less loaded machine; the bound still holds"
                     for c in dict.fromkeys(cuts))
    return dataclasses.replace(res, search_time_s=time.perf_counter() - t0, notes=(*res.notes, *narrow_note, *cut_note))


def _priced_warm_start(options: PlanOptions, progress: Progress | None = None) -> WarmStart:
    """costmilp: the heuristic under the same objective and budget ([H10] ``plan_fewest_nodes``, k
    identical pipelines: in the MILP's space), work-limited like the time objective's warm start
    (``priced_warm_work``), so that its plan does not depend on the machine's load; the clock
    (``seconds``) is only the backstop. sigint: ``progress`` (a stop-only view) carries a stop request in."""
    from hgopt.search.hierarchical.nodes import plan_fewest_nodes
    from hgopt.search.hierarchical.records import HeuristicOptions

    extra = options.extra
    links = extra.get("max_compressed_links")
    hopts = HeuristicOptions(link_precision=extra.get("link_precision", "native") or "native",
                             max_compressed_links=None if links in (None, "") else int(links),
                             cross_cluster_dp=False, objective=options.objective,
                             budget_usd_per_hour=options.budget_usd_per_hour, progress=progress)

    def run(inst: Instance, tables: CostTables, seconds: float, objective: str) -> Plan | None:
        res = plan_fewest_nodes(inst, tables=tables, options=dataclasses.replace(
            hopts, time_limit_s=seconds, work_limit=priced_warm_work(seconds), objective=objective))
        log.info("warm start: heuristic (%s) %s", objective, res.plan and f"{res.iteration_time_s:.6g} s")
        return res.plan

    def warm(inst: Instance, tables: CostTables, seconds: float) -> Plan | None:
        fallback = options.objective == "time" and options.budget_usd_per_hour is not None
        plan = run(inst, tables, seconds / (2 if fallback else 1), options.objective)
        if plan is None and fallback:
            # no plan within the budget by time: the cheapest plan keeps the budget if any does
            plan = run(inst, tables, seconds / 2, "cost")
        return plan

    return warm


def _with_grouped_bound(instance: Instance, options: PlanOptions, res: PlanResult, policy: str, links: LinkPolicy,
                        t0: float, grouped: tuple[Plan, float] | None) -> PlanResult:
    """colgen: the certificate over k identical pipelines and data parallelism across cluster groups
    (``hgopt.search.master``), within what is left of the time limit."""
    if res.plan is None or res.lower_bound_s is None:
        return res
    mode = options.extra.get("grouped_bound", GROUPED_BOUND_DEFAULT)
    if mode == "off" or (mode == "auto" and (grouped is None or grouped[1] >= res.iteration_time_s)):
        return name_outside(res)  # "auto": the wider space only when a grouped plan is the result
    # at most GROUPED_SHARE of the limit after the k-identical search, never past the limit: a search
    # that ends early leaves time to the caller (e.g. the why-not lines)
    # determinism: ended by its counted work (GROUPED_SHARE of the work budget); the limit's end is the watchdog
    gb = grouped_bound(instance, build_tables(instance), links, link_precision=policy, target=res.lower_bound_s,
                       deadline=min(t0 + options.time_limit_s, time.perf_counter() + PHASE_SLACK * GROUPED_SHARE
                                    * options.time_limit_s),
                       stop=counted_stop(GROUPED_SHARE * _work_of(options), GROUPED_QUERY_S, _stop_of(options)))
    return certify(res, gb, gap=options.gap, grouped_plan=grouped)


# ---- mixed: stages mixing replica groups of fast-linked clusters ([H11], hgopt.search.mixed) ----------
MIXED_COVERED = ("; or k identical pipelines whose stages mix replica groups of several clusters (the heuristic's "
                 "mixed-stage family [H11] among them), bounded by [H11b] (hgopt.search.mixed_bound: {bound:.6g} s, "
                 "never below the compute floor {floor:.6g} s){within}")
"""hetgap: the one clause naming stages that mix clusters when the certificate covers them."""
MIXED_MARGIN = 1e-9
"""A mixed plan replaces the result only when faster by more than this share (a tie in evaluate's
rounding keeps the k-identical result and its bound)."""
MIXED_NOT_BOUNDED = "; not bounded: stages that mix replica groups of several clusters ({found})"
"""hetgap: the one clause naming them when it does not (master's outside lists no longer name them)."""
MIXED_BOUND_CLUSTERS = 4
"""``mixed_bound`` runs on instances of at most this many clusters (its fill orders grow as C!)."""


_NOT_RUN = object()


def _mixed_family(instance: Instance, options: PlanOptions) -> object:
    """The mixed-stage family's best plan (``best_mixed_plan``; None: no pool or nothing fits), searched
    before the MILP when the limit allows a second or more; else ``_NOT_RUN`` (tried after the MILP if
    time is left)."""
    if options.extra.get("mixed_stages", "auto") == "off" or options.time_limit_s < 1.0:
        return _NOT_RUN
    return best_mixed_plan(instance, build_tables(instance), stop=_mixed_stop(options, time.perf_counter()))


def _mixed_stop(options: PlanOptions, t0: float) -> Callable[[], bool]:
    """hetgap: the mixed family's stop: a stop request, or MIXED_BOUND_SHARE of the limit gone (the rest
    is the MILP's)."""
    prog = options.progress
    end = t0 + MIXED_BOUND_SHARE * options.time_limit_s
    return lambda: (prog is not None and prog.stop_requested()) or time.perf_counter() >= end


MIXED_BOUND_SHARE = 0.25
"""hetgap: share of the time limit ``mixed_bound`` may take right after the mixed-stage family, before
the MILP (which runs to its limit when it does not prove optimality); at its deadline it falls back to the
compute floor. sailor-het-80+240: ~7-16 s CPU on the loaded 2-core machine in round 7, 5.1 s after hetgap2
(load ~22; bench/RESULTS.md "[H11b] cheaper and tighter")."""


def _early_mixed_bound(instance: Instance, options: PlanOptions, early: object, t0: float) -> MixedBound | None:
    """[H11b] on the mixed family's plan time as the target, within MIXED_BOUND_SHARE of the limit
    (None: no mixed plan, too many clusters, or the family was not searched early)."""
    if not isinstance(early, MixedPlan) or len(instance.topology.clusters) > MIXED_BOUND_CLUSTERS:
        return None
    # determinism: ended by its counted work (MIXED_BOUND_SHARE of the work budget); the limit's end is the watchdog
    return mixed_bound(instance, build_tables(instance), target=early.iteration_time_s,
                       deadline=t0 + min(1.0, PHASE_SLACK * MIXED_BOUND_SHARE) * options.time_limit_s,
                       stop=counted_stop(MIXED_BOUND_SHARE * _work_of(options), _mixed_pair_s(instance), _stop_of(options)))


def _mixed_outside(res: PlanResult, found: str) -> PlanResult:
    """``res`` with the plan space naming mixed-cluster stages as not bounded (before the grouped space's
    "outside" suffix, which ``master.certify`` strips when it covers grouped plans)."""
    note = MIXED_NOT_BOUNDED.format(found=found)
    space = (res.plan_space.removesuffix(OUTSIDE_WHEN_OFF) + note + OUTSIDE_WHEN_OFF
             if res.plan_space.endswith(OUTSIDE_WHEN_OFF) else res.plan_space + note)
    meta = dict(res.plan.meta) if res.plan is not None else {}
    if "plan_space" in meta:
        meta["plan_space"] = space
    plan = None if res.plan is None else dataclasses.replace(res.plan, meta=tuple(meta.items()))
    return dataclasses.replace(res, plan=plan, plan_space=space)


def _with_mixed_stages(instance: Instance, options: PlanOptions, res: PlanResult, t0: float,
                       early: object = _NOT_RUN, early_bound: MixedBound | None = None) -> PlanResult:
    """mixed/hetgap: the certificate and the heuristic's mixed-stage family [H11]. That family is
    deterministic (no clock), so the heuristic returns no mixed plan faster than the one found here.

    The bound over mixed stages is ``mixed_bound`` [H11b] (valid for every plan of k identical
    pipelines whose stages hold replica groups of any clusters, the k-identical space included; at
    least ``compute_floor``; on instances of at most MIXED_BOUND_CLUSTERS clusters, within the time
    limit, else the floor). The certificate's bound is the least over the families it covers:

    - the mixed plan is faster than ``res``'s (after ``choose_sync``): it is the result; the bound is
      [H11b]'s (with the grouped space covered, the lesser of it and ``res``'s bound);
    - otherwise, when [H11b]'s bound is at least ``res``'s, the space covers mixed stages too and the
      bound is [H11b]'s (a valid bound of ``res``'s space as well; with the grouped space covered,
      ``res``'s); when it is below, the space names mixed stages "not bounded" and keeps ``res``'s
      bound (``res``'s plan is at least as fast as the family's best)."""
    if res.plan is None or res.lower_bound_s is None:
        return res
    if options.extra.get("mixed_stages", "auto") == "off":
        return _mixed_outside(res, "not searched: mixed_stages off")
    tables = build_tables(instance)
    deadline = t0 + options.time_limit_s
    late = early is _NOT_RUN and time.perf_counter() >= deadline
    prog = options.progress
    mixed = early if early is not _NOT_RUN else None if late else best_mixed_plan(
        instance, tables, stop=lambda: (prog is not None and prog.stop_requested()) or time.perf_counter() >= deadline)
    if mixed is None:
        return _mixed_outside(res, "not tried: the time limit ran out" if late else "no fast pool of clusters")
    assert isinstance(mixed, MixedPlan)
    # against the result as the registry returns it (its sync fields by choose_sync, like the mixed plan's)
    own = evaluate(choose_sync(res.plan, instance, tables, zero=True), instance, tables)
    own_s = min(res.iteration_time_s, own.iteration_time_s) if own.feasible else res.iteration_time_s
    adopt = mixed.iteration_time_s < own_s * (1 - MIXED_MARGIN)
    grouped = not res.plan_space.endswith(OUTSIDE_WHEN_OFF)  # master.certify covered grouped plans
    floor = compute_floor(instance, tables)
    mb = early_bound
    if mb is None and len(instance.topology.clusters) <= MIXED_BOUND_CLUSTERS and time.perf_counter() < deadline:
        mb = mixed_bound(instance, tables, target=mixed.iteration_time_s if adopt else own_s, deadline=deadline,
                         stop=counted_stop(MIXED_BOUND_SHARE * _work_of(options), _mixed_pair_s(instance), _stop_of(options)))
    mbv = max(floor, mb.value) if mb is not None else floor
    t = mixed.iteration_time_s if adopt else res.iteration_time_s
    if not adopt:
        if mbv < res.lower_bound_s * (1 - 1e-12):
            why = (f"its [H11b] bound, {mbv:.6g} s, is below this bound" if mb is not None else
                   f"more than {MIXED_BOUND_CLUSTERS} clusters, or the time limit ran out")
            return _mixed_outside(res, f"their best, {mixed.iteration_time_s:.6g} s, is not faster; {why}")
        lb = res.lower_bound_s if grouped else mbv
    else:
        lb = max(floor, min(res.lower_bound_s, mbv)) if grouped else mbv
    lb = min(lb, t)
    g = max(0.0, (t - lb) / t)
    status = "optimal" if g <= options.gap + 1e-12 else "feasible"
    solver = res.solver
    if status != res.status and "certified the result" in solver:
        solver = solver.split(" (")[0] + " (not run: the k-identical space's bounds certified it, the mixed-stage space's did not)"
    within = "; not within data parallelism across cluster groups" if grouped else ""
    space = res.plan_space.removesuffix(OUTSIDE_WHEN_OFF) + MIXED_COVERED.format(bound=mbv, floor=floor, within=within)
    if res.plan_space.endswith(OUTSIDE_WHEN_OFF):
        space += OUTSIDE_WHEN_OFF
    base = mixed.plan if adopt else res.plan
    meta = dict(res.plan.meta)
    meta.update(lower_bound_s=repr(lb), gap=f"{g:.6f}", status=status, plan_space=space, solver=solver,
                lower_bound_before_mixed_s=repr(res.lower_bound_s), compute_floor_s=repr(floor), mixed_bound_s=repr(mbv))
    if adopt:
        meta["mixed"] = dict(mixed.plan.meta).get("mixed", "")
    bound_note = mb.describe() if mb is not None else f"the compute floor {floor:.6g} s"
    note = (f"the heuristic's plan with stages mixing clusters ({t:.6g} s by evaluate) is faster than the best plan "
            f"of the space above ({own_s:.6g} s) and is the result; bound: {bound_note}" if adopt else
            f"stages mixing clusters: their best plan {mixed.iteration_time_s:.6g} s is not faster; {bound_note}")
    plan = dataclasses.replace(base, planner="milp", meta=tuple(meta.items()))
    return dataclasses.replace(res, plan=plan, iteration_time_s=t, lower_bound_s=lb, status=status, solver=solver,
                               plan_space=space, notes=(*res.notes, note))


def _work_of(options: PlanOptions) -> float:
    """determinism: the search's work budget (nominal seconds, ``hgopt.search.work``)."""
    return options.time_limit_s if options.work_limit_s is None else options.work_limit_s


def _mixed_pair_s(instance: Instance) -> float:
    """determinism: the work charged for one of [H11b]'s (B, m) pairs on ``instance`` (``work.mixed_pair_work``)."""
    return mixed_pair_work(len(instance.model.layers), len(instance.topology.clusters))


def _stop_of(options: PlanOptions) -> Callable[[], bool] | None:
    """determinism: the search's stop flag (``Progress.stop_requested``) for the bound routines, or None."""
    return options.progress.stop_requested if options.progress is not None else None


def _heuristic_warm_start(policy: str, max_compressed: int | None, progress: Progress | None = None,
                          hard: float | None = None, cuts: list[str] | None = None, wall_share: float = 0.0) -> WarmStart:
    """The heuristic's plan under ``policy`` (k identical pipelines: in the MILP's space). sigint:
    ``progress`` (the search's ``Progress.stop_only()`` view) lets a stop request end it, with its
    incumbent (or none). determinism: its work limit (``warm_start_work`` of its share) ends it; the
    wall clock only at ``PHASE_SLACK`` × its share (of the work, or ``wall_share``, its share of the wall
    limit, when larger: ``--work-limit`` below ``--time-limit``) or at ``hard`` (``time.perf_counter()`` time:
    the search's own deadline), whichever comes first — the watchdog, no longer the share itself."""

    def warm(inst: Instance, tables: CostTables, seconds: float) -> Plan | None:
        kw: dict[str, object] = {}
        if policy != "native":
            kw = {"link_precision": policy, "max_compressed_links": max_compressed}
        wall = seconds if hard is None else max(min(hard - time.perf_counter(),
                                                     PHASE_SLACK * max(seconds, wall_share)), 0.05)
        res = heuristic_incumbent(inst, tables, time_limit_s=wall, work_limit=warm_start_work(seconds),
                                  progress=progress, **kw)  # type: ignore[arg-type]
        log.info("warm start: heuristic %s after %d work units (%s)", res.plan and f"{res.iteration_time_s:.6g} s",
                 res.work, res.stopped or "complete")
        if cuts is not None and res.stopped == "time limit":  # determinism: the clock, not its work, ended it
            cuts.append("warm start's heuristic")
        return res.plan

    return warm
