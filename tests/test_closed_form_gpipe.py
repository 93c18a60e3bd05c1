"""[C3s] for GPipe: a GPipe pipeline with a stage whose replicas span clusters is replayed replica by
replica, piece by piece (``evaluate.piece_timeline``, the runner's GPipe order: every forward, then
every backward), as the 1F1B ones are (tests/test_spanning.py, whose instance and plan this reuses)."""

from __future__ import annotations

import dataclasses

import pytest

from hgopt.cost import evaluate
from hgopt.cost.evaluate import spans_clusters
from hgopt.plan import Plan
from hgopt.simulate import simulate
from hgopt.spec import Instance
from tests.factories import tiny_instance
from tests.test_spanning import _spanning_plan, _three_regions


def _gpipe(plan: Plan) -> Plan:
    return Plan(pipelines=tuple(dataclasses.replace(p, schedule="gpipe") for p in plan.pipelines))


def _instance(samples: int, cap: float | None = None) -> Instance:
    return tiny_instance(global_batch=samples, topology=_three_regions(cap_gbit_s=cap))


def test_gpipe_spanning_hand_computed() -> None:
    """m = 3. Stage 0: one replica on a (A, 2 samples): f 0.04, b 0.08. Stage 1: replica b (B, 1 sample)
    f 0.04, b 0.08, its piece 0.001 s transfer + 10 ms each way; replica c (A, 1 sample) f 0.02, b 0.04,
    its piece 0.010 + 0.010 s (tests/test_spanning.py). GPipe: F0 F1 F2 B0 B1 B2 everywhere.
    Stage 0: F0 0-.04, F1 -.08, F2 -.12. b gets F0 .051, F1 .091, F2 .131: F0 .051-.091, F1 -.131,
    F2 -.171, B0 -.251, B1 -.331, B2 -.411; its gradients arrive .262, .342, .422. c gets F0 .060, F1
    .100, F2 .140: F0 .06-.08, F1 .10-.12, F2 .14-.16, B0 -.20, B1 -.24, B2 -.28; arrive .22, .26, .30.
    Stage 0: B0 .262-.342, B1 .342-.422, B2 .422-.502: 0.502 s. The stage-level GPipe form (slowest
    replica 0.04/0.08, slowest piece 0.020 s): (m − 1)·(0.04 + 0.08) + 0.12 + 0.12 + 0.04 = 0.52 s."""
    inst = _instance(6)
    plan = _gpipe(_spanning_plan(3))
    assert spans_clusters(plan.pipelines[0])
    for mode in ("closed", "replay"):
        assert evaluate(plan, inst, pipeline=mode).pipeline_time_s == pytest.approx(0.502, rel=1e-9)  # type: ignore[arg-type]
    sim = simulate(plan, inst)
    assert sim.pipeline_time_s == pytest.approx(0.502, rel=1e-9)
    # the order matters: 1F1B on the same plan ends elsewhere
    assert evaluate(_spanning_plan(3), inst).pipeline_time_s != pytest.approx(0.502, rel=1e-6)


@pytest.mark.parametrize("m,first_dp,first_mbs,cap", [(2, 1, 4, None), (4, 2, 2, None), (5, 2, 3, None),
                                                      (4, 1, 4, 1.6), (6, 2, 2, 1.2)])
def test_gpipe_spanning_equals_the_simulator(m: int, first_dp: int, first_mbs: int, cap: float | None) -> None:
    """As tests/test_spanning.py's 1F1B cases, in GPipe order: the pipeline part, every stage's last
    backward and the iteration (nothing contends with the sync) agree with the simulator."""
    inst = _instance(first_dp * first_mbs * m, cap)
    plan = _gpipe(_spanning_plan(m, first_dp, first_mbs))
    sim = simulate(plan, inst)
    ev = evaluate(plan, inst)
    assert ev.pipeline_time_s == pytest.approx(sim.pipeline_time_s, rel=1e-9)
    assert [s.last_backward_end_s for s in ev.stages] == pytest.approx([s.compute_end_s for s in sim.stages], rel=1e-9)
    assert ev.iteration_time_s == pytest.approx(sim.iteration_time_s, rel=1e-9)
