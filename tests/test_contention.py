"""A stage's gradient sync and the pipeline's last backward sends sharing a capped link (#10 item 2).

Hand case (``_contended``): clusters a and b of 2-GPU nodes, A GPUs on both (forward 0.01 s per layer
and sample, backward 0.02 s); the link between them 8 Gbit/s = 1 GB/s per flow and as the aggregate
cap of each direction, 10 ms latency; 1e7 activation bytes per sample, 1e7 fp32 parameters (40 MB)
and 1 ms of optimizer step per layer. One microbatch of 2 samples; stage 0 = layer 0 on two
replicas in a, stage 1 = layers 1-3 on one replica in a (row 0) and one in b (row 1); one bucket per
segment (``grad_bucket_mb`` 1000).

Forward: stage 0 ends at 0.01 s; row 1 crosses a -> b: 1e7 / 1e9 = 10 ms + 10 ms latency, so stage
1's b replica starts at 0.03 s and ends its backward (3 layers: 0.03 + 0.06 s) at E_1 = 0.12 s. Its
backward message (10 MB, one flow) leaves for stage 0's replica 1 over b -> a at 0.12 s, exactly when
stage 1's one bucket starts (both holders ready; one replica per cluster, so no ring inside a
cluster): the WAN ring over {a, b} of 120 MB, alone 2·(1/2)·120e6 / 1e9 + 2·10 ms = 0.140 s [C5].
Both flows cross the b -> a cap and share it by processor sharing (0.5 GB/s each): the message's
10 MB are through at 0.14 s (arrives 0.15 s), the ring has done 10 MB-seconds' worth and does its
remaining 0.130 s alone: the sync ends at 0.12 + 0.020 + 0.130 = 0.270 s, 10 ms (the message's
cap-seconds) after it would alone (0.260 s); stage 1's optimizer step (3 ms) ends the iteration at
0.273 s. Stage 0's replica 1 runs its backward 0.15 -> 0.17 s, its sync inside a takes < 1 ms.
"""

from __future__ import annotations

import pytest

from hgopt.cost import evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.simulate import simulate
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology

E1 = 0.12
RING = 0.120 + 0.020
MSG = 0.010


def _contended_instance(cap: bool = True) -> Instance:
    topo = tiny_topology(clusters=(("a", "A", 2, 2, 80.0), ("b", "A", 2, 2, 80.0)))
    link: dict[str, object] = {"kind": "per_flow", "per_flow": {"gbit_s": 8.0, "latency_ms": 10.0}}
    if cap:
        link["aggregate"] = {"gbit_s": 8.0}
    topo["links"] = {"default": link}
    model = tiny_model(num_layers=4, gpus={"A": 0.01}, params=1e7, activation_bytes=1e7)
    return tiny_instance(global_batch=2, model=model, topology=topo)


def _contended_plan() -> Plan:
    return Plan(pipelines=(Pipeline(stages=(
        Stage(start=0, end=1, groups=(ReplicaGroup(cluster="a", dp=2, mbs=1),)),
        Stage(start=1, end=4, groups=(ReplicaGroup(cluster="a", dp=1, mbs=1), ReplicaGroup(cluster="b", dp=1, mbs=1))),
    ), num_microbatches=1),), grad_bucket_mb=1000.0)


def test_simulator_shares_the_cap_between_the_sync_and_the_last_backward_send() -> None:
    inst, plan = _contended_instance(), _contended_plan()
    sim = simulate(plan, inst)
    s1 = next(s for s in sim.stages if s.stage == 1)
    assert s1.compute_end_s == pytest.approx(E1, rel=1e-12)
    sync = [e for e in sim.events if e.kind == "sync" and e.stage == 1]
    assert len(sync) == 1 and sync[0].start == pytest.approx(E1, rel=1e-12)
    assert sync[0].end == pytest.approx(E1 + 2 * MSG + (RING - MSG), rel=1e-12)  # = E1 + RING + MSG
    send = next(e for e in sim.events if e.kind == "sendB" and e.stage == 1 and e.replica == 1)
    assert send.start == pytest.approx(E1, rel=1e-12)
    assert send.end == pytest.approx(E1 + 2 * MSG + 0.010, rel=1e-12)  # half the cap, then the latency
    b0 = next(e for e in sim.events if e.kind == "B" and e.stage == 0 and e.replica == 1)
    assert b0.start == pytest.approx(E1 + 2 * MSG + 0.010, rel=1e-12)
    assert sim.iteration_time_s == pytest.approx(E1 + RING + MSG + 0.003, rel=1e-12)


