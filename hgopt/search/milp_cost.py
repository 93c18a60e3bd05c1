"""Cost and budget inside the exact planner (``--planner milp --objective cost``, ``--budget USD_PER_HOUR``;
formulations/cluster_milp.md §10, money as defined in ``hgopt.cost.money`` [$1]).

Plan space: the exact planner's (``hgopt.search.milp.PLAN_SPACE``). Per batch split (k pipelines,
microbatch B, m microbatches) the split's MILP of ``milp.build_milp`` is built over the block
options WITHOUT a bottleneck cap and with cost dominance (``Window.gpus_matter``: an option beats
another only if it also uses no more GPUs), and this module adds:

- ``Tit >= the time MILP's objective`` (the iteration time it bounds, ``milp.build_milp``'s
  objective: (m − 1)·T + U + fills + WAN fills; a lower bound on ``evaluate``'s time of the
  decoded plan), ``Tit`` <= ``M`` (the objective at every variable's upper bound, U at the largest
  tail any option has);
- per block option o (binary y_o, cluster c, g_o GPUs per pipeline): ``q_o >= Tit − M·(1 − y_o)``,
  ``q_o >= 0`` — exactly y_o·Tit at the optimum, as only Σ price·q is minimised (McCormick with
  Tit in [0, M] is exact for a binary);
- ``$/iteration = Σ_o k·g_o·gpu_usd_per_second(c)·q_o + Σ_arcs,pairs z·egress(arc, pair)`` with
  egress(arc, pair) = the kernel's ``wan_bytes_per_iteration`` of that hand-over (activations a→b,
  gradients b→a, at the pair's precision) × ``egress_usd_per_byte`` of each direction;
- budget: ``Σ_o k·g_o·gpu_usd_per_second(c)·y_o <= BUDGET / 3600`` — the GPU part of $/hour, linear in
  y and exact, because a plan's $/hour is GPU $/s·3600 + egress $/iteration·3600 / iteration time and
  egress only adds. The egress part cannot be written over the MILP's T, which is a *lower* bound on
  evaluate's time (egress / T >= egress / evaluate: the row would remove plans that keep the budget);
  instead every decoded plan is priced exactly and, when over budget, cut off by a no-good row on its
  binaries (the binaries determine the plan, so no plan within budget is removed) and the split is
  solved again.

Why the bound holds: for a plan P of the space with configuration (y, z), the time MILP's objective
at (y, z) is <= evaluate(P)'s time (the time planner's bound rests on the same fact, [M1]-[M19]),
P's GPU set is fixed by y, and $ = Σ price·GPUs·time + egress is increasing in time for a fixed GPU
set; so the cost MILP's value at (y, z) is <= P's $ per iteration and its optimum (the solver's
bound) bounds every plan of the split. The cost bound of the search is the least over splits of
the split's proven bound; a split without a MILP (pruned, or the time limit) keeps the floor
``max(by_cost.cost_lower_bound, k · least GPU price · the split's cheap time bound)`` (each plan
uses >= k GPUs for >= its iteration time). The value reported is the decoded plan's ``money``
from ``evaluate``'s time, never the MILP's.

Pruning [C4] (formulations/cluster_milp.md §10): block options whose own GPUs over the split's time
floor plus the least $ of the layers outside them (``money.layer_work_usd``) already reach the
incumbent are never generated (``blocks.Window.usd_cap``). Time limit: every phase checks the
deadline (cheap bounds within 20 % of it, the warm start work-limited within its share, option
generation raises ``OutOfTime``, the size guard skips a MILP the time left cannot load, the solver's
limit leaves that load time); a stopped split keeps its floor, so the result is always a bound.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import wan_bytes_per_iteration
from hgopt.cost.money import egress_usd_per_byte, gpu_usd_per_second, layer_work_usd, money
from hgopt.cost.pipeline import stages_that_matter
from hgopt.cost.tables import CostTables
from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, PlanResult
from hgopt.search.blocks import BlockOption, CheapBounds, LinkPolicy, OutOfTime, Window, block_options, cheap_bounds, model_shape
from hgopt.search.milp import (
    MAX_NONZEROS,
    BatchSplit,
    Formulation,
    WarmStart,
    batch_splits,
    build_milp,
    decode,
    estimated_nonzeros,
    link_policy,
    plan_hint,
    plan_space,
    work_lower_bound,
)
from hgopt.solvers import SolveOptions, solve
from hgopt.spec import Instance

__all__ = ["COST_SCALE", "CostGoal", "GoalRows", "add_goal", "cost_goal", "handover_egress_usd", "plan_milp_cost"]

log = logging.getLogger(__name__)

Objective = Literal["time", "cost"]
COST_SCALE = 1000.0
"""The MILP's cost objective is in units of 1/COST_SCALE GPU-second at the cheapest GPU's price:
coefficients of >= 1000 per GPU-second, so CP-SAT's rounding of objective coefficients to integers
(downwards, a relaxation) costs at most 0.1 %, and HiGHS's absolute tolerances stay far below the
values (a $ objective would be ~1e-5)."""
MAX_CUTS = 25
"""Per split, at most this many no-good cuts of over-budget plans before the split keeps its bound."""
GOAL_NONZEROS_PER_OPTION = 14
"""Nonzeros ``add_goal`` writes per block option (rows C1: q, v, q·v, q lower bound), for the size guard."""
WARM_SHARE = 0.4
"""Share of the time limit (at most 12 s) the warm start (the heuristic under the same goal) may take."""
LOAD_S_PER_NONZERO_COST = 5e-5
"""Seconds per nonzero the size guard and the solver's limit reserve for building and loading a goal
MILP (2.5 x ``milp.LOAD_S_PER_NONZERO``: on geo-3r-gpt1.3b under load a 98 k-nonzero model's HiGHS
solve overran its limit by 3.7 s, a 1.05 M one took 5.2 s to build and load)."""
RESERVE_S = 2.0
"""The splits' MILPs stop min(RESERVE_S, 10 % of the time limit) before it: a solver may overrun its
own limit by seconds (presolve, the root LP), and ``--time-limit T`` must return by max(1.1 T, T + 2 s)."""
SPLIT_SHARE = 0.5
"""A split's solve may take at most this share of the time left (the others keep some)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostGoal:
    """What the exact planner optimises: ``time`` or ``cost`` ($ per iteration), under an optional
    budget in $ per hour of training."""

    objective: Objective = "time"
    budget_usd_per_hour: float | None = None


