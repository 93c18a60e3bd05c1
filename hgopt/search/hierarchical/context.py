"""One search's caches and clock (``Ctx``): created per call, never shared between calls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hgopt.cost import evaluate
from hgopt.cost.evaluate import Evaluation
from hgopt.cost.tables import CostTables
from hgopt.search.baselines._common import BlockLayout
from hgopt.search.hier_tables import ClusterTable
from hgopt.search.hierarchical.objective import Scorer
from hgopt.search.hierarchical.records import Estimated, HeuristicOptions
from hgopt.plan import Plan
from hgopt.search.intra import LocalPlan
from hgopt.spec import Instance


@dataclass(kw_only=True, slots=True)
class Ctx:
    """Per-search caches (one search; never shared between calls)."""

    instance: Instance
    tables: CostTables
    layout: BlockLayout
    start: float
    tabs: dict[tuple[object, ...], ClusterTable] = field(default_factory=dict)
    links: dict[tuple[str, str, int, int, str], tuple[float, float]] = field(default_factory=dict)
    best_links: dict[tuple[str, str, int, int, int], tuple[str, float, float]] = field(default_factory=dict)
    """[H7] per (a, b, B, cut, m), the allowed precision a → b costs least at and its (fwd, bwd)."""
    local: dict[tuple[object, ...], LocalPlan | None] = field(default_factory=dict)
    parts: dict[tuple[str, int, int], object] = field(default_factory=dict)
    subsets: dict[tuple[int, int, tuple[str, ...], int], Estimated | None] = field(default_factory=dict)
    """[H4] estimated skeleton per (k, B, clusters, passes)."""
    holds: dict[tuple[int, tuple[str, ...]], bool] = field(default_factory=dict)
    """[C6] memory screen per (k, clusters)."""
    alike: dict[str, tuple[object, ...]] = field(default_factory=dict)
    """[H2] per cluster, what its estimates read of it (the key of the shared tables)."""
    allowed: tuple[str, ...] = ("native",)
    """Precisions an inter-cluster boundary may use (mixed-precision links)."""
    max_links: int | None = None
    """At most this many compressed inter-cluster boundaries per pipeline (None: no limit)."""
    penalty: dict[str, float] = field(default_factory=dict)
    """Seconds per boundary compressed to a precision [H7]."""
    neighbours: int = 8
    """Candidate-list length of the large-instance steps (``HeuristicOptions.neighbours``)."""
    ranks: dict[str, list[str]] = field(default_factory=dict)
    """[H3] per cluster, the others by a one-sample send (neighbour lists above ``neighbours`` + 1 clusters)."""
    work: int = 0
    """Work done so far (``HeuristicOptions.work_limit``): subsets split, skeletons realised."""
    stopped: str = ""
    """What first ended a phase early: 'work limit', 'time limit' or 'stop request' ('' = none)."""
    score: Scorer | None = None
    """[H10] How candidates compare (time, or $ per iteration) and the plans scored; set by the search."""
    split_tables: dict[int, Any] = field(default_factory=dict)
    """[H4] ``split.prepared`` per cluster table (by id; the entry keeps the table alive)."""
    evaluated: dict[Plan, Evaluation] = field(default_factory=dict)
    """``evaluate`` per plan on this search's instance and tables (the same plan is realised, checked
    and polished several times)."""

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def evaluated(ctx: Ctx, plan: Plan) -> Evaluation:
    """``evaluate(plan, ctx.instance, ctx.tables)``, once per plan and search."""
    got = ctx.evaluated.get(plan)
    if got is None:
        got = ctx.evaluated[plan] = evaluate(plan, ctx.instance, ctx.tables)
    return got


def out_of_time(ctx: Ctx, options: HeuristicOptions) -> bool:
    """The time limit, the work limit or a stop request (SIGINT) has ended the search."""
    why = ""
    if options.progress is not None and options.progress.stop_requested():  # (cli-explain)
        why = "stop request"
    elif options.work_limit is not None and ctx.work >= options.work_limit:
        why = "work limit"
    elif options.time_limit_s is not None and ctx.elapsed() >= options.time_limit_s:
        why = "time limit"
    if why and not ctx.stopped:
        ctx.stopped = why
    return bool(why)
