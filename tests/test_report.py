"""The 1F1B timeline simulation and the pictures."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.report import plot_comparison, plot_timeline, simulate_1f1b
from tests.factories import tiny_instance, tiny_model, tiny_topology


@pytest.mark.parametrize("S,m", [(1, 1), (1, 5), (3, 4), (4, 2), (4, 8)])
def test_equal_stages_without_transfers_take_the_textbook_time(S: int, m: int) -> None:
    """1F1B with S equal stages of f + b: (m − 1)(f + b) + S(f + b)."""
    ops = simulate_1f1b([1.0] * S, [2.0] * S, [0.0] * S, [0.0] * S, m)
    assert max(o.end for o in ops) == pytest.approx((m - 1) * 3.0 + S * 3.0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.1, 2.0), st.floats(0.1, 2.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
             min_size=1, max_size=5),
    st.integers(1, 7),
)
def test_schedule_respects_dependencies(stages: list[tuple[float, float, float, float]], m: int) -> None:
    f, b, sf, sb = (list(x) for x in zip(*stages))
    S = len(stages)
    ops = simulate_1f1b(f, b, sf, sb, m)
    end = {(o.kind, o.stage, o.microbatch): o.end for o in ops if o.kind in ("F", "B")}
    start = {(o.kind, o.stage, o.microbatch): o.start for o in ops if o.kind in ("F", "B")}
    assert len(end) == 2 * S * m
    for s in range(S):
        for i in range(m):
            if s > 0:  # forward input = previous stage's output after its transfer
                assert start[("F", s, i)] >= end[("F", s - 1, i)] + sf[s - 1] - 1e-9
            if s < S - 1:
                assert start[("B", s, i)] >= end[("B", s + 1, i)] + sb[s] - 1e-9
            assert start[("B", s, i)] >= end[("F", s, i)] - 1e-9
        own = sorted((o.start, o.end) for o in ops if o.stage == s and o.kind in ("F", "B"))
        assert all(a[1] <= b_[0] + 1e-9 for a, b_ in zip(own, own[1:]))  # one operation at a time
        # 1F1B keeps at most S − s forwards in flight
        for o in ops:
            if o.kind == "F" and o.stage == s:
                done_b = sum(1 for p in ops if p.kind == "B" and p.stage == s and p.end <= o.start + 1e-12)
                assert o.microbatch - done_b < S - s


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
