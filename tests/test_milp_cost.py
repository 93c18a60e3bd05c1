"""The exact planner under ``--objective cost`` and ``--budget`` (hgopt.search.milp_cost) against brute
force over its plan space on tiny priced instances: every plan of the space (tests.test_milp._space)
evaluated and priced by ``hgopt.cost.money``."""

from __future__ import annotations

from collections.abc import Iterator

import itertools
import math
import random
from typing import Any

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.cost.money import money
from hgopt.plan import Plan
from hgopt.search import PlanOptions, PlanResult
from hgopt.search.exact import plan_exact
from hgopt.search.milp import BatchSplit
from hgopt.search.milp_cost import handover_egress_usd
from hgopt.solvers import available_backends
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology
from tests.test_milp import _space

BACKENDS = available_backends()
SEEDS = 6
NO_HELP = {"warm_start": "none"}
"""No warm start: the MILP itself must find and prove the optimum."""


def _priced(seed: int) -> Instance:
    """2 clusters of 1-2 nodes x 2 GPUs with different GPU prices, 3-4 identical layers, every
    directed link priced for egress."""
    rng = random.Random(1000 + seed)
    names = ["a", "b"]
    gpus = {"A": 0.01, "B": rng.choice([0.006, 0.02])}
    clusters = tuple((n, g, rng.choice([1, 2]), 2, rng.choice([1.2, 40.0])) for n, g in zip(names, gpus))
    topo: dict[str, Any] = tiny_topology(clusters=clusters, wan_gbit_s=8.0, wan_latency_ms=rng.choice([1.0, 10.0]))
    for c in topo["clusters"]:
        c["cost_per_gpu_hour"] = rng.choice([1.0, 2.0, 3.5])
    topo["links"]["pairs"] = [
        {"src": a, "dst": b, "directed": True, "gbit_s": rng.choice([4.0, 20.0]), "latency_ms": 5.0,
         "egress_usd_per_gb": rng.choice([0.0, 0.02, 0.5])}
        for a, b in itertools.permutations(names, 2)]
    model = tiny_model(num_layers=rng.randint(3, 4), gpus=gpus, activation_bytes=rng.choice([1e5, 1e6]))
    for t in model["timings"]:  # tp 2 at 60 % of tp 1's time: more GPUs cost more per sample
        if t["tp"] == 2:
            t["fwd"] = [x * 1.2 for x in t["fwd"]]
            t["bwd"] = [x * 1.2 for x in t["bwd"]]
    return tiny_instance(global_batch=rng.choice([2, 4]), model=model, topology=topo, recompute="off")


def _priced_space(inst: Instance) -> Iterator[tuple[BatchSplit, float, float]]:
    """(batch split, iteration time, $ per iteration) of every feasible plan of the MILP's space."""
    tables = build_tables(inst)
    tokens = inst.job.global_batch * inst.job.seq_len
    for sp, pipe in _space(inst):
        plan = Plan(pipelines=(pipe,) * sp.k)
        ev = evaluate(plan, inst, tables)
        if ev.feasible:
            usd = money(plan, inst, tables, ev.iteration_time_s, tokens).usd_per_iteration
            assert usd is not None
            yield sp, ev.iteration_time_s, usd


def _plans(inst: Instance) -> list[tuple[float, float, float]]:
    """(iteration time, $ per iteration, $ per hour) of every feasible plan of the MILP's space."""
    return [(t, usd, usd / t * 3600.0) for _, t, usd in _priced_space(inst)]


_CACHE: dict[int, list[tuple[float, float, float]]] = {}


def _brute(seed: int) -> list[tuple[float, float, float]]:
    if seed not in _CACHE:
        _CACHE[seed] = _plans(_priced(seed))
    return _CACHE[seed]


def _meta(res: PlanResult) -> dict[str, str]:
    assert res.plan is not None
    return dict(res.plan.meta)


def _usd(res: PlanResult, inst: Instance) -> tuple[float, float]:
    """($ per iteration, $ per hour) of the result's plan, priced here from evaluate."""
    assert res.plan is not None
    ev = evaluate(res.plan, inst)
    assert ev.feasible
    usd = money(res.plan, inst, build_tables(inst), ev.iteration_time_s,
                inst.job.global_batch * inst.job.seq_len).usd_per_iteration
    assert usd is not None
    return usd, usd / ev.iteration_time_s * 3600.0


