"""The scorer against values computed by hand on tiny instances (formulations/cost_model.md)."""

from __future__ import annotations

import math

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.cost.tables import allreduce_time, bandwidth_bytes_per_s, transfer_time
from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Bandwidth
from tests.factories import tiny_instance, tiny_model, tiny_topology

# tiny_model: every layer forward 0.01·mbs/tp s on A (0.02 on B), backward twice that, 1e6 params,
# 1e6 activation bytes per sample at each boundary, 1e7 activation bytes kept per sample, fp32.
WAN_BPS = 8e9 / 8  # 8 Gbit/s
WAN_LAT = 0.010
INTER_BPS = 100e9 / 8
INTRA_BPS = 100e9


def g(cluster: str, tp: int = 1, dp: int = 1, mbs: int = 1) -> ReplicaGroup:
    return ReplicaGroup(cluster=cluster, tp=tp, dp=dp, mbs=mbs)


def one_pipeline(m: int, *stages: Stage, boundaries: tuple[Boundary, ...] = ()) -> Plan:
    return Plan(pipelines=(Pipeline(stages=stages, num_microbatches=m, boundaries=boundaries),))


def test_two_stages_across_one_wan_link() -> None:
    inst = tiny_instance(global_batch=8)
    plan = one_pipeline(4, Stage(start=0, end=2, groups=(g("a", dp=2),)), Stage(start=2, end=4, groups=(g("b", dp=2),)))
    ev = evaluate(plan, inst)
    assert ev.feasible, ev.violations
    t0 = 2 * 0.01 + 2 * 0.02  # stage 0 on A: 2 layers fwd + bwd, mbs 1
    t1 = 2 * 0.02 + 2 * 0.04  # stage 1 on B
    send = WAN_LAT + 2 * 1e6 / WAN_BPS  # the microbatch's 2 samples cross a -> b
    pipe = 3 * max(t0, t1, send) + (t0 + t1 + 2 * send)
    # grad sync: 2 replicas inside one node (2 GPUs/node) -> ring on intra-node, 2 layers x 1e6 x 4 B
    sync0 = 2 * 1 / 2 * (2e6 * 4) / INTRA_BPS
    sync1 = sync0  # same bytes; cluster b also has 100 GB/s intra-node in the factory
    opt = 2 * 0.001
    assert ev.pipelines[0].time_s == pytest.approx(pipe, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(pipe + max(sync0, sync1) + opt, rel=1e-12)
    assert ev.throughput_samples_per_s == pytest.approx(8 / ev.iteration_time_s)
    assert ev.stages[0].send_fwd_s == pytest.approx(send)
    assert ev.stages[1].send_fwd_s == 0.0


def test_three_stages_local_and_wan_boundary_and_compute_bound_steady_state() -> None:
    inst = tiny_instance(global_batch=16)
    plan = one_pipeline(
        8,
        Stage(start=0, end=1, groups=(g("a", mbs=2),)),
        Stage(start=1, end=2, groups=(g("a", mbs=2),)),
        Stage(start=2, end=4, groups=(g("b", tp=2, mbs=2),)),
    )
    ev = evaluate(plan, inst)
    assert ev.feasible, ev.violations
    t0 = 0.01 * 2 + 0.02 * 2  # one layer, mbs 2
    t2 = 2 * (0.02 * 2 / 2 + 0.04 * 2 / 2)  # two layers on B at tp 2, mbs 2
    local = 2 * 1e6 / INTER_BPS  # a -> a: inter-node, no latency in the factory
    wan = WAN_LAT + 2 * 1e6 / WAN_BPS
    bottleneck = max(t0, t2, local, wan)
    fill = t0 + t0 + t2 + 2 * local + 2 * wan
    assert ev.pipelines[0].bottleneck_s == pytest.approx(bottleneck)
    assert ev.pipeline_time_s == pytest.approx(7 * bottleneck + fill)
    # single replicas: no gradient sync at all
    assert all(s.sync_s == 0.0 for s in ev.stages)
    # optimizer: tp-2 update time is update/tp per layer in the factory
    assert ev.sync_optimizer_time_s == pytest.approx(max(0.001, 2 * 0.001 / 2))


def test_two_pipelines_in_two_clusters_all_reduce_over_the_wan() -> None:
    inst = tiny_instance(global_batch=8)
    p_a = Pipeline(stages=(Stage(start=0, end=4, groups=(g("a"),)),), num_microbatches=4)
    p_b = Pipeline(stages=(Stage(start=0, end=4, groups=(g("b"),)),), num_microbatches=4)
    ev = evaluate(Plan(pipelines=(p_a, p_b)), inst)
    assert ev.feasible, ev.violations
    grad_bytes = 4 * 1e6 * 4
    # k=2 clusters, one replica each: no intra ring; WAN ring 2(k-1)/k · bytes / BW + 2(k-1)·latency
    sync = 2 * 1 / 2 * grad_bytes / WAN_BPS + 2 * WAN_LAT
    slowest = 4 * (4 * 0.02 + 4 * 0.04)  # pipeline b: 4 microbatches, no sends
    assert ev.pipeline_time_s == pytest.approx(slowest)
    assert ev.stages[0].sync_s == pytest.approx(sync)
    assert ev.iteration_time_s == pytest.approx(slowest + sync + 4 * 0.001)


def test_memory_counts_weights_grads_adam_and_in_flight_activations() -> None:
    inst = tiny_instance(global_batch=16)
    plan = one_pipeline(4, Stage(start=0, end=3, groups=(g("a", mbs=4),)), Stage(start=3, end=4, groups=(g("b", mbs=4),)))
    ev = evaluate(plan, inst)
    params = 3e6
    # fp32 Adam: weights 4 + grads 4 + state 8 bytes/param; first of 2 stages keeps min(2, 4) microbatches
    expect0 = params * (4 + 4 + 8) + 2 * 4 * 3 * 1e7 + 2**30
    expect1 = 1e6 * 16 + 1 * 4 * 1e7 + 2**30
    assert ev.stages[0].peak_memory_bytes == pytest.approx(expect0)
    assert ev.stages[1].peak_memory_bytes == pytest.approx(expect1)


def test_out_of_memory_is_flagged_and_costed() -> None:
    model = tiny_model(act_mem_bytes=3e9)  # 3 GB per sample per layer
    inst = tiny_instance(global_batch=8, model=model)
    plan = one_pipeline(2, Stage(start=0, end=2, groups=(g("a", mbs=4),)), Stage(start=2, end=4, groups=(g("b", mbs=4),)))
    ev = evaluate(plan, inst)
    assert not ev.feasible
    assert math.isfinite(ev.iteration_time_s)
    assert any("out of memory" in v for v in ev.violations)
    assert ev.stages[0].oom and ev.stages[1].oom


def test_zero_shards_optimizer_state_over_replicas() -> None:
    inst = tiny_instance(global_batch=8)
    base = Stage(start=0, end=4, groups=(g("a", dp=4, mbs=1),))
    sharded = Stage(start=0, end=4, groups=(g("a", dp=4, mbs=1),), zero=1)
    e0 = evaluate(one_pipeline(2, base), inst)
    e1 = evaluate(one_pipeline(2, sharded), inst)
    assert e0.stages[0].peak_memory_bytes - e1.stages[0].peak_memory_bytes == pytest.approx(4e6 * 8 * (1 - 1 / 4))
    assert e1.stages[0].optimizer_s == pytest.approx(e0.stages[0].optimizer_s / 4)


def test_compressed_boundary_sends_fewer_bytes() -> None:
    inst = tiny_instance(global_batch=8)
    stages = (Stage(start=0, end=2, groups=(g("a", mbs=2),)), Stage(start=2, end=4, groups=(g("b", mbs=2),)))
    plain = evaluate(one_pipeline(4, *stages), inst)
    bf = evaluate(one_pipeline(4, *stages, boundaries=(Boundary(fwd="bf16", bwd="fp8"),)), inst)
    hbm = 900e9  # default memory bandwidth of a cluster
    # bf16: sender reads 4 B and writes 2 B per value, receiver reads 2 B and writes 4 B
    quant_bf16 = 2e6 * (1 + 0.5) / hbm + 2e6 * (0.5 + 1) / hbm
    # fp8: one more read of the native tensor for the per-tensor scale
    quant_fp8 = 2e6 * (2 + 0.25) / hbm + 2e6 * (0.25 + 1) / hbm
    assert bf.stages[0].send_fwd_s == pytest.approx(WAN_LAT + 2 * 1e6 * 0.5 / WAN_BPS + quant_bf16)
    assert bf.stages[0].send_bwd_s == pytest.approx(WAN_LAT + 2 * 1e6 * 0.25 / WAN_BPS + quant_fp8)
    assert plain.stages[0].send_fwd_s == pytest.approx(WAN_LAT + 2 * 1e6 / WAN_BPS)


def test_bf16_gradient_sync_over_the_wan_halves_its_bytes() -> None:
    inst = tiny_instance(global_batch=8)
    pipes = tuple(Pipeline(stages=(Stage(start=0, end=4, groups=(g(c),)),), num_microbatches=4) for c in ("a", "b"))
    native = evaluate(Plan(pipelines=pipes), inst)
    bf16 = evaluate(Plan(pipelines=pipes, grad_sync_precision="bf16"), inst)
    grad_bytes = 4 * 1e6 * 4
    assert native.stages[0].sync_s - bf16.stages[0].sync_s == pytest.approx(grad_bytes / 2 / WAN_BPS)


def test_concurrent_cross_cluster_allreduces_share_the_wan_link() -> None:
    """[C5w] Two 2-stage pipelines, one in a and one in b, cut alike: two segments of 2 layers, each
    held by one replica in a and one in b. Alone, a segment's ring moves 2·1e6·4 B = 8 MB over the
    link (k = 2: bytes/BW + 2λ = 0.028 s); both rings run at once over the same a–b link, so each stage
    waits for 16 MB: 0.036 s. One segment alone (single-stage pipelines) is unchanged."""
    inst = tiny_instance(global_batch=8)
    two = tuple(Pipeline(stages=(Stage(start=0, end=2, groups=(g(c),)), Stage(start=2, end=4, groups=(g(c),))),
                         num_microbatches=4) for c in ("a", "b"))
    ev = evaluate(Plan(pipelines=two), inst)
    assert [s.sync_s for s in ev.stages] == pytest.approx([16e6 / WAN_BPS + 2 * WAN_LAT] * 4)
    one = tuple(Pipeline(stages=(Stage(start=0, end=4, groups=(g(c),)),), num_microbatches=4) for c in ("a", "b"))
    ev1 = evaluate(Plan(pipelines=one), inst)
    assert [s.sync_s for s in ev1.stages] == pytest.approx([16e6 / WAN_BPS + 2 * WAN_LAT] * 2)
    # unequal segments (4 MB and 12 MB): each stage still waits for the link to carry all 16 MB
    three = tuple(Pipeline(stages=(Stage(start=0, end=1, groups=(g(c),)), Stage(start=1, end=4, groups=(g(c),))),
                           num_microbatches=4) for c in ("a", "b"))
    ev3 = evaluate(Plan(pipelines=three), inst)
    assert ev3.stages[1].sync_s == pytest.approx(16e6 / WAN_BPS + 2 * WAN_LAT)  # shared: all 16 MB
    assert ev3.stages[0].sync_s == pytest.approx(16e6 / WAN_BPS + 2 * WAN_LAT)


def test_pipelines_crossing_the_same_wan_link_share_it() -> None:
    inst = tiny_instance(global_batch=16, topology=tiny_topology(
        clusters=(("a", "A", 2, 2, 40.0), ("b", "B", 2, 2, 40.0)), wan_gbit_s=8.0, wan_latency_ms=10.0))
    ab = Pipeline(stages=(Stage(start=0, end=2, groups=(g("a", mbs=2),)), Stage(start=2, end=4, groups=(g("b", mbs=2),))),
                  num_microbatches=4)
    ba = Pipeline(stages=(Stage(start=0, end=2, groups=(g("b", mbs=2),)), Stage(start=2, end=4, groups=(g("a", mbs=2),))),
                  num_microbatches=4, boundaries=(Boundary(fwd="bf16", bwd="native"),))
    # two copies of a -> b: each direction carries both pipelines' 2 samples per microbatch
    twice = evaluate(Plan(pipelines=(ab, ab)), inst)
    assert twice.stages[0].send_fwd_s == pytest.approx(WAN_LAT + 2 * 2e6 / WAN_BPS)
    # a -> b and b -> a (different pipelines, c4w [C4j]): each boundary is priced with its own pipeline's
    # load (ab's activations 2e6 B, its gradients 2e6 B; ba's activations in bf16 1e6 B); the sharing of
    # the link is the joint replay's (tests/test_c4w_joint.py), not a stretched send time
    both = evaluate(Plan(pipelines=(ab, ba)), inst)
    hbm = 900e9
    quant = 2e6 * 1.5 / hbm + 2e6 * 1.5 / hbm
    assert both.stages[0].send_fwd_s == pytest.approx(WAN_LAT + 2e6 / WAN_BPS)
    assert both.stages[0].send_bwd_s == pytest.approx(WAN_LAT + 2e6 / WAN_BPS)
    assert both.stages[2].send_fwd_s == pytest.approx(WAN_LAT + 1e6 / WAN_BPS + quant)
    assert both.stages[2].send_bwd_s == pytest.approx(WAN_LAT + 2e6 / WAN_BPS)


def test_heterogeneous_replicas_split_samples_by_block() -> None:
    # stage 0: 1 replica in a with 3 samples + 1 replica in b with 1 sample; stage 1: 2 replicas in b (2 each)
    inst = tiny_instance(global_batch=8)
    s0 = Stage(start=0, end=2, groups=(g("a", mbs=3), g("b", mbs=1)))
    s1 = Stage(start=2, end=4, groups=(g("b", dp=2, mbs=2),))
    ev = evaluate(one_pipeline(2, s0, s1), inst)
    assert ev.feasible, ev.violations
    # samples 0-2 live in a, sample 3 in b; stage 1 holds 0-1 and 2-3 in b: 3 samples cross a->b
    wan = WAN_LAT + 3 * 1e6 / WAN_BPS
    local = 1 * 1e6 / INTER_BPS  # sample 3 moves between two b replicas
    assert ev.stages[0].send_fwd_s == pytest.approx(max(wan, local))
    # stage 0 runs at its slowest replica: a with mbs 3 (0.03/layer) vs b with mbs 1 (0.02/layer)
    assert ev.stages[0].fwd_s == pytest.approx(2 * 0.03)


def test_structural_violations_make_the_plan_infeasible_with_infinite_time() -> None:
    inst = tiny_instance(global_batch=8)
    plan = one_pipeline(4, Stage(start=0, end=3, groups=(g("a", dp=2),)))  # layer 3 not covered
    ev = evaluate(plan, inst)
    assert not ev.feasible and math.isinf(ev.iteration_time_s)
    assert any("layers covered up to 3" in v for v in ev.violations)


def test_link_primitives() -> None:
    const = Bandwidth(gbyte_s=2.0, latency_s=0.05)
    assert transfer_time(const, 4e9) == pytest.approx(0.05 + 2.0)
    assert allreduce_time(const, 4e9, 4) == pytest.approx(2 * 3 / 4 * 2.0 + 6 * 0.05)
    assert allreduce_time(const, 4e9, 1) == 0.0
    # Sailor's curve for one A100 per VM in one zone (docs/sources.md: 1.18 / 1.88 / 2.41 GB/s)
    curve = Bandwidth(gbyte_s=2.42, curve=(-0.00244142, 0.14086273, 1.11682276))
    assert bandwidth_bytes_per_s(curve, 1e6) / 1e9 == pytest.approx(1.1168, rel=1e-3)
    # u clamped at the top: huge messages do not exceed the maximum
    assert bandwidth_bytes_per_s(curve, 1e15) <= 2.42e9


def test_tables_are_reusable_and_give_the_same_answer() -> None:
    inst = tiny_instance(global_batch=8)
    plan = one_pipeline(4, Stage(start=0, end=2, groups=(g("a", dp=2),)), Stage(start=2, end=4, groups=(g("b", dp=2),)))
    tables = build_tables(inst)
    assert evaluate(plan, inst, tables) == evaluate(plan, inst)


def test_microbatch_interpolation_between_and_beyond_profiled_sizes() -> None:
    model = tiny_model(mbss=(2, 4))
    inst = tiny_instance(global_batch=8, model=model)
    tab = build_tables(inst).table("A", 1)
    assert tab.times(3, 0, 1)[0] == pytest.approx(0.03)  # linear between 2 and 4
    assert tab.times(1, 0, 1)[0] == pytest.approx(0.01)  # proportional below the smallest
    assert tab.times(8, 0, 1)[0] == pytest.approx(0.08)  # proportional above the largest