def cost_goal(instance: Instance, options: PlanOptions) -> CostGoal | None:
    """The goal of ``options`` (``PlanOptions.objective`` / ``budget_usd_per_hour``); None for the
    plain time objective without budget. ValueError (naming the setting) for a cluster without a price, a bad budget, or a link penalty."""
    objective, budget = options.objective, options.budget_usd_per_hour
    if objective not in ("time", "cost"):
        raise ValueError(f"--objective: must be time or cost, got {objective!r}")
    if objective == "time" and budget is None:
        return None
    if budget is not None and not (budget > 0 and math.isfinite(budget)):
        raise ValueError(f"--budget: must be > 0 dollars per hour, got {budget}")
    unpriced = [c.name for c in instance.topology.clusters if gpu_usd_per_second(instance, c.name) is None]
    if unpriced:
        raise ValueError(f"--objective cost / --budget: clusters without cost_per_gpu_hour: {', '.join(unpriced)} "
                         "(set topology.clusters[*].cost_per_gpu_hour)")
    if options.extra.get("link_penalty"):
        raise ValueError("--link-penalty: applies to --objective time without --budget only")
    return CostGoal(objective=objective, budget_usd_per_hour=budget)  # type: ignore[arg-type]


def handover_egress_usd(instance: Instance, tables: CostTables, split: BatchSplit, a: str, b: str,
                        pair: tuple[str, str]) -> float:
    """$ per iteration of the WAN egress of one hand-over a→b of all k pipelines at precision ``pair``
    (forward, backward): the kernel's ``wan_bytes_per_iteration`` of a probe plan with that one
    inter-cluster boundary at the trunk's boundary size (every boundary of the space sends the same
    bytes per sample: ``blocks.model_shape``) × each direction's ``egress_usd_per_byte`` (0 when unpriced)."""
    shape = model_shape(instance)
    cut, L = shape.p + 1, shape.num_layers
    ga, gb = (ReplicaGroup(cluster=c, tp=1, dp=1, mbs=split.microbatch) for c in (a, b))
    bd = () if pair == ("native", "native") else (Boundary(fwd=pair[0], bwd=pair[1]),)  # type: ignore[arg-type]
    probe = Pipeline(stages=(Stage(start=0, end=cut, groups=(ga,)), Stage(start=cut, end=L, groups=(gb,))),
                     num_microbatches=split.num_microbatches, boundaries=bd)
    total = 0.0
    for (src, dst), nbytes in wan_bytes_per_iteration(Plan(pipelines=(probe,) * split.k), instance, tables).items():
        total += nbytes * (egress_usd_per_byte(instance, src, dst) or 0.0)
    return total