@pytest.mark.parametrize("seed", range(SEEDS))
def test_cost_optimum_equals_brute_force(seed: int) -> None:
    inst = _priced(seed)
    plans = _brute(seed)
    best = min(c for _, c, _ in plans)
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-7, objective="cost", extra=NO_HELP))
    usd, _ = _usd(res, inst)
    assert usd == pytest.approx(best, rel=1e-7)
    meta = _meta(res)
    assert res.usd_per_iteration == pytest.approx(usd, rel=1e-12)  # the reported value is evaluate's
    assert float(meta["usd_per_iteration"]) == res.usd_per_iteration
    lb = res.usd_lower_bound
    assert lb is not None and float(meta["usd_lower_bound"]) == lb and res.usd_gap is not None
    assert lb <= best * (1 + 1e-9)  # below every plan's cost
    assert lb >= best * (1 - 1e-6)  # and proven
    assert res.status == "optimal" and meta["objective"] == "cost" and res.objective == "cost"


def test_cost_and_time_optima_differ_somewhere() -> None:
    """The cost objective is not the time objective in disguise: on some seed the cheapest plan is
    strictly cheaper than the fastest plan (by brute force), and the planner returns it."""
    seen = 0
    for seed in range(SEEDS):
        plans = _brute(seed)
        fastest = min(plans)
        cheapest = min(c for _, c, _ in plans)
        if cheapest < fastest[1] * (1 - 1e-6):
            seen += 1
            inst = _priced(seed)
            t = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-7, extra=NO_HELP))
            c = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-7, objective="cost", extra=NO_HELP))
            assert _usd(c, inst)[0] < _usd(t, inst)[0] * (1 - 1e-6)
            assert c.iteration_time_s >= t.iteration_time_s * (1 - 1e-9)
    assert seen >= 1


@pytest.mark.parametrize("objective", ["cost", "time"])
@pytest.mark.parametrize("seed", range(SEEDS))
def test_budget_respected_and_optimal(seed: int, objective: str) -> None:
    """A budget between the cheapest and the dearest $/hour: the planner's plan keeps it and is the
    best plan (of the objective) among those that keep it; its bound lies below all of them."""
    inst = _priced(seed)
    plans = _brute(seed)
    hours = sorted(h for _, _, h in plans)
    budget = hours[len(hours) // 3]
    ok = [p for p in plans if p[2] <= budget * (1 + 1e-12)]
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-7,
                                       objective=objective,  # type: ignore[arg-type]
                                       budget_usd_per_hour=budget, extra=NO_HELP))
    usd, per_hour = _usd(res, inst)
    assert per_hour <= budget * (1 + 1e-9)
    if objective == "cost":
        best = min(c for _, c, _ in ok)
        assert usd == pytest.approx(best, rel=1e-7)
        assert res.usd_lower_bound is not None and res.usd_lower_bound <= best * (1 + 1e-9)
    else:
        best = min(t for t, _, _ in ok)
        assert res.iteration_time_s == pytest.approx(best, rel=1e-7)
        assert res.lower_bound_s is not None and res.lower_bound_s <= best * (1 + 1e-9)
    assert res.status == "optimal"


@pytest.mark.parametrize("objective", ["cost", "time"])
def test_infeasible_budget_is_reported(objective: str) -> None:
    """A budget below every plan's $/hour: no plan, status infeasible, said in the notes."""
    inst = _priced(0)
    cheapest_hour = min(h for _, _, h in _brute(0))
    res = plan_exact(inst, PlanOptions(time_limit_s=60, objective=objective,  # type: ignore[arg-type]
                                       budget_usd_per_hour=cheapest_hour * 0.99, extra=NO_HELP))
    assert res.plan is None
    assert res.status == "infeasible"
    assert any("budget" in n for n in res.notes)


