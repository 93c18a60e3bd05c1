"""Cost as an objective (``hgopt plan --objective cost``, ``--budget USD_PER_HOUR``, ``--pareto``).

Candidates: the registered planner run on the whole instance with the objective and budget
(``PlanOptions.objective`` / ``budget_usd_per_hour``). When it returns the plans it scored on the way
(``PlanResult.candidates``: the heuristic, which searches cluster subsets, node counts and grouped
plans itself under the cost objective [H10]), those are the candidates, and under ``time`` the
planner is run once more under ``cost`` so that the listing also holds the cheap end of the plan
space. Otherwise (a planner that returns one plan) the planner also runs on cluster subsets of the
instance (``groups.sub_instance``): for up to four clusters every subset, else each cluster alone,
and every cluster alone on half its nodes. Every plan is scored by ``evaluate`` on the whole instance
and priced by ``hgopt.cost.money`` (GPU-hours of the GPUs it uses from ``cost_per_gpu_hour`` over the
iteration time, plus WAN egress from ``egress_usd_per_gb``).

Bounds, each valid for every plan of any planner:

- **cost** (``cost_lower_bound``): every sample passes forward and backward through every layer on
  some GPU, and in every plan each GPU computes its share of microbatches one after another within
  the iteration ([C3]: iteration time ≥ m × a stage's compute), so a plan's GPU-seconds priced by
  ``cost_per_gpu_hour`` are at least Σ_layers global_batch × min over (cluster, tp, profiled
  microbatch size) of price × tp × (forward + backward seconds of the layer) / microbatch size — the
  kernel's [C2] times (``CostTables``; per-sample time between profiled sizes is interpolated
  linearly, so its minimum is at a profiled size); plus each layer's cheapest optimizer step, which
  every GPU runs after its last backward (``hgopt.cost.money``'s docstring). Egress only adds.
- **time** (with ``--budget``): the time planner's lower bound on the whole instance (a budget only
  removes plans).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from hgopt.cost import build_tables, evaluate
from hgopt.cost.money import budget_note, usd_per_hour_floor
from hgopt.cost.money import cost_lower_bound as money_bound
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.search import PlanOptions, PlanResult
from hgopt.spec import Instance

__all__ = ["Candidate", "CostSearch", "cost_lower_bound", "pareto", "plan_by_cost", "plan_usd", "single_result_search",
           "subset_shares"]

log = logging.getLogger(__name__)

ALL_SUBSETS_UP_TO = 4
"""Clusters up to which every subset is a candidate (beyond: each alone and all together)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    clusters: tuple[str, ...]
    """The clusters the time planner was given."""
    nodes: int | None = None
    """For a one-cluster candidate given only part of its cluster: the nodes it was given."""
    result: PlanResult
    iteration_time_s: float
    """``evaluate`` on the whole instance (inf: no feasible plan)."""
    usd_per_iteration: float | None
    usd_per_hour: float | None
    usd_per_million_tokens: float | None
    source: str = "planner"
    """``planner``: the planner's plan on ``clusters``; ``searched``: a plan it scored on the way."""
    stopped: bool = False
    """deadline2: the planner returned it after a stop was requested (its search was cut short)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostSearch:
    objective: str
    """``cost`` or ``time``."""
    budget_usd_per_hour: float | None
    candidates: tuple[Candidate, ...]
    best: Candidate | None
    """The cheapest (objective cost) or fastest (time) candidate within the budget; None: none."""
    lower_bound: float | None
    """$ per iteration (cost) or seconds (time), valid for every plan of any planner."""
    gap: float | None
    """(best − bound) / best, for the chosen objective."""
    bound_note: str
    note: str = ""
    """Why no candidate was chosen (e.g. the cheapest $/hour found, over the budget)."""
    unsearched: int = 0
    """deadline2: cluster subsets left out because the time limit (or a stop) came first."""


def plan_usd(plan: Plan, instance: Instance, tables: CostTables) -> tuple[float, float | None]:
    """(iteration time by ``evaluate``, $ per iteration by ``hgopt.explain``'s pricing or None)."""
    from hgopt.explain import explain

    ev = evaluate(plan, instance, tables)
    if not ev.feasible:
        return math.inf, None
    return ev.iteration_time_s, explain(plan, instance, ev, tables).money.usd_per_iteration


def cost_lower_bound(instance: Instance, tables: CostTables | None = None) -> float:
    """$ per iteration below which no plan's GPU-hours can go (``hgopt.cost.money.cost_lower_bound``)."""
    return money_bound(instance, tables or build_tables(instance))


def _subsets(instance: Instance) -> list[tuple[tuple[str, ...], int | None]]:
    """(clusters, nodes of a lone cluster or None): the whole instance first, then every subset (up
    to ``ALL_SUBSETS_UP_TO`` clusters; beyond, each cluster alone), then each cluster alone on half
    its nodes (fewer GPUs can be cheaper per iteration: less synchronisation, smaller bubbles)."""
    names = tuple(c.name for c in instance.topology.clusters)
    if len(names) <= ALL_SUBSETS_UP_TO:
        out = [s for k in range(1, len(names) + 1) for s in itertools.combinations(names, k)]
    else:
        out = [(n,) for n in names] + [names]
    ordered: list[tuple[tuple[str, ...], int | None]] = [
        (s, None) for s in sorted(out, key=lambda s: (len(s) != len(names), len(s)))]
    ordered += [((c.name,), c.nodes // 2) for c in instance.topology.clusters if c.nodes >= 2]
    return ordered


def _restricted(instance: Instance, subset: tuple[str, ...], nodes: int | None) -> Instance:
    import dataclasses

    from hgopt.search.groups import sub_instance

    if nodes is None and len(subset) == len(instance.topology.clusters):
        return instance
    sub = sub_instance(instance, subset, instance.job.global_batch)
    if nodes is None:
        return sub
    (c,) = sub.topology.clusters
    return dataclasses.replace(sub, name=f"{sub.name}:{nodes}nodes", topology=dataclasses.replace(
        sub.topology, clusters=(dataclasses.replace(c, nodes=nodes),)))


def _candidate(instance: Instance, tables: CostTables, subset: tuple[str, ...], nodes: int | None, res: PlanResult,
               source: str = "planner", stopped: bool = False) -> Candidate:
    """``res`` scored by ``evaluate`` on the whole instance and priced."""
    if res.plan is None:
        return Candidate(clusters=subset, nodes=nodes, result=res, iteration_time_s=math.inf, stopped=stopped,
                         usd_per_iteration=None, usd_per_hour=None, usd_per_million_tokens=None, source=source)
    tokens = instance.job.global_batch * instance.job.seq_len
    t, usd = plan_usd(res.plan, instance, tables)
    return Candidate(clusters=subset, nodes=nodes, result=res, iteration_time_s=t, usd_per_iteration=usd,
                     usd_per_hour=None if usd is None or not math.isfinite(t) else usd / t * 3600.0,
                     usd_per_million_tokens=None if usd is None else usd / tokens * 1e6, source=source,
                     stopped=stopped)


def subset_shares(time_limit_s: float, subsets: int) -> tuple[float, ...]:
    """deadline2: the nominal time limit of each cluster subset's planner run, a fixed function of
    ``--time-limit`` (the same input and limit give the same runs whatever the machine's load): the
    whole instance half of it (all of it when it is the only subset), the other subsets the other
    half in equal parts; at least 0.1 s each."""
    if subsets <= 1:
        return (max(time_limit_s, 0.1),)
    rest = max(0.5 * time_limit_s / (subsets - 1), 0.1)
    return (max(0.5 * time_limit_s, 0.1),) + (rest,) * (subsets - 1)


def plan_by_cost(instance: Instance, planner: Callable[[Instance, PlanOptions], PlanResult], options: PlanOptions,
                 *, objective: str = "cost", budget_usd_per_hour: float | None = None,
                 tables: CostTables | None = None,
                 on_update: Callable[[CostSearch], None] | None = None) -> CostSearch:
    """Run ``planner`` on the cluster subsets (the whole instance first; ``options.time_limit_s``
    shared among them by ``subset_shares``; subsets not started by then — in CPU seconds of the process,
    so that the load does not change them; the wall is the stop flag's — are left out and counted in
    ``unsearched``) and pick the cheapest (``cost``) or fastest (``time``) plan whose $/hour is
    within ``budget_usd_per_hour``; with the bound of the chosen objective. ``on_update``: called
    with the search so far after every planner run (a command's deadline takes the last one when
    the search does not return in time)."""
    from hgopt.cost.money import unpriced_clusters

    if objective not in ("cost", "time"):
        raise ValueError(f"--objective: must be time or cost, got {objective!r}")
    if budget_usd_per_hour is not None and not (budget_usd_per_hour > 0 and math.isfinite(budget_usd_per_hour)):
        raise ValueError(f"--budget: must be > 0 dollars per hour, got {budget_usd_per_hour}")
    unpriced = unpriced_clusters(instance)
    if unpriced:
        names = [c.name for c in instance.topology.clusters]
        fields = ", ".join(f"topology.clusters[{names.index(n)}].cost_per_gpu_hour ({n})" for n in unpriced)
        raise ValueError(f"{instance.source}: --objective cost / --budget / --pareto need every cluster's price "
                         f"per GPU-hour; not set: {fields}")
    tables = tables or build_tables(instance)
    names = tuple(c.name for c in instance.topology.clusters)
    subsets = _subsets(instance)
    shares = subset_shares(options.time_limit_s, len(subsets))
    # deadline3: the subset loop's limit is in CPU seconds of this process (the same input and limit give
    # the same subsets whatever the load); the wall deadline is the command's watchdog's (the stop flag)
    deadline = time.process_time() + options.time_limit_s
    out: list[Candidate] = []
    whole_bound: float | None = None
    planner_usd_bound: float | None = None
    seen: set[str] = set()
    points: set[tuple[float, float | None, tuple[tuple[str, int], ...]]] = set()
    usd_floor = cost_lower_bound(instance, tables) if objective == "cost" else None

    def summary(unsearched: int) -> CostSearch:
        return _summarise(instance, tables, objective, budget_usd_per_hour, out, whole_bound, planner_usd_bound,
                          usd_floor, unsearched)

    def add(subset: tuple[str, ...], nodes: int | None, res: PlanResult, source: str = "planner",
            cut: bool = False) -> None:
        if res.plan is not None:  # the same plan once (its label fields aside)
            doc = res.plan.to_dict()
            for label in ("meta", "planner", "instance"):
                doc.pop(label, None)
            text = json.dumps(doc, sort_keys=True)
            if text in seen:
                return
            seen.add(text)
        cand = _candidate(instance, tables, subset, nodes, res, source, cut)
        if res.plan is not None:
            point = (cand.iteration_time_s, cand.usd_per_iteration, tuple(sorted(res.plan.gpus_by_cluster().items())))
            if source == "searched" and point in points:  # the same point of the listing (e.g. another mbs x m)
                return
            points.add(point)
        out.append(cand)

    def searched(res: PlanResult) -> None:
        for plan, _ in res.candidates:
            used = tuple(n for n in names if n in plan.gpus_by_cluster())
            add(used, None, PlanResult(planner=res.planner, status="heuristic", plan=plan), "searched")

    def options_for(share: float, obj: str, budget: float | None) -> PlanOptions:
        return PlanOptions(time_limit_s=share, gap=options.gap, solver=options.solver, threads=options.threads,
                           seed=options.seed, extra=options.extra, progress=options.progress,
                           objective=obj, budget_usd_per_hour=budget)  # type: ignore[arg-type]

    def stopped() -> bool:
        return options.progress is not None and options.progress.stop_requested()

    unsearched = 0
    for i, (subset, nodes) in enumerate(subsets):
        if i == 1 and any(c.result.candidates for c in out):  # the planner searched the plan space itself
            if objective == "time" and not stopped():  # the cheap end of the plan space too (for the listing)
                try:
                    cheap = planner(instance, options_for(shares[0], "cost", None))
                except ValueError as exc:
                    cheap = PlanResult(planner="", status="error", plan=None, notes=(str(exc),))
                add(names, None, cheap, cut=stopped())
                searched(cheap)
            break
        if i and (time.process_time() >= deadline or stopped()):
            log.info("cost search: time limit reached after %d of %d cluster subsets", i, len(subsets))
            unsearched = len(subsets) - i
            break
        sub = _restricted(instance, subset, nodes)
        log.info("cost search: %s%s (%d of %d cluster subsets, %.1f s)", "+".join(subset),
                 "" if nodes is None else f" on {nodes} nodes", i + 1, len(subsets), shares[i])
        try:
            res = planner(sub, options_for(shares[i], objective, budget_usd_per_hour))
        except ValueError as exc:  # e.g. a subset the planner declines; the others still count
            res = PlanResult(planner="", status="error", plan=None, notes=(str(exc),))
        if len(subset) == len(names) and nodes is None:
            whole_bound = res.lower_bound_s if res.objective == "time" else None
            planner_usd_bound = res.usd_lower_bound
        add(subset, nodes, res, cut=stopped())
        searched(res)
        if on_update is not None:
            on_update(summary(len(subsets) - i - 1))
    return summary(unsearched)


def single_result_search(instance: Instance, res: PlanResult, *, objective: str, budget_usd_per_hour: float | None,
                         tables: CostTables, unsearched: int | None = None) -> CostSearch:
    """deadline2: the search made of one whole-instance result (a command's deadline stopped the
    cost search before it had priced any plan: the incumbent its planner last reported), with the
    bound of the objective that holds for every plan."""
    names = tuple(c.name for c in instance.topology.clusters)
    out = [_candidate(instance, tables, names, None, res, stopped=True)]
    whole = res.lower_bound_s if objective == "time" and res.objective == "time" else None
    usd_floor = cost_lower_bound(instance, tables) if objective == "cost" else None
    left = len(_subsets(instance)) - 1 if unsearched is None else unsearched
    return _summarise(instance, tables, objective, budget_usd_per_hour, out, whole, None, usd_floor, left)


def _summarise(instance: Instance, tables: CostTables, objective: str, budget_usd_per_hour: float | None,
               out: list[Candidate], whole_bound: float | None, planner_usd_bound: float | None,
               usd_floor: float | None, unsearched: int) -> CostSearch:
    ok = [c for c in out if c.usd_per_iteration is not None and math.isfinite(c.iteration_time_s)
          and (budget_usd_per_hour is None or (c.usd_per_hour or 0.0) <= budget_usd_per_hour)]
    key = (lambda c: (c.usd_per_iteration, c.iteration_time_s)) if objective == "cost" else \
        (lambda c: (c.iteration_time_s, c.usd_per_iteration))
    best = min(ok, key=key) if ok else None  # type: ignore[arg-type]
    if objective == "cost":
        lb: float | None = usd_floor if usd_floor is not None else cost_lower_bound(instance, tables)
        note = ("$ per iteration: global batch x per layer the cheapest GPU-seconds of forward + backward over "
                "every cluster, tp and profiled microbatch size, + per layer the cheapest optimizer step "
                "(any plan of any planner; egress only adds)")
        if planner_usd_bound is not None and lb is not None and planner_usd_bound > lb:  # e.g. the cost MILP
            note += (f"; the planner's own bound over its plan space is higher: ${planner_usd_bound:.4g} per "
                     "iteration (not used here: it need not hold for plans outside that space)")
        val = best.usd_per_iteration if best else None
    else:
        lb = whole_bound
        note = ("seconds: the time planner's lower bound on the whole instance (the budget only removes plans)"
                if lb is not None else "no time bound (the planner gives none)")
        val = best.iteration_time_s if best else None
    gap = None if val is None or lb is None or val <= 0 else max(0.0, (val - lb) / val)
    why = ""
    if best is None and budget_usd_per_hour is not None:
        rates = [c.usd_per_hour for c in out if c.usd_per_hour is not None]
        why = budget_note(budget_usd_per_hour, min(rates) if rates else None, usd_per_hour_floor(instance, tables))
    return CostSearch(objective=objective, budget_usd_per_hour=budget_usd_per_hour, candidates=tuple(out), best=best,
                      lower_bound=lb, gap=gap, bound_note=note, note=why, unsearched=unsearched)


def pareto(candidates: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
    """The candidates no other is both faster and cheaper than (ties keep both), fastest first."""
    ok = [c for c in candidates if c.usd_per_iteration is not None and math.isfinite(c.iteration_time_s)]
    keep = [c for c in ok if not any(
        (o.iteration_time_s <= c.iteration_time_s and o.usd_per_iteration <= c.usd_per_iteration  # type: ignore[operator]
         and (o.iteration_time_s < c.iteration_time_s or o.usd_per_iteration < c.usd_per_iteration))  # type: ignore[operator]
        for o in ok)]
    return tuple(sorted(keep, key=lambda c: c.iteration_time_s))
