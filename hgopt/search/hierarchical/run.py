"""Entry points for others: the exact planner's warm start and the planner registry's adapter."""

from __future__ import annotations

import math
import time

from hgopt.cost.money import cost_lower_bound, money, unpriced_clusters
from hgopt.cost.tables import CostTables, build_tables
from hgopt.progress import Progress
from hgopt.search import PlanOptions, PlanResult, link_penalties
from hgopt.search.hierarchical.nodes import plan_fewest_nodes
from hgopt.search.hierarchical.records import HeuristicOptions, HeuristicResult
from hgopt.search.hierarchical.search import plan_heuristic
from hgopt.spec import Instance


def heuristic_incumbent(
    instance: Instance, tables: CostTables | None = None, time_limit_s: float | None = 10.0,
    link_precision: str = "native", max_compressed_links: int | None = None, work_limit: int | None = None,
    progress: Progress | None = None,
) -> HeuristicResult:
    """Warm start for the exact planner: the heuristic's plan and its cluster-level skeleton (k, B,
    cluster order, layers per cluster, local weights, link precisions), whose local pipelines come
    from ``best_local_plan``. Data parallelism across cluster groups [H9] is left out: the warm start
    must lie in the exact planner's space (k identical pipelines). With ``work_limit``, the search
    ends at that much work (``HeuristicOptions.work_limit``) unless the time limit comes first: when
    the work limit ends it (``result.stopped == 'work limit'``) the plan does not depend on the clock.
    sigint: ``progress`` (the exact planner's ``Progress.stop_only()`` view) carries a stop request into it."""
    return plan_heuristic(instance, tables=tables, options=HeuristicOptions(
        time_limit_s=time_limit_s, link_precision=link_precision, max_compressed_links=max_compressed_links,
        cross_cluster_dp=False, work_limit=work_limit, progress=progress))


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
    priced = options.objective == "cost" or options.budget_usd_per_hour is not None  # [H10]
    tables = build_tables(instance) if priced else None
    if priced:
        check_priced(instance, options)
    hopts = HeuristicOptions(
        time_limit_s=options.time_limit_s, link_precision=extra.get("link_precision", "native"),
        max_compressed_links=max_links, link_penalty=tuple(link_penalties(extra).items()),
        require_clusters=tuple(n for n in extra.get("require_clusters", "").split(",") if n),  # (cli-explain)
        progress=options.progress,  # (cli-explain)
        objective=options.objective, budget_usd_per_hour=options.budget_usd_per_hour)
    res = plan_fewest_nodes(instance, tables=tables, options=hopts) if priced else \
        plan_heuristic(instance, options=hopts)
    elapsed = time.perf_counter() - t0
    space = ("k identical pipelines over an ordered subset of clusters, one contiguous layer range per "
             "cluster, local pipelines by the intra-cluster DP; or data parallelism across cluster groups, "
             "each group such pipelines; or one pipeline whose stages mix replica groups of clusters joined by fast "
             "links [H11]" + ("; on every cluster's nodes or fewer (greedy descent from all nodes and "
                                             "from each cluster alone on 1, half or all its nodes)" if priced else ""))
    # [H10] the $ bound holds for every plan of any planner (hgopt.cost.money.cost_lower_bound)
    usd_bound = cost_lower_bound(instance, tables) if tables is not None and not unpriced_clusters(instance) else None
    candidates = tuple(res.candidates)
    if res.plan is None:
        return PlanResult(planner="heuristic", status="infeasible", plan=None, search_time_s=elapsed,
                          plan_space=space, notes=(res.note or "no skeleton could be realised",),
                          objective=options.objective, usd_lower_bound=usd_bound, candidates=candidates)
    usd = None
    if tables is not None:
        tokens = instance.job.global_batch * instance.job.seq_len
        usd = money(res.plan, instance, tables, res.iteration_time_s, tokens).usd_per_iteration
    status = "heuristic"
    if options.objective == "cost" and usd is not None and usd_bound is not None:
        status = "optimal" if (usd - usd_bound) <= options.gap * usd else "feasible"
    return PlanResult(planner="heuristic", status=status, plan=res.plan, iteration_time_s=res.iteration_time_s,  # type: ignore[arg-type]
                      search_time_s=elapsed, plan_space=space, notes=tuple(f"{k}: {v}" for k, v in res.plan.meta),
                      objective=options.objective, usd_per_iteration=usd, usd_lower_bound=usd_bound,
                      candidates=candidates)


def check_priced(instance: Instance, options: PlanOptions) -> None:
    """[H10] The cost objective and a budget need every cluster's price: ValueError naming the field."""
    if options.objective not in ("time", "cost"):
        raise ValueError(f"--objective: must be time or cost, got {options.objective!r}")
    b = options.budget_usd_per_hour
    if b is not None and not (b > 0 and math.isfinite(b)):
        raise ValueError(f"--budget: must be > 0 dollars per hour, got {b}")
    for i, c in enumerate(instance.topology.clusters):
        if c.cost_per_gpu_hour is None:
            raise ValueError(f"{instance.source}: topology.clusters[{i}].cost_per_gpu_hour: not set for cluster "
                             f"{c.name!r} (--objective cost and --budget need every cluster's price per GPU-hour)")
