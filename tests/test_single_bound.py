"""replay3 [R0s]: the one-cluster part of the relaxation under the exact timeline, stage count by stage
count (``hgopt.search.single_bound``), against brute force over every one-cluster plan of each split."""

from __future__ import annotations

import math
import random

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan
from hgopt.spec import Instance
from tests.factories import every_layout, local_pipelines, tiny_instance, tiny_model, tiny_topology


def _instance(seed: int, *, varied: bool) -> Instance:
    """One or two clusters of 1-4 nodes x 2 GPUs, 3-6 layers, memory from roomy to tight, no
    recomputation; ``varied``: the first two layers and the last drawn on their own around identical
    middle ones (like ``default``'s OPT profile: not trunk-shaped for the intra DP, its [I5] path), else
    identical layers ([I4])."""
    rng = random.Random(seed)
    names = ["a", "b"][: rng.choice([1, 2])]
    gpus = {"A": 0.01, "B": 0.02}
    clusters = tuple((n, g, rng.choice([1, 2, 4]), 2, rng.choice([1.14, 1.2, 40.0])) for n, g in zip(names, gpus))
    topo = tiny_topology(clusters=clusters, wan_gbit_s=8.0, wan_latency_ms=10.0)
    for c in topo["clusters"]:  # NIC latency: what the replay's intra-cluster sends carry
        c["inter_node"]["latency_ms"] = rng.choice([0.0, 0.5, 5.0])
    L = rng.randint(5, 7) if varied else rng.randint(3, 6)
    model = tiny_model(num_layers=L, gpus=dict(list(gpus.items())[: len(names)]),
                       activation_bytes=rng.choice([1e6, 2e7]))
    odd = {0, 1, L - 1}
    scale = [rng.uniform(0.3, 2.0) if i in odd else 1.0 for i in range(L)]
    ratio = [rng.uniform(0.5, 3.0) if i in odd else 2.0 for i in range(L)]
    for t in model["timings"]:
        if varied:
            t["fwd"] = [x * s for x, s in zip(t["fwd"], scale)]
            t["bwd"] = [x * r / 2.0 for x, r in zip(t["fwd"], ratio)]
    return tiny_instance(global_batch=rng.choice([4, 8, 16]), model=model, topology=topo, recompute="off")


def _best_one_cluster(inst: Instance, sp: object) -> float:
    """Least replay time over every one-cluster plan of the split (any layout, stage count, partition)."""
    tables = build_tables(inst)
    best = math.inf
    L = inst.model.num_layers
    for c in inst.topology.clusters:
        budget = c.num_gpus // sp.k  # type: ignore[attr-defined]
        for stages in local_pipelines(every_layout(inst, c.name, sp.microbatch), 0, L, budget):  # type: ignore[attr-defined]
            pipe = Pipeline(stages=stages, num_microbatches=sp.num_microbatches)  # type: ignore[attr-defined]
            ev = evaluate(Plan(pipelines=(pipe,) * sp.k), inst, tables, pipeline="replay")  # type: ignore[attr-defined]
            if ev.feasible:
                best = min(best, ev.iteration_time_s)
    return best


