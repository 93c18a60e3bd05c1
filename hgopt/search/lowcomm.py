"""Plans with an outer synchronisation every H steps across cluster groups (DiLoCo, issue #15).

For each H of a user-given list, the groups, their shares of the batch, each group's own plan and
the delta precision; every candidate is scored by the kernel's ``evaluate_outer`` ([C9]). H > 1
changes the optimisation (the groups drift apart for H steps and meet through an outer optimizer):
H is the user's choice, never the planner's; the planner only reports what each H costs.

Search:

1. Groupings: the [H9] partitions of the clusters into components of fast links
   (``groups.groupings``: every distinct link speed as a threshold, down to all singletons).
2. Rates: every group plans one rating share with the registered sub-planner (``heuristic`` by
   default, or ``milp``) on the group alone; rate = share / inner step time.
3. Subsets: the groups by falling rate, every prefix of at least two (slow groups may be left
   idle); shares proportional to the rates (multiples of a power-of-two unit,
   ``groups.proportional_shares`` as in [H9]), re-balanced once from the realised inner step times
   (lock-step: the slowest group paces a round).
4. For every H and every allowed delta precision ``evaluate_outer`` prices each realised candidate;
   per H the fastest, in the widest precision within 1 % of the fastest (a narrower delta buys
   nothing once the sync is amortised, and costs accuracy).

The synchronous plan of the same planner on the whole instance is reported beside, with two fluid
upper bounds: the grouping's (every group alone at its own pace, no outer sync) and the instance's
(every cluster at its compute rate bound, [H9]'s ``rate_bound``: no bubble, no communication).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import wan_bytes_per_iteration
from hgopt.cost.outer import OuterEvaluation, evaluate_outer, group_instance
from hgopt.cost.tables import CostTables
from hgopt.plan import DeltaPrecision, OuterSync, Plan
from hgopt.progress import Progress
from hgopt.search import PlanOptions, PlanResult, get_planner
from hgopt.search.groups import groupings, proportional_shares, rate_bound, share_unit
from hgopt.spec import Instance

__all__ = ["DELTA_PRECISIONS", "LowCommResult", "OuterChoice", "SyncBaseline", "plan_low_comm"]

log = logging.getLogger(__name__)
DELTA_PRECISIONS: tuple[DeltaPrecision, ...] = ("fp32", "bf16", "fp8", "int8")
_WITHIN = 0.01
"""A wider delta precision is kept when its throughput is within this of the fastest."""

SubPlanner = Callable[[Instance], "Plan | None"]

SYNC_SHARE = 0.5
"""deadline3: the synchronous plan's share of ``options.time_limit_s`` (the grouped candidates' sub-planner
calls get ``per_call_limit`` each, also a fixed function of the limit)."""


def per_call_limit(time_limit_s: float) -> float:
    """deadline3: the nominal limit of one grouped sub-planner call: a fixed function of the search's
    limit (the same input and limit give the same candidates whatever the load, while the deadline does
    not cut the search)."""
    return max(1.0, min(10.0, time_limit_s / 8))


class _ClockStop(Progress):
    """deadline3: a stop flag that is set once ``clock()`` reaches ``stop_at`` (the command's deadline):
    the sub-planners, which poll ``stop_requested``, return their incumbents."""

    def __init__(self, stop_at: float, clock: Callable[[], float]) -> None:
        super().__init__("outer-steps", heartbeat=False)
        self.stop_at = stop_at
        self.clock = clock

    def left(self) -> float:
        return self.stop_at - self.clock()

    def stop_requested(self) -> bool:
        if not self._stop.is_set() and self.clock() >= self.stop_at:
            self.request_stop()
        return super().stop_requested()


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterChoice:
    steps: int
    plan: Plan
    evaluation: OuterEvaluation
    by_precision: tuple[tuple[str, OuterEvaluation], ...]
    """The same groups and shares in every allowed precision."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncBaseline:
    plan: Plan | None
    tokens_per_s: float
    gpus_used: int
    wan_bytes_per_step: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LowCommResult:
    instance: str
    sync: SyncBaseline
    choices: tuple[OuterChoice, ...]
    """One per requested H (absent when no grouping of at least two groups fits)."""
    compute_bound_tokens_per_s: float
    """Every cluster at its compute rate bound, no communication (an upper bound of every plan)."""
    notes: tuple[str, ...] = ()


def plan_low_comm(instance: Instance, steps: Sequence[int], options: PlanOptions, *, planner: str = "heuristic",
                  precisions: Sequence[DeltaPrecision] = DELTA_PRECISIONS, lr: float = 0.7, momentum: float = 0.9,
                  fragments: int = 1, overlap: bool = False, sync_plan: Plan | None = None,
                  stop_at: float | None = None, clock: Callable[[], float] = time.monotonic) -> LowCommResult:
    """The best outer-synchronised plan per H in ``steps`` and the synchronous plan beside it.

    deadline3: with ``stop_at`` (a ``clock`` reading: the command's deadline) every sub-planner call
    gets at most what is left and sees a stop at ``stop_at``; calls that would start after it are not
    made (their groups are not rated or realised: fewer candidates, counted in a note). Without it,
    or while it is not reached, the limits are fixed functions of ``options.time_limit_s``."""
    if not steps or any(h < 1 for h in steps):
        raise ValueError(f"--outer-steps: every H must be >= 1, got {list(steps)}")
    bad = [p for p in precisions if p not in DELTA_PRECISIONS]
    if bad or not precisions:
        raise ValueError(f"--delta-precision: expected some of {', '.join(DELTA_PRECISIONS)}, got {list(precisions)}")
    precisions = sorted(set(precisions), key=DELTA_PRECISIONS.index)  # widest first: ties keep the wider
    tables = build_tables(instance)
    sub = get_planner(planner)
    per_call = per_call_limit(options.time_limit_s)
    stop = _ClockStop(stop_at, clock) if stop_at is not None else None
    skipped = [0]

    def limited(limit: float) -> PlanOptions | None:
        if stop is None:
            return dataclasses.replace(options, time_limit_s=limit, progress=None)
        left = stop.left()
        if left <= 0:
            return None
        return dataclasses.replace(options, time_limit_s=min(limit, left), progress=stop)

    def sub_planner(inst: Instance) -> Plan | None:
        opts = limited(per_call)
        if opts is None:
            skipped[0] += 1
            return None
        res: PlanResult = sub(inst, opts)
        return res.plan if res.plan is not None and math.isfinite(res.iteration_time_s) else None

    if sync_plan is None:
        sync_opts = limited(SYNC_SHARE * options.time_limit_s if stop is not None else options.time_limit_s)
        sync_plan = sub(instance, sync_opts).plan if sync_opts is not None else None
    sync = _sync_baseline(instance, tables, sync_plan)
    candidates = _candidates(instance, tables, sub_planner)
    seq = instance.job.seq_len
    bound = sum(rate_bound(instance, tables, c.name) for c in instance.topology.clusters) * seq
    choices = []
    for h in steps:
        best: OuterChoice | None = None
        for plan in candidates:
            evs = []
            for prec in precisions:
                outer = OuterSync(groups=plan.outer.groups, steps=h, precision=prec, lr=lr, momentum=momentum,  # type: ignore[union-attr]
                                  fragments=min(fragments, h), overlap=overlap)
                p = dataclasses.replace(plan, outer=outer)
                evs.append((p, evaluate_outer(p, instance, tables)))
            ok = [(p, e) for p, e in evs if e.feasible]
            if not ok:
                continue
            top = max(e.tokens_per_s for _, e in ok)
            pick_p, pick_e = next((p, e) for p, e in ok if e.tokens_per_s >= (1 - _WITHIN) * top)
            if best is None or pick_e.tokens_per_s > best.evaluation.tokens_per_s:
                best = OuterChoice(steps=h, plan=pick_p, evaluation=pick_e,
                                   by_precision=tuple((p.outer.precision, e) for p, e in evs))  # type: ignore[union-attr]
        if best is not None:
            choices.append(best)
    notes = ("H > 1 changes the optimisation: the groups train apart for H steps and meet through an outer "
             "Nesterov step; the loss per token is not the synchronous plan's. H is your choice; "
             "bench/low_comm.py measures the small model's loss for several H.",)
    if skipped[0]:
        notes += (f"stopped by the command's deadline: {skipped[0]} group plan(s) not searched (and the shares that "
                  "needed them not tried), so some groupings were not rated or realised; a longer --time-limit "
                  "searches them",)
    if not candidates:
        notes += ("no grouping of at least two cluster groups fits" if not skipped[0] else
                  "no grouped candidate was realised before the command's deadline",)
    return LowCommResult(instance=instance.name, sync=sync, choices=tuple(choices),
                         compute_bound_tokens_per_s=bound, notes=notes)


def _sync_baseline(instance: Instance, tables: CostTables, plan: Plan | None) -> SyncBaseline:
    if plan is None:
        return SyncBaseline(plan=None, tokens_per_s=0.0, gpus_used=0, wan_bytes_per_step=0.0)
    ev = evaluate(plan, instance, tables)
    return SyncBaseline(plan=plan, tokens_per_s=ev.tokens_per_s, gpus_used=ev.gpus_used,
                        wan_bytes_per_step=sum(wan_bytes_per_iteration(plan, instance, tables).values()))


def _candidates(instance: Instance, tables: CostTables, sub_planner: SubPlanner) -> list[Plan]:
    """Realised grouped plans (``outer`` holds the groups; H and precision are set by the caller)."""
    G = instance.job.global_batch
    memo: dict[tuple[tuple[str, ...], int], tuple[Plan, float] | None] = {}

    def plan_group(group: tuple[str, ...], share: int) -> tuple[Plan, float] | None:
        key = (group, share)
        if key not in memo:
            inst = group_instance(instance, group, share)
            plan = sub_planner(inst)
            memo[key] = None if plan is None else (plan, evaluate(plan, inst, tables).iteration_time_s)
        return memo[key]

    out: list[Plan] = []
    seen: set[tuple[tuple[tuple[str, ...], int], ...]] = set()
    for part in groupings(instance):
        unit = share_unit(G, len(part))
        rating = max(unit, (G // len(part)) // unit * unit)
        rated = []
        for g in part:
            got = plan_group(g, rating)
            if got is not None and got[1] > 0 and math.isfinite(got[1]):
                rated.append((rating / got[1], g))
        rated.sort(key=lambda rg: -rg[0])
        for k in range(2, len(rated) + 1):
            head = rated[:k]
            plan = _realise([g for _, g in head], [r for r, _ in head], G, unit, plan_group, seen)
            if plan is not None:
                out.append(dataclasses.replace(plan, instance=instance.name))
    log.debug("%d grouped candidates", len(out))
    return out


def _realise(groups: list[tuple[str, ...]], rates: list[float], G: int, unit: int,
             plan_group: Callable[[tuple[str, ...], int], "tuple[Plan, float] | None"],
             seen: set[tuple[tuple[tuple[str, ...], int], ...]]) -> Plan | None:
    """The groups' plans with shares proportional to ``rates``, re-balanced once from the realised
    inner step times; the realisation whose slowest group is fastest (lock-step)."""
    best: tuple[float, Plan] | None = None
    for _ in range(2):
        shares = proportional_shares(G, rates, unit)
        if shares is None:
            break
        key = tuple(zip(groups, shares))
        subs = [plan_group(g, s) for g, s in zip(groups, shares)]
        if any(s is None for s in subs):
            break
        t_inner = max(s[1] for s in subs)  # type: ignore[index]
        if key not in seen:
            seen.add(key)
            if best is None or t_inner < best[0]:
                best = (t_inner, _assemble([s[0] for s in subs]))  # type: ignore[index]
        new = [s / sp[1] for s, sp in zip(shares, subs)]  # type: ignore[index]
        if all(abs(a / sum(new) - b / sum(rates)) < 0.01 for a, b in zip(new, rates)):
            break
        rates = new
    return None if best is None else best[1]


def _assemble(plans: list[Plan]) -> Plan:
    """One plan of every group's pipelines; ``outer.groups`` says which pipelines form a group. The
    gradient-sync fields are the groups' when they agree (else the defaults)."""
    pipes, groups = [], []
    for p in plans:
        groups.append(tuple(range(len(pipes), len(pipes) + len(p.pipelines))))
        pipes.extend(p.pipelines)
    first = plans[0]
    agree = all((p.grad_sync_precision, p.overlap_grad_sync, p.grad_bucket_mb)
                == (first.grad_sync_precision, first.overlap_grad_sync, first.grad_bucket_mb) for p in plans)
    base = first if agree else Plan(pipelines=())
    return Plan(pipelines=tuple(pipes), planner=f"lowcomm:{first.planner}", grad_sync_precision=base.grad_sync_precision,
                overlap_grad_sync=base.overlap_grad_sync, grad_bucket_mb=base.grad_bucket_mb,
                outer=OuterSync(groups=tuple(groups)))
