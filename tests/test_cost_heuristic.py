"""The heuristic under --objective cost / --budget ([H10], issue #14 item 4) and the replan speed-ups
that must not change results: hand-computed prices, the $ bound against every planner's plans, the
budget, a case where fewer nodes are cheaper, the Pareto listing, unpriced clusters named."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.cost.money import FLOOR_GRID, cost_lower_bound, money, replica_state_bytes, usd_per_hour_floor
from hgopt.instances import load_instance
from hgopt.search import PlanOptions, get_planner, planner_names
from hgopt.search.baselines._common import block_layout
from hgopt.search.by_cost import pareto, plan_by_cost, plan_usd
from hgopt.search.hier_tables import cluster_tables
from hgopt.search.intra import StageModel, local_configs
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology

V100 = 0.02
"""tiny_model: forward = base·mbs/tp s per layer, backward twice that; base of V100-16 here."""


def _one_cluster() -> Instance:
    """One cluster b: 2 nodes x 2 V100-16 at $1 per GPU-hour, 4 identical layers, global batch 8."""
    topo = tiny_topology(clusters=(("b", "V100-16", 2, 2, 40.0),))
    topo["clusters"][0]["cost_per_gpu_hour"] = 1.0
    return tiny_instance(global_batch=8, model=tiny_model(gpus={"V100-16": V100}), topology=topo)


def _two_clusters() -> Instance:
    topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, 40.0), ("b", "V100-16", 2, 2, 40.0)))
    for c, price in zip(topo["clusters"], (3.6, 1.0)):
        c["cost_per_gpu_hour"] = price
    return tiny_instance(global_batch=8, model=tiny_model(gpus={"A100-40": 0.01, "V100-16": V100}), topology=topo)


def _usd(plan, inst: Instance) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    t, usd = plan_usd(plan, inst, build_tables(inst))
    assert usd is not None and math.isfinite(t)
    return t, usd


def test_fewer_nodes_are_cheaper_and_the_heuristic_finds_them() -> None:
    """By hand: on one node, tp=2 over its 2 GPUs, 8 microbatches of 1 sample through 4 layers:
    8 x 4 x (1 + 2) x 0.02 / 2 = 0.96 s of compute + the optimizer 4 x 0.001 / 2 = 0.002 s, no
    gradient sync (dp 1): 2 GPUs x $1/h x 0.962 s. Any plan on both nodes' 4 GPUs computes the same
    1.92 GPU-seconds (tp x (f + b) / mbs = 0.06 s per sample and layer at every tp, mbs) plus at least
    0.002 s of optimizer on each GPU: >= 4 x 0.482 = 1.928 GPU-s > 1.924. The time objective uses
    both nodes (faster), the cost objective one."""
    inst = _one_cluster()
    h = get_planner("heuristic")
    fast = h(inst, PlanOptions(time_limit_s=20))
    cheap = h(inst, PlanOptions(time_limit_s=20, objective="cost"))
    assert fast.plan is not None and cheap.plan is not None
    assert fast.plan.gpus_by_cluster() == {"b": 4}
    assert cheap.plan.gpus_by_cluster() == {"b": 2}
    t_fast, usd_fast = _usd(fast.plan, inst)
    t_cheap, usd_cheap = _usd(cheap.plan, inst)
    assert t_cheap == pytest.approx(0.962)
    assert usd_cheap == pytest.approx(2 * 1.0 * 0.962 / 3600)
    assert cheap.usd_per_iteration == pytest.approx(usd_cheap)
    assert usd_fast >= 4 * 0.482 / 3600 * (1 - 1e-12) > usd_cheap
    # every sample-layer's 0.06 GPU-s + every layer's optimizer step (tp x 0.001 / tp) at $1/h: 1.924
    # GPU-s, which the one-node plan attains (2 x 0.962): gap 0
    bound = (8 * 4 * 3 * V100 + 4 * 0.001) / 3600
    assert cheap.usd_lower_bound == pytest.approx(bound)
    assert cheap.usd_gap == pytest.approx(0.0, abs=1e-9)
    assert cheap.status == "optimal"


def test_cost_objective_is_no_dearer_than_time_and_above_the_bound() -> None:
    inst = _two_clusters()
    h = get_planner("heuristic")
    fast = h(inst, PlanOptions(time_limit_s=20))
    cheap = h(inst, PlanOptions(time_limit_s=20, objective="cost"))
    assert fast.plan is not None and cheap.plan is not None
    _, usd_fast = _usd(fast.plan, inst)
    _, usd_cheap = _usd(cheap.plan, inst)
    bound = cost_lower_bound(inst, build_tables(inst))
    assert bound * (1 - 1e-12) <= usd_cheap <= usd_fast
    assert usd_cheap < usd_fast  # the fast plan uses the dear A100s; the cheap one must not
    assert cheap.usd_lower_bound == pytest.approx(bound)
    for plan, _ in cheap.candidates:  # every plan it scored is above the bound too
        assert _usd(plan, inst)[1] >= bound * (1 - 1e-12)


@pytest.mark.parametrize("objective", ["time", "cost"])
def test_budget_is_respected(objective: str) -> None:
    """$/hour = GPUs used x $1 on the one-cluster instance: a $3/hour budget rules out the 4-GPU plan."""
    inst = _one_cluster()
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=20, objective=objective, budget_usd_per_hour=3.0))
    assert res.plan is not None
    t, usd = _usd(res.plan, inst)
    assert usd / t * 3600 <= 3.0
    assert sum(res.plan.gpus_by_cluster().values()) <= 3


def test_budget_below_the_floor_is_refused_with_the_floor_named() -> None:
    """[$2] by hand: the tiny model's whole state fits one V100-16 (GiBs to spare), so the floor is one
    GPU at $1/hour; $0.5/hour is below it: refused at once, the floor named, no plan searched."""
    inst = _one_cluster()
    assert usd_per_hour_floor(inst, build_tables(inst)) == pytest.approx(1.0)
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=20, budget_usd_per_hour=0.5))
    assert res.plan is None and res.status == "infeasible"
    assert "no plan of any planner costs less than $1/hour" in res.notes[0]
    assert not res.candidates
    s = plan_by_cost(inst, get_planner("heuristic"), PlanOptions(time_limit_s=20), objective="cost",
                     budget_usd_per_hour=0.5)
    assert s.best is None and "no plan within the budget of $0.5/hour" in s.note


def _mixed_floor() -> Instance:
    """By hand ([$2]): fp32 + Adam, 16 bytes per parameter (4 + 4 weights and gradients, 8 optimizer),
    4 layers of 0.78125e9 parameters: 50 GB of state. Room per GPU = memory - 1 GiB workspace:
    a (A100-40, $2.5/h, 4 nodes x 1) 38.93 GB, b (V100-16, $1/h, 3 nodes x 1) 14.93 GB. One a (38.93)
    or all three b (44.78) are short; 1 a + 1 b (53.85) is the cheapest cover: $3.5/hour, below every
    one-cluster cover (2 a: $5/hour) -- and a real plan: a holds 3 layers (37.5 GB), b 1 (12.5 GB)."""
    topo = tiny_topology(clusters=(("a", "A100-40", 4, 1, 40.0), ("b", "V100-16", 3, 1, 16.0)))
    for c, price in zip(topo["clusters"], (2.5, 1.0)):
        c["cost_per_gpu_hour"] = price
    return tiny_instance(global_batch=8, model=tiny_model(gpus={"A100-40": 0.01, "V100-16": V100}, params=0.78125e9),
                         topology=topo)


def _brute_floor(inst: Instance, need: float, slack: float = 0.0) -> float:
    """Cheapest $/hour of GPU counts (each cluster up to its GPUs) whose room (+ ``slack`` each) covers ``need``."""
    import itertools

    cl = inst.topology.clusters
    best = math.inf
    for counts in itertools.product(*(range(c.num_gpus + 1) for c in cl)):
        room = sum(n * (c.gpu_memory_bytes - inst.job.workspace_bytes + slack) for n, c in zip(counts, cl))
        if room >= need:
            best = min(best, sum(n * c.cost_per_gpu_hour for n, c in zip(counts, cl)))
    return best


def test_floor_by_hand_mixes_clusters() -> None:
    inst = _mixed_floor()
    tables = build_tables(inst)
    assert replica_state_bytes(tables) == pytest.approx(4 * 0.78125e9 * 16)
    assert usd_per_hour_floor(inst, tables) == pytest.approx(3.5)
    assert usd_per_hour_floor(inst, tables, {"b": 0}) == pytest.approx(5.0)  # a alone: two of them
    assert usd_per_hour_floor(inst, tables, {"a": 0}) == math.inf  # three b cannot hold it
    assert usd_per_hour_floor(inst, tables, {"a": 1, "b": 1}) == pytest.approx(3.5)


@settings(max_examples=60, deadline=None)
@given(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       st.tuples(st.floats(8.0, 80.0), st.floats(8.0, 80.0), st.floats(8.0, 80.0)),
       st.tuples(st.floats(0.5, 5.0), st.floats(0.5, 5.0), st.floats(0.5, 5.0)),
       st.floats(0.05e9, 3e9))
def test_floor_equals_brute_force_up_to_its_grid(nodes, mem, price, params) -> None:  # type: ignore[no-untyped-def]
    """[$2] the knapsack never exceeds the exact cheapest cover (valid), and is at least the exact
    cheapest cover when every GPU is credited one grid part more (its only rounding)."""
    topo = tiny_topology(clusters=tuple((n, "V100-16", k, 1, m) for n, k, m in zip("abc", nodes, mem)))
    for c, p in zip(topo["clusters"], price):
        c["cost_per_gpu_hour"] = p
    inst = tiny_instance(model=tiny_model(gpus={"V100-16": V100}, params=params), topology=topo)
    tables = build_tables(inst)
    need = replica_state_bytes(tables)
    got = usd_per_hour_floor(inst, tables)
    exact = _brute_floor(inst, need)
    assert got <= exact * (1 + 1e-12)
    assert got >= _brute_floor(inst, need, slack=need / FLOOR_GRID) * (1 - 1e-12)


def test_budget_one_node_fits_on_geo() -> None:
    """geo-3r-gpt1.3b (shipped list prices): one node of 8 A100-40 is 8 x $1.29 = $10.32/hour and holds
    the model (22.7 GB of state per replica, 40 GB GPUs); the descent from all nodes alone answered
    'infeasible' (cheapest found $41.28/hour under time). The heuristic must find a plan within
    $20/hour under both objectives; the exact planner with the same budget agrees one exists."""
    inst = load_instance("geo-3r-gpt1.3b")
    for objective in ("time", "cost"):
        res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=120, objective=objective,
                                                         budget_usd_per_hour=20.0))
        assert res.plan is not None, res.notes
        t, usd = _usd(res.plan, inst)
        assert usd / t * 3600 <= 20.0
    exact = get_planner("milp")(inst, PlanOptions(time_limit_s=30, objective="cost", budget_usd_per_hour=20.0))
    assert exact.status != "infeasible" and exact.plan is not None, exact.notes
    t, usd = _usd(exact.plan, inst)
    assert usd / t * 3600 <= 20.0


def test_budget_between_floor_and_plans_names_both() -> None:
    """geo-3r-gpt1.3b at $5/hour: above the floor (one A100-40 holds a replica: $1.29/hour) but below any
    whole node (8 x $1.29): infeasible, naming the cheapest plan found and the floor."""
    inst = load_instance("geo-3r-gpt1.3b")
    tables = build_tables(inst)
    assert usd_per_hour_floor(inst, tables) == pytest.approx(1.29)
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=120, objective="cost", budget_usd_per_hour=5.0))
    assert res.plan is None and res.status == "infeasible"
    rates = [_usd(p, inst)[1] / _usd(p, inst)[0] * 3600 for p, _ in res.candidates]
    assert rates and min(rates) > 5.0
    assert f"the cheapest found costs ${min(rates):.4g}/hour" in res.notes[0]
    assert "no plan of any planner costs less than $1.29/hour" in res.notes[0]


def test_pareto_listing_is_nondominated_and_complete() -> None:
    inst = _two_clusters()
    s = plan_by_cost(inst, get_planner("heuristic"), PlanOptions(time_limit_s=30), objective="cost")
    priced = [c for c in s.candidates if c.usd_per_iteration is not None and math.isfinite(c.iteration_time_s)]
    front = pareto(s.candidates)
    assert len(front) >= 2  # a real trade-off: faster plans cost more here
    assert any(c.source == "searched" for c in s.candidates)  # the heuristic's own candidates are listed

    def dominates(o, c) -> bool:  # type: ignore[no-untyped-def]
        return (o.iteration_time_s <= c.iteration_time_s and o.usd_per_iteration <= c.usd_per_iteration
                and (o.iteration_time_s < c.iteration_time_s or o.usd_per_iteration < c.usd_per_iteration))

    for c in front:
        assert not any(dominates(o, c) for o in priced)
    for c in priced:
        assert c in front or any(dominates(o, c) for o in front)
    times = [c.iteration_time_s for c in front]
    assert times == sorted(times)
    assert s.best is not None and s.best.usd_per_iteration == min(c.usd_per_iteration for c in priced)


@pytest.mark.parametrize("name", planner_names())
def test_cost_bound_holds_for_every_planner(name: str) -> None:
    """cost_lower_bound below the $ of every plan each registered planner returns, and the $/hour floor
    [$2] below its $/hour, on three priced instances (tiny; one whose floor mixes clusters; default,
    whose list prices and egress are shipped), under both objectives."""
    for inst, limit in ((_two_clusters(), 10.0), (_mixed_floor(), 10.0), (load_instance("default"), 10.0)):
        if name in ("milp", "metis") and inst.name == "default":
            continue  # minutes on 56 GPUs; the tiny instance covers them
        tables = build_tables(inst)
        bound = cost_lower_bound(inst, tables)
        floor = usd_per_hour_floor(inst, tables)  # [$2] $/hour
        for objective in ("time", "cost"):
            try:
                res = get_planner(name)(inst, PlanOptions(time_limit_s=limit, objective=objective))  # type: ignore[arg-type]
            except ValueError:
                continue  # a baseline that declines the instance
            for plan in [res.plan] + [p for p, _ in res.candidates] if res.plan is not None else []:
                ev = evaluate(plan, inst, tables)
                if not ev.feasible:
                    continue
                usd = money(plan, inst, tables, ev.iteration_time_s, 1).usd_per_iteration
                assert usd is not None and usd >= bound * (1 - 1e-12), (name, objective, usd, bound)
                assert usd / ev.iteration_time_s * 3600 >= floor * (1 - 1e-12), (name, objective, usd, floor)


def test_unpriced_cluster_is_named_by_field() -> None:
    topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, 40.0), ("b", "V100-16", 2, 2, 40.0)))
    topo["clusters"][0]["cost_per_gpu_hour"] = 2.0
    inst = tiny_instance(global_batch=8, model=tiny_model(gpus={"A100-40": 0.01, "V100-16": V100}), topology=topo)
    with pytest.raises(ValueError, match=r"topology\.clusters\[1\]\.cost_per_gpu_hour"):
        get_planner("heuristic")(inst, PlanOptions(time_limit_s=5, objective="cost"))
    with pytest.raises(ValueError, match=r"topology\.clusters\[1\]\.cost_per_gpu_hour \(b\)"):
        plan_by_cost(inst, get_planner("heuristic"), PlanOptions(time_limit_s=5), objective="cost")


# ---- replan speed: the faster paths give the same numbers ---------------------------------------------

@pytest.mark.parametrize("instance", ["default", "sailor-het-16+16"])
def test_vectorised_memory_fit_equals_the_scalar_one(instance: str) -> None:
    """[C6] the intra DP's vectorised largest in-flight count (its non-recomputing path) is the scalar one."""
    inst = load_instance(instance)
    tables = build_tables(inst)
    L = tables.num_layers
    los, his = np.triu_indices(L + 1, 1)
    checked = 0
    for c in inst.topology.clusters:
        for cfg in local_configs(inst, c.name, 8, tables):
            if cfg.recompute:
                continue
            sm = StageModel(inst, tables, c, cfg, replicas=2)
            vec = sm.max_in_flight_v(los, his).tolist()
            scalar = [sm.max_in_flight(lo, hi) for lo, hi in zip(los.tolist(), his.tolist())]
            assert vec == scalar
            checked += len(scalar)
    assert checked > 0