@pytest.mark.parametrize("backend", [b for b in ("highs", "cp-sat", "cbc", "scip") if b in BACKENDS])
def test_cost_backends_agree(backend: str) -> None:
    """Every backend: no plan below the brute-force optimum, the bound below it, equal when proven."""
    seed = 1
    inst = _priced(seed)
    best = min(c for _, c, _ in _brute(seed))
    gap = 5e-3 if backend == "cp-sat" else 1e-6
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=gap, solver=backend,
                                       objective="cost", extra=NO_HELP))
    usd, _ = _usd(res, inst)
    assert usd >= best * (1 - 1e-9)
    assert res.usd_lower_bound is not None and res.usd_lower_bound <= best * (1 + 1e-9)
    if res.status == "optimal":
        assert usd == pytest.approx(best, rel=max(gap, 1e-6))


def test_handover_egress_is_what_money_charges() -> None:
    """The MILP's egress coefficient of a hand-over equals money's egress of a plan with that one
    inter-cluster boundary (hand computation: global batch x boundary bytes x price, both ways)."""
    inst = _priced(2)
    tables = build_tables(inst)
    act = float(tables.activation_bytes[0])
    prices = {(l.src, l.dst): l.egress_usd_per_gb for l in inst.topology.links}
    g = inst.job.global_batch
    sp = BatchSplit(k=1, microbatch=g, num_microbatches=1)
    got = handover_egress_usd(inst, tables, sp, "a", "b", ("native", "native"))
    want = g * act * ((prices[("a", "b")] or 0.0) + (prices[("b", "a")] or 0.0)) / 1e9
    assert got == pytest.approx(want, rel=1e-12)
    assert math.isfinite(got)


def test_unpriced_cluster_is_refused() -> None:
    inst = tiny_instance()
    with pytest.raises(ValueError, match="cost_per_gpu_hour"):
        plan_exact(inst, PlanOptions(time_limit_s=5, objective="cost"))


def _egress_instance(egress_usd_per_gb: float) -> Instance:
    """Cluster a: cheap GPUs ($1/h) with too little memory for the whole model; b: dear ($3.5/h) with
    room. The cheapest GPU-hours span a and b, so the egress price decides between spanning and b alone."""
    topo: dict[str, Any] = tiny_topology(clusters=(("a", "A", 1, 2, 1.1), ("b", "B", 1, 2, 40.0)), wan_gbit_s=8.0,
                                         wan_latency_ms=1.0)
    topo["clusters"][0]["cost_per_gpu_hour"] = 1.0
    topo["clusters"][1]["cost_per_gpu_hour"] = 3.5
    topo["links"]["pairs"] = [{"src": a, "dst": b, "directed": True, "gbit_s": 20.0, "latency_ms": 1.0,
                               "egress_usd_per_gb": egress_usd_per_gb} for a, b in itertools.permutations("ab", 2)]
    return tiny_instance(global_batch=4, model=tiny_model(num_layers=4, gpus={"A": 0.01, "B": 0.02},
                                                          activation_bytes=1e6), topology=topo, recompute="off")


def _egress_plans(inst: Instance) -> list[tuple[float, float, float, float]]:
    """(total $, GPU $, egress $, $ per hour) per iteration of every feasible plan of the space."""
    tables = build_tables(inst)
    out = []
    for sp, pipe in _space(inst):
        plan = Plan(pipelines=(pipe,) * sp.k)
        ev = evaluate(plan, inst, tables)
        if ev.feasible:
            m = money(plan, inst, tables, ev.iteration_time_s, inst.job.global_batch * inst.job.seq_len)
            assert m.usd_per_iteration is not None and m.gpu_usd_per_iteration is not None
            out.append((m.usd_per_iteration, m.gpu_usd_per_iteration, m.egress_usd_per_iteration or 0.0,
                        m.usd_per_iteration / ev.iteration_time_s * 3600.0))
    return out


@pytest.mark.parametrize("egress", [0.01, 0.05])
def test_egress_is_in_the_objective(egress: float) -> None:
    """Brute force: at $0.05/GB the egress makes b alone cheaper than the plans spanning a and b (the
    cheapest by GPU-hours); at $0.01/GB spanning stays cheapest. The planner matches both."""
    inst = _egress_instance(egress)
    plans = _egress_plans(inst)
    best = min(plans)
    by_gpu = min(plans, key=lambda p: p[1])
    assert by_gpu[2] > 0  # the cheapest GPU-hours pay egress
    assert (best[2] == 0) == (egress == 0.05)  # ... and at $0.05/GB are not the cheapest plan
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-7, objective="cost", extra=NO_HELP))
    assert _usd(res, inst)[0] == pytest.approx(best[0], rel=1e-7)
    lb = float(res.usd_lower_bound)  # type: ignore[arg-type]
    assert best[0] * (1 - 1e-6) <= lb <= best[0] * (1 + 1e-9)  # a bound, and proven (with the egress in it)
    assert res.status == "optimal"


