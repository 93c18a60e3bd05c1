"""[C5w] moment by moment: gradient rings share a capped link only while they run at the same time.

Hand cases: clusters a and b (2-GPU nodes, A GPUs: forward 0.01 s per layer and sample, backward 0.02
s), link a <-> b 1 GB/s per flow (8 Gbit/s) with 10 ms latency, capped per direction; 4 layers of
``params`` fp32 parameters, 1e3 activation bytes per sample. Two identical pipelines of one replica
per stage, one in a and one in b, cut alike: every sync segment is one stage's layers, held by one
replica in a and one in b, so each is a ring over {a, b} (k = 2: alone x / BW + 2·10 ms, [C5]; no ring
inside a cluster), one bucket per segment (``grad_bucket_mb`` 1e5). The boundaries stay inside a
cluster, so only the rings use the capped link. Stage s's ring starts when its last backward ends,
E_s (read from ``evaluate``: the pipeline, which these tests do not check, is about 0.08 / 0.10 /
0.12 s for three stages). Under processor sharing each of n concurrent rings gets the cap / n, at most
its per-flow rate; its 2·10 ms of latency follow its bytes, off the link. Every case is also run by
the simulator, to 1e-9.
"""

from __future__ import annotations

import pytest

from hgopt.cost import evaluate
from hgopt.cost.sharing import CapFlow, FluidLinks
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.simulate import simulate
from hgopt.spec import Bandwidth, Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology

LAT = 0.02  # the ring's 2(k - 1) = 2 hops of 10 ms


def _instance(per_flow_gbit: float = 8.0, cap_gbit: float = 8.0, params: float = 1e8,
              latency_ms: float = 10.0) -> Instance:
    topo = tiny_topology(clusters=(("a", "A", 2, 2, 80.0), ("b", "A", 2, 2, 80.0)))
    topo["links"] = {"default": {"kind": "per_flow", "per_flow": {"gbit_s": per_flow_gbit, "latency_ms": latency_ms},
                                 "aggregate": {"gbit_s": cap_gbit}}}
    model = tiny_model(num_layers=4, gpus={"A": 0.01}, params=params, activation_bytes=1e3)
    return tiny_instance(global_batch=2, model=model, topology=topo)


def _plan(cuts: tuple[int, ...]) -> Plan:
    b = [0, *cuts, 4]
    pipes = tuple(Pipeline(stages=tuple(Stage(start=x, end=y, groups=(ReplicaGroup(cluster=c, dp=1, mbs=1),))
                                        for x, y in zip(b, b[1:])), num_microbatches=1) for c in "ab")
    return Plan(pipelines=pipes, grad_bucket_mb=1e5)


def _ends(plan: Plan, inst: Instance) -> tuple[list[float], list[float], float, float]:
    """(E_s, sync end per stage of pipeline 0 by evaluate; iteration by evaluate, by the simulator),
    after checking that both pipelines agree and that the simulator's every stage agrees."""
    ev, sim = evaluate(plan, inst), simulate(plan, inst)
    n = len(plan.pipelines[0].stages)
    by = {(r.pipeline, r.stage): r for r in ev.stages}
    for r, q in zip(ev.stages, sim.stages):
        assert (r.pipeline, r.stage) == (q.pipeline, q.stage)
        assert q.compute_end_s == pytest.approx(r.last_backward_end_s, rel=1e-9)
        assert q.sync_end_s == pytest.approx(r.sync_end_s, rel=1e-9)
        assert by[(1 - r.pipeline, r.stage)].sync_end_s == pytest.approx(r.sync_end_s, rel=1e-12)
    return ([by[(0, s)].last_backward_end_s for s in range(n)], [by[(0, s)].sync_end_s for s in range(n)],
            ev.iteration_time_s, sim.iteration_time_s)