def test_shared_estimate_cache_gives_the_fresh_tables() -> None:
    """[H2] a cache filled by other microbatch counts and a sub-instance's batch returns what a fresh one does."""
    inst = load_instance("sailor-het-16+16")
    tables, layout = build_tables(inst), block_layout(inst)
    c = inst.topology.clusters[0]
    shared: dict[tuple[object, ...], object] = {}
    half = dataclasses.replace(inst, job=dataclasses.replace(inst.job, global_batch=inst.job.global_batch // 2))
    for other, m in ((half, 4), (inst, 2), (inst, 8)):
        cluster_tables(other, tables, layout, c, "first", microbatch=4, num_microbatches=m, gpu_budget=8,
                       replicas=2, stages_after=1, cache=shared)
    for m in (4, 8):
        got = cluster_tables(inst, tables, layout, c, "first", microbatch=4, num_microbatches=m, gpu_budget=8,
                             replicas=2, stages_after=1, cache=shared)
        fresh = cluster_tables(inst, tables, layout, c, "first", microbatch=4, num_microbatches=m, gpu_budget=8,
                               replicas=2, stages_after=1, cache={})
        for w in fresh:
            for f in ("bottleneck", "fill", "sync_opt", "stages", "tp", "dp", "recompute"):
                assert np.array_equal(getattr(got[w], f), getattr(fresh[w], f)), (m, w, f)


def _pareto_reference(cands: list[tuple[float, float, float, int, int]]) -> list[tuple[float, float, float, int, int]]:
    """The intra DP's Pareto filter as it was (quadratic): points not dominated in (T, S, sends)."""
    cands = sorted(cands)
    kept: list[tuple[float, float, float, int, int]] = []
    for c in cands:
        if not any(k[0] <= c[0] and k[1] <= c[1] and k[2] <= c[2] for k in kept):
            kept.append(c)
    return kept


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6), st.integers(0, 3),
                          st.integers(0, 3)), max_size=40))
