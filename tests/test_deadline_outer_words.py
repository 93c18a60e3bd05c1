"""deadline3 (issue #11 items 4/5, after deadline2): ``plan --outer-steps`` under the command's deadline
(``lowcomm.plan_low_comm``'s ``stop_at``), a compare row of a planner that finished on its own after its
slot (no "stopped by the command's deadline"), and the milp's relaxation-only note (no certificate
words). Fake clocks only: no wall-clock verdict."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

import hgopt.commands.compare as compare_cmd
import hgopt.commands.plan as plan_cmd
import hgopt.search.lowcomm as lowcomm
from hgopt.cli import build_parser
from hgopt.commands._deadline import Deadline, search_limit
from hgopt.cost import evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, PlanResult, get_planner
from hgopt.search.milp import _size_note
from hgopt.spec import Instance
from tests.factories import FakeClock, tiny_instance, tiny_topology

WAIT_S = 60.0  # generous: only reached when something is broken


def _three() -> Instance:
    return tiny_instance(global_batch=16, topology=tiny_topology(
        clusters=(("a", "A", 2, 2, 40.0), ("b", "B", 2, 2, 40.0), ("c", "A", 2, 2, 40.0))))


def _ticking(clock: FakeClock, step: float, calls: list[tuple[float, float, bool]]):  # type: ignore[no-untyped-def]
    """The real uniform planner, which moves the fake clock by ``step`` per call and records
    (clock at the start, its time limit, whether it saw a stop at its end)."""
    uniform = get_planner("uniform")

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        start = clock.now
        clock.now += step
        seen = options.progress is not None and options.progress.stop_requested()
        calls.append((start, options.time_limit_s, seen))
        return uniform(instance, options)

    return planner


def _summary(res: lowcomm.LowCommResult) -> list[tuple[int, str, float]]:
    return [(c.steps, c.plan.to_json(), c.evaluation.tokens_per_s) for c in res.choices]


def test_outer_steps_limits_are_fixed_while_the_deadline_does_not_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow clock (10 s per sub-planner call) and a frozen one give the same sub-planner limits and the
    same plans when the deadline is far: the limits are fixed functions of the search's limit."""
    inst, limit = _three(), 40.0
    runs = []
    for step in (0.0, 10.0):
        clock, calls = FakeClock(), []  # type: ignore[var-annotated]
        monkeypatch.setattr(lowcomm, "get_planner", lambda name: _ticking(clock, step, calls))
        res = lowcomm.plan_low_comm(inst, [1, 10], PlanOptions(time_limit_s=limit), stop_at=1e9, clock=clock)
        assert calls[0][1] == lowcomm.SYNC_SHARE * limit  # the synchronous plan first
        assert {c[1] for c in calls[1:]} == {lowcomm.per_call_limit(limit)} == {5.0}
        assert not any(c[2] for c in calls) and not any("deadline" in n for n in res.notes)
        runs.append((_summary(res), len(calls)))
    assert runs[0] == runs[1] and runs[0][0] and runs[0][1] > 3


def test_outer_steps_stop_at_the_deadline_with_what_was_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call gets at most what is left before ``stop_at``, sees the stop once the clock passed it,
    and no call starts after it; the skipped group plans are counted in a note."""
    inst = _three()
    clock, calls = FakeClock(), []  # type: ignore[var-annotated]
    monkeypatch.setattr(lowcomm, "get_planner", lambda name: _ticking(clock, 1.0, calls))
    free = lowcomm.plan_low_comm(inst, [10], PlanOptions(time_limit_s=40.0))  # no deadline: every call
    all_calls = len(calls)
    clock.now, calls[:] = 0.0, []
    res = lowcomm.plan_low_comm(inst, [10], PlanOptions(time_limit_s=40.0), stop_at=2.5, clock=clock)
    assert [c[0] for c in calls] == [0.0, 1.0, 2.0]  # the one that would start at 3.0 > 2.5 is not made
    assert [c[1] for c in calls] == [2.5, 1.5, 0.5]  # min(20 | 5, what is left of 2.5)
    assert [c[2] for c in calls] == [False, False, True]  # the last one ran past stop_at: told to stop
    assert all_calls > len(calls) and free.choices
    note = next(n for n in res.notes if "deadline" in n)
    skipped = int(re.search(r"(\d+) group plan\(s\) not searched", note).group(1))  # type: ignore[union-attr]
    assert 1 <= skipped <= all_calls - len(calls)  # the unrated groups' realisations are not even tried
    assert res.sync.plan is not None  # the synchronous plan came first


def test_plan_outer_steps_under_a_passed_deadline_says_so(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The command: a deadline already passed makes no sub-planner call and says why (exit 1: no choice)."""
    calls: list[Any] = []
    monkeypatch.setattr(plan_cmd, "load_instance", lambda name: _three())
    monkeypatch.setattr(lowcomm, "get_planner", lambda name: _ticking(FakeClock(), 0.0, calls))
    args = build_parser().parse_args(["plan", "tiny", "-q", "--outer-steps", "1,10", "--time-limit", "10", "--json"])
    dl = Deadline(10.0, 0.0, FakeClock(100.0))
    rc = plan_cmd.run(args, deadline=dl)
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and calls == []
    assert any("before the command's deadline" in n for n in doc["notes"]), doc["notes"]


