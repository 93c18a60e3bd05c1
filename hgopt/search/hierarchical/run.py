"""Entry points for others: the exact planner's warm start and the planner registry's adapter."""

from __future__ import annotations

import time

from hgopt.cost.tables import CostTables
from hgopt.search import PlanOptions, PlanResult, link_penalties
from hgopt.search.hierarchical.records import HeuristicOptions, HeuristicResult
from hgopt.search.hierarchical.search import plan_heuristic
from hgopt.spec import Instance


def heuristic_incumbent(
    instance: Instance, tables: CostTables | None = None, time_limit_s: float | None = 10.0,
    link_precision: str = "native", max_compressed_links: int | None = None, work_limit: int | None = None,
) -> HeuristicResult:
    """Warm start for the exact planner: the heuristic's plan and its cluster-level skeleton (k, B,
    cluster order, layers per cluster, local weights, link precisions), whose local pipelines come
    from ``best_local_plan``. Data parallelism across cluster groups [H9] is left out: the warm start
    must lie in the exact planner's space (k identical pipelines). With ``work_limit``, the search
    ends at that much work (``HeuristicOptions.work_limit``) unless the time limit comes first: when
    the work limit ends it (``result.stopped == 'work limit'``) the plan does not depend on the clock."""
    return plan_heuristic(instance, tables=tables, options=HeuristicOptions(
        time_limit_s=time_limit_s, link_precision=link_precision, max_compressed_links=max_compressed_links,
        cross_cluster_dp=False, work_limit=work_limit))


def run_heuristic(instance: Instance, options: PlanOptions) -> PlanResult:
    """``heuristic`` for the planner registry: a plan without a bound."""
    t0 = time.perf_counter()
    if options.progress:  # progress (cli-explain)
        options.progress.report("estimating skeletons")
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
        progress=options.progress))  # (cli-explain)
    elapsed = time.perf_counter() - t0
    space = ("k identical pipelines over an ordered subset of clusters, one contiguous layer range per "
             "cluster, local pipelines by the intra-cluster DP; or data parallelism across cluster groups, "
             "each group such pipelines")
    if res.plan is None:
        return PlanResult(planner="heuristic", status="infeasible", plan=None, search_time_s=elapsed,
                          plan_space=space, notes=("no skeleton could be realised",))
    return PlanResult(planner="heuristic", status="heuristic", plan=res.plan, iteration_time_s=res.iteration_time_s,
                      search_time_s=elapsed, plan_space=space, notes=tuple(f"{k}: {v}" for k, v in res.plan.meta))