@dataclass(frozen=True, kw_only=True, slots=True)
class GoalRows:
    """What ``add_goal`` added: the scale of the cost objective and the variables to read back."""

    usd_per_unit: float
    """$ per unit of the MILP's cost objective (0 under the time objective)."""
    gpu_rate: dict[int, float]
    """Per block option binary: its k·g_o GPUs' $ per second."""
    egress: dict[int, float]
    """Per link binary: the hand-over's egress $ per iteration."""
    binaries: tuple[int, ...]


def add_goal(form: Formulation, instance: Instance, tables: CostTables, goal: CostGoal,
             cheap: CheapBounds | None = None) -> GoalRows:
    """Turn the split's time MILP into the goal's (see the module docstring): under ``cost`` the
    objective becomes $ per iteration (scaled), under a budget the GPU $/s row is added."""
    lm, split = form.model, form.split
    rate = {j: split.k * o.gpus * (gpu_usd_per_second(instance, o.cluster) or 0.0) for j, o in form.y.items()}
    positive = [gpu_usd_per_second(instance, c.name) or 0.0 for c in instance.topology.clusters]
    ref = min((r for r in positive if r > 0), default=1.0 / 3600.0)  # $ per GPU-second of the cheapest GPU
    egress = {v.z: handover_egress_usd(instance, tables, split, a, b, v.arc.pair)
              for (a, b), lv in form.links.items() for v in lv}
    binaries = tuple(j for j, var in enumerate(lm.vars) if var.integer)
    if goal.budget_usd_per_hour is not None:
        lm.add_row("C2_budget_gpu", {j: r / ref for j, r in rate.items()}, ub=goal.budget_usd_per_hour / 3600.0 / ref)
    if goal.objective != "cost":
        return GoalRows(usd_per_unit=0.0, gpu_rate=rate, egress=egress, binaries=binaries)
    time_obj = dict(lm.objective)
    u_max = max([lm.vars[_var(lm, "U")].lb, *(o.sync_opt for o in form.y.values())])
    big = lm.offset
    for j, c in time_obj.items():
        ub = lm.vars[j].ub if lm.vars[j].name != "U" else u_max
        if not math.isfinite(ub):
            raise AssertionError(f"objective variable {lm.vars[j].name} has no upper bound")
        big += max(c, 0.0) * ub
    big = big * (1 + 1e-9) + 1e-12
    tit = lm.add_var("Tit", lb=0.0, ub=big, kind="time")
    lm.add_row("C0_iteration_time", {tit: 1.0, **{j: -c for j, c in time_obj.items()}}, lb=lm.offset, kind="time")
    obj: dict[int, float] = {}
    names = {v.name: i for i, v in enumerate(lm.vars)}
    w = time_obj.get(_var(lm, "T"), 0.0)
    s_lb = lm.vars[_var(lm, "U")].lb
    starts: dict[int, float] = {}
    for j, r in rate.items():
        o = form.y[j]
        q = lm.add_var(f"q[{j}]", lb=0.0, ub=big, kind="time")
        if o.role in ("first", "only"):
            starts[q] = 1.0
        lm.add_row(f"C1_q[{j}]", {q: 1.0, tit: -1.0, j: -big}, lb=-big, kind="time")  # q >= Tit − M(1 − y)
        # valid cuts for the LP (q = y·Tit, v = y·T): q >= (m−1)·v + (tail + fill of o)·y, v >= bottleneck·y,
        # q >= lb_above(o's bottleneck)·y (every plan with o has bottleneck >= o's)
        v = names[f"v[{j}]"]
        lm.add_row(f"C1_v[{j}]", {v: 1.0, j: -max(o.bottleneck, lm.vars[_var(lm, "T")].lb)}, lb=0.0, kind="time")
        lm.add_row(f"C1_qv[{j}]", {q: 1.0, v: -w, j: -(max(o.sync_opt, s_lb) + o.fill)}, lb=0.0, kind="time")
        if cheap is not None:
            lm.add_row(f"C1_qlb[{j}]", {q: 1.0, j: -cheap.lb_above(max(o.bottleneck, cheap.t_lb))}, lb=0.0, kind="time")
        if r > 0:
            obj[q] = COST_SCALE * r / ref
    lm.add_row("C1_start", {**starts, tit: -1.0}, lb=0.0, kind="time")  # one start block: Σ_start q = Tit
    for z, usd in egress.items():
        if usd > 0:
            obj[z] = obj.get(z, 0.0) + COST_SCALE * usd / ref
    lm.set_objective(obj)
    return GoalRows(usd_per_unit=ref / COST_SCALE, gpu_rate=rate, egress=egress, binaries=binaries)