@pytest.mark.parametrize("varied", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_one_cluster_replay_bound_never_exceeds_brute_force(seed: int, varied: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """[R0s] ``milp._best_single`` under the replay is at most the least replay time of every one-cluster
    plan of each split (brute force over layouts, stage counts and partitions); it is infinite only where
    no one-cluster plan fits. Over all splits it also reaches the brute-force optimum on some (within
    1e-9: the one-stage plans, where the warm-up form is exact) — so it is not a dead bound."""
    import hgopt.cost.pipeline as pipeline_mod
    from hgopt.search.blocks import cheap_bounds
    from hgopt.search.milp import _best_single, batch_splits

    monkeypatch.setattr(pipeline_mod, "EVALUATE_1F1B", "replay")
    inst = _instance(seed, varied=varied)
    tables = build_tables(inst)
    tight = 0
    for sp in batch_splits(inst):
        cb = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches)
        bound = _best_single(inst, tables, sp, cb)
        best = _best_one_cluster(inst, sp)
        if not math.isfinite(best):
            assert bound == math.inf, (sp, bound)
            continue
        assert bound <= best * (1 + 1e-9), (sp, bound, best)
        tight += bound >= best * (1 - 1e-9)
    assert tight >= 1


def test_one_cluster_replay_bound_as_tight_as_the_closed_form_on_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """[R0s] On ``default``'s weakest split (k=1 B=32 m=16, a split allowing 26 stages), the one-cluster
    bound under the replay is within 1 % of the closed form's one-cluster optimum D* (its best plan runs on
    one stage, where the two models coincide); the round-7 form κ·D* + ... (κ = bound_weight / (m − 1)
    with the split's 26 stages) was below half of it."""
    import hgopt.cost.pipeline as pipeline_mod
    from hgopt.instances import load_instance
    from hgopt.search.blocks import cheap_bounds
    from hgopt.search.milp import _best_single, batch_splits

    inst = load_instance("default")
    tables = build_tables(inst)
    sp = next(s for s in batch_splits(inst) if s.k == 1 and s.microbatch == 32)
    cb = cheap_bounds(inst, tables, replicas=1, microbatch=32, num_microbatches=sp.num_microbatches)
    closed = _best_single(inst, tables, sp, cb)
    monkeypatch.setattr(pipeline_mod, "EVALUATE_1F1B", "replay")
    cbr = cheap_bounds(inst, tables, replicas=1, microbatch=32, num_microbatches=sp.num_microbatches)
    replay = _best_single(inst, tables, sp, cbr)
    assert cbr.weight / (sp.num_microbatches - 1) < 0.5  # what the old scaling would have used
    assert 0.99 * closed <= replay <= closed * (1 + 1e-9)


def _tiny_multi(seed: int) -> Instance:
    """Like tests/test_milp.py's tiny instances (two clusters of 1-2 nodes x 2 GPUs, 3-5 identical layers)
    with up to 16 samples, so some splits allow more stages than microbatches and others fewer."""
    rng = random.Random(1000 + seed)
    names = ["a", "b"]
    gpus = {"A": 0.01, "B": 0.02, "C": 0.013}
    clusters = tuple((n, g, rng.choice([1, 2]), 2, rng.choice([1.14, 1.2, 40.0])) for n, g in zip(names, gpus))
    topo = tiny_topology(clusters=clusters, wan_gbit_s=rng.choice([2.0, 8.0, 50.0]),
                         wan_latency_ms=rng.choice([1.0, 10.0, 80.0]))
    for c in topo["clusters"]:
        c["inter_node"]["latency_ms"] = rng.choice([0.0, 0.5, 5.0])
    model = tiny_model(num_layers=rng.randint(3, 5), gpus=dict(list(gpus.items())[: len(names)]),
                       activation_bytes=rng.choice([1e6, 2e7]))
    for t in model["timings"]:  # backward/forward ratio away from 2, so rho matters
        t["bwd"] = [x * 0.6 for x in t["bwd"]]
    return tiny_instance(global_batch=rng.choice([4, 8, 16]), model=model, topology=topo, recompute="off")


@pytest.mark.parametrize("seed", range(8))
def test_split_relaxation_bound_under_the_replay_never_exceeds_the_split_optimum(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """[R4s]/[R0s] Per batch split: max(cheap [B4], relaxation [R4] with [R0]) under the replay, as the
    planner's relaxation phase computes it (``milp._relaxation_bound`` at target inf and at the optimum),
    is at most the least replay time over every plan of that split (brute force over
    ``tests.factories.chain_space``)."""
    import hgopt.cost.pipeline as pipeline_mod
    from hgopt.search.blocks import cheap_bounds
    from hgopt.search.milp import _relaxation_bound, batch_splits
    from tests.factories import chain_space

    monkeypatch.setattr(pipeline_mod, "EVALUATE_1F1B", "replay")
    inst = _tiny_multi(seed)
    tables = build_tables(inst)
    best: dict[str, float] = {}
    for sp, pipe in chain_space(inst):
        ev = evaluate(Plan(pipelines=(pipe,) * sp.k), inst, tables, pipeline="replay")
        if ev.feasible:
            best[str(sp)] = min(best.get(str(sp), math.inf), ev.iteration_time_s)
    for sp in batch_splits(inst):
        opt = best.get(str(sp), math.inf)
        cb = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches)
        for target in (math.inf, opt):
            rb = _relaxation_bound(inst, tables, sp, cb, target, math.inf)[0]
            assert max(cb.value, rb) <= opt * (1 + 1e-9), (sp, target, cb.value, rb, opt)
