"""The intra-cluster DP against brute force over every local plan, scored by ``evaluate``."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search.intra import (
    StageModel,
    _generic_best,
    _search_range,
    best_local_plan,
    layer_classes,
    local_configs,
    local_plan_costs,
)
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology


def special_model(num_layers: int, emb_params: float = 2e7, head_factor: float = 3.0, **kw: Any) -> dict[str, Any]:
    """tiny_model with a heavy-parameter first layer (embedding) and a slow last layer (head)."""
    m = tiny_model(num_layers=num_layers, **kw)
    m["layers"][0]["params"] = emb_params
    m["layers"][0]["kind"] = "embedding"
    m["layers"][-1]["kind"] = "head"
    m["layers"][-1]["act_mem_bytes"] = 3e7
    for t in m["timings"]:
        t["fwd"][-1] *= head_factor
        t["bwd"][-1] *= head_factor
    return m


def irregular_model(num_layers: int, seed: int) -> dict[str, Any]:
    """Every layer different (forces the generic Pareto DP)."""
    rng = random.Random(seed)
    m = tiny_model(num_layers=num_layers)
    for layer in m["layers"]:
        layer["params"] = rng.uniform(0.2e6, 3e6)
        layer["act_mem_bytes"] = rng.uniform(0.3e7, 2e7)
        layer["activation_bytes"] = rng.uniform(0.5e6, 2e6)
    for t in m["timings"]:
        scale = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
        t["fwd"] = [f * s for f, s in zip(t["fwd"], scale)]
        t["bwd"] = [b * s for b, s in zip(t["bwd"], scale)]
    return m


def _instance(model: dict[str, Any], mem_gb: float = 1.2, batch: int = 8, gpn: int = 2) -> Instance:
    topo = tiny_topology(clusters=(("a", "A", 2, gpn, mem_gb), ("b", "B", 8, 2, 40.0)))
    return tiny_instance(global_batch=batch, model=model, topology=topo)


def _compositions(n: int, s: int) -> list[tuple[int, ...]]:
    return [tuple(c) for c in itertools.combinations(range(1, n), s - 1)]


def _brute_force(inst: Instance, start: int, end: int, microbatch: int, m: int, budget: int, after: int) -> float:
    """min J over every (tp, dp, s, partition) of [start, end) in cluster a that fits in memory, with
    memory judged by evaluate on a full plan whose remaining layers follow in cluster b."""
    tables = build_tables(inst)
    L = inst.model.num_layers
    assert start == 0 and end + after == L
    best = np.inf
    for cfg in local_configs(inst, "a", microbatch):
        if cfg.gpus > budget:
            continue
        group = ReplicaGroup(cluster="a", tp=cfg.tp, dp=cfg.dp, mbs=cfg.mbs)
        tail = tuple(Stage(start=i, end=i + 1, groups=(ReplicaGroup(cluster="b", dp=microbatch),), zero=1)
                     for i in range(end, L))
        for s in range(1, min(budget // cfg.gpus, end - start) + 1):
            for cuts in _compositions(end - start, s):
                b = (start, *(start + c for c in cuts), end)
                rc = "full" if cfg.recompute else "none"  # layouts with recomputation [I3r] too
                local = tuple(Stage(start=lo, end=hi, groups=(group,), zero=1, recompute=rc) for lo, hi in zip(b, b[1:]))
                plan = Plan(pipelines=(Pipeline(stages=local + tail, num_microbatches=m),))
                ev = evaluate(plan, inst, tables)
                assert ev.stages, ev.violations
                if any(st.oom for st in ev.stages[: len(local)]):
                    continue
                lp = local_plan_costs(inst, tables, "a", local)
                best = min(best, lp.objective(m))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_best_local_plan_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    L = rng.randint(4, 7)
    after = rng.choice([0, 0, 1, 2])
    model = special_model(L + after) if seed % 2 == 0 else irregular_model(L + after, seed)
    microbatch, m, budget = rng.choice([1, 2, 4]), rng.choice([2, 4, 8]), rng.choice([2, 3, 4])
    inst = _instance(model, mem_gb=rng.choice([1.13, 1.16, 1.2, 40.0]), batch=microbatch * m)
    tables = build_tables(inst)
    expect = _brute_force(inst, 0, L, microbatch, m, budget, after)
    got = best_local_plan(inst, tables, "a", 0, L, microbatch=microbatch, num_microbatches=m, gpu_budget=budget,
                          stages_after=after)
    if not np.isfinite(expect):
        assert got is None
        return
    assert got is not None
    assert got.objective(m) == pytest.approx(expect, rel=1e-12)
    assert got.gpus <= budget
    assert all(st.microbatch == microbatch for st in got.stages)


def _tail_floor(ev, tables) -> float:  # type: ignore[no-untyped-def]
    """[C7o] The first stage's tail floor from evaluate's own stage-0 numbers: exposed_sync_floor
    (ZeRO-1) of its [C5] sync, its backward, the last bucket's all-reduce at least that of layer 0's
    gradients (gaps3; the factories' intra-cluster links are constant and without latency, so that is
    the stage's sync times layer 0's share of its parameters), + its optimizer."""
    from hgopt.cost.gradsync import exposed_sync_floor

    r = ev.stages[0]
    params = tables.table(*next(iter(tables.by_gpu_tp))).params  # prefix sums; the same for every (gpu, tp)
    last = r.sync_s * float(params[1] - params[0]) / float(params[r.layers[1]] - params[r.layers[0]])
    return float(exposed_sync_floor(r.sync_s, r.bwd_s, last, zero=True)) + r.optimizer_s


def test_local_plan_numbers_agree_with_evaluate() -> None:
    """Single-cluster full plan: evaluate's pipeline = (m−1)·bottleneck + fill exactly, and sync_opt is
    the [C7o] floor of stage 0's tail from evaluate's own sync, backward and optimizer numbers, at most
    the tail evaluate finds under every bucket size and overlap setting."""
    import dataclasses

    inst = _instance(special_model(8), mem_gb=40.0, batch=16, gpn=4)
    tables = build_tables(inst)
    grp = ReplicaGroup(cluster="a", tp=1, dp=2, mbs=2)
    stages = tuple(Stage(start=lo, end=hi, groups=(grp,), zero=1) for lo, hi in ((0, 3), (3, 6), (6, 8)))
    lp = local_plan_costs(inst, tables, "a", stages)
    plan = Plan(pipelines=(Pipeline(stages=lp.stages, num_microbatches=4),))
    ev = evaluate(plan, inst, tables)
    assert ev.feasible
    assert ev.pipelines[0].bottleneck_s == pytest.approx(lp.bottleneck_s, rel=1e-13)
    assert ev.pipelines[0].fill_drain_s == pytest.approx(lp.fill_s, rel=1e-13)
    assert ev.pipeline_time_s == pytest.approx(lp.objective(4) - lp.sync_opt_s, rel=1e-13)
    assert lp.sync_opt_s == pytest.approx(_tail_floor(ev, tables), rel=1e-13)
    for mb, overlap in itertools.product((1e-6, 25.0, 1e6), (True, False)):
        other = evaluate(dataclasses.replace(plan, grad_bucket_mb=mb, overlap_grad_sync=overlap), inst, tables)
        assert other.iteration_time_s >= lp.objective(4) * (1 - 1e-12), (mb, overlap)


def test_replicas_enter_the_gradient_ring_like_identical_pipelines_in_evaluate() -> None:
    """NVLink slowed to 0.05 GB/s so that the sync is not hidden by the backward: the tail floor of
    two replicas is evaluate's for two identical pipelines (their ring), not the single pipeline's."""
    topo = tiny_topology(clusters=(("a", "A", 2, 8, 40.0), ("b", "B", 8, 2, 40.0)))
    topo["clusters"][0]["intra_node"] = {"gbyte_s": 0.05}
    inst = tiny_instance(global_batch=16, model=special_model(6), topology=topo)
    tables = build_tables(inst)
    lp = best_local_plan(inst, tables, "a", 0, 6, microbatch=2, num_microbatches=4, gpu_budget=4, replicas=2)
    assert lp is not None
    pipe = Pipeline(stages=lp.stages, num_microbatches=4)
    ev = evaluate(Plan(pipelines=(pipe, pipe)), inst, tables)
    assert ev.feasible
    assert lp.sync_opt_s == pytest.approx(_tail_floor(ev, tables), rel=1e-13)  # evaluate's ring of both pipelines
    assert ev.sync_optimizer_time_s >= lp.sync_opt_s
    single = local_plan_costs(inst, tables, "a", lp.stages)
    assert single.sync_opt_s != pytest.approx(lp.sync_opt_s)  # the ring size matters
    half = tiny_instance(global_batch=8, model=special_model(6), topology=topo)  # one pipeline's batch
    assert single.sync_opt_s == pytest.approx(_tail_floor(evaluate(Plan(pipelines=(pipe,)), half), tables), rel=1e-13)


@pytest.mark.parametrize("seed", range(8))
def test_closed_form_equals_pareto_dp_on_trunk_ranges(seed: int) -> None:
    rng = random.Random(100 + seed)
    L = rng.randint(5, 12)
    inst = _instance(special_model(L, emb_params=rng.choice([1e6, 3e7])), mem_gb=rng.choice([1.12, 1.15, 1.2]))
    tables = build_tables(inst)
    c = inst.topology.cluster("a")
    classes = layer_classes(inst)
    lo, hi = rng.choice([(0, L), (1, L), (0, L - 1), (1, L - 1)])
    d, m = rng.choice([0, 1, 3]), rng.choice([2, 8])
    for cfg in local_configs(inst, "a", 2):
        sm = StageModel(inst, tables, c, cfg, 1)
        fast = _search_range(classes, sm, lo, hi, hi - lo, d, m)
        slow = _generic_best(sm, lo, hi, hi - lo, d, m)
        assert (fast is None) == (slow is None)
        if fast is not None and slow is not None:
            assert fast.value == pytest.approx(slow.value, rel=1e-12)


def test_memory_limit_forces_more_stages_and_none_when_nothing_fits() -> None:
    inst = _instance(special_model(6, emb_params=1e6), mem_gb=1.15)
    tables = build_tables(inst)
    lp = best_local_plan(inst, tables, "a", 0, 6, microbatch=1, num_microbatches=8, gpu_budget=4)
    assert lp is not None and len(lp.stages) >= 2
    ev = evaluate(Plan(pipelines=(Pipeline(stages=lp.stages, num_microbatches=8),)), inst, tables)
    assert ev.feasible
    none = best_local_plan(inst, tables, "a", 0, 6, microbatch=1, num_microbatches=8, gpu_budget=1)
    assert none is None


def test_bad_arguments_raise_value_error_naming_the_setting() -> None:
    inst = _instance(special_model(4))
    tables = build_tables(inst)
    with pytest.raises(ValueError, match="cluster"):
        best_local_plan(inst, tables, "zz", 0, 4, microbatch=1, num_microbatches=1, gpu_budget=1)
    with pytest.raises(ValueError, match="start/end"):
        best_local_plan(inst, tables, "a", 3, 3, microbatch=1, num_microbatches=1, gpu_budget=1)
    with pytest.raises(ValueError, match="microbatch"):
        best_local_plan(inst, tables, "a", 0, 4, microbatch=0, num_microbatches=1, gpu_budget=1)


@pytest.mark.parametrize("nvlink", [0.05, 5.0, 500.0])
def test_first_tail_is_monotone_and_below_every_single_stage_plans_tail(nvlink: float) -> None:
    """[C7b] ``first_tail`` of [0, h) is at most the tail evaluate finds for the pipeline holding [0, h)
    in its first stage and the rest in a second, ZeRO-1 on or off, 25 MiB buckets or one bucket (every
    planner's setting, ``choose_sync``), overlap on or off (irregular layers: the sync of a range grows
    unevenly with its backward); exact where [0, h) fits in one 25 MiB bucket and the first stage's
    tail ends the iteration; its ``monotone`` form is non-decreasing in h (the cheap bound takes the
    shortest range the first stage must hold) and below it."""
    import dataclasses

    from hgopt.cost.compute import optimizer_time
    from hgopt.search.intra import LocalConfig

    topo = tiny_topology(clusters=(("a", "A", 2, 4, 40.0), ("b", "B", 8, 2, 40.0)))
    topo["clusters"][0]["intra_node"] = {"gbyte_s": nvlink}
    inst = tiny_instance(global_batch=8, model=irregular_model(6, 3), topology=topo)
    tables = build_tables(inst)
    c = inst.topology.cluster("a")
    sm = StageModel(inst, tables, c, LocalConfig(tp=1, dp=2, mbs=1), 1)
    L = inst.model.num_layers
    tails = sm.first_tail(np.zeros(L, dtype=np.int64), np.arange(1, L + 1))
    mono = sm.first_tail(np.zeros(L, dtype=np.int64), np.arange(1, L + 1), monotone=True)
    opt = np.array([float(optimizer_time(sm.tab, 0, h, 2)) for h in range(1, L + 1)])
    assert np.all(np.diff(mono - opt) >= -1e-15) and np.all(mono <= tails + 1e-15)
    grp = ReplicaGroup(cluster="a", tp=1, dp=2, mbs=1)
    for h in range(1, L):
        for zero, mb in itertools.product((0, 1), (25.0, 1e6)):
            stages = (Stage(start=0, end=h, groups=(grp,), zero=zero), Stage(start=h, end=L, groups=(grp,), zero=zero))
            plan = Plan(pipelines=(Pipeline(stages=stages, num_microbatches=4),), grad_bucket_mb=mb)
            ev = evaluate(plan, inst, tables)
            assert ev.iteration_time_s - ev.pipeline_time_s >= tails[h - 1] - 1e-12, (h, zero, mb)
            off = evaluate(dataclasses.replace(plan, overlap_grad_sync=False), inst, tables)
            assert off.iteration_time_s - off.pipeline_time_s >= tails[h - 1] - 1e-12, (h, zero, mb)