def _var(lm: object, name: str) -> int:
    return next(j for j, v in enumerate(lm.vars) if v.name == name)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# The search over batch splits
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Priced:
    """A plan with its evaluate time and $: value is the objective's (seconds or $ per iteration)."""

    split: BatchSplit
    plan: Plan
    time_s: float
    usd_per_iteration: float
    usd_per_hour: float
    value: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitCost:
    split: BatchSplit
    best: Priced | None
    lower_bound: float
    solver: str = ""
    cuts: int = 0
    unfinished: bool = False
    variables: int = 0
    rows: int = 0


def _price(plan: Plan, split: BatchSplit, instance: Instance, tables: CostTables, goal: CostGoal) -> Priced | None:
    """The plan priced by ``money`` from evaluate's time; None when infeasible or over the budget."""
    ev = evaluate(plan, instance, tables)
    if not ev.feasible or not math.isfinite(ev.iteration_time_s):
        return None
    tokens = instance.job.global_batch * instance.job.seq_len
    usd = money(plan, instance, tables, ev.iteration_time_s, tokens).usd_per_iteration
    assert usd is not None  # every cluster is priced (cost_goal)
    per_hour = usd / ev.iteration_time_s * 3600.0
    if goal.budget_usd_per_hour is not None and per_hour > goal.budget_usd_per_hour * (1 + 1e-12):
        return None
    value = usd if goal.objective == "cost" else ev.iteration_time_s
    return Priced(split=split, plan=plan, time_s=ev.iteration_time_s, usd_per_iteration=usd, usd_per_hour=per_hour,
                  value=value)