def test_without_the_cap_the_sync_runs_alone() -> None:
    """No aggregate cap: the ring and the message run between different node pairs and do not share."""
    sim = simulate(_contended_plan(), _contended_instance(cap=False))
    sync = next(e for e in sim.events if e.kind == "sync" and e.stage == 1)
    assert sync.end == pytest.approx(E1 + RING, rel=1e-12)
    assert sim.iteration_time_s == pytest.approx(E1 + RING + 0.003, rel=1e-12)


# ---- the kernel [C7c] ------------------------------------------------------------------------------
def test_evaluate_prices_the_shared_cap_as_the_hand_case() -> None:
    inst, plan = _contended_instance(), _contended_plan()
    ev = evaluate(plan, inst)
    s1 = next(s for s in ev.stages if s.stage == 1)
    assert s1.last_backward_end_s == pytest.approx(E1, rel=1e-12)
    assert s1.sync_end_s == pytest.approx(E1 + RING + MSG, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(E1 + RING + MSG + 0.003, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(simulate(plan, inst).iteration_time_s, rel=1e-12)


def test_evaluate_without_the_cap_prices_the_sync_alone() -> None:
    ev = evaluate(_contended_plan(), _contended_instance(cap=False))
    assert next(s for s in ev.stages if s.stage == 1).sync_end_s == pytest.approx(E1 + RING, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(E1 + RING + 0.003, rel=1e-12)


def test_a_message_larger_than_the_ring_waits_for_it_too() -> None:
    """The hand case with 3e8 activation bytes per sample: the message is 0.3 s of the cap, one flow,
    longer than the ring's 0.140 s (0.120 s of bytes, then its 2 · 10 ms of latency, off the link).
    Forward: stage 1's b replica starts at 0.01 + 0.3 + 0.01 s and ends its backward at E_1 = 0.41 s.
    Both flows share the cap at half each until the ring's 120 MB are through, 0.240 s later; its
    latency ends the sync at 0.41 + 0.26 = 0.67 s (0.120 s late, min(message, ring bytes)). The ring
    taken as its 2 steps (60 MB, then 10 ms) gives the same: each step's bytes at half the cap, the
    message alone in the latency gaps. The message has 0.180 s left, alone: through at 0.83 s,
    arrives 0.84 s, 0.120 s late, which stage 0's replica 1 waits for: its backward ends at 0.86 s,
    then its sync inside a (one node: the intra-node ring of 40 MB among 2) and its optimizer step
    (1 ms) end the iteration."""
    from hgopt.cost.tables import allreduce_time

    topo = tiny_topology(clusters=(("a", "A", 2, 2, 80.0), ("b", "A", 2, 2, 80.0)))
    topo["links"] = {"default": {"kind": "per_flow", "per_flow": {"gbit_s": 8.0, "latency_ms": 10.0},
                                 "aggregate": {"gbit_s": 8.0}}}
    model = tiny_model(num_layers=4, gpus={"A": 0.01}, params=1e7, activation_bytes=3e8)
    inst = tiny_instance(global_batch=2, model=model, topology=topo)
    plan = _contended_plan()
    e1, late = 0.41, 0.120
    end = 0.86 + allreduce_time(inst.topology.cluster("a").intra_node, 4e7, 2) + 0.001
    sim = simulate(plan, inst)
    sync = next(e for e in sim.events if e.kind == "sync" and e.stage == 1)
    assert (sync.start, sync.end) == pytest.approx((e1, e1 + RING + late), rel=1e-12)
    assert next(s for s in sim.stages if s.stage == 0).compute_end_s == pytest.approx(0.74 + late, rel=1e-12)
    assert sim.iteration_time_s == pytest.approx(end, rel=1e-12)
    ev = evaluate(plan, inst)
    by = {s.stage: s for s in ev.stages}
    assert by[1].last_backward_end_s == pytest.approx(e1, rel=1e-12)
    assert by[1].sync_end_s == pytest.approx(e1 + RING + late, rel=1e-12)
    assert by[0].last_backward_end_s == pytest.approx(0.74 + late, rel=1e-12)
    assert ev.pipeline_time_s == pytest.approx(0.74, rel=1e-12)  # the pipeline alone, as [C3] prices it
    assert ev.iteration_time_s == pytest.approx(end, rel=1e-12)


def _without_contention(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from hgopt.cost.gradsync import bucket_schedule_starts

    mod = importlib.import_module("hgopt.cost.evaluate")
    monkeypatch.setattr(mod, "_contended_sync",
                        lambda plan, inst, tables, first, ends, buckets, rings, **kw: (ends, *bucket_schedule_starts(buckets, ends)))


def _mixed_plans() -> list[Plan]:
    """Two-stage plans whose stages span a and b in either order, 1-4 microbatches, one bucket or 5 MiB ones."""
    out = []
    for m in (1, 2, 4):
        for cut in (1, 2, 3):
            for order in (("a", "b"), ("b", "a")):
                for bucket in (5.0, 1000.0):
                    s0 = Stage(start=0, end=cut, groups=(ReplicaGroup(cluster=order[0], dp=1, mbs=1),
                                                         ReplicaGroup(cluster=order[1], dp=1, mbs=1)))
                    s1 = Stage(start=cut, end=4, groups=(ReplicaGroup(cluster=order[1], dp=1, mbs=1),
                                                         ReplicaGroup(cluster=order[0], dp=1, mbs=1)))
                    out.append(Plan(pipelines=(Pipeline(stages=(s0, s1), num_microbatches=m),), grad_bucket_mb=bucket))
    return out


@pytest.mark.parametrize("activation_bytes", [1e6, 1e7, 1e8])
def test_contention_only_raises_evaluate(activation_bytes: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """[C7c] never lowers a stage's last backward end, sync end or the iteration (so every lower bound
    of the uncontended [C7o] stays one), and it moves something on these plans."""
    topo = tiny_topology(clusters=(("a", "A", 2, 2, 80.0), ("b", "A", 2, 2, 80.0)))
    topo["links"] = {"default": {"kind": "per_flow", "per_flow": {"gbit_s": 8.0, "latency_ms": 10.0},
                                 "aggregate": {"gbit_s": 8.0}}}
    model = tiny_model(num_layers=4, gpus={"A": 0.01}, params=1e7, activation_bytes=activation_bytes)
    moved = 0
    plans = _mixed_plans()
    with_c = {}
    for plan in plans:
        inst = tiny_instance(global_batch=2 * plan.pipelines[0].num_microbatches, model=model, topology=topo)
        with_c[plan] = (inst, evaluate(plan, inst))
    _without_contention(monkeypatch)
    for plan in plans:
        inst, ev = with_c[plan]
        base = evaluate(plan, inst)
        assert ev.iteration_time_s >= base.iteration_time_s - 1e-12
        assert ev.pipeline_time_s == base.pipeline_time_s
        for s, b in zip(ev.stages, base.stages):
            assert s.last_backward_end_s >= b.last_backward_end_s - 1e-12
            assert s.sync_end_s >= b.sync_end_s - 1e-12
        moved += ev.iteration_time_s > base.iteration_time_s + 1e-9
    assert moved > 0


GEO3R_UNIFORM = {  # bench/cost_fidelity_plans.json "geo-3r-gpt1.3b uniform 5" (round 6), frozen here
    "grad_bucket_mb": 2706.0, "grad_sync_precision": "native", "instance": "geo-3r-gpt1.3b", "overlap_grad_sync": True,
    "planner": "uniform", "version": 1,
    "pipelines": [{"boundaries": [], "num_microbatches": 2, "schedule": "1f1b", "stages": [
        {"groups": [{"cluster": "us-east-h100-80", "dp": 16, "mbs": 8, "tp": 1},
                    {"cluster": "eu-west-a100-80", "dp": 16, "mbs": 8, "tp": 1}], "layers": [0, 13], "zero": 0},
        {"groups": [{"cluster": "eu-west-a100-80", "dp": 16, "mbs": 8, "tp": 1},
                    {"cluster": "ap-northeast-a100-40", "dp": 16, "mbs": 8, "tp": 1}], "layers": [13, 26], "zero": 0}]}]}


def test_geo3r_uniform_sync_is_priced_with_the_send_it_shares_the_link_with() -> None:
    """The round-6 case (bench/RESULTS.md, cost fidelity): stage 1's ring over eu-west <-> ap-northeast
    (2 Gbit/s, aggregate = per flow) shares the pair with the last backward message (16 flows, 4.3 s);
    simulate 19.52 s, evaluate 17.04 s before [C7c]. With the exact pipeline replay under it, evaluate
    is within 0.5 % of the simulator; stage 1's sync runs > 9 s past its last backward in both."""
    from hgopt.instances import load_instance

    inst = load_instance("geo-3r-gpt1.3b")
    plan = Plan.from_dict(GEO3R_UNIFORM)
    sim = simulate(plan, inst)
    ev = evaluate(plan, inst, pipeline="replay")
    assert sim.iteration_time_s / ev.iteration_time_s == pytest.approx(1.0, abs=0.005)
    s1 = next(s for s in ev.stages if s.stage == 1)
    assert s1.sync_end_s - s1.last_backward_end_s > 9.0
    sim1 = next(s for s in sim.stages if s.stage == 1)
    assert sim1.sync_end_s - sim1.compute_end_s > 9.0


def test_an_earlier_backward_message_shares_the_cap_with_an_early_bucket() -> None:
    """Beyond the last microbatch: m = 2, stage 0 = layer 0 on a and b, stage 1 = layers 1-3 on b and
    a (one replica each, row 0 / row 1), 1e8 activation bytes per sample (each backward message 100
    MB, 0.1 s of the 1 GB/s cap), 40 MB of gradients per layer in 5 MiB buckets (one layer each: ring
    0.04 s of bytes + 0.02 s of latency), overlap on. Stage 1's backward of microbatch 0 ends at 0.21
    s and its message runs alone until 0.27 s (60 MB), when stage 1's first bucket (layer 3, ready a
    third into its last backward, 0.25 .. 0.31 s) starts: both at half the cap, the message's last
    40 MB and the ring's 40 MB are through at 0.35 s, the ring ends at 0.37 s. The last message
    (ready at E_1 = 0.31 s) leaves after the first, at 0.35 s: 20 MB alone until bucket 2 starts at
    0.37 s, 40 MB with it until 0.45 s, 20 MB alone during its latency, the last 20 MB with bucket 3
    (from 0.47 s) until 0.51 s; bucket 3's other 20 MB alone, its latency: stage 1's sync ends at
    0.55 s. The message arrives at 0.52 s (uncontended 0.42 s): stage 0's last backward 0.52 .. 0.54
    s, its ring (40 MB, alone) to 0.60 s, its optimizer step (1 ms) to 0.601 s. Counting only the last
    message on the cap, evaluate said 0.561 s."""
    inst, plan = _crossed_pair_on_a_cap(activation_bytes=1e8, cut=1)
    sim = simulate(plan, inst)
    syncs = sorted(t for e in sim.events if e.kind == "sync" and e.stage == 1 for t in (e.start, e.end))
    assert syncs == pytest.approx([0.27, 0.37, 0.37, 0.47, 0.47, 0.55], rel=1e-12)
    first = next(e for e in sim.events if e.kind == "sendB" and e.microbatch == 0 and e.replica == 0)
    last = next(e for e in sim.events if e.kind == "sendB" and e.microbatch == 1 and e.replica == 0)
    assert (first.start, first.end, last.start, last.end) == pytest.approx((0.21, 0.36, 0.35, 0.52), rel=1e-12)
    assert sim.iteration_time_s == pytest.approx(0.601, rel=1e-12)
    for mode in ("closed", "replay"):
        ev = evaluate(plan, inst, pipeline=mode)  # type: ignore[arg-type]
        by = {s.stage: s for s in ev.stages}
        assert by[1].last_backward_end_s == pytest.approx(0.31, rel=1e-12)
        assert by[1].sync_end_s == pytest.approx(0.55, rel=1e-12)
        assert by[0].last_backward_end_s == pytest.approx(0.54, rel=1e-12)
        assert ev.iteration_time_s == pytest.approx(0.601, rel=1e-12)


def test_a_receiver_that_did_not_wait_for_the_message_does_not_move() -> None:
    """m = 2, stage 0 = layers 0-2, stage 1 = layer 3 (both on a and b), 1e7 activation bytes (10 MB
    messages), 5 MiB buckets. Stage 1's last backward ends at E_1 = 0.11 s and its one bucket (40
    MB) starts with the last message: the message's 10 MB at half the cap, through at 0.13 s, arrives
    at 0.14 s (0.01 s late). Stage 0 is still busy with microbatch 0's backward (0.10 .. 0.16 s), so
    its last backward starts at 0.16 s either way: E_0 stays 0.22 s (moving it by the whole delay
    gave 0.23 s)."""
    inst, plan = _crossed_pair_on_a_cap(activation_bytes=1e7, cut=3)
    sim = simulate(plan, inst)
    last = next(e for e in sim.events if e.kind == "sendB" and e.microbatch == 1 and e.replica == 0)
    assert (last.start, last.end) == pytest.approx((0.11, 0.14), rel=1e-12)
    assert next(s for s in sim.stages if s.stage == 0).compute_end_s == pytest.approx(0.22, rel=1e-12)
    ev = evaluate(plan, inst, pipeline="replay")
    by = {s.stage: s for s in ev.stages}
    assert by[0].last_backward_end_s == pytest.approx(0.22, rel=1e-12)
    assert ev.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=1e-12)


def _crossed_pair_on_a_cap(activation_bytes: float, cut: int) -> tuple[object, Plan]:
    """Two clusters a, b (2 nodes x 2 GPUs) joined by an 8 Gbit/s per-flow link with an 8 Gbit/s cap and 10 ms;
    4 layers of 0.01 s, 1e7 parameters; one 2-microbatch pipeline whose stages [0, cut) and [cut, 4) each have a
    replica on a and on b (so its boundary messages and both stages' rings cross the cap); 5 MiB buckets."""
    topo = tiny_topology(clusters=(("a", "A", 2, 2, 80.0), ("b", "A", 2, 2, 80.0)))
    topo["links"] = {"default": {"kind": "per_flow", "per_flow": {"gbit_s": 8.0, "latency_ms": 10.0},
                                 "aggregate": {"gbit_s": 8.0}}}
    model = tiny_model(num_layers=4, gpus={"A": 0.01}, params=1e7, activation_bytes=activation_bytes)
    inst = tiny_instance(global_batch=4, model=model, topology=topo)
    s0 = Stage(start=0, end=cut, groups=(ReplicaGroup(cluster="a", dp=1, mbs=1), ReplicaGroup(cluster="b", dp=1, mbs=1)))
    s1 = Stage(start=cut, end=4, groups=(ReplicaGroup(cluster="b", dp=1, mbs=1), ReplicaGroup(cluster="a", dp=1, mbs=1)))
    return inst, Plan(pipelines=(Pipeline(stages=(s0, s1), num_microbatches=2),), grad_bucket_mb=5.0)