def test_budget_on_egress_cuts_plans_off() -> None:
    """A budget the spanning plans keep by GPU-hours but not with their egress: the MILP's GPU budget
    row admits them, each decoded one is priced, cut off, and the search ends on the best plan that
    keeps the budget (brute force)."""
    inst = _egress_instance(0.01)
    plans = _egress_plans(inst)
    spanning = [p for p in plans if p[2] > 0]
    cheapest_span = min(spanning)
    gpu_hour = cheapest_span[1] / cheapest_span[0] * cheapest_span[3]  # its GPU part of $/hour
    budget = 0.5 * (gpu_hour + cheapest_span[3])
    ok = [p for p in plans if p[3] <= budget]
    assert ok and min(ok) > cheapest_span  # the budget removes that plan and the answer changes
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-7,
                                       objective="cost", budget_usd_per_hour=budget, extra=NO_HELP))
    usd, per_hour = _usd(res, inst)
    assert per_hour <= budget
    assert usd == pytest.approx(min(ok)[0], rel=1e-7)
    lb = float(res.usd_lower_bound)  # type: ignore[arg-type]
    assert min(ok)[0] * (1 - 1e-6) <= lb <= min(ok)[0] * (1 + 1e-9)
    assert res.status == "optimal"
    assert any("cut off" in n for n in res.notes)


def test_link_penalty_is_refused_with_a_cost_goal() -> None:
    inst = _priced(0)
    with pytest.raises(ValueError, match="--link-penalty"):
        plan_exact(inst, PlanOptions(time_limit_s=5, objective="cost", extra={"link_penalty": "fp8=0.1"}))


def test_priced_geo_instance_prices_every_cluster_and_direction() -> None:
    """geo-3r-gpt1.3b carries cost_per_gpu_hour on every cluster and egress on both directions of every
    link (instances/build_analytic_instances.py: priced())."""
    from hgopt.cost.money import egress_usd_per_byte, gpu_usd_per_second
    from hgopt.instances import load_instance

    inst = load_instance("geo-3r-gpt1.3b")
    names = [c.name for c in inst.topology.clusters]
    assert all((gpu_usd_per_second(inst, n) or 0) > 0 for n in names)
    assert all((egress_usd_per_byte(inst, a, b) or 0) > 0 for a in names for b in names if a != b)


def _split_costs(inst: Instance) -> dict[BatchSplit, float]:
    """Per batch split, the least $ per iteration of its feasible plans (brute force)."""
    out: dict[BatchSplit, float] = {}
    for sp, _, usd in _priced_space(inst):
        out[sp] = min(out.get(sp, math.inf), usd)
    return out


@pytest.mark.parametrize("seed", range(SEEDS))
def test_usd_pruning_keeps_each_splits_optimum(seed: int) -> None:
    """[C4] $ pruning while block options are generated (blocks.Window.usd_cap / gpu_usd_s_cap):
    per split, with the incumbent at the overall cheapest plan's $ x 1.02 (so some splits hold a
    cheaper plan and some do not), the pruned split MILP finds the same optimum as the unpruned one
    (= brute force), its bound stays below that optimum, and on some seed the pruning drops options
    (the test would pass vacuously otherwise: checked over all seeds in the next test)."""
    from hgopt.search.blocks import cheap_bounds
    from hgopt.search.milp import link_policy
    from hgopt.search.milp_cost import CostGoal, solve_split_cost
    from hgopt.solvers import SolveOptions

    inst = _priced(seed)
    tables = build_tables(inst)
    per_split = _split_costs(inst)
    incumbent = min(per_split.values()) * 1.02
    links = link_policy(inst, {})
    goal = CostGoal(objective="cost")
    sopts = SolveOptions(time_limit_s=60, relative_gap=1e-9)
    for sp, best in per_split.items():
        cheap = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                             links=links)
        got = [solve_split_cost(inst, tables, sp, cheap, goal, links, solver="highs", solve_options=sopts, floor=0.0,
                                deadline=math.inf, incumbent=incumbent, prune=prune) for prune in (True, False)]
        for out in got:
            assert out.lower_bound <= min(best, incumbent) * (1 + 1e-9)
            if best < incumbent * (1 - 1e-9):
                assert out.best is not None and out.best.value == pytest.approx(best, rel=1e-7)
        assert (got[0].best is None) == (got[1].best is None)