def solve_split_cost(instance: Instance, tables: CostTables, split: BatchSplit, cheap: CheapBounds, goal: CostGoal,
                     links: LinkPolicy, *, solver: str, solve_options: SolveOptions, floor: float, deadline: float,
                     incumbent: float = math.inf, hint: Plan | None = None, prune: bool = True) -> SplitCost:
    """The split's goal MILP (module docstring), re-solved with a no-good cut after each decoded plan
    over the budget; the bound is the last solve's (``floor`` when no solve bounds the split).

    Block options that only plans of value >= ``incumbent`` can use are left out (``_useful``), so
    the split's bound is min(MILP bound, incumbent)."""
    rate = {c.name: gpu_usd_per_second(instance, c.name) or 0.0 for c in instance.topology.clusters}
    window = Window(t_lb=cheap.t_lb, s_lb=cheap.s_lb, weight=cheap.weight, mbs_matters=links.compresses,
                    gpus_matter=True, t_cap=_time_cap(cheap, goal, split, min(rate.values()), incumbent))
    if prune:
        window = _usd_pruning(window, rate, cheap, goal, incumbent, layer_work_usd(instance, tables))
    t0 = time.perf_counter()
    try:
        opts = block_options(instance, tables, replicas=split.k, microbatch=split.microbatch,
                             num_microbatches=split.num_microbatches,
                             d_cap=stages_that_matter(split.num_microbatches), window=window, deadline=deadline)
    except OutOfTime:
        return SplitCost(split=split, best=None, lower_bound=min(floor, incumbent), unfinished=True)
    log.debug("split %s: %d block options in %.2f s", split, sum(map(len, opts.values())), time.perf_counter() - t0)
    opts = {key: kept for key, os in opts.items()
            if (kept := [o for o in os if _useful(o, cheap, goal, split, rate[o.cluster], incumbent)])}
    size = estimated_nonzeros(opts, len(instance.topology.clusters)) + GOAL_NONZEROS_PER_OPTION * sum(map(len, opts.values()))
    if size > MAX_NONZEROS or size * LOAD_S_PER_NONZERO_COST > deadline - time.perf_counter():
        log.info("split %s: cost MILP of ~%d nonzeros not built", split, size)
        return SplitCost(split=split, best=None, lower_bound=min(floor, incumbent), unfinished=True)
    if not opts:
        return SplitCost(split=split, best=None, lower_bound=max(floor, incumbent))
    t0 = time.perf_counter()
    form = build_milp(instance, tables, split, opts, cheap, links)
    rows = add_goal(form, instance, tables, goal, cheap)
    log.debug("split %s: MILP %s built in %.2f s", split, form.model.size(), time.perf_counter() - t0)
    if hint is not None:
        form.model.hint = plan_hint(instance, form, hint)
    best: Priced | None = None
    bound, name, cuts = floor, "", 0
    while True:
        # the solver's own limit leaves room for loading the model (the size guard's estimate): its
        # limit does not count the load, which on a large model takes seconds
        limit = max(0.2, min(solve_options.time_limit_s, deadline - time.perf_counter() - size * LOAD_S_PER_NONZERO_COST))
        res = solve(form.model, solver, dataclasses.replace(solve_options, time_limit_s=limit))
        name = res.version
        if res.status in ("optimal", "feasible", "no_solution", "infeasible"):
            b = res.bound * rows.usd_per_unit if goal.objective == "cost" else res.bound
            bound = max(floor, b)
        over = False
        if res.values is not None:
            plan = decode(instance, form, res.values)
            priced = _price(plan, split, instance, tables, goal)
            if priced is not None and (best is None or priced.value < best.value):
                best = priced
            over = priced is None and goal.budget_usd_per_hour is not None and evaluate(plan, instance, tables).feasible
        log.debug("split %s: %s obj %.6g bound %.6g (%d cuts), solve %.2f s (limit %.2f)", split, res.status,
                  res.objective, bound, cuts, res.wall_s, limit)
        if not over or cuts >= MAX_CUTS or time.perf_counter() >= deadline or res.status == "error":
            break
        ones = [j for j in rows.binaries if res.values[j] > 0.5]  # type: ignore[index]
        zeros = [j for j in rows.binaries if res.values[j] <= 0.5]  # type: ignore[index]
        form.model.add_row(f"C3_over_budget[{cuts}]", {**{j: 1.0 for j in ones}, **{j: -1.0 for j in zeros}},
                           ub=len(ones) - 1.0)
        form.model.hint = {}
        cuts += 1
    bound = min(bound, incumbent, best.value if best is not None else math.inf)
    return SplitCost(split=split, best=best, lower_bound=bound, solver=name, cuts=cuts,
                     variables=len(form.model.vars), rows=len(form.model.rows))


