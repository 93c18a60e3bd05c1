"""[H11] Stages mixing replica groups of fast-linked clusters (``hgopt.search.mixed``): brute force on a
tiny two-cluster one-zone instance where only a mixed stage uses every GPU, the compute floor by hand
and against every plan enumerated, the sample split against brute force, and the exact planner's
certificate over the result."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions
from hgopt.search.exact import plan_exact
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic
from hgopt.search.mixed import best_mixed_plan, compute_floor, fast_pools, split_samples
from tests.factories import tiny_instance, tiny_model, tiny_topology

G = 8
STEP = 0.01  # forward seconds per sample per layer on GPU type A (backward twice that): 0.03 s f+b
MEM_GB = 0.19 + 2**30 / 1e9  # 190 MB besides the job's default 1 GiB workspace


def _one_zone(region_same: bool = True):
    """Cluster a: 3 GPUs, cluster b: 1 GPU, both of type A in one zone (fast link). Two layers of 1e7
    parameters: one layer fits a GPU's 190 MB besides the workspace (80 MB weights+grads, 80 MB Adam state), two never do
    (160 MB + 160 MB / z > 190 MB for every ZeRO-1 shard count z <= 4), so every plan is a two-stage
    pipeline; a stage confined to one cluster leaves a GPU idle or b's single GPU the bottleneck."""
    topo = tiny_topology(clusters=(("a", "A", 1, 3, MEM_GB), ("b", "A", 1, 1, MEM_GB)), wan_gbit_s=100.0,
                         wan_latency_ms=0.0)
    if region_same:
        for c in topo["clusters"]:
            c["region"] = "zone-1"
    model = tiny_model(num_layers=2, gpus={"A": STEP}, tps=(1,), mbss=(1, 2, 4), params=1e7, activation_bytes=1e3,
                       act_mem_bytes=1e3)
    return tiny_instance(global_batch=G, model=model, topology=topo, name="one-zone")


def _replica_splits(n: int, samples: int) -> set[tuple[int, ...]]:
    """Every sorted per-replica microbatch vector of ``n`` replicas summing to ``samples`` (each >= 1)."""
    return {tuple(sorted(c)) for c in itertools.product(range(1, samples + 1), repeat=n) if sum(c) == samples}


def _stage_layouts(samples: int, free: dict[str, int]):
    """Every replica layout of one stage: per cluster a replica count within ``free`` and a microbatch
    per replica, together ``samples``; as (groups, GPUs used per cluster)."""
    names = sorted(free)
    for counts in itertools.product(*(range(free[n] + 1) for n in names)):
        if sum(counts) == 0 or sum(counts) > samples:
            continue
        per = [(n, c) for n, c in zip(names, counts) if c > 0]
        for split in _replica_splits(sum(counts), samples):
            # assign the sorted microbatches to clusters in every way (as multisets per cluster)
            for owners in set(itertools.permutations([n for n, c in per for _ in range(c)])):
                groups = Counter(zip(owners, split))
                yield tuple(ReplicaGroup(cluster=c, tp=1, dp=k, mbs=mb) for (c, mb), k in sorted(groups.items())), \
                    dict(zip(names, counts))


def _all_single_pipeline_plans(inst):
    """Every one-pipeline plan of two stages (one layer each), every microbatch count, every replica
    layout and every ZeRO setting (each stage's groups may come from both clusters)."""
    gpus = {c.name: c.num_gpus for c in inst.topology.clusters}
    for B in (d for d in range(1, G + 1) if G % d == 0):
        for first, used in _stage_layouts(B, gpus):
            left = {n: gpus[n] - used[n] for n in gpus}
            for second, _ in _stage_layouts(B, left):
                for z0, z1 in itertools.product((0, 1), repeat=2):
                    yield Plan(pipelines=(Pipeline(num_microbatches=G // B, stages=(
                        Stage(start=0, end=1, groups=first, zero=z0), Stage(start=1, end=2, groups=second, zero=z1))),))


@pytest.fixture(scope="module")
def brute():
    inst = _one_zone()
    tables = build_tables(inst)
    mixed, single = math.inf, math.inf
    times = []
    for plan in _all_single_pipeline_plans(inst):
        ev = evaluate(plan, inst, tables)
        if not ev.feasible:
            continue
        times.append(ev.iteration_time_s)
        one_cluster = all(len(s.clusters()) == 1 for s in plan.pipelines[0].stages)
        if one_cluster:
            single = min(single, ev.iteration_time_s)
        mixed = min(mixed, ev.iteration_time_s)
    return inst, tables, mixed, single, times