def test_three_rings_share_the_cap_only_while_they_overlap() -> None:
    """Stages [0, 1), [1, 2), [2, 4): rings of 0.4, 0.4, 0.8 GB (cap-seconds at 1 GB/s) from E_0 > E_1 >
    E_2. Ring 2 runs alone until E_1, with ring 1 at half the cap until E_0, then the three at a third:
    ring 1 has r1 = 0.4 − (E_0 − E_1)/2 left and ends first, 3·r1 later; ring 0 (0.4 − r1 left) then
    shares with ring 2 at half: 2·(0.4 − r1); ring 2 ends alone with r2 − 0.4 left, r2 = 0.8 − (E_1 −
    E_2) − (E_0 − E_1)/2. Each then pays its latency. The cap never idles: the last ring's bytes end
    at E_2 + 1.6 s. (The former [C5w] floor had every stage wait for all 1.6 GB from its own start:
    stage 0 at E_0 + 1.6 + 0.02 s = 1.74 s against 1.33 s here.)"""
    inst, plan = _instance(), _plan((1, 2))
    (e0, e1, e2), (s0, s1, s2), t_ev, t_sim = _ends(plan, inst)
    assert e2 < e1 < e0
    r1 = 0.4 - (e0 - e1) / 2
    r2 = 0.8 - (e1 - e2) - (e0 - e1) / 2
    assert s1 == pytest.approx(e0 + 3 * r1 + LAT, rel=1e-9)
    assert s0 == pytest.approx(e0 + 3 * r1 + 2 * (0.4 - r1) + LAT, rel=1e-9)
    assert s2 == pytest.approx(e0 + r1 + 0.8 + (r2 - 0.4) + LAT, rel=1e-9)
    assert s2 == pytest.approx(e2 + 1.6 + LAT, rel=1e-9)
    assert t_ev == pytest.approx(s2 + 0.002, rel=1e-9)  # stage 2's optimizer step: 2 layers of 1 ms
    assert t_sim == pytest.approx(t_ev, rel=1e-9)


def test_a_cap_of_two_flows_slows_only_the_third_ring() -> None:
    """The same three rings with 0.5 GB/s per flow under the 1 GB/s cap (min(n·per_flow, aggregate)):
    one or two rings run at their per-flow 0.5 GB/s, three at 1/3 GB/s each. In GB: ring 2 does 0.01
    alone until E_1 (E_1 − E_2 = 0.02 s), rings 2 and 1 0.01 each until E_0; then at a third ring 1
    (0.39 left) ends 3·0.39 s later, ring 0 (0.01 left) at half the cap but its per-flow 0.5 GB/s,
    0.02 s more, and ring 2 (0.38 left) alone at 0.5 GB/s: 0.76 s."""
    inst, plan = _instance(per_flow_gbit=4.0), _plan((1, 2))
    (e0, e1, e2), (s0, s1, s2), _, _ = _ends(plan, inst)
    assert e1 - e2 == pytest.approx(0.02, abs=1e-6) and e0 - e1 == pytest.approx(0.02, abs=1e-6)
    x1 = 0.4 - 0.5 * (e0 - e1)  # GB each ring has left at E_0
    x0 = 0.4
    x2 = 0.8 - 0.5 * (e1 - e2) - 0.5 * (e0 - e1)
    t1 = 3 * x1  # at 1/3 GB/s
    left0, left2 = x0 - x1, x2 - x1
    t0 = left0 / 0.5
    assert s1 == pytest.approx(e0 + t1 + LAT, rel=1e-9)
    assert s0 == pytest.approx(e0 + t1 + t0 + LAT, rel=1e-9)
    assert s2 == pytest.approx(e0 + t1 + t0 + (left2 - left0) / 0.5 + LAT, rel=1e-9)


def test_two_rings_under_a_cap_of_two_flows_run_as_alone() -> None:
    """Stages [0, 2), [2, 4) (0.8 GB each) at 0.5 GB/s per flow under a 1 GB/s cap: together they fill
    the cap exactly, so each takes its time alone, 0.8 / 0.5 + 0.02 s (the former floor's
    1.6 GB / 1 GB/s from the first start was below that, and did not bind)."""
    inst, plan = _instance(per_flow_gbit=4.0), _plan((2,))
    (e0, e1), (s0, s1), _, _ = _ends(plan, inst)
    assert s0 == pytest.approx(e0 + 1.6 + LAT, rel=1e-9)
    assert s1 == pytest.approx(e1 + 1.6 + LAT, rel=1e-9)


