"""determinism (issue #11 item 5): the exact planner's phases end by counted work (``hgopt.search.work``), the
wall clock is only the watchdog. A run whose clock runs 3x (or 10x) faster — a deliberately slowed process,
as the planner sees it — gives the same plan and the same bound as a normal run, as long as the watchdog
does not fire; when it fires, the result says so. No wall-clock verdict: the fake clocks decide, and the
work budgets are far from the (fake) deadlines."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import pytest

from hgopt.instances import load_instance
from hgopt.search import PlanOptions, PlanResult
from hgopt.search.exact import _heuristic_warm_start
from hgopt.search.milp import batch_splits, plan_milp
from hgopt.search.work import WorkMeter, milp_work, node_limit
from hgopt.spec import instance_from_dict
from tests.test_deadline_determinism import _three_clusters

CUT = "stopped by the time limit"


def _fast_clock(monkeypatch: pytest.MonkeyPatch, speed: float) -> None:
    """``time.perf_counter`` running ``speed`` times faster than the real one from now on."""
    real = time.perf_counter
    t0 = real()
    monkeypatch.setattr(time, "perf_counter", lambda: t0 + speed * (real() - t0))


def _plan_json(res: PlanResult) -> str:
    assert res.plan is not None
    doc: dict[str, Any] = res.plan.to_dict()  # type: ignore[attr-defined]
    return json.dumps({k: v for k, v in doc.items() if k != "meta"}, sort_keys=True)


def _no_phase_watchdog(m: pytest.MonkeyPatch) -> None:
    """The per-phase watchdogs (``PHASE_SLACK`` × a phase's share of the wall limit) out of the way: they are
    wall-clock cuts (said in the result), not what these tests are about."""
    import hgopt.search.exact as exact
    import hgopt.search.work as work

    m.setattr(work, "PHASE_SLACK", 1e6)
    m.setattr(exact, "PHASE_SLACK", 1e6)


def _run(monkeypatch: pytest.MonkeyPatch, speed: float, work_s: float, wall_s: float = 600.0) -> PlanResult:
    with monkeypatch.context() as m:
        _no_phase_watchdog(m)
        if speed != 1.0:
            _fast_clock(m, speed)
        return plan_milp(instance_from_dict(_three_clusters()),
                         PlanOptions(time_limit_s=wall_s, work_limit_s=work_s, gap=1e-6), warm_start=None)


@pytest.mark.parametrize("work_s", (0.6, 1.2))
def test_a_3x_faster_clock_gives_the_same_plan_and_bound(monkeypatch: pytest.MonkeyPatch, work_s: float) -> None:
    """The work budget binds (some split's MILP is left unbuilt: not all phases complete) and the wall
    clock does not (600 s watchdog): a clock 3x faster changes nothing. A phase ended by the clock at a
    share of the limit (the round-7 planner) would end at a third of the work here."""
    a, b = _run(monkeypatch, 1.0, work_s), _run(monkeypatch, 3.0, work_s)
    assert not any(n.startswith(CUT) for n in (*a.notes, *b.notes))
    assert any("before the MILP of split" in n for n in a.notes)  # the budget, not completion, ended it
    assert (a.status, a.iteration_time_s, a.lower_bound_s) == (b.status, b.iteration_time_s, b.lower_bound_s)
    assert a.notes == b.notes
    if a.plan is not None or b.plan is not None:
        assert _plan_json(a) == _plan_json(b)


def test_more_work_never_weakens_the_bound_and_the_full_run_is_optimal(monkeypatch: pytest.MonkeyPatch) -> None:
    small, full = _run(monkeypatch, 1.0, 1.2), _run(monkeypatch, 1.0, 30.0)
    assert full.status == "optimal" and full.lower_bound_s is not None
    assert small.lower_bound_s is not None and small.lower_bound_s <= full.iteration_time_s * (1 + 1e-9)
    assert small.lower_bound_s <= full.lower_bound_s * (1 + 1e-9)


def test_the_watchdog_cut_is_said_and_the_bound_still_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock 10^5 times faster passes a 30 s deadline within the first phase: the result names the cut,
    and its bound is still below the optimum of the full run."""
    full = _run(monkeypatch, 1.0, 30.0)
    cut = _run(monkeypatch, 1e5, 30.0, wall_s=30.0)
    assert any(n.startswith(CUT) for n in cut.notes), cut.notes
    assert cut.status != "optimal"
    assert cut.lower_bound_s is not None and cut.lower_bound_s <= full.iteration_time_s * (1 + 1e-9)


def test_the_warm_start_ends_by_its_work_limit_not_by_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm start's heuristic under a clock 10x faster: the same plan (its share, 0.5 s, would pass
    after 0.05 real seconds — before its 75 work units on sailor-geo-5x32 — if the share were its wall limit).
    The per-phase watchdog (``PHASE_SLACK`` × its share) is moved out of the way: it is a wall-clock cut."""
    _no_phase_watchdog(monkeypatch)
    inst = load_instance("sailor-geo-5x32")
    from hgopt.cost import build_tables

    tables = build_tables(inst)

    def plan(speed: float) -> str:
        with monkeypatch.context() as m:
            if speed != 1.0:
                _fast_clock(m, speed)
            warm = _heuristic_warm_start("native", None, None, hard=time.perf_counter() + 600.0)
            p = warm(inst, tables, 0.5)
        assert p is not None
        return json.dumps({k: v for k, v in p.to_dict().items() if k != "meta"}, sort_keys=True)  # type: ignore[attr-defined]

    assert plan(1.0) == plan(10.0)


# ---- the meter and the node limit: hand values ----------------------------------------------------------
def test_the_meter_ends_a_share_by_work_and_records_a_cut_by_the_clock() -> None:
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]
    m = WorkMeter(10.0, deadline=100.0, clock=clock)
    assert m.within(0.2) and m.left(0.2) == pytest.approx(2.0)
    m.charge(2.0)
    assert not m.within(0.2) and m.cut == ""  # the work share, not the clock
    assert m.within(1.0)
    now[0] = 100.0
    assert not m.within(1.0, "relaxation phase") and m.cut == "relaxation phase"
    assert m.past_deadline("MILP phase") and m.cut == "relaxation phase"  # the first cut is kept


def test_a_phase_is_cut_at_its_slack_times_its_share_of_the_wall_limit() -> None:
    from hgopt.search.work import PHASE_SLACK

    now = [0.0]
    m = WorkMeter(10.0, deadline=100.0, clock=lambda: now[0])
    now[0] = PHASE_SLACK * 0.2 * 100.0 - 1e-9
    assert m.within(0.2, "cheap bounds") and m.cut == ""
    now[0] = PHASE_SLACK * 0.2 * 100.0
    assert not m.within(0.2, "cheap bounds") and m.cut == "cheap bounds"
    assert m.within(0.75)  # a later phase's watchdog is later


def test_the_node_limit_follows_the_work_left() -> None:
    root = milp_work(10_000, 1, 1)
    assert node_limit(10_000, root / 2) == 1  # the root alone
    assert node_limit(10_000, 3 * root) == 21  # 1 + (3 - 1) / 0.1
    assert milp_work(10_000, 21, 21) == pytest.approx(3 * root)
    assert milp_work(10_000, -1, 21) == milp_work(10_000, 21, 21)  # unknown count: the limit given
    assert node_limit(10_000, math.inf) > 1000


def test_the_splits_come_in_a_fixed_order() -> None:
    inst = instance_from_dict(_three_clusters())
    assert batch_splits(inst) == batch_splits(inst) and len(batch_splits(inst)) == 14


def test_the_exact_planner_with_a_3x_faster_clock_gives_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole ``milp`` planner (warm start, mixed-stage family and its bound [H11b], the k-identical
    search, the grouped-plan check and bound): every phase by work, so a clock 3x faster changes nothing."""
    from hgopt.search.exact import plan_exact

    def run(speed: float) -> PlanResult:
        with monkeypatch.context() as m:
            _no_phase_watchdog(m)
            if speed != 1.0:
                _fast_clock(m, speed)
            return plan_exact(instance_from_dict(_three_clusters()),
                              PlanOptions(time_limit_s=600, work_limit_s=1.5, gap=1e-6))

    a, b = run(1.0), run(3.0)
    assert not any(n.startswith(CUT) for n in (*a.notes, *b.notes))
    assert (a.status, a.iteration_time_s, a.lower_bound_s) == (b.status, b.iteration_time_s, b.lower_bound_s)
    assert a.notes == b.notes and a.plan_space == b.plan_space
    assert _plan_json(a) == _plan_json(b)


def test_a_counted_stop_is_a_work_limit() -> None:
    from hgopt.search.work import CORE_SHARE, counted_stop

    ask = counted_stop(1.0, 0.25 * CORE_SHARE)  # 0.25 nominal s a query: four queries
    assert [ask() for _ in range(6)] == [False] * 4 + [True] * 2
    flag = [False]
    ask = counted_stop(100.0, 0.0, lambda: flag[0])
    assert not ask()
    flag[0] = True
    assert ask()


def test_a_bad_work_limit_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    from hgopt.cli import main

    assert main(["plan", "default", "--work-limit", "0", "--time-limit", "5"]) == 2
    assert "--work-limit" in capsys.readouterr().err


def test_the_work_limit_reaches_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan --work-limit W`` hands W to the planner as ``PlanOptions.work_limit_s`` (the search's
    ``time_limit_s`` stays the --time-limit's share)."""
    import hgopt.commands.plan as plan_cmd

    seen: list[PlanOptions] = []

    def fake(name: str, planner: object, inst: object, opts: PlanOptions, *a: object, **k: object) -> object:
        seen.append(opts)
        raise SystemExit(0)

    monkeypatch.setattr(plan_cmd, "run_planner", fake)
    from hgopt.cli import main

    with pytest.raises(SystemExit):
        main(["-q", "plan", "default", "--work-limit", "3.5", "--time-limit", "20"])
    assert seen and seen[0].work_limit_s == 3.5 and seen[0].time_limit_s == 19.0


def test_the_exact_planner_says_when_the_clock_cut_a_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock 10^4 times faster: the per-phase watchdogs (the warm start's heuristic, the cheap bounds) cut
    their phases, and the result says so; its bound still holds (below the full run's plan)."""
    from hgopt.search.exact import plan_exact

    full = plan_exact(instance_from_dict(_three_clusters()), PlanOptions(time_limit_s=600, work_limit_s=30.0))
    with monkeypatch.context() as m:
        _fast_clock(m, 1e4)
        cut = plan_exact(instance_from_dict(_three_clusters()), PlanOptions(time_limit_s=600, work_limit_s=30.0))
    assert any(n.startswith(CUT) for n in cut.notes), cut.notes
    # the bound holds for the space the cut result names: where that leaves grouped plans unbounded
    # (the full run's answer here is a grouped plan, outside k identical pipelines), it is held below the
    # best k-identical plan (plan_milp, that space alone), else below the full run's plan
    from hgopt.search.master import OUTSIDE_WHEN_OFF
    from hgopt.search.milp import plan_milp

    if cut.plan_space.endswith(OUTSIDE_WHEN_OFF):
        best = plan_milp(instance_from_dict(_three_clusters()), PlanOptions(time_limit_s=600, work_limit_s=30.0))
        assert best.plan is not None
        ref = best.iteration_time_s
    else:
        ref = full.iteration_time_s
    assert cut.lower_bound_s is None or cut.lower_bound_s <= ref * (1 + 1e-9)


def test_mixed_pair_work_scales_with_layer_ranges_and_clusters() -> None:
    """[H11b]'s charge per (B, m) pair: MIXED_PAIR_S at the calibration size (26 layers, 2 clusters),
    scaled by layer ranges × clusters (hand values)."""
    from hgopt.search.work import MIXED_PAIR_S, mixed_pair_work

    assert mixed_pair_work(26, 2) == MIXED_PAIR_S
    assert mixed_pair_work(80, 8) == pytest.approx(MIXED_PAIR_S * 3240 * 8 / 702, rel=1e-12)
    assert mixed_pair_work(2, 2) == pytest.approx(MIXED_PAIR_S * 6 / 702, rel=1e-12)
    assert mixed_pair_work(26, 1) == pytest.approx(MIXED_PAIR_S / 2, rel=1e-12)
