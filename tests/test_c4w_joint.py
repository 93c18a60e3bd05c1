"""[C4j] Different pipelines sharing a capped link direction are replayed in one timeline
(``hgopt/cost/joint.py``, ``evaluate._joint_ends``), not priced as if all their messages crossed the cap
at once ([C4w]'s shared load; issue #10 items 2/4, the runner's plan (b): evaluate +21 %).

Instance: clusters a and b of four one-GPU nodes of GPU A (forward 0.01·mbs s per layer, backward twice
that), 1e6 activation bytes per sample, a per-flow 8 Gbit/s (1 GB/s) link and an
aggregate cap per direction; parameters of 1e-3 bytes and no link latency, so the gradient rings
(whose latency steps hold a share of the cap in the simulator) do not load it: the [C7c] ring/message
sharing is not what these tests are about."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hgopt.cost import evaluate
from hgopt.cost.evaluate import _wan_loads
from hgopt.cost.joint import capped_groups
from hgopt.cost.tables import build_tables
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.simulate import simulate
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology


def _inst(cap_gbit_s: float, batch: int) -> Instance:
    topo = tiny_topology(clusters=(("a", "A", 4, 1, 40.0), ("b", "A", 4, 1, 40.0)))
    topo["links"]["default"] = {"kind": "per_flow", "per_flow": {"gbit_s": 8.0, "latency_ms": 0.0},
                                "aggregate": {"gbit_s": cap_gbit_s}}
    return tiny_instance(global_batch=batch, topology=topo, model=tiny_model(params=1e-3))


def _pipe(c0: str, c1: str, m: int, mbs: int = 2, cut: int = 2) -> Pipeline:
    return Pipeline(stages=(Stage(start=0, end=cut, groups=(ReplicaGroup(cluster=c0, mbs=mbs),)),
                            Stage(start=cut, end=4, groups=(ReplicaGroup(cluster=c1, mbs=mbs),))),
                    num_microbatches=m)


def _stage_ends(sim: object, pi: int, stages: int) -> list[float]:
    return [max(e.end for e in sim.events if e.kind == "B" and e.pipeline == pi and e.stage == s)  # type: ignore[attr-defined]
            for s in range(stages)]


def test_opposite_pipelines_on_one_cap_by_hand() -> None:
    """a|b and b|a, m = 1, cap 0.4 Gbit/s = 0.05 GB/s. Stage forward 2 layers · 0.02 = 0.04 s, backward
    0.08 s; a message is 2e6 bytes: alone on the cap 40 ms. On a -> b pipeline 0's forward leaves at
    0.04 s and pipeline 1's backward at 0.04 + 0.04 + 0.04 + 0.08 = 0.20 s: they never share the cap,
    so each pipeline takes 0.04 + 0.04 + 0.04 + 0.08 + 0.04 + 0.08 = 0.32 s. [C4w]'s shared load (4e6
    bytes a message, 80 ms) said 0.40 s."""
    inst = _inst(0.4, 4)
    plan = Plan(pipelines=(_pipe("a", "b", 1), _pipe("b", "a", 1)))
    for mode in ("closed", "replay"):
        ev = evaluate(plan, inst, pipeline=mode)  # type: ignore[arg-type]
        assert [p.time_s for p in ev.pipelines] == pytest.approx([0.32, 0.32], rel=1e-12)
    sim = simulate(plan, inst)
    assert _stage_ends(sim, 0, 2) == pytest.approx([0.32, 0.20], rel=1e-9)  # the 4e-3-byte ring shares the cap: 1e-10 s


def test_identical_copies_keep_the_shared_load() -> None:
    """Two identical pipelines a|b move in lock step: [C4w]'s shared load is their timeline (both
    forwards cross at once: 4e6 bytes at 0.05 GB/s = 80 ms); no joint replay is needed."""
    inst = _inst(0.4, 4)
    plan = Plan(pipelines=(_pipe("a", "b", 1), _pipe("a", "b", 1)))
    ev = evaluate(plan, inst)
    assert ev.stages[0].send_fwd_s == pytest.approx(0.08, rel=1e-12)
    assert ev.pipelines[0].time_s == pytest.approx(0.04 + 0.08 + 0.04 + 0.08 + 0.08 + 0.08, rel=1e-12)


@pytest.mark.parametrize("cap", [0.4, 0.8, 4.0])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("other", ["opposite", "same-direction"])
def test_joint_timeline_equals_the_simulator(cap: float, m: int, other: str) -> None:
    """The replay of both pipelines in one timeline is the simulator's point-to-point model: stage by
    stage the last backward ends agree to 1e-9 (``pipeline="replay"``), for pipelines in opposite
    directions and for two different pipelines a|b whose forwards share a -> b at overlapping times
    (mbs 2 and mbs 1: processor sharing of the cap)."""
    second = _pipe("b", "a", m) if other == "opposite" else _pipe("a", "b", m, mbs=1, cut=1)
    plan = Plan(pipelines=(_pipe("a", "b", m), second))
    inst = _inst(cap, sum(p.num_microbatches * p.microbatch for p in plan.pipelines))
    ev, sim = evaluate(plan, inst, pipeline="replay"), simulate(plan, inst)
    for pi, rep in enumerate(ev.pipelines):
        assert list(rep.stage_ends) == pytest.approx(_stage_ends(sim, pi, 2), rel=1e-9)


def test_groups_are_the_pipelines_connected_by_a_shared_cap() -> None:
    loads = [{("a", "b"): 1.0}, {("b", "c"): 2.0}, {("a", "b"): 3.0, ("c", "d"): 1.0}, {("c", "d"): 1.0},
             {("e", "f"): 1.0}, {("e", "f"): 0.0}]
    capped = {("a", "b"), ("c", "d"), ("e", "f")}
    assert sorted(capped_groups(loads, capped)) == [[0, 2, 3]]
    assert capped_groups(loads, set()) == []


@settings(max_examples=25, deadline=None)
@given(m0=st.integers(1, 5), m1=st.integers(1, 5), mbs0=st.sampled_from([1, 2, 4]), mbs1=st.sampled_from([1, 2, 4]),
       cut0=st.integers(1, 3), cut1=st.integers(1, 3), cap=st.sampled_from([0.2, 0.5, 1.0, 3.0]),
       flip=st.booleans(), mode=st.sampled_from(["closed", "replay"]))
def test_evaluate_is_never_below_the_cap_occupancy_nor_the_simulator(
        m0: int, m1: int, mbs0: int, mbs1: int, cut0: int, cut1: int, cap: float, flip: bool, mode: str) -> None:
    """Floors every evaluate must respect: each capped direction carries all microbatches' bytes of
    every pipeline before the last pipeline ends (Σ_p m_p·X_p / cap), and the simulator's exact
    point-to-point timeline (stage by stage) where the rings carry nothing."""
    p0 = _pipe("a", "b", m0, mbs0, cut0)
    p1 = _pipe("b", "a", m1, mbs1, cut1) if flip else _pipe("a", "b", m1, mbs1, cut1)
    plan = Plan(pipelines=(p0, p1))
    inst = _inst(cap, m0 * mbs0 + m1 * mbs1)
    ev = evaluate(plan, inst, pipeline=mode)  # type: ignore[arg-type]
    tables = build_tables(inst)
    rate = cap * 1e9 / 8
    for d in (("a", "b"), ("b", "a")):
        occupancy = sum(p.num_microbatches * _wan_loads(inst, tables, (p,)).get(d, 0.0) for p in plan.pipelines) / rate
        assert ev.pipeline_time_s >= occupancy * (1 - 1e-12)
    sim = simulate(plan, inst)
    for pi, rep in enumerate(ev.pipelines):
        ends = list(rep.stage_ends) or [rep.time_s]
        assert ends[0] >= _stage_ends(sim, pi, 2)[0] * (1 - 1e-9)
