"""Planners: every planner is a function ``(instance, options) -> PlanResult`` registered by name in
:data:`PLANNERS` ("module:function", imported on first use so that ``hgopt plan`` loads only the
planner it runs). Add a planner with a one-line edit of the mapping."""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping

from hgopt.plan import Plan
from hgopt.progress import Progress
from hgopt.spec import Instance

__all__ = ["LINK_PENALTY_DEFAULT", "PLANNERS", "Objective", "PlanOptions", "PlanResult", "Planner", "Status", "get_planner",
           "link_penalties", "planner_names"]

Objective = Literal["time", "cost"]
"""time: the iteration time (seconds); cost: $ per iteration (``hgopt.cost.money``, [$1])."""

Status = Literal["optimal", "feasible", "heuristic", "infeasible", "error", "interrupted"]
"""optimal: proven within ``gap`` of the lower bound over the planner's stated plan space;
feasible: a plan and a lower bound, gap not closed at the time limit; heuristic: a plan without
bound; infeasible: proven that no plan of the space fits; error: the search failed; interrupted:
stopped by the user (SIGINT/SIGTERM) — the incumbent so far, its bound still valid."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """Settings shared by every planner; a planner ignores the ones it has no use for."""

    time_limit_s: float = 60.0
    """Wall-clock budget of the whole search."""
    work_limit_s: float | None = None
    """determinism: the work budget (nominal seconds, ``hgopt.search.work``) of the phases whose end changes
    the result, where a planner counts work (the exact planner); None: ``time_limit_s``. The wall clock
    (``time_limit_s``) stays the watchdog."""
    gap: float = 0.01
    """Stop once (iteration time − lower bound) / iteration time <= gap."""
    solver: str = "highs"
    """MILP backend name (see ``hgopt.solvers.backend_names()``)."""
    threads: int = 1
    seed: int = 0
    extra: Mapping[str, str] = field(default_factory=dict)
    """Planner-specific settings as strings (e.g. ``link_precision``)."""
    objective: Objective = "time"
    """What the planner minimises (``--objective``): the iteration time, or $ per iteration (GPU-hours
    of the GPUs a plan uses at ``cost_per_gpu_hour`` + WAN egress at ``egress_usd_per_gb``, [$1])."""
    budget_usd_per_hour: float | None = None
    """Only plans whose $ per iteration / iteration time × 3600 is at most this (``--budget``); None: any."""
    progress: Progress | None = field(default=None, compare=False)
    """Heartbeat sink and cooperative stop flag (``hgopt.progress``); None: silent, never stopped."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    """What a planner returns. ``lower_bound_s`` is a proven lower bound on the iteration time of
    every plan in the planner's plan space (``None``: no bound)."""

    planner: str
    status: Status
    plan: Plan | None
    iteration_time_s: float = math.inf
    """``evaluate(plan).iteration_time_s`` (inf without a plan)."""
    lower_bound_s: float | None = None
    search_time_s: float = 0.0
    solver: str = ""
    """Solver name and version, when one was used."""
    plan_space: str = ""
    """One line saying which plans the bound and 'optimal' refer to."""
    notes: tuple[str, ...] = ()
    objective: Objective = "time"
    """The objective the planner minimised (``PlanOptions.objective``); status and 'optimal' refer to it."""
    usd_per_iteration: float | None = None
    """The plan's $ per iteration ([$1], ``hgopt.cost.money``) when the planner priced it."""
    usd_lower_bound: float | None = None
    """A proven lower bound on $ per iteration of every plan (of any planner; objective cost)."""
    candidates: tuple[tuple[Plan, float], ...] = field(default=(), compare=False)
    """Other plans the planner scored on the way, with their iteration times (``evaluate``): the
    time-vs-cost listing (``--pareto``) draws on them; () when the planner keeps none."""

    @property
    def usd_gap(self) -> float | None:
        """($ per iteration − $ lower bound) / $ per iteration, or None without both."""
        if self.usd_lower_bound is None or self.usd_per_iteration is None or self.usd_per_iteration <= 0:
            return None
        return max(0.0, (self.usd_per_iteration - self.usd_lower_bound) / self.usd_per_iteration)

    @property
    def gap(self) -> float | None:
        """(iteration time − lower bound) / iteration time, or None without both."""
        if self.lower_bound_s is None or not math.isfinite(self.iteration_time_s):
            return None
        return max(0.0, (self.iteration_time_s - self.lower_bound_s) / self.iteration_time_s)


Planner = Callable[[Instance, PlanOptions], PlanResult]

LINK_PENALTY_DEFAULT: Mapping[str, float] = {"fp32": 0.0, "bf16": 0.0, "fp16": 0.0, "fp8": 0.0}
"""Seconds added to a planner's objective per inter-cluster boundary compressed to a precision
(``link_penalty`` in PlanOptions.extra, ``--link-penalty``). 0 by default: the objective stays
``evaluate``'s iteration time, so the exact planner's lower bound and gap keep bounding that time
(the reason in full: formulations/cluster_milp.md §7)."""


def link_penalties(extra: Mapping[str, str]) -> dict[str, float]:
    """``extra['link_penalty']`` ("fp8=0.05,bf16=0": seconds per compressed boundary) over the
    defaults; ValueError naming the setting otherwise."""
    out = dict(LINK_PENALTY_DEFAULT)
    text = extra.get("link_penalty", "") or ""
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        prec, sep, val = item.partition("=")
        prec = prec.strip()
        if not sep or prec not in out:
            raise ValueError(f"--link-penalty: expected PRECISION=SECONDS with PRECISION one of "
                             f"{', '.join(out)}, got {item!r}")
        try:
            sec = float(val)
        except ValueError:
            raise ValueError(f"--link-penalty: {prec}: expected seconds, got {val.strip()!r}") from None
        if not (sec >= 0 and math.isfinite(sec)):
            raise ValueError(f"--link-penalty: {prec}: must be >= 0 seconds, got {sec}")
        out[prec] = sec
    return out


PLANNERS: Mapping[str, str] = {
    "milp": "hgopt.search.exact:plan_exact",
    "heuristic": "hgopt.search.hierarchical:run_heuristic",
    "metis": "hgopt.search.baselines:run_metis",
    "uniform": "hgopt.search.baselines:run_uniform",
    "dp-only": "hgopt.search.baselines:run_dp_only",
}


def planner_names() -> tuple[str, ...]:
    return tuple(PLANNERS)


def get_planner(name: str) -> Planner:
    """The planner registered as ``name``; ValueError naming the choices otherwise."""
    if name not in PLANNERS:
        raise ValueError(f"--planner: unknown planner {name!r} (choices: {', '.join(PLANNERS)})")
    module, func = PLANNERS[name].split(":")
    planner: Planner = getattr(importlib.import_module(module), func)

    def run(instance: Instance, options: PlanOptions) -> PlanResult:
        """The planner, then the plan's gradient-sync fields by [C7o] (``sync_choice.choose_sync``)."""
        from hgopt.search.sync_choice import choose_sync

        res = planner(instance, options)
        if res.plan is None:
            return res
        # hgopt's planners build ZeRO-1 stages: also try them without it where memory allows (zero1ov)
        return dataclasses.replace(res, plan=choose_sync(res.plan, instance, zero=name in ("milp", "heuristic")))

    return run