def _usd_pruning(window: Window, rate: dict[str, float], cheap: CheapBounds, goal: CostGoal,
                 incumbent: float, layer_usd: tuple[float, ...]) -> Window:
    """[C4] The $ pruning of ``blocks.block_options`` (``Window.usd_cap`` / ``gpu_usd_s_cap``; the
    proofs are ``blocks._usd_useful``'s / ``_usd_stage_cap``'s): under ``cost`` an option whose own
    GPUs over the split's time floor at its bottleneck plus the least $ of the layers outside it
    (``money.layer_work_usd``) already cost >= the incumbent, under a budget one whose GPUs alone
    cost more per second than the budget, is never generated (``solve_split_cost(prune=False)``: none)."""
    usd_cap = incumbent if goal.objective == "cost" and math.isfinite(incumbent) else math.inf
    cap_s = math.inf if goal.budget_usd_per_hour is None else goal.budget_usd_per_hour / 3600.0
    return dataclasses.replace(window, gpu_usd_per_s=tuple(sorted(rate.items())), usd_cap=usd_cap,
                               gpu_usd_s_cap=cap_s, time_floor=cheap.lb_above, layer_usd=layer_usd)


def _time_cap(cheap: CheapBounds, goal: CostGoal, split: BatchSplit, least_rate: float, incumbent: float) -> float:
    """A bottleneck above which no plan of the split beats ``incumbent``: its time is >= lb_above(T)
    (``CheapBounds``) and, under ``cost``, it rents >= k GPUs at >= the least price for that time."""
    if not math.isfinite(incumbent):
        return math.inf
    need = incumbent if goal.objective == "time" else (incumbent / (split.k * least_rate) if least_rate > 0 else math.inf)
    for tau in cheap.grid:
        if cheap.lb_above(tau) >= need:
            return tau
    if cheap.weight <= 0 or not math.isfinite(need):
        return math.inf
    return max((need - cheap.f_lb - cheap.s_lb + cheap.offset) / cheap.weight,  # [C3b] offset (fidelity3)
               cheap.grid[-1] if cheap.grid else 0.0)


def _useful(o: BlockOption, cheap: CheapBounds, goal: CostGoal, split: BatchSplit, rate: float, incumbent: float) -> bool:
    """Whether a plan using option o can be within the budget and below ``incumbent``: its bottleneck
    is >= o's, so its time is >= lb_above(o's bottleneck), and it rents o's k·g_o GPUs for that time."""
    gpu_usd_s = split.k * o.gpus * rate
    if goal.budget_usd_per_hour is not None and gpu_usd_s * 3600.0 > goal.budget_usd_per_hour * (1 + 1e-12):
        return False
    t = cheap.lb_above(max(o.bottleneck, cheap.t_lb))
    return (gpu_usd_s * t if goal.objective == "cost" else t) < incumbent