def test_one_layer_fits_two_do_not():
    inst = _one_zone()
    for groups, m in (((ReplicaGroup(cluster="a", dp=2, mbs=1),), 4),  # ZeRO-1 over 2: 160 + 80 MB
                      ((ReplicaGroup(cluster="a", dp=3, mbs=1), ReplicaGroup(cluster="b", dp=1, mbs=1)), 2)):  # over 4
        whole = Plan(pipelines=(Pipeline(num_microbatches=m, stages=(Stage(start=0, end=2, zero=1, groups=groups),)),))
        ev = evaluate(whole, inst)
        assert not ev.feasible and any("out of memory" in v for v in ev.violations)
    split = Plan(pipelines=(Pipeline(num_microbatches=8, stages=(
        Stage(start=0, end=1, groups=(ReplicaGroup(cluster="a", dp=1, mbs=1),)),
        Stage(start=1, end=2, groups=(ReplicaGroup(cluster="b", dp=1, mbs=1),)))),))
    assert evaluate(split, inst).feasible


def test_pools():
    assert fast_pools(_one_zone()) == [("a", "b")]
    assert fast_pools(tiny_instance()) == []  # own regions, 8 Gbit/s 10 ms WAN: no pool


def test_mixed_stage_is_provably_better_and_found(brute):
    inst, tables, best_any, best_single_cluster, _ = brute
    # by hand: with stages of one cluster a GPU idles (a alone: 1 + 2 GPUs, the 1-GPU stage runs all 8
    # samples) or b's one GPU runs one layer for all 8 samples: >= 8 · 0.03 s of compute on one GPU;
    # mixed: 2 + (1 + 1) GPUs, 4 samples each: ~4 · 0.03 s
    assert best_single_cluster >= 8 * 3 * STEP - 1e-12
    assert best_any < 0.7 * best_single_cluster
    got = best_mixed_plan(inst, tables)
    assert got is not None and evaluate(got.plan, inst, tables).feasible
    assert got.iteration_time_s == pytest.approx(best_any, rel=1e-9)  # the brute-force optimum of the space
    assert any(len(s.clusters()) == 2 for s in got.plan.pipelines[0].stages)
    assert got.iteration_time_s == pytest.approx(evaluate(got.plan, inst, tables).iteration_time_s, rel=1e-12)


def test_heuristic_returns_the_mixed_plan(brute):
    inst, tables, best_any, best_single_cluster, _ = brute
    with_mixed = plan_heuristic(inst, tables=tables, options=HeuristicOptions(time_limit_s=None))
    without = plan_heuristic(inst, tables=tables, options=HeuristicOptions(time_limit_s=None, mixed_stages=False))
    assert with_mixed.plan is not None and without.plan is not None
    assert with_mixed.iteration_time_s == pytest.approx(best_any, rel=1e-9)
    assert without.iteration_time_s > 1.3 * with_mixed.iteration_time_s
    assert dict(with_mixed.plan.meta).get("mixed", "").startswith("pool a+b")
    # the exact planner's warm start stays in its space
    assert all(len(s.clusters()) == 1 for p in without.plan.pipelines for s in p.stages)


def test_compute_floor_by_hand_and_below_every_plan(brute):
    inst, tables, _, _, times = brute
    # every sample through both layers at 0.03 s per sample per layer, over 4 GPUs
    assert compute_floor(inst, tables) == pytest.approx(G * 2 * 3 * STEP / 4, rel=1e-9)
    assert times and min(times) >= compute_floor(inst, tables) * (1 - 1e-12)


