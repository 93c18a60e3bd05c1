"""[H10] The heuristic's objective: how it compares two candidate plans. Under ``time`` (the default)
by ``evaluate``'s iteration time, as always; under ``cost`` by $ per iteration ([$1],
``hgopt.cost.money.money`` on the plan and its ``evaluate`` time: GPU-hours of the GPUs it uses plus
WAN egress), ties by time. With a budget ($/hour), a plan over it ranks behind every plan within it
under either objective (and is never returned). Estimated skeletons are ranked under ``cost`` by
their estimated time × the $/second of the GPUs the skeleton may use (its clusters' GPUs per
pipeline × pipelines; the local DP may use fewer, so this is an estimate for ordering only).

Every plan scored is kept (``Scorer.seen``) for the time-vs-cost listing (``--pareto``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hgopt.cost.money import gpu_usd_per_second, money, usd_per_hour
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.search import Objective
from hgopt.search.hierarchical.records import Estimated, Realised, Skeleton
from hgopt.spec import Instance

INF = math.inf


@dataclass(kw_only=True, slots=True)
class Scorer:
    """Prices and ranks the plans of one search (per search; never shared between calls)."""

    instance: Instance
    """The instance the plans are priced on (the whole one, also when a search runs on fewer nodes)."""
    tables: CostTables
    objective: Objective = "time"
    budget_usd_per_hour: float | None = None
    seen: list[tuple[Plan, float]] = field(default_factory=list)
    """(plan, iteration seconds) of every realised plan the search scored, in order (``record``)."""
    _usd: dict[tuple[int, float], tuple[Plan, float | None]] = field(default_factory=dict)
    """id(plan) -> (plan, kept alive so the id stays its own; $ per iteration)."""

    def record(self, plan: Plan, time_s: float) -> None:
        """Keep a scored plan for the time-vs-cost listing."""
        if math.isfinite(time_s):
            self.seen.append((plan, time_s))

    @property
    def plain(self) -> bool:
        """Time objective without a budget: the heuristic's ranking as it always was."""
        return self.objective == "time" and self.budget_usd_per_hour is None

    def usd(self, plan: Plan, time_s: float) -> float | None:
        """$ per iteration of ``plan`` running ``time_s`` seconds (None: a used cluster has no price)."""
        key = (id(plan), time_s)
        if key not in self._usd:
            tokens = self.instance.job.global_batch * self.instance.job.seq_len
            got = money(plan, self.instance, self.tables, time_s, tokens).usd_per_iteration \
                if math.isfinite(time_s) else None
            self._usd[key] = (plan, got)
        return self._usd[key][1]

    def within_budget(self, plan: Plan, time_s: float) -> bool:
        if self.budget_usd_per_hour is None:
            return math.isfinite(time_s)
        usd = self.usd(plan, time_s)
        return usd is not None and math.isfinite(time_s) and usd_per_hour(usd, time_s) <= self.budget_usd_per_hour

    def key(self, plan: Plan, time_s: float) -> tuple[float, ...]:
        """Smaller is better: (over budget, $ or time, time)."""
        if self.plain:
            return (time_s,)
        over = 0.0 if self.within_budget(plan, time_s) else 1.0
        if self.objective == "time":
            return (over, time_s)
        usd = self.usd(plan, time_s)
        return (over, INF if usd is None else usd, time_s)

    def better(self, a: Realised, b: Realised | None) -> bool:
        """Whether ``a`` beats ``b`` under the objective (``b`` None: always)."""
        if b is None:
            return True
        if self.plain:
            return a.time_s < b.time_s - 1e-12
        return self.key(a.plan, a.time_s) < self.key(b.plan, b.time_s)

    def rank(self, r: Realised) -> tuple[float, ...]:
        return self.key(r.plan, r.time_s)

    def estimate_usd(self, est: Estimated) -> float:
        """[H10] estimated $ per iteration of a skeleton: estimate × $/s of the GPUs it may use."""
        return est.estimate_s * self.skeleton_usd_per_s(est.skeleton)

    def skeleton_usd_per_s(self, sk: Skeleton) -> float:
        total = 0.0
        for name in sk.order:
            rate = gpu_usd_per_second(self.instance, name)
            if rate is None:
                return INF
            total += rate * (self.instance.topology.cluster(name).num_gpus // sk.pipelines) * sk.pipelines
        return total

    def cheapest_usd_per_hour(self) -> float | None:
        """The least $/hour among the plans scored (for the 'no plan within the budget' message)."""
        rates = [usd_per_hour(u, t) for p, t in self.seen if (u := self.usd(p, t)) is not None and t > 0]
        return min(rates) if rates else None