def plan_milp_cost(instance: Instance, options: PlanOptions, goal: CostGoal, *,
                   warm_start: WarmStart | None = None) -> PlanResult:
    """The exact planner under ``goal``: every batch split's goal MILP (the warm start's split
    first, then by their floors), pruned by the floors against the incumbent; the bound of the
    goal's objective is the least over splits."""
    from hgopt.search.by_cost import cost_lower_bound

    t_start = time.perf_counter()
    deadline = t_start + options.time_limit_s - min(RESERVE_S, 0.1 * options.time_limit_s)
    tables = build_tables(instance)
    model_shape(instance)
    links = link_policy(instance, options.extra)
    splits = batch_splits(instance)
    rates = [gpu_usd_per_second(instance, c.name) or 0.0 for c in instance.topology.clusters]
    work_usd = cost_lower_bound(instance, tables)
    t_floor = work_lower_bound(instance, tables)
    cheap: dict[BatchSplit, CheapBounds] = {}
    for sp in splits:
        if time.perf_counter() >= t_start + 0.2 * options.time_limit_s:
            break
        cheap[sp] = cheap_bounds(instance, tables, replicas=sp.k, microbatch=sp.microbatch,
                                 num_microbatches=sp.num_microbatches, links=links)

    def floor(sp: BatchSplit) -> float:
        t_lb = cheap[sp].value if sp in cheap else t_floor
        if goal.objective == "time":
            return t_lb
        return max(work_usd, sp.k * min(rates) * t_lb) if math.isfinite(t_lb) else math.inf

    lbs = {sp: floor(sp) for sp in splits}
    best: Priced | None = None
    if warm_start is not None and options.extra.get("warm_start", "heuristic") == "heuristic":
        try:
            plan = warm_start(instance, tables, min(12.0, WARM_SHARE * options.time_limit_s))
        except ValueError as exc:
            log.info("warm start skipped: %s", exc)
            plan = None
        if plan is not None:
            p0 = plan.pipelines[0]
            sp0 = BatchSplit(k=len(plan.pipelines), microbatch=p0.microbatch, num_microbatches=p0.num_microbatches)
            best = _price(plan, sp0, instance, tables, goal)
    first = best.split if best else None
    # ties (the work floor bounds most splits alike) go to the smaller MILPs first: fewer (tp, dp, mbs) per
    # stage at a smaller microbatch, fewer pipelines (the warm start's split first
    # only under the time objective: it is the fastest plan's)
    # then by the split's own $ floor (k GPUs at the least price for its cheap time bound): the few-pipeline
    # splits, which hold the plans on few GPUs, first; their MILPs are small once [C4] prunes their options
    own = {sp: sp.k * min(rates) * cheap[sp].value for sp in cheap}
    order = sorted(cheap, key=lambda sp: (goal.objective == "time" and sp != first, lbs[sp],
                                          own[sp] if goal.objective == "cost" else 0.0,
                                          sp.num_microbatches / sp.k, sp.microbatch))
    sopts = SolveOptions(time_limit_s=options.time_limit_s, relative_gap=options.gap / 2, threads=options.threads,
                         seed=options.seed)
    solver, solved, cuts = "", 0, 0
    unfinished: list[BatchSplit] = []
    seen: list[Priced] = [best] if best is not None else []
    prog = options.progress
    for i, sp in enumerate(order):
        if prog:  # heartbeat: seconds only under the time objective (the line prints them as seconds)
            timed = goal.objective == "time"
            prog.report(f"{goal.objective} MILP splits", done=i, total=len(order),
                        incumbent_s=best.value if best and timed else None,
                        bound_s=min(lbs.values()) if timed else None, plan=best.plan if best else None)
        target = (best.value if best else math.inf) * (1 - options.gap / 2)
        if lbs[sp] >= target or not math.isfinite(lbs[sp]):
            continue
        left = deadline - time.perf_counter()
        if left <= 0 or (options.progress is not None and options.progress.stop_requested()):
            unfinished.append(sp)
            continue
        share = left if i == len(order) - 1 else max(0.5, SPLIT_SHARE * left)
        out = solve_split_cost(instance, tables, sp, cheap[sp], goal, links, solver=options.solver,
                               solve_options=dataclasses.replace(sopts, time_limit_s=share), floor=lbs[sp],
                               deadline=deadline, incumbent=best.value if best is not None else math.inf,
                               hint=best.plan if best is not None and best.split == sp else None)
        solved += 1
        cuts += out.cuts
        solver = out.solver or solver
        lbs[sp] = max(lbs[sp], out.lower_bound)
        if out.unfinished:
            unfinished.append(sp)
        if out.best is not None:
            seen.append(out.best)
            if best is None or out.best.value < best.value:
                best = out.best
        log.info("split %s: %s, bound %.6g; best %s (%.1f s, %d variables)", sp, out.best and f"{out.best.value:.6g}",
                 out.lower_bound, best and f"{best.value:.6g}", time.perf_counter() - t_start, out.variables)
    return _result(instance, options, goal, links, best, lbs, solver, unfinished, solved, cuts,
                   time.perf_counter() - t_start, [sp for sp in splits if sp not in cheap], seen)


