"""Cost as an objective (``hgopt plan --objective cost``, ``--budget USD_PER_HOUR``, ``--pareto``).

Candidates: the registered time planner (heuristic or exact) run on cluster subsets of the instance
(``groups.sub_instance``): every cluster alone, the whole instance, for up to four clusters every
subset, and every cluster alone on half its nodes; each plan scored by ``evaluate`` on the whole
instance and priced like
``hgopt.explain`` (GPU-hours of the GPUs it uses from ``cost_per_gpu_hour`` over the iteration time,
plus WAN egress from ``egress_usd_per_gb``). GPU counts other than what the time planner picks on
those (sub)instances are not searched.

Bounds, each valid for every plan of any planner:

- **cost** (``cost_lower_bound``): every sample passes forward and backward through every layer on
  some GPU, and in every plan each GPU computes its share of microbatches one after another within
  the iteration ([C3]: iteration time ≥ m × a stage's compute), so a plan's GPU-seconds priced by
  ``cost_per_gpu_hour`` are at least Σ_layers global_batch × min over (cluster, tp, profiled
  microbatch size) of price × tp × (forward + backward seconds of the layer) / microbatch size — the
  kernel's [C2] times (``CostTables``; per-sample time between profiled sizes is interpolated
  linearly, so its minimum is at a profiled size). Egress only adds.
- **time** (with ``--budget``): the time planner's lower bound on the whole instance (a budget only
  removes plans).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from hgopt.cost import build_tables, evaluate
from hgopt.cost.money import cost_lower_bound as money_bound
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.search import PlanOptions, PlanResult
from hgopt.spec import Instance

__all__ = ["Candidate", "CostSearch", "cost_lower_bound", "pareto", "plan_by_cost", "plan_usd"]

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


def plan_by_cost(instance: Instance, planner: Callable[[Instance, PlanOptions], PlanResult], options: PlanOptions,
                 *, objective: str = "cost", budget_usd_per_hour: float | None = None,
                 tables: CostTables | None = None) -> CostSearch:
    """Run ``planner`` on the cluster subsets (the whole instance first; ``options.time_limit_s``
    shared among them) and pick the cheapest (``cost``) or fastest (``time``) plan whose $/hour is
    within ``budget_usd_per_hour``; with the bound of the chosen objective."""
    if objective not in ("cost", "time"):
        raise ValueError(f"--objective: must be time or cost, got {objective!r}")
    if budget_usd_per_hour is not None and not (budget_usd_per_hour > 0 and math.isfinite(budget_usd_per_hour)):
        raise ValueError(f"--budget: must be > 0 dollars per hour, got {budget_usd_per_hour}")
    unpriced = [c.name for c in instance.topology.clusters if c.cost_per_gpu_hour is None]
    if unpriced:
        raise ValueError(f"--objective cost / --budget / --pareto: clusters without cost_per_gpu_hour: "
                         f"{', '.join(unpriced)} (set topology.clusters[*].cost_per_gpu_hour)")
    tables = tables or build_tables(instance)
    names = tuple(c.name for c in instance.topology.clusters)
    subsets = _subsets(instance)
    deadline = time.monotonic() + options.time_limit_s
    tokens = instance.job.global_batch * instance.job.seq_len
    out: list[Candidate] = []
    whole_bound: float | None = None
    for i, (subset, nodes) in enumerate(subsets):
        left = deadline - time.monotonic()
        if i and left <= 0:
            log.info("cost search: time limit reached after %d of %d cluster subsets", i, len(subsets))
            break
        share = max(left / (len(subsets) - i), 0.1) if i else max(left / 2 if len(subsets) > 1 else left, 0.1)
        sub = _restricted(instance, subset, nodes)
        log.info("cost search: %s%s (%d of %d cluster subsets, %.1f s)", "+".join(subset),
                 "" if nodes is None else f" on {nodes} nodes", i + 1, len(subsets), share)
        try:
            res = planner(sub, PlanOptions(time_limit_s=share, gap=options.gap, solver=options.solver,
                                           threads=options.threads, seed=options.seed, extra=options.extra,
                                           progress=options.progress))
        except ValueError as exc:  # e.g. a subset the planner declines; the others still count
            res = PlanResult(planner="", status="error", plan=None, notes=(str(exc),))
        if len(subset) == len(names) and nodes is None:
            whole_bound = res.lower_bound_s
        if res.plan is None:
            out.append(Candidate(clusters=subset, nodes=nodes, result=res, iteration_time_s=math.inf, usd_per_iteration=None,
                                 usd_per_hour=None, usd_per_million_tokens=None))
            continue
        t, usd = plan_usd(res.plan, instance, tables)
        out.append(Candidate(clusters=subset, nodes=nodes, result=res, iteration_time_s=t, usd_per_iteration=usd,
                             usd_per_hour=None if usd is None or not math.isfinite(t) else usd / t * 3600.0,
                             usd_per_million_tokens=None if usd is None else usd / tokens * 1e6))
        if options.progress is not None and options.progress.stop_requested():
            break
    ok = [c for c in out if c.usd_per_iteration is not None and math.isfinite(c.iteration_time_s)
          and (budget_usd_per_hour is None or (c.usd_per_hour or 0.0) <= budget_usd_per_hour)]
    key = (lambda c: (c.usd_per_iteration, c.iteration_time_s)) if objective == "cost" else \
        (lambda c: (c.iteration_time_s, c.usd_per_iteration))
    best = min(ok, key=key) if ok else None  # type: ignore[arg-type]
    if objective == "cost":
        lb: float | None = cost_lower_bound(instance, tables)
        note = ("$ per iteration: global batch x per layer the cheapest GPU-seconds of forward + backward over "
                "every cluster, tp and profiled microbatch size (any plan of any planner; egress only adds)")
        val = best.usd_per_iteration if best else None
    else:
        lb = whole_bound
        note = ("seconds: the time planner's lower bound on the whole instance (the budget only removes plans)"
                if lb is not None else "no time bound (the planner gives none)")
        val = best.iteration_time_s if best else None
    gap = None if val is None or lb is None or val <= 0 else max(0.0, (val - lb) / val)
    return CostSearch(objective=objective, budget_usd_per_hour=budget_usd_per_hour, candidates=tuple(out), best=best,
                      lower_bound=lb, gap=gap, bound_note=note)


def pareto(candidates: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
    """The candidates no other is both faster and cheaper than (ties keep both), fastest first."""
    ok = [c for c in candidates if c.usd_per_iteration is not None and math.isfinite(c.iteration_time_s)]
    keep = [c for c in ok if not any(
        (o.iteration_time_s <= c.iteration_time_s and o.usd_per_iteration <= c.usd_per_iteration  # type: ignore[operator]
         and (o.iteration_time_s < c.iteration_time_s or o.usd_per_iteration < c.usd_per_iteration))  # type: ignore[operator]
        for o in ok)]
    return tuple(sorted(keep, key=lambda c: c.iteration_time_s))