def test_compute_floor_uneven_clusters():
    """Two GPU types whose per-layer speed ratios differ (layer 0 fast on A, layer 1 fast on B): the
    floor is the LP's, below what any one-type rate gives, and still below every plan enumerated."""
    model = tiny_model(num_layers=2, gpus={"A": STEP, "B": STEP}, tps=(1,), mbss=(1, 2, 4), params=1e7,
                       activation_bytes=1e3, act_mem_bytes=1e3)
    for t in model["timings"]:  # layer 0 costs 1x on A and 4x on B, layer 1 the other way round
        f = t["fwd"][0]
        t["fwd"], t["bwd"] = ([f, 4 * f], [2 * f, 8 * f]) if t["gpu"] == "A" else ([4 * f, f], [8 * f, 2 * f])
    topo = tiny_topology(clusters=(("a", "A", 1, 2, MEM_GB), ("b", "B", 1, 2, MEM_GB)), wan_gbit_s=100.0,
                         wan_latency_ms=0.0)
    inst = tiny_instance(global_batch=G, model=model, topology=topo)
    floor = compute_floor(inst)
    # LP optimum by hand: a runs layer 0, b layer 1, 8 samples · 0.03 s over 2 GPUs each = 0.12 s
    assert floor == pytest.approx(G * 3 * STEP / 2, rel=1e-6)
    plan = Plan(pipelines=(Pipeline(num_microbatches=4, stages=(
        Stage(start=0, end=1, groups=(ReplicaGroup(cluster="a", dp=2, mbs=1),)),
        Stage(start=1, end=2, groups=(ReplicaGroup(cluster="b", dp=2, mbs=1),)))),))
    ev = evaluate(plan, inst)
    assert ev.feasible and ev.iteration_time_s >= floor


@pytest.mark.parametrize("counts,samples", [((2, 1), 5), ((1, 3), 7), ((3,), 4), ((2, 2), 9), ((1, 1), 2)])
def test_split_samples_against_brute_force(counts, samples):
    times = [tuple(STEP * k ** 1.2 for k in range(1, 6)), tuple(2.5 * STEP * k for k in range(1, 6))]
    kinds = list(zip(counts, times))
    got = split_samples(kinds, samples)
    flat = [t for (n, t) in kinds for _ in range(n)]
    best = min((max(t[m - 1] for t, m in zip(flat, mbs)) for mbs in
                itertools.product(range(1, 6), repeat=len(flat)) if sum(mbs) == samples), default=None)
    if best is None:
        assert got is None
        return
    assert got is not None
    assert sum(n * m for parts in got for n, m in parts) == samples
    assert [sum(n for n, _ in parts) for parts in got] == list(counts)
    assert max(t[m - 1] for (_, t), parts in zip(kinds, got) for _, m in parts) == pytest.approx(best)


def test_split_samples_refuses():
    t = (1.0, 2.0)
    assert split_samples([(3, t)], 2) is None  # more replicas than samples
    assert split_samples([(1, t)], 3) is None  # beyond the largest microbatch


def test_exact_certificate_covers_the_mixed_result(brute):
    inst, tables, best_any, _, times = brute
    res = plan_exact(inst, PlanOptions(time_limit_s=20))
    assert res.plan is not None and res.lower_bound_s is not None
    heur = plan_heuristic(inst, tables=tables, options=HeuristicOptions(time_limit_s=None))
    # the result is the mixed plan, the bound [H11b]'s (hetgap): above the compute floor, below the
    # heuristic's plan and every plan enumerated
    assert res.iteration_time_s == pytest.approx(best_any, rel=1e-9)
    floor = compute_floor(inst, tables)
    assert floor * 1.02 < res.lower_bound_s
    assert res.lower_bound_s <= heur.iteration_time_s and res.lower_bound_s <= min(times)
    assert res.lower_bound_s == float(dict(res.plan.meta)["mixed_bound_s"])
    assert "bounded by [H11b]" in res.plan_space and "compute floor" in res.plan_space
    assert res.plan_space.count("several clusters") == 1
    # the bound is within 1 % of the optimum here (0.1501 against 0.1509 s): the mixed plan is proven optimal
    g = (res.iteration_time_s - res.lower_bound_s) / res.iteration_time_s
    assert g <= 0.01 and res.status == ("optimal" if g <= PlanOptions().gap + 1e-12 else "feasible")
    assert dict(res.plan.meta)["lower_bound_s"] == repr(res.lower_bound_s)


def test_exact_names_mixed_stages_not_bounded_without_a_pool():
    inst = _one_zone(region_same=False)
    inst = tiny_instance(global_batch=G, model=tiny_model(num_layers=2, gpus={"A": STEP}, tps=(1,), mbss=(1, 2, 4)),
                         topology=tiny_topology(clusters=(("a", "A", 1, 2, 40.0), ("b", "A", 1, 2, 40.0))))
    assert fast_pools(inst) == []
    res = plan_exact(inst, PlanOptions(time_limit_s=20))
    assert res.plan is not None
    assert "not bounded: stages that mix replica groups of several clusters" in res.plan_space
    assert "no fast pool" in res.plan_space
    assert res.plan_space.count("several clusters") == 1  # hetgap: named once


