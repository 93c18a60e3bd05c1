"""[H10] How many nodes of each cluster, under the cost objective or a budget: a plan on fewer GPUs
is often cheaper per iteration (less gradient synchronisation, smaller bubbles: the iteration slows
by less than the GPUs it gives back) and cheaper per hour, which the time objective never picks.

Every trial is a whole heuristic search (the same objective and budget) on the instance with those
nodes (``with_nodes``), scored on the whole instance by ``evaluate`` and ``Scorer``; trials already
run are not run again. First, when a budget is given and it is below the $/hour floor [$2]
(``hgopt.cost.money.usd_per_hour_floor``: no plan of any planner costs less), the answer is
'infeasible' at once, naming the floor. Otherwise:

1. greedy descent from all nodes: each round tries, for every cluster the current plan uses, half
   its nodes and one node fewer (and no node at all when another cluster is left), and moves to the
   best trial while it beats the current plan under the objective;
2. starts: every cluster alone on 1 node, half its nodes and all its nodes (also the clusters the
   plans so far do not use), skipping a start whose own floor [$2] is infinite (its GPUs cannot
   hold a replica) or over the budget; from the best start, when it beats the plan of 1, the same
   greedy descent.

When the plan on all nodes is over the budget (or there is none), 2 runs before 1, its starts
ordered by the $/hour of all their GPUs (cheapest first, so that a short time limit reaches them),
and 1 runs only when no start beats that plan.

Work: 1 + (descent rounds) + 3·C + (descent rounds) searches for C clusters, each descent round at
most 2 trials per used cluster and each round removes at least one node, so at most
2·C·log2(nodes)-ish rounds in practice; stops at the time limit with the best so far (the time
left is shared out among the trials still to run). Nodes only: a node's GPUs are used or not by
the intra-cluster DP. When nothing is within the budget, the note names the cheapest plan found and
the floor [$2]."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Mapping

from hgopt.cost import evaluate
from hgopt.cost.money import budget_note, usd_per_hour_floor
from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Plan
from hgopt.search.groups import sub_instance
from hgopt.search.hierarchical.objective import Scorer
from hgopt.search.hierarchical.records import HeuristicOptions, HeuristicResult, Realised, Skeleton
from hgopt.search.hierarchical.search import plan_heuristic
from hgopt.spec import Instance

__all__ = ["plan_fewest_nodes", "with_nodes"]

log = logging.getLogger(__name__)


def with_nodes(instance: Instance, nodes: Mapping[str, int]) -> Instance:
    """``instance`` with each cluster cut to ``nodes[name]`` nodes (0: left out, with its links)."""
    keep = [c.name for c in instance.topology.clusters if nodes.get(c.name, c.nodes) > 0]
    sub = sub_instance(instance, keep, instance.job.global_batch) if len(keep) < len(instance.topology.clusters) \
        else instance
    clusters = tuple(dataclasses.replace(c, nodes=nodes.get(c.name, c.nodes)) for c in sub.topology.clusters)
    label = ",".join(f"{n}:{k}" for n, k in sorted(nodes.items()) if k != instance.topology.cluster(n).nodes)
    return dataclasses.replace(sub, name=f"{instance.name}[{label}]" if label else instance.name,
                               topology=dataclasses.replace(sub.topology, clusters=clusters))


def _trials(current: Mapping[str, int], plan: Plan) -> list[dict[str, int]]:
    """Node vectors one step below ``current`` on the clusters ``plan`` uses."""
    used = plan.gpus_by_cluster()
    alive = [n for n, k in current.items() if k > 0]
    out: list[dict[str, int]] = []
    for name in sorted(used):
        k = current[name]
        for fewer in sorted({k // 2, k - 1}, reverse=True):
            if fewer < 0 or fewer == k or (fewer == 0 and len(alive) < 2):
                continue
            vec = dict(current)
            vec[name] = fewer
            if vec not in out:
                out.append(vec)
    return out


def _starts(instance: Instance) -> list[dict[str, int]]:
    """[H10] Node vectors of every cluster alone: 1 node, half its nodes, all its nodes."""
    out: list[dict[str, int]] = []
    names = [c.name for c in instance.topology.clusters]
    for c in instance.topology.clusters:
        for k in sorted({1, c.nodes // 2, c.nodes}):
            vec = {n: (k if n == c.name else 0) for n in names}
            if k > 0 and vec not in out:
                out.append(vec)
    return out


def _rent(instance: Instance, nodes: Mapping[str, int]) -> float:
    """$/hour of every GPU of ``nodes`` (ordering only; no price counts as 0)."""
    return sum(k * c.gpus_per_node * (c.cost_per_gpu_hour or 0.0)
               for c in instance.topology.clusters if (k := nodes.get(c.name, c.nodes)) > 0)


def plan_fewest_nodes(instance: Instance, *, tables: CostTables | None = None,
                      options: HeuristicOptions = HeuristicOptions()) -> HeuristicResult:
    """[H10] The heuristic under ``options.objective`` / budget over node counts (module docstring)."""
    import time

    t0 = time.perf_counter()
    tables = tables or build_tables(instance)
    budget = options.budget_usd_per_hour
    floor = usd_per_hour_floor(instance, tables)
    if budget is not None and budget < floor:
        return HeuristicResult(plan=None, skeleton=None, note=budget_note(budget, None, floor),
                               search_time_s=time.perf_counter() - t0)
    score = Scorer(instance=instance, tables=tables, objective=options.objective,  # type: ignore[arg-type]
                   budget_usd_per_hour=budget)
    tried: dict[tuple[tuple[str, int], ...], tuple[HeuristicResult, Realised | None]] = {}

    def left() -> float | None:
        return None if options.time_limit_s is None else options.time_limit_s - (time.perf_counter() - t0)

    def run(vec: Mapping[str, int], share: float | None) -> tuple[HeuristicResult, Realised | None]:
        key = tuple(sorted(vec.items()))
        if key in tried:
            return tried[key]
        res = plan_heuristic(with_nodes(instance, vec), tables=tables,
                             options=dataclasses.replace(options, time_limit_s=share))
        sk = res.skeleton or Skeleton(pipelines=1, microbatch=1, order=(), layers=())
        scored = []
        for plan in ([res.plan] if res.plan is not None else []) + [p for p, _ in res.candidates]:
            ev = evaluate(plan, instance, tables)  # priced on the whole instance
            if ev.feasible:
                score.record(plan, ev.iteration_time_s)
                scored.append(Realised(ev.iteration_time_s, sk, plan))
        # the search's own choice; without one (all over the budget) its best candidate, to descend from
        got = None if not scored else scored[0] if res.plan is not None else min(scored, key=score.rank)
        tried[key] = (res, got)
        return res, got

    def share(i: int, n: int) -> float | None:
        rest = left()
        return None if rest is None else max(rest / (n - i), 0.05)

    def out_of_time() -> bool:
        rest = left()
        return rest is not None and rest <= 0

    def descend(current: dict[str, int], result: HeuristicResult,
                best: Realised) -> tuple[dict[str, int], HeuristicResult, Realised]:
        while True:
            trials = _trials(current, best.plan)
            if not trials or out_of_time():
                break
            step: tuple[dict[str, int], HeuristicResult, Realised] | None = None
            for i, vec in enumerate(trials):
                if out_of_time():
                    break
                res, got = run(vec, share(i, len(trials)))
                log.debug("nodes %s: %s", vec, got and round(got.time_s, 4))
                if got is not None and (step is None or score.better(got, step[2])):
                    step = (vec, res, got)
            if step is None or not score.better(step[2], best):
                break
            current, result, best = step
        return current, result, best

    current = {c.name: c.nodes for c in instance.topology.clusters}
    first, best = run(current, left())
    result = first
    over = best is None or not score.within_budget(best.plan, best.time_s)
    if not over:
        assert best is not None
        current, result, best = descend(current, result, best)
    starts = [v for v in _starts(instance) if v != current
              and math.isfinite(f := usd_per_hour_floor(instance, tables, v)) and (budget is None or f <= budget)]
    if over:  # nothing within the budget on all nodes: the starts renting the least first (a short time limit)
        starts.sort(key=lambda v: _rent(instance, v))
    lead: tuple[dict[str, int], HeuristicResult, Realised] | None = None
    for i, vec in enumerate(starts):
        if out_of_time():
            break
        res, got = run(vec, share(i, len(starts) + 1))
        log.debug("start %s: %s", vec, got and round(got.time_s, 4))
        if got is not None and (lead is None or score.better(got, lead[2])):
            lead = (vec, res, got)
    if lead is not None and score.better(lead[2], best):
        current, result, best = descend(*lead)
    elif over and best is not None:  # no start helps: the descent from all nodes after all
        current, result, best = descend(current, result, best)
    if best is None or not score.within_budget(best.plan, best.time_s):
        note = first.note or ("no skeleton could be realised" if best is None else "")
        if best is not None or budget is not None:
            note = budget_note(budget, score.cheapest_usd_per_hour(), floor)
        return dataclasses.replace(first, plan=None, skeleton=None, iteration_time_s=float("inf"),
                                   candidates=tuple(score.seen), note=note,
                                   search_time_s=time.perf_counter() - t0)
    meta = tuple(best.plan.meta) + ((("nodes", ", ".join(f"{n}: {k} of {instance.topology.cluster(n).nodes}"
                                                          for n, k in current.items()
                                                          if k != instance.topology.cluster(n).nodes)),)
                                    if any(k != instance.topology.cluster(n).nodes for n, k in current.items()) else ())
    plan = dataclasses.replace(best.plan, instance=instance.name, meta=meta)
    return dataclasses.replace(result, plan=plan, iteration_time_s=best.time_s, candidates=tuple(score.seen),
                               search_time_s=time.perf_counter() - t0)