def _result(instance: Instance, options: PlanOptions, goal: CostGoal, links: LinkPolicy, best: Priced | None,
            lbs: dict[BatchSplit, float], solver: str, unfinished: list[BatchSplit], solved: int, cuts: int,
            wall: float, unbounded: list[BatchSplit], seen: list[Priced]) -> PlanResult:
    """The PlanResult of the goal: under ``cost`` ``usd_per_iteration`` / ``usd_lower_bound`` (and
    the same in the plan's meta), status and gap of $; under ``time`` with a budget the time bound."""
    unit = "$ per iteration" if goal.objective == "cost" else "s"
    lb = min(lbs.values(), default=math.inf)
    if best is not None:
        lb = min(lb, best.value)
    space = plan_space(links)
    budget = "" if goal.budget_usd_per_hour is None else f", budget ${goal.budget_usd_per_hour:g}/hour"
    notes = [f"objective {goal.objective}{budget}: bound {lb:.6g} {unit} = the least over {len(lbs)} batch splits of "
             f"each split's proven bound ({solved} MILP(s) solved, the others bounded by their floors"
             + (f"; {cuts} over-budget plan(s) cut off" if cuts else "") + ")"]
    if unfinished:
        notes.append(f"time limit (or the size guard) reached before the MILP of {len(unfinished)} split(s) finished "
                     "(their floors still hold); a longer --time-limit closes the gap")
    if unbounded:
        notes.append(f"{len(unbounded)} split(s) without a cheap bound (time limit): bounded by the work floor")
    if best is None:
        status = "infeasible" if not math.isfinite(lb) else "error"
        notes.insert(0, "no plan of this space within the budget" + ("" if status == "infeasible" else
                     " found within the time limit (the bound still holds)") if goal.budget_usd_per_hour is not None
                     else "no plan found")
        return PlanResult(planner="milp", status=status, plan=None,
                          lower_bound_s=lb if goal.objective == "time" and math.isfinite(lb) else None,
                          search_time_s=wall, solver=solver or "none", plan_space=space, notes=tuple(notes),
                          objective=goal.objective,
                          usd_lower_bound=lb if goal.objective == "cost" and math.isfinite(lb) else None)
    gap = max(0.0, (best.value - lb) / best.value) if best.value > 0 else 0.0
    status = "optimal" if gap <= options.gap + 1e-12 else "feasible"
    meta: tuple[tuple[str, str], ...] = (
        ("solver", solver or "none"), ("objective", goal.objective), ("status", status), ("split", str(best.split)),
        ("usd_per_iteration", repr(best.usd_per_iteration)), ("usd_per_hour", repr(best.usd_per_hour)),
        ("plan_space", space))
    if goal.budget_usd_per_hour is not None:
        meta += (("budget_usd_per_hour", repr(goal.budget_usd_per_hour)),)
    if goal.objective == "cost":
        meta += (("usd_lower_bound", repr(lb)), ("usd_gap", f"{gap:.6f}"))
        notes.insert(0, f"cost ${best.usd_per_iteration:.6g} per iteration (${best.usd_per_hour:.4g}/hour), lower bound "
                        f"${lb:.6g}, gap {100 * gap:.2f} %")
    else:
        meta += (("lower_bound_s", repr(lb)), ("gap", f"{gap:.6f}"))
    plan = Plan(pipelines=best.plan.pipelines, planner="milp", instance=instance.name, meta=meta)
    return PlanResult(planner="milp", status=status, plan=plan, iteration_time_s=best.time_s,
                      lower_bound_s=lb if goal.objective == "time" else None, search_time_s=wall, solver=solver or "none",
                      plan_space=space, notes=tuple(notes), objective=goal.objective,
                      usd_per_iteration=best.usd_per_iteration, usd_lower_bound=lb if goal.objective == "cost" else None,
                      candidates=tuple((p.plan, p.time_s) for p in seen if p is not best))

