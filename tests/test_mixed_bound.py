"""[H11b] ``mixed_bound``: a lower bound over k identical pipelines whose stages hold replica groups of
any clusters, checked against brute force on tiny pools and against every planner's plan on the
Sailor A100+V100 instances."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan, Stage
from hgopt.search.mixed import best_mixed_plan, compute_floor
from hgopt.search.mixed_bound import MixedBoundOptions, mixed_bound
from tests.factories import tiny_instance, tiny_model, tiny_topology
from tests.test_mixed import MEM_GB, STEP, _one_zone, _stage_layouts


def _pool(a_gpus: int = 3, b_gpus: int = 1, b_speed: float = 1.0, G: int = 8):
    """Two clusters in one zone, GPU types A and B (B ``b_speed`` times A's seconds), two layers of
    which one fits a GPU (``test_mixed._one_zone``'s memory)."""
    topo = tiny_topology(clusters=(("a", "A", 1, a_gpus, MEM_GB), ("b", "B", 1, b_gpus, MEM_GB)), wan_gbit_s=100.0,
                         wan_latency_ms=0.0)
    for c in topo["clusters"]:
        c["region"] = "zone-1"
    model = tiny_model(num_layers=2, gpus={"A": STEP, "B": STEP * b_speed}, tps=(1,), mbss=(1, 2, 4), params=1e7,
                       activation_bytes=1e3, act_mem_bytes=1e3)
    return tiny_instance(global_batch=G, model=model, topology=topo, name="pool")


def _every_identical_plan(inst):
    """Every plan of k identical pipelines, each stage of any replica groups of both clusters (the
    GPUs of one pipeline at most a 1/k share of each cluster), every layer partition, microbatch count
    and ZeRO-1 setting."""
    G = inst.job.global_batch
    gpus = {c.name: c.num_gpus for c in inst.topology.clusters}
    L = 2
    for k in (d for d in range(1, G + 1) if G % d == 0):
        share = {n: g // k for n, g in gpus.items()}
        for m in (d for d in range(1, G // k + 1) if (G // k) % d == 0):
            B = G // (k * m)
            for cuts in ((0, 2), (0, 1, 2)):
                ranges = list(zip(cuts, cuts[1:]))

                def stages(i: int, free: dict[str, int]):
                    if i == len(ranges):
                        yield ()
                        return
                    for groups, used in _stage_layouts(B, free):
                        left = {n: free[n] - used[n] for n in free}
                        for rest in stages(i + 1, left):
                            yield (groups,) + rest

                for layout in stages(0, share):
                    for zeros in itertools.product((0, 1), repeat=len(ranges)):
                        pipe = Pipeline(num_microbatches=m, stages=tuple(
                            Stage(start=a, end=b, groups=g, zero=z) for (a, b), g, z in zip(ranges, layout, zeros)))
                        yield Plan(pipelines=(pipe,) * k)
    del L


def _brute(inst):
    tables = build_tables(inst)
    best, n = math.inf, 0
    for plan in _every_identical_plan(inst):
        ev = evaluate(plan, inst, tables)
        n += 1
        if ev.feasible:
            best = min(best, ev.iteration_time_s)
    return tables, best, n


@pytest.mark.parametrize("a_gpus,b_gpus,b_speed", [(3, 1, 1.0), (2, 2, 2.5), (2, 1, 0.5)])
def test_bound_below_brute_force_over_identical_mixed_pipelines(a_gpus, b_gpus, b_speed):
    inst = _pool(a_gpus, b_gpus, b_speed)
    tables, best, n = _brute(inst)
    assert n > 100 and math.isfinite(best)
    got = mixed_bound(inst, tables)
    floor = compute_floor(inst, tables)
    assert floor <= got.value <= best * (1 + 1e-9)
    # and it is tighter than the compute floor here: the fill of a two-stage pipeline is a real cost
    assert got.value > floor * 1.02
    # with a target above the optimum (the grid then ends there) it is still a bound; a target below
    # it is returned as is (no plan beats it)
    with_target = mixed_bound(inst, tables, target=best * 1.5).value
    assert floor * 1.02 < with_target <= best * (1 + 1e-9)
    low = got.value * 0.9
    assert mixed_bound(inst, tables, target=low).value == low


def test_bound_on_the_two_layer_pool_by_hand():
    """``test_mixed._one_zone`` (3 + 1 GPUs of type A, every plan two one-layer stages): a stage's 8
    samples per microbatch at 0.03 s per sample over its GPUs; with g and 4 − g GPUs the pipeline
    takes at least (m − 1)·τ + t_0 + t_1 ≥ m·max + min ≥ 8·0.03·(1/2 + 1/(2m))... The brute-force optimum
    of that instance is in test_mixed; here the bound must sit between the floor and it."""
    inst = _one_zone()
    tables, best, _ = _brute(inst)
    got = mixed_bound(inst, tables)
    assert compute_floor(inst, tables) < got.value <= best * (1 + 1e-9)


def test_bound_counts_memory():
    """Without the memory check (GPUs of a thousand times the memory: the whole model fits one GPU) the
    one-stage plans come in, and the bound must fall: memory is a term of the bound."""
    inst = _one_zone()
    big = dataclasses.replace(inst, topology=dataclasses.replace(inst.topology, clusters=tuple(
        dataclasses.replace(c, gpu_memory_bytes=c.gpu_memory_bytes * 1000) for c in inst.topology.clusters)))
    tight = mixed_bound(inst).value
    loose = mixed_bound(big).value
    assert loose < tight * 0.999
    _, best_big, _ = _brute(big)
    assert loose <= best_big * (1 + 1e-9)


def test_bound_counts_the_fill_and_the_steady_term(monkeypatch):
    """Dropping the fill (the Σ t_s of the DP) or the steady term lowers the bound: both are in it."""
    import hgopt.search.mixed_bound as mb

    inst = _one_zone()
    full = mixed_bound(inst).value
    monkeypatch.setattr(mb, "search_weight", lambda m, S, rho=1.0: 0.0)
    no_steady = mixed_bound(inst).value
    assert no_steady < full * 0.999


@pytest.mark.parametrize("name", ["sailor-het-16+16", "sailor-het-32+96", "sailor-het-80+240"])
def test_bound_below_the_mixed_plan_every_cached_plan_and_above_the_floor(name):
    """floor <= [H11b] <= the mixed family's plan and <= evaluate of every planner's plan of the instance in
    bench/cost_fidelity.py's cache (milp, heuristic, metis, uniform, dp-only, native and auto links: the
    bound is over k identical pipelines with stages of any replica groups, a space that contains every
    k-identical plan and every mixed-stage plan). sailor-het-128+384 and sailor-gptneo-het-32+96 (30 s
    here) take the same path: `bench/mixed_bound_gap.py` covers them."""
    import json
    from pathlib import Path

    from hgopt.instances import load_instance
    from hgopt.plan import Plan

    inst = load_instance(name)
    tables = build_tables(inst)
    mp = best_mixed_plan(inst, tables)
    assert mp is not None
    got = mixed_bound(inst, tables, target=mp.iteration_time_s)
    assert got.complete
    assert compute_floor(inst, tables) <= got.value <= mp.iteration_time_s
    cache = json.loads((Path(__file__).resolve().parents[1] / "bench" / "cost_fidelity_plans.json").read_text())
    mine = [(k, v) for k, v in cache.items() if k.startswith(f"{name} ") and v.get("plan")]
    assert len(mine) >= 4
    checked = 0
    for key, entry in mine:
        plan = Plan.from_dict(entry["plan"])
        ev = evaluate(plan, inst, tables)
        if ev.feasible and len({(p.microbatch, p.num_microbatches) for p in plan.pipelines}) == 1:
            assert got.value <= ev.iteration_time_s * (1 + 1e-9), key
            checked += 1
    assert checked >= 3


def test_one_microbatch_bound_is_the_fill_by_hand():
    """m = 1, B = 8 on ``_pool(3, 1)`` (4 GPUs of one speed, two one-layer stages forced by memory):
    T ≥ t_0 + t_1 with t_s ≥ 8 · 0.03 s / g_s and g_0 + g_1 ≤ 4, least at 2 + 2: 0.24 s. The
    Lagrangian over the GPUs reaches it up to the time grid (a stage time counts its level's lower end,
    coarse_ratio below the bottleneck's window): the fill is a term of the bound."""
    import hgopt.search.mixed_bound as mb
    from hgopt.cost.compute import forward_share_of

    inst = _pool(3, 1, 1.0)
    tables = build_tables(inst)
    lo, hi = mb._ranges(2)
    kinds = mb._kinds(inst, tables, lo, hi)
    opts = MixedBoundOptions()
    v = mb._pair_bound(inst, tables, kinds, lo, hi, 8, 1, 1, compute_floor(inst, tables), math.inf,
                       forward_share_of(tables, 8), opts)
    assert 0.24 / opts.coarse_ratio <= v <= 0.24 * 1.001


def test_tail_floor_below_every_two_holder_layout_of_layer_zero():
    """k >= 2 pipelines: layer 0's collective among >= k holders follows the pipeline. The floor is 0 for
    one pipeline, positive for two, and at most [C5]'s all-reduce of layer 0 for every placement of two
    replicas (one cluster, or one in each), in every gradient precision."""
    import hgopt.search.mixed_bound as mb
    from hgopt.cost.evaluate import segment_allreduce
    from hgopt.plan import ReplicaGroup

    inst = _pool(2, 2, 1.0)
    tables = build_tables(inst)
    assert mb._tail_floor(inst, tables, 1) == 0.0
    two = mb._tail_floor(inst, tables, 2)
    assert two > 0.0
    for pair in (("a", "a"), ("b", "b"), ("a", "b")):
        holders = [Stage(start=0, end=1, groups=(ReplicaGroup(cluster=c, tp=1, dp=1, mbs=1),)) for c in pair]
        for prec in ("native", "bf16", "fp16", "fp8"):
            seg = segment_allreduce(inst, tables, holders, 0, 1, prec)
            assert two <= seg.intra + seg.inter + 1e-15
    assert mb._tail_floor(inst, tables, 4) >= two
