"""[H10] How many nodes of each cluster, under the cost objective or a budget: a plan on fewer GPUs
is often cheaper per iteration (less gradient synchronisation, smaller bubbles: the iteration slows
by less than the GPUs it gives back) and cheaper per hour, which the time objective never picks.

Greedy descent over node counts, every trial a whole heuristic search (the same objective and
budget) on the instance with those nodes (``with_nodes``), scored on the whole instance by
``evaluate`` and ``Scorer``: from all nodes, each round tries, for every cluster the current plan
uses, half its nodes and one node fewer (and no node at all when another cluster is left), and
moves to the best trial while it beats the current plan under the objective; stops at the time
limit with the best so far. Nodes only: a node's GPUs are used or not by the intra-cluster DP."""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

from hgopt.cost import evaluate
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


def plan_fewest_nodes(instance: Instance, *, tables: CostTables | None = None,
                      options: HeuristicOptions = HeuristicOptions()) -> HeuristicResult:
    """[H10] The heuristic under ``options.objective`` / budget over node counts (module docstring)."""
    import time

    t0 = time.perf_counter()
    tables = tables or build_tables(instance)
    score = Scorer(instance=instance, tables=tables, objective=options.objective,  # type: ignore[arg-type]
                   budget_usd_per_hour=options.budget_usd_per_hour)

    def left() -> float | None:
        return None if options.time_limit_s is None else options.time_limit_s - (time.perf_counter() - t0)

    def run(vec: Mapping[str, int], share: float | None) -> tuple[HeuristicResult, Realised | None]:
        res = plan_heuristic(with_nodes(instance, vec), tables=tables,
                             options=dataclasses.replace(options, time_limit_s=share))
        sk = res.skeleton or Skeleton(pipelines=1, microbatch=1, order=(), layers=())
        scored = []
        for plan in ([res.plan] if res.plan is not None else []) + [p for p, _ in res.candidates]:
            ev = evaluate(plan, instance, tables)  # priced on the whole instance
            if ev.feasible:
                score.record(plan, ev.iteration_time_s)
                scored.append(Realised(ev.iteration_time_s, sk, plan))
        if not scored:
            return res, None
        # the search's own choice; without one (all over the budget) its best candidate, to descend from
        return res, scored[0] if res.plan is not None else min(scored, key=score.rank)

    current = {c.name: c.nodes for c in instance.topology.clusters}
    first, best = run(current, left())
    result = first
    while best is not None:
        trials = _trials(current, best.plan)
        rest = left()
        if not trials or (rest is not None and rest <= 0):
            break
        step: tuple[dict[str, int], HeuristicResult, Realised] | None = None
        for i, vec in enumerate(trials):
            rest = left()
            if rest is not None and rest <= 0:
                break
            share = None if rest is None else max(rest / (len(trials) - i), 0.05)
            res, got = run(vec, share)
            log.debug("nodes %s: %s", vec, got and round(got.time_s, 4))
            if got is not None and (step is None or score.better(got, step[2])):
                step = (vec, res, got)
        if step is None or not score.better(step[2], best):
            break
        current, result, best = step
    if best is None or not score.within_budget(best.plan, best.time_s):
        cheapest = score.cheapest_usd_per_hour()
        note = first.note or ("no skeleton could be realised" if best is None else "")
        if best is not None or options.budget_usd_per_hour is not None:
            note = (f"no plan within the budget of ${options.budget_usd_per_hour:g}/hour"
                    + ("" if cheapest is None else f" (the cheapest found costs ${cheapest:.4g}/hour)"))
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