def test_staircase_pareto_equals_the_quadratic_one(points: list[tuple[int, int, int, int, int]]) -> None:
    """Small integer coordinates: many ties in T, S and sends."""
    from hgopt.search.intra import _pareto

    cands = [(float(a), float(b), float(c), h, i) for a, b, c, h, i in points]
    assert _pareto(list(cands)) == _pareto_reference(list(cands))


def test_cli_infeasible_budget_names_the_floor(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from hgopt.cli import main

    topo = tiny_topology(clusters=(("b", "V100-16", 2, 2, 40.0),))
    topo["clusters"][0]["cost_per_gpu_hour"] = 1.0
    doc = {"name": "one", "model": tiny_model(gpus={"V100-16": V100}), "topology": topo,
           "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}
    path = tmp_path / "one.yaml"
    path.write_text(json.dumps(doc))
    assert main(["-q", "plan", str(path), "--planner", "heuristic", "--objective", "cost", "--budget", "0.5",
                 "--time-limit", "20"]) == 1
    text = capsys.readouterr().out
    assert "no plan within the budget of $0.5/hour: no plan of any planner costs less than $1/hour" in text
    assert main(["-q", "plan", str(path), "--planner", "heuristic", "--objective", "cost", "--time-limit", "20"]) == 0
    text = capsys.readouterr().out
    assert "objective cost: $" in text and "gap" in text and "b:2" in text  # the one-node plan, its $ gap


def test_budget_on_a_priced_geo_instance() -> None:
    """geo-3r-gpt1.3b (shipped list prices): every plan the time objective realises first uses all 16
    H100s ($47.84/hour) or more; $30/hour needs the skeletons estimated within the budget and fewer nodes."""
    inst = load_instance("geo-3r-gpt1.3b")
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=120, budget_usd_per_hour=30.0))
    assert res.plan is not None
    t, usd = _usd(res.plan, inst)
    assert usd / t * 3600 <= 30.0
