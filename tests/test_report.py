"""The timeline the pictures draw (from ``hgopt.simulate``) and the pictures."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.report import plot_comparison, plot_timeline, timeline_ops
from tests.factories import tiny_instance, tiny_model, tiny_topology


def _chain(S: int, m: int, activation_bytes: float = 1e-3, wan_gbit_s: float = 8.0) -> tuple[Plan, object]:
    """S one-layer, one-GPU stages (mbs 1) alternating between clusters a (GPU A: forward 0.01 s,
    backward 0.02 s) and b (GPU B: 0.02 s, 0.04 s), m microbatches; by default 1e-3 activation bytes
    per sample: transfers of ~1e-14 s."""
    inst = tiny_instance(global_batch=m, model=tiny_model(num_layers=S, activation_bytes=activation_bytes),
                         topology=tiny_topology(clusters=(("a", "A", 1, 4, 40.0), ("b", "B", 1, 4, 40.0)),
                                                wan_gbit_s=wan_gbit_s))
    stages = tuple(Stage(start=s, end=s + 1, groups=(ReplicaGroup(cluster="ab"[s % 2]),)) for s in range(S))
    return Plan(pipelines=(Pipeline(stages=stages, num_microbatches=m),)), inst


@pytest.mark.parametrize("S,m", [(1, 1), (1, 5), (3, 4), (4, 2), (4, 8)])
def test_equal_stages_without_transfers_take_the_textbook_time(S: int, m: int) -> None:
    """The drawn timeline of S stages all on cluster b's node (f + b = 0.06 s) with negligible
    transfers ends its compute at the 1F1B textbook time (m − 1)(f + b) + S(f + b)."""
    plan, inst = _chain(S, m)
    plan = Plan(pipelines=(Pipeline(stages=tuple(Stage(start=st.start, end=st.end, groups=(ReplicaGroup(cluster="b"),))
                                                 for st in plan.pipelines[0].stages), num_microbatches=m),))
    ops = timeline_ops(plan, inst)  # type: ignore[arg-type]
    assert len([o for o in ops if o.kind in ("F", "B")]) == 2 * S * m
    assert max(o.end for o in ops if o.kind in ("F", "B")) == pytest.approx((m - 1) * 0.06 + S * 0.06, abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from([1e-3, 1e6, 2e7]), st.sampled_from([0.5, 8.0, 100.0]))
def test_drawn_schedule_respects_dependencies(S: int, m: int, act: float, wan: float) -> None:
    """The boxes ``plot_timeline`` draws (``timeline_ops``, from ``simulate``) keep 1F1B's order on
    a chain crossing slow or fast WAN links: a forward after its input's transfer, a backward after
    its own forward and the gradient's transfer, one compute op at a time per stage, at most S − s
    forwards in flight."""
    plan, inst = _chain(S, m, activation_bytes=act, wan_gbit_s=wan)
    ops = timeline_ops(plan, inst)  # type: ignore[arg-type]
    end = {(o.kind, o.stage, o.microbatch): o.end for o in ops if o.kind != "sync" and o.kind != "optimizer"}
    start = {(o.kind, o.stage, o.microbatch): o.start for o in ops if o.kind in ("F", "B")}
    assert len(start) == 2 * S * m
    for s in range(S):
        for i in range(m):
            if s > 0:  # forward input = previous stage's output after its transfer
                assert start[("F", s, i)] >= end[("F", s - 1, i)] - 1e-12
                assert start[("F", s, i)] >= end.get(("sendF", s - 1, i), 0.0) - 1e-12
            if s < S - 1:
                assert start[("B", s, i)] >= end[("B", s + 1, i)] - 1e-12
                assert start[("B", s, i)] >= end.get(("sendB", s + 1, i), 0.0) - 1e-12
            assert start[("B", s, i)] >= end[("F", s, i)] - 1e-12
        own = sorted((o.start, o.end) for o in ops if o.stage == s and o.kind in ("F", "B"))
        assert all(a[1] <= b_[0] + 1e-12 for a, b_ in zip(own, own[1:]))  # one operation at a time
        for o in ops:  # 1F1B keeps at most S − s forwards in flight
            if o.kind == "F" and o.stage == s:
                done_b = sum(1 for p in ops if p.kind == "B" and p.stage == s and p.end <= o.start + 1e-12)
                assert o.microbatch - done_b < S - s
    if S > 1:  # the transfers are drawn
        assert any(o.kind == "sendF" for o in ops) and any(o.kind == "sendB" for o in ops)


def _plan() -> tuple[Plan, object]:
    inst = tiny_instance(global_batch=16, model=tiny_model(num_layers=6), topology=tiny_topology(wan_gbit_s=1.0))
    plan = Plan(pipelines=(Pipeline(stages=(
        Stage(start=0, end=4, groups=(ReplicaGroup(cluster="a", dp=2),)),
        Stage(start=4, end=6, groups=(ReplicaGroup(cluster="b", dp=2),))), num_microbatches=8),))
    return plan, inst


def test_plot_timeline_writes_a_png(tmp_path: Path) -> None:
    plan, inst = _plan()
    out = plot_timeline(plan, inst, tmp_path / "t.png")  # type: ignore[arg-type]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_refuses_an_invalid_plan(tmp_path: Path) -> None:
    plan, inst = _plan()
    bad = Plan(pipelines=(Pipeline(stages=plan.pipelines[0].stages, num_microbatches=3),))
    with pytest.raises(ValueError, match="global batch"):
        plot_timeline(bad, inst, tmp_path / "t.png")  # type: ignore[arg-type]


def test_plot_comparison_writes_a_png(tmp_path: Path) -> None:
    out = plot_comparison("x", [("a", 1.0), ("b", 2.5)], tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
