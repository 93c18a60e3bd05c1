"""The planners choose activation recomputation ([C2r]/[C6r], ``recompute: full`` on a stage) exactly when
it makes a better plan: where memory binds, the heuristic and the exact planner return a plan with
recomputation that ``evaluate`` finds feasible and faster than the best plan the same planner finds
with recomputation disabled (``job.recompute: off``), with their lower bounds below ``evaluate``; where
memory does not bind, no stage recomputes. The intra-cluster DP with recomputation equals brute force
over every local plan of its space (tests/test_intra.py enumerates the recomputing layouts too)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, get_planner
from hgopt.search.intra import best_local_plan, local_configs, local_plan_costs
from hgopt.spec import Instance, instance_from_dict
from tests.factories import chain_brute_force, every_layout, tiny_instance, tiny_model, tiny_topology


def _instance(mem_gb: float, recompute: str = "auto") -> Instance:
    """Embedding, 6 identical blocks, head; 200 MB of saved activations per block and sample against
    1 MB handed over: 2 GB GPUs cannot keep one sample's activations of the whole model (plus the
    1 GiB workspace) but keep its layer inputs easily."""
    m: dict[str, Any] = tiny_model(num_layers=8, gpus={"A": 0.01, "B": 0.02}, tps=(1,), act_mem_bytes=2e8, params=1e6,
                                   activation_bytes=1e6)
    m["layers"][0].update(kind="embedding", params=2e6, act_mem_bytes=1e6)
    m["layers"][-1].update(kind="head", params=2e6, act_mem_bytes=3e8)
    topo = tiny_topology(clusters=(("a", "A", 2, 2, mem_gb), ("b", "B", 1, 2, mem_gb)))
    inst = tiny_instance(global_batch=4, model=m, topology=topo)
    return dataclasses.replace(inst, job=dataclasses.replace(inst.job, recompute=recompute))  # type: ignore[arg-type]


def _recomputing(plan: Plan) -> list[bool]:
    return [s.recompute == "full" for p in plan.pipelines for s in p.stages]


@pytest.mark.parametrize("planner", ["heuristic", "milp"])
def test_planners_recompute_where_memory_binds_and_beat_the_plan_without(planner: str) -> None:
    run = get_planner(planner)
    on = run(_instance(2.0), PlanOptions(time_limit_s=30))
    off = run(_instance(2.0, "off"), PlanOptions(time_limit_s=10))
    assert on.plan is not None and off.plan is not None
    ev_on, ev_off = evaluate(on.plan, _instance(2.0)), evaluate(off.plan, _instance(2.0, "off"))
    assert ev_on.feasible and ev_off.feasible
    assert any(_recomputing(on.plan)) and not any(_recomputing(off.plan))
    assert on.iteration_time_s == pytest.approx(ev_on.iteration_time_s, rel=1e-12)
    assert ev_on.iteration_time_s < ev_off.iteration_time_s
    # hand check of the recomputing plan both find: the whole model on 4 replicas of one GPU, 1 sample
    # each: 8 layers x (forward 0.01 + backward 0.02 + the forward again 0.01) = 0.32 s + the gradient
    # ring of cluster a; without recomputation one GPU cannot hold the model's activations
    assert ev_on.iteration_time_s == pytest.approx(0.32 + ev_on.sync_optimizer_time_s, rel=1e-9)
    for res, ev in ((on, ev_on), (off, ev_off)):
        if res.lower_bound_s is not None:
            assert res.lower_bound_s <= ev.iteration_time_s * (1 + 1e-9)
    if planner == "milp":  # proven: no plan of the exact planner's space without recomputation is as fast
        # the bound covers the whole pipeline (0.32 s); the sync tail's floor is below evaluate's since
        # the ZeRO-1 reduce-scatter overlaps the backward ([C7b]), so the status is no longer "optimal"
        assert on.lower_bound_s is not None and 0.32 <= on.lower_bound_s <= ev_on.iteration_time_s
        assert off.lower_bound_s is not None and off.lower_bound_s > ev_on.iteration_time_s


@pytest.mark.parametrize("planner", ["heuristic", "milp"])
def test_no_recomputation_where_memory_does_not_bind(planner: str) -> None:
    res = get_planner(planner)(_instance(40.0), PlanOptions(time_limit_s=30))
    assert res.plan is not None and not any(_recomputing(res.plan))
    off = get_planner(planner)(_instance(40.0, "off"), PlanOptions(time_limit_s=30))
    assert off.plan is not None and res.iteration_time_s == pytest.approx(off.iteration_time_s, rel=1e-12)


def test_local_configs_offer_recomputation_only_where_memory_can_bind() -> None:
    tight, roomy = _instance(2.0), _instance(40.0)
    assert any(c.recompute for c in local_configs(tight, "a", 4, build_tables(tight)))
    assert not any(c.recompute for c in local_configs(roomy, "a", 4, build_tables(roomy)))
    assert not any(c.recompute for c in local_configs(_instance(2.0, "off"), "a", 4))


def test_intra_dp_recomputing_plan_equals_evaluate_and_brute_force() -> None:
    """The DP's local plan with recomputation costs what evaluate says (its pipeline exactly, its tail a
    floor [C7b]), and no partition of any
    layout (with or without recomputation) of cluster a that evaluate finds feasible has a lower DP
    objective [I1] (brute force, as tests/test_intra.py does it)."""
    import itertools

    inst = _instance(2.0)
    tables = build_tables(inst)
    lp = best_local_plan(inst, tables, "a", 0, 8, microbatch=4, num_microbatches=1, gpu_budget=4)
    assert lp is not None and all(s.recompute == "full" for s in lp.stages)
    ev = evaluate(Plan(pipelines=(Pipeline(stages=lp.stages, num_microbatches=1),)), inst, tables)
    assert ev.feasible and ev.pipeline_time_s == pytest.approx(lp.objective(1) - lp.sync_opt_s, rel=1e-12)
    assert lp.objective(1) <= ev.iteration_time_s  # [C7b]: the tail is a floor of evaluate's
    best = float("inf")
    for cfg in local_configs(inst, "a", 4, tables):
        g = ReplicaGroup(cluster="a", tp=cfg.tp, dp=cfg.dp, mbs=cfg.mbs)
        for s in range(1, 4 // cfg.gpus + 1):
            for cuts in itertools.combinations(range(1, 8), s - 1):
                b = (0, *cuts, 8)
                stages = tuple(Stage(start=x, end=y, groups=(g,), zero=1, recompute="full" if cfg.recompute else "none")
                               for x, y in zip(b, b[1:]))
                e = evaluate(Plan(pipelines=(Pipeline(stages=stages, num_microbatches=1),)), inst, tables)
                if e.feasible:
                    best = min(best, local_plan_costs(inst, tables, "a", stages).objective(1))
    assert lp.objective(1) == pytest.approx(best, rel=1e-12)


def test_job_recompute_is_read_from_the_instance() -> None:
    base = {"name": "t", "model": tiny_model(), "topology": tiny_topology(),
            "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}
    assert instance_from_dict(base).job.recompute == "auto"
    for value, want in (("off", "off"), (False, "off"), ("auto", "auto")):  # YAML reads a bare off as false
        assert instance_from_dict({**base, "job": {**base["job"], "recompute": value}}).job.recompute == want
    with pytest.raises(Exception, match="job.recompute"):
        instance_from_dict({**base, "job": {**base["job"], "recompute": "sometimes"}})


def _milp_instance(seed: int) -> Instance:
    """2 clusters of 1-2 nodes x 2 GPUs, embedding + 3-4 identical blocks, memory tight enough that
    some layouts only fit with recomputation."""
    import random

    rng = random.Random(seed)
    m: dict[str, Any] = tiny_model(num_layers=rng.randint(4, 5), gpus={"A": 0.01, "B": 0.02}, tps=(1, 2),
                                   act_mem_bytes=rng.choice([3e8, 5e8]), activation_bytes=1e6)
    m["layers"][0].update(kind="embedding", params=2e6, act_mem_bytes=1e6)
    topo = tiny_topology(clusters=(("a", "A", rng.choice([1, 2]), 2, rng.choice([1.5, 2.0])),
                                   ("b", "B", 1, 2, rng.choice([1.5, 2.0, 2.5]))),
                         wan_gbit_s=rng.choice([2.0, 50.0]), wan_latency_ms=rng.choice([1.0, 20.0]))
    return tiny_instance(global_batch=rng.choice([2, 4]), model=m, topology=topo)


def _brute_force(inst: Instance) -> float:
    """Best evaluate() over the exact planner's plan space (k identical pipelines, a chain of distinct
    clusters with one block each, one layout per block — with recomputation where local_configs offers
    it — any partition): ``factories.chain_brute_force``, the enumeration tests/test_milp.py runs
    without recomputation."""
    return chain_brute_force(inst, lambda c, mb: every_layout(inst, c, mb, recompute="planner"))


@pytest.mark.parametrize("seed", [0, 5, 6, 7])
def test_milp_with_recomputation_equals_brute_force_and_its_bound_holds(seed: int) -> None:
    """Seeds 5-7 are memory-bound (their brute-force optimum recomputes), 0 is not."""
    import math

    from hgopt.search.milp import plan_milp

    inst = _milp_instance(seed)
    expect = _brute_force(inst)
    without = _brute_force(dataclasses.replace(inst, job=dataclasses.replace(inst.job, recompute="off")))
    res = plan_milp(inst, PlanOptions(time_limit_s=60, gap=1e-7, extra={"warm_start": "none", "relaxation": "off"}))
    if not math.isfinite(expect):
        assert res.plan is None
        return
    assert res.plan is not None
    ev = evaluate(res.plan, inst)
    assert ev.feasible and ev.iteration_time_s == pytest.approx(expect, rel=1e-7)
    assert res.lower_bound_s is not None and res.lower_bound_s <= ev.iteration_time_s * (1 + 1e-9)
    # recomputation exactly when it makes a better plan than any plan without it
    assert any(_recomputing(res.plan)) == (expect < without * (1 - 1e-9))
    pruned = plan_milp(inst, PlanOptions(time_limit_s=60, gap=1e-7))  # warm start + relaxation bound
    assert pruned.iteration_time_s == pytest.approx(expect, rel=1e-7)
    assert pruned.lower_bound_s is not None and pruned.lower_bound_s <= expect * (1 + 1e-9)


def test_plan_table_shows_the_recomputing_stages() -> None:
    from hgopt.commands.plan import render_result

    inst = _instance(2.0)
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=30))
    assert res.plan is not None
    text = render_result(inst, res, evaluate(res.plan, inst))
    head = next(line for line in text.splitlines() if line.lstrip().startswith("stage"))
    assert head.rstrip().endswith("recompute") and " full" in text
    roomy = _instance(40.0)
    plain = get_planner("heuristic")(roomy, PlanOptions(time_limit_s=30))
    assert plain.plan is not None and "recompute" not in render_result(roomy, plain, evaluate(plain.plan, roomy))


def test_the_chosen_recomputing_plan_trains_like_one_process(tmp_path: Any) -> None:
    """The heuristic's plan with recomputation, exported, runs under the runner (``torch.utils.checkpoint``
    per layer on the recomputing stage, 4 ranks, gloo, float64) to the parameters of single-process
    training after 3 steps."""
    pytest.importorskip("torch")
    from hgopt.export import ExportOptions, build_runner_plan
    from tests.test_runner_hf import _run, _worst_abs

    inst = _instance(2.0)
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=30))
    assert res.plan is not None and any(_recomputing(res.plan))
    rp = build_runner_plan(res.plan, inst, ExportOptions(dtype="float64", data="random"))
    assert [s.recompute for p in rp.pipelines for s in p.stages] == ["full" if r else "none" for r in _recomputing(res.plan)]
    _run(rp, tmp_path)
    worst, name = _worst_abs(rp, tmp_path)
    assert worst <= 1e-10, f"{name} differs by {worst:.2e}"