def test_rings_that_do_not_overlap_do_not_share() -> None:
    """Small gradients (1e6 parameters a layer), no latency: stage 1's ring of 12 MB runs E_1 .. E_1 +
    0.012 s, before stage 0's (4 MB) starts at E_0 = E_1 + 0.02 s: each takes its time alone. The
    former floor priced stage 0 at E_0 + 16 MB / 1 GB/s = E_0 + 0.016 s."""
    inst, plan = _instance(params=1e6, latency_ms=0.0), _plan((1,))
    (e0, e1), (s0, s1), t_ev, t_sim = _ends(plan, inst)
    assert e1 + 0.012 < e0
    assert s1 == pytest.approx(e1 + 0.012, rel=1e-9)
    assert s0 == pytest.approx(e0 + 0.004, rel=1e-9)
    assert t_sim == pytest.approx(t_ev, rel=1e-9)


@pytest.mark.parametrize("per_flow_gbit", [8.0, 4.0, 2.0])
@pytest.mark.parametrize("cuts", [(1,), (2,), (3,), (1, 2), (1, 3), (2, 3)])
def test_the_cap_carries_every_ring(per_flow_gbit: float, cuts: tuple[int, ...]) -> None:
    """The physical floor the grouped bound [G6](a) (``master.gradient_floor``) rests on: the capped
    direction carries every segment's ring within the iteration, T >= Σ_seg 2(k − 1)/k · bytes / cap
    (here the whole model's 1.6 GB at 1 GB/s), whether or not the rings overlap; and each stage's sync
    ends no earlier than its ring alone ([C5])."""
    inst, plan = _instance(per_flow_gbit=per_flow_gbit), _plan(cuts)
    es, ss, t_ev, t_sim = _ends(plan, inst)
    assert t_ev >= 1.6
    b = [0, *cuts, 4]
    for e, s, (x, y) in zip(es, ss, zip(b, b[1:])):
        alone = (y - x) * 0.4 / (per_flow_gbit / 8) + LAT
        assert s >= e + alone - 1e-12


def test_fluid_links_by_hand() -> None:
    """Two flows on one 1 GB/s cap: 0.2 GB with no own limit from t = 0, 0.3 GB at most 0.25 GB/s from
    t = 0.1. The first runs alone until 0.1 (0.1 GB done); then the second is held by its own 0.25
    GB/s and the first gets only the equal share, 0.5 GB/s (the simulator's rule: each of n flows at
    most cap / n, no redistribution): 0.1 GB more take 0.2 s, done at 0.3; the second has 0.3 − 0.05
    = 0.25 GB left, alone at its 0.25 GB/s: 1.0 s, done at 1.3."""
    cap = {"d": Bandwidth(gbyte_s=1.0)}
    fl = FluidLinks(cap)
    got: dict[str, float] = {}
    fl.at(0.0, lambda: fl.start(CapFlow(nbytes=0.2e9, limit=float("inf"), dirs=("d",)), lambda t: got.__setitem__("a", t)))
    fl.at(0.1, lambda: fl.start(CapFlow(nbytes=0.3e9, limit=0.25e9, dirs=("d",)), lambda t: got.__setitem__("b", t)))
    fl.run()
    assert got["a"] == pytest.approx(0.3, rel=1e-12)
    assert got["b"] == pytest.approx(1.3, rel=1e-12)
    # a message of 4 equal flows counts 4 times in the share: with one ring flow each gets 1/5
    fl = FluidLinks(cap)
    fl.at(0.0, lambda: fl.start(CapFlow(nbytes=0.1e9, limit=float("inf"), dirs=("d",), flows=4),
                                lambda t: got.__setitem__("m", t)))
    fl.at(0.0, lambda: fl.start(CapFlow(nbytes=1.0e9, limit=float("inf"), dirs=("d",)), lambda t: got.__setitem__("r", t)))
    fl.run()
    assert got["m"] == pytest.approx(0.5, rel=1e-12)  # 0.1 GB at 0.2 GB/s
    assert got["r"] == pytest.approx(0.5 + 0.9, rel=1e-12)  # 0.1 GB by then, 0.9 alone
