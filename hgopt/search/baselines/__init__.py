"""Baseline planners, each implemented from its published description (see docs/planners.md), with
adapters to the planner registry's ``(instance, PlanOptions) -> PlanResult`` interface."""

from __future__ import annotations

import time
from typing import Callable

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Plan
from hgopt.search import PlanOptions, PlanResult
from hgopt.spec import Instance

__all__ = ["run_dp_only", "run_metis", "run_uniform"]


def _result(name: str, space: str, search: Callable[[], Plan | None], instance: Instance, t0: float,
            notes: tuple[str, ...] = ()) -> PlanResult:
    plan = search()
    elapsed = time.perf_counter() - t0
    if plan is None:
        return PlanResult(planner=name, status="infeasible", plan=None, search_time_s=elapsed, plan_space=space,
                          notes=notes + ("no plan of this planner's space fits",))
    ev = evaluate(plan, instance)
    return PlanResult(planner=name, status="heuristic", plan=plan, iteration_time_s=ev.iteration_time_s,
                      search_time_s=elapsed, plan_space=space, notes=notes + tuple(f"{k}: {v}" for k, v in plan.meta))


def run_uniform(instance: Instance, options: PlanOptions) -> PlanResult:
    """``uniform`` for the registry (see :mod:`hgopt.search.baselines.uniform`)."""
    from hgopt.search.baselines.uniform import plan_uniform

    t0 = time.perf_counter()
    tables = build_tables(instance)
    return _result("uniform", "Megatron-style PP x TP x DP grid, equal blocks per stage, one microbatch size",
                   lambda: plan_uniform(instance, tables=tables, time_limit_s=options.time_limit_s), instance, t0)


def run_dp_only(instance: Instance, options: PlanOptions) -> PlanResult:
    """``dp-only`` for the registry (see :mod:`hgopt.search.baselines.dp_only`)."""
    from hgopt.search.baselines.dp_only import plan_dp_only

    t0 = time.perf_counter()
    tables = build_tables(instance)
    return _result("dp-only", "data parallelism, tp 1, one microbatch size, ZeRO-1 only if needed",
                   lambda: plan_dp_only(instance, tables=tables, time_limit_s=options.time_limit_s), instance, t0)


def run_metis(instance: Instance, options: PlanOptions) -> PlanResult:
    """``metis`` for the registry (see :mod:`hgopt.search.baselines.metis`); ``options.extra`` may
    set max_stages, scale_variance, max_permute_len and bandwidth ('node' or 'slowest-link')."""
    from hgopt.search.baselines.metis import MetisOptions, plan_metis

    t0 = time.perf_counter()
    tables = build_tables(instance)
    extra = dict(options.extra)
    try:
        mo = MetisOptions(
            time_limit_s=options.time_limit_s,
            max_stages=int(extra.get("max_stages", 16)),
            scale_variance=int(extra.get("scale_variance", 1)),
            max_permute_len=int(extra.get("max_permute_len", 4)),
            bandwidth=extra.get("bandwidth", "node"),
        )
    except ValueError:
        raise ValueError("metis: max_stages, scale_variance and max_permute_len must be integers") from None
    return _result("metis", "Metis (ATC'24): device-type orderings, power-of-two device groups, per-stage (dp, tp), "
                   "speed-proportional data split, one inter-node bandwidth, no compression",
                   lambda: plan_metis(instance, tables=tables, options=mo), instance, t0)
