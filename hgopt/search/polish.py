"""A local improvement of a plan of k identical pipelines, scored by ``evaluate`` (gaps3, issue #11
item 3: the exact planner's incumbent).

The MILP of a batch split proposes plans from a model that prices the tail by the first stage only
and hand-overs by a floor over layouts, and under load its time runs out before the best plan of
the split appears (sailor-geo-5x32: 2.2527 s at 40 s where 2.2426 s is one layer away). ``polish``
walks from a plan to neighbours that keep the batch split — one stage boundary moved by one layer
in every pipeline, or two clusters' blocks swapped (or a block moved to an unused cluster) — and
keeps the first neighbour that ``evaluate`` (plus the link penalty) scores lower, until none does or
``max_evals`` evaluations are spent. Deterministic: the neighbours are visited in a fixed order and
the work is counted in evaluations, not seconds (the deadline only stops it early).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Iterator

from hgopt.cost import evaluate
from hgopt.cost.tables import CostTables
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Instance

__all__ = ["MAX_EVALS", "polish"]

log = logging.getLogger(__name__)

MAX_EVALS = 200
"""Evaluations one ``polish`` call may spend (about 1 ms each on sailor-geo-5x32)."""


def polish(instance: Instance, tables: CostTables, plan: Plan, *, penalty: Callable[[tuple[Pipeline, ...]], float],
           deadline: float = math.inf, max_evals: int = MAX_EVALS,
           stop: Callable[[], bool] | None = None) -> tuple[Plan, float]:
    """The best plan the walk reaches from ``plan`` and its objective (``evaluate``'s iteration time +
    ``penalty`` of its pipelines); ``plan`` itself when no neighbour beats it. determinism: ``stop`` (e.g.
    ``Progress.stop_requested``) answering True ends the walk like the deadline, with the best plan so far."""

    def halted() -> bool:
        return time.perf_counter() >= deadline or (stop is not None and stop())

    best, best_val = plan, _score(instance, tables, plan, penalty)
    evals = 1
    start = best_val
    while evals < max_evals and not halted():
        for cand in _neighbours(instance, best):
            if evals >= max_evals or halted():
                break
            evals += 1
            v = _score(instance, tables, cand, penalty)
            if v < best_val * (1 - 1e-9):
                best, best_val = cand, v
                break
        else:
            break  # no neighbour is better: a local optimum
    if best_val < start:
        log.info("polish: %.6g s -> %.6g s in %d evaluations", start, best_val, evals)
    return best, best_val


def _score(instance: Instance, tables: CostTables, plan: Plan, penalty: Callable[[tuple[Pipeline, ...]], float]) -> float:
    ev = evaluate(plan, instance, tables)
    if not ev.feasible or not math.isfinite(ev.iteration_time_s):
        return math.inf
    return ev.iteration_time_s + penalty(plan.pipelines)


def _neighbours(instance: Instance, plan: Plan) -> Iterator[Plan]:
    """Boundary moves first (one layer, every pipeline alike), then block swaps and moves."""
    pipes = plan.pipelines
    if not pipes or any(len(p.stages) != len(pipes[0].stages) for p in pipes):
        return
    for i in range(len(pipes[0].stages) - 1):
        for d in (-1, 1):
            moved = tuple(_shift(p, i, d) for p in pipes)
            if all(m is not None for m in moved):
                yield dataclasses.replace(plan, pipelines=moved)  # type: ignore[arg-type]
    used = list(dict.fromkeys(g.cluster for p in pipes for s in p.stages for g in s.groups))
    others = [c.name for c in instance.topology.clusters if c.name not in used]
    for i, a in enumerate(used):
        for b in [*used[i + 1:], *others]:
            names = {a: b, b: a}
            yield dataclasses.replace(plan, pipelines=tuple(_rename(p, names) for p in pipes))


def _shift(p: Pipeline, i: int, d: int) -> Pipeline | None:
    """Stage i's end (and stage i + 1's start) moved by d layers; None when a stage would be empty."""
    a, b = p.stages[i], p.stages[i + 1]
    cut = a.end + d
    if not (a.start < cut < b.end):
        return None
    stages = (*p.stages[:i], dataclasses.replace(a, end=cut), dataclasses.replace(b, start=cut), *p.stages[i + 2:])
    return dataclasses.replace(p, stages=stages)


def _rename(p: Pipeline, names: dict[str, str]) -> Pipeline:
    def group(g: ReplicaGroup) -> ReplicaGroup:
        return dataclasses.replace(g, cluster=names.get(g.cluster, g.cluster))

    def stage(s: Stage) -> Stage:
        return dataclasses.replace(s, groups=tuple(group(g) for g in s.groups))

    return dataclasses.replace(p, stages=tuple(stage(s) for s in p.stages))