def test_plan_outer_steps_gets_the_search_limit(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    clock, calls = FakeClock(), []  # type: ignore[var-annotated]
    monkeypatch.setattr(plan_cmd, "load_instance", lambda name: _three())
    monkeypatch.setattr(lowcomm, "get_planner", lambda name: _ticking(clock, 0.0, calls))
    args = build_parser().parse_args(["plan", "tiny", "-q", "--outer-steps", "10", "--time-limit", "30", "--json"])
    assert plan_cmd.run(args, deadline=Deadline(30.0, 0.0, clock)) == 0
    assert calls[0][1] == lowcomm.SYNC_SHARE * search_limit(30.0)
    assert json.loads(capsys.readouterr().out)["outer"]


# --- compare: a planner that finished on its own after its slot --------------------------------------------------

def _plan() -> Plan:
    return Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster="a", dp=4, mbs=1),)),),
                                    num_microbatches=2),), planner="fake")


def test_compare_row_of_a_planner_that_never_saw_the_stop_is_not_called_stopped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A baseline that does not poll the stop flag runs past its slot, the watchdog asks it to stop, it
    finishes its own search: its row is a finished one (no "stopped by the command's deadline"); one
    that polled the flag and returned on it keeps the words."""
    clock = FakeClock(0.0)
    dl = Deadline(10.0, 0.0, clock)
    share, ends = compare_cmd.planner_slots(dl, 2)

    def deaf(instance: Instance, options: PlanOptions) -> PlanResult:
        clock.now = ends[0] + 0.1  # past its slot
        assert options.progress is not None and options.progress._stop.wait(WAIT_S)  # the watchdog asked
        plan = _plan()
        return PlanResult(planner="deaf", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    def listening(instance: Instance, options: PlanOptions) -> PlanResult:
        clock.now = ends[1]
        assert options.progress is not None
        for _ in range(int(WAIT_S / 0.01)):
            if options.progress.stop_requested():
                break
            time.sleep(0.01)
        plan = _plan()
        return PlanResult(planner="listening", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    monkeypatch.setattr(compare_cmd, "get_planner", lambda n: deaf if n == "uniform" else listening)
    rows = {r.planner: r for r in compare_cmd.compare(tiny_instance(), ["uniform", "metis"], 10.0,
                                                      heartbeat=False, deadline=dl)}
    assert rows["uniform"].status == "heuristic" and rows["uniform"].plan is not None
    assert "deadline" not in rows["uniform"].note
    assert rows["metis"].status == "heuristic" and "stopped by the command's deadline" in rows["metis"].note


# --- milp: the relaxation-only note ---------------------------------------------------------------------------

class _Outcome:
    split, solves, unfinished = "k=1 B=32 m=16", 0, False


def test_relaxation_only_note_claims_no_certificate_and_names_the_overall_gap() -> None:
    note = _size_note(_Outcome(), 0.858)  # type: ignore[arg-type]
    assert "no MILP needed" not in note and "alone" not in note
    assert "this split's bound came from the relaxations" in note and note.endswith("overall gap 85.8 %")