@pytest.mark.parametrize("zero", [0, 1])
def test_runner_trains_a_mixed_stage_like_one_process(tmp_path, zero):
    """Export and the PyTorch runner (CPU/gloo) carry a stage whose replicas sit on two clusters with
    their own microbatch shares: after 3 steps every parameter equals single-process training."""
    pytest.importorskip("torch")
    from hgopt.export import ExportOptions, build_runner_plan
    from hgopt.runner.checkpoint import load_full_state
    from hgopt.runner.launch import run_forked
    from hgopt.runner.reference import train_reference
    from tests.runner_plans import G, runner_instance

    inst = runner_instance()
    plan = Plan(pipelines=(Pipeline(num_microbatches=2, stages=(
        Stage(start=0, end=2, zero=zero, groups=(G("a", dp=2, mbs=2),)),
        Stage(start=2, end=4, zero=zero, groups=(G("a", mbs=3), G("b", mbs=1))))),))
    assert evaluate(plan, inst).feasible
    rp = build_runner_plan(plan, inst, ExportOptions(dtype="float64"))
    codes = run_forked(rp, tmp_path, timeout_s=120)
    assert codes == {r: 0 for r in range(rp.world_size)}
    ref, _ = train_reference(rp, 3)
    got = load_full_state(tmp_path)
    worst = max(float((p.detach() - got[n]).norm() / p.detach().norm()) for n, p in ref.named_parameters())
    assert worst <= 1e-5


def test_shipped_pool_plan_is_valid_and_shards_only_one_tp_stages():
    """sailor-het-80+240 (A100 + V100 in one zone): the family's plan is feasible, has a stage on both
    clusters, ZeRO-1 only where a stage's groups share one tp degree (what the export can shard), and
    lies above the compute floor."""
    from hgopt.instances import load_instance

    inst = load_instance("sailor-het-80+240")
    tables = build_tables(inst)
    got = best_mixed_plan(inst, tables)
    assert got is not None
    ev = evaluate(got.plan, inst, tables)
    assert ev.feasible and ev.iteration_time_s == got.iteration_time_s
    stages = got.plan.pipelines[0].stages
    assert any(len(s.clusters()) == 2 for s in stages)
    assert all(s.zero == 0 for s in stages if len({g.tp for g in s.groups}) > 1)
    assert got.iteration_time_s >= compute_floor(inst, tables)
    assert got.plan.num_gpus() <= inst.topology.num_gpus()


def test_exact_adopts_the_mixed_plan_even_when_the_milp_uses_the_whole_limit(brute, monkeypatch):
    """The mixed-stage family runs before the MILP (it is deterministic and cheap), so a MILP that runs
    to the limit does not leave it untried: a MILP stand-in that returns the real result only after
    the whole limit has passed still ends with the mixed plan and its [H11b] bound (before, the
    plan space said "not tried: the time limit ran out" and the MILP's slower plan was the answer)."""
    import time

    import hgopt.search.exact as exact

    inst, tables, best_any, _, _ = brute
    real, limit = exact.plan_milp, 1.5

    def slow_milp(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        time.sleep(limit)  # past the limit however fast the real search was
        return out

    monkeypatch.setattr(exact, "plan_milp", slow_milp)
    res = plan_exact(inst, PlanOptions(time_limit_s=limit))
    assert res.plan is not None and "not tried" not in res.plan_space
    assert res.iteration_time_s == pytest.approx(best_any, rel=1e-9)
    # hetgap: [H11b] runs before the MILP too, so its bound (above the floor here) survives the late MILP
    assert compute_floor(inst, tables) * 1.02 < res.lower_bound_s <= best_any
    assert "bounded by [H11b]" in res.plan_space


def test_best_mixed_plan_stops_when_asked(brute):
    """hetgap: ``stop`` (a stop request or the caller's deadline) ends the search with what it has: at
    once, nothing; after a few checks, a plan no better than the full search's."""
    inst, tables, best_any, _, _ = brute
    assert best_mixed_plan(inst, tables, stop=lambda: True) is None
    calls = {"n": 0}

    def later() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    got = best_mixed_plan(inst, tables, stop=later)
    full = best_mixed_plan(inst, tables)
    assert full is not None and (got is None or got.iteration_time_s >= full.iteration_time_s - 1e-12)
    assert calls["n"] >= 3