def test_usd_pruning_drops_options_and_only_useless_ones() -> None:
    """The pruned option sets are subsets of the unpruned ones, strictly smaller on some split, and
    every dropped option's $ floor (k·GPUs·price·lb_above(bottleneck) + the least $ of the layers
    outside it) is >= the cap."""
    import dataclasses

    from hgopt.cost.money import cost_lower_bound, gpu_usd_per_second, layer_work_usd
    from hgopt.cost.pipeline import stages_that_matter
    from hgopt.search.blocks import Window, block_options, cheap_bounds

    dropped = 0
    for seed in range(SEEDS):
        inst = _priced(seed)
        tables = build_tables(inst)
        per_split = _split_costs(inst)
        cap = min(per_split.values()) * 1.02
        rate = {c.name: gpu_usd_per_second(inst, c.name) or 0.0 for c in inst.topology.clusters}
        layers = layer_work_usd(inst, tables)
        assert sum(layers) <= cost_lower_bound(inst, tables) * (1 + 1e-12)
        for sp in per_split:
            cheap = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch,
                                 num_microbatches=sp.num_microbatches)
            win = Window(t_lb=cheap.t_lb, s_lb=cheap.s_lb, weight=cheap.weight, gpus_matter=True)
            kw = dict(replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                      d_cap=stages_that_matter(sp.num_microbatches))
            full = block_options(inst, tables, window=win, **kw)  # type: ignore[arg-type]
            pruned = block_options(inst, tables, window=dataclasses.replace(
                win, gpu_usd_per_s=tuple(rate.items()), usd_cap=cap, time_floor=cheap.lb_above,
                layer_usd=layers), **kw)  # type: ignore[arg-type]
            for key, opts in full.items():
                kept = pruned.get(key, [])
                assert all(o in opts for o in kept)
                for o in opts:
                    if o not in kept:
                        dropped += 1
                        rest = sum(layers) - sum(layers[o.bounds[0]:o.bounds[-1]])
                        assert sp.k * o.gpus * rate[o.cluster] * cheap.lb_above(o.bottleneck) + rest >= cap * (1 - 1e-9)
    assert dropped > 0



@pytest.mark.parametrize("objective", ["cost", "time"])
def test_stopped_search_returns_plan_and_valid_bound(objective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A search stopped before any split's MILP (the size guard at 0 nonzeros: a work limit, not the
    clock) still returns the warm start's plan with a bound below every plan of the space (brute
    force), and says the MILPs did not finish; without a warm start no plan, the bound still valid."""
    import hgopt.search.milp_cost as mc

    monkeypatch.setattr(mc, "MAX_NONZEROS", 0)
    seed = 1
    inst = _priced(seed)
    plans = _brute(seed)
    budget = None if objective == "cost" else max(h for _, _, h in plans) * 2  # a budget every plan keeps
    best = min(c for _, c, _ in plans) if objective == "cost" else min(t for t, _, _ in plans)
    # gap 1e-9: the floors alone (cost_lower_bound is within 0.11 % here) cannot end the search, so
    # every split needs the MILP the size guard refuses
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-9, objective=objective,  # type: ignore[arg-type]
                                       budget_usd_per_hour=budget))
    assert res.plan is not None
    lb = res.usd_lower_bound if objective == "cost" else res.lower_bound_s
    assert lb is not None and lb <= best * (1 + 1e-9)
    assert any("size guard" in n for n in res.notes)
    res = plan_exact(inst, PlanOptions(time_limit_s=60, objective=objective, budget_usd_per_hour=budget,  # type: ignore[arg-type]
                                       extra=NO_HELP))
    assert res.plan is None and res.status == "error"
    lb = res.usd_lower_bound if objective == "cost" else res.lower_bound_s
    assert lb is not None and lb <= best * (1 + 1e-9)
