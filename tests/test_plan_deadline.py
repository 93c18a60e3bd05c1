"""deadline (issue #11 item 4): ``hgopt plan --time-limit T`` shares one deadline, measured from the
process start, among its phases; past it the search is stopped with its plan and bound kept and
the optional post-search phases are skipped and named. No wall-clock verdict: the clock is a fake
one (a deadline already passed, or one frozen at the start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hgopt.commands.plan as plan_cmd
from hgopt.cli import build_parser
from hgopt.commands._deadline import Deadline, hard_limit, process_elapsed_s, search_limit
from hgopt.cost import evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, PlanResult, get_planner
from hgopt.spec import Instance
from tests.factories import FakeClock, tiny_instance

WAIT_S = 60.0  # generous: only reached when something is broken


def _plan() -> Plan:  # uses cluster a only: b is idle, so the why-not lines have something to say
    return Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster="a", dp=4, mbs=1),)),),
                                    num_microbatches=2),), planner="fake")


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], deadline: Deadline,
         planner: object, *extra: str) -> dict:  # type: ignore[type-arg]
    inst = tiny_instance()
    monkeypatch.setattr(plan_cmd, "load_instance", lambda name: inst)
    if planner is not None:
        monkeypatch.setattr(plan_cmd, "get_planner", lambda name: planner)
    args = build_parser().parse_args(["plan", "tiny", "--json", "-q", "--time-limit", "10", *extra])
    rc = plan_cmd.run(args, deadline=deadline)
    doc = json.loads(capsys.readouterr().out)
    doc["rc"] = rc
    return doc


def _stoppable(seen: list[float]):  # type: ignore[no-untyped-def]
    """A planner that runs until asked to stop, then returns its plan with a bound."""

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        assert options.progress is not None
        seen.append(options.time_limit_s)
        for _ in range(int(WAIT_S / 0.01)):
            if options.progress.stop_requested():
                break
            import time

            time.sleep(0.01)
        plan = _plan()
        return PlanResult(planner="fake", status="feasible", plan=plan, lower_bound_s=0.01,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s,
                          solver="none (highs not needed: the relaxation bounds certified the result)")

    return planner


def test_phase_shares_are_fixed_functions_of_the_limit() -> None:
    assert hard_limit(10) == 12 and hard_limit(30) == pytest.approx(33) and hard_limit(1) == 3
    assert search_limit(30) == 29 and search_limit(1) == 0.5  # deterministic: the same T, the same search
    clock = FakeClock(100.0)
    d = Deadline(10.0, 95.0, clock)
    assert d.left() == 5.0 and d.hard_left() == 7.0 and d.elapsed() == 5.0 and d.stop_at < d.hard
    assert process_elapsed_s() >= 0.0


def test_a_passed_deadline_stops_the_search_and_skips_and_names_the_post_search_phases(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    seen: list[float] = []
    png = tmp_path / "t.png"
    doc = _run(monkeypatch, capsys, Deadline(10.0, 0.0, clock), _stoppable(seen), "--timeline", str(png))
    assert seen == [search_limit(10.0)]  # the search's share of the deadline
    assert doc["rc"] == 0 and doc["plan"] is not None
    plan = Plan.from_dict(doc["plan"])
    ev = evaluate(plan, tiny_instance())
    assert ev.feasible and doc["iteration_time_s"] == ev.iteration_time_s
    assert doc["lower_bound_s"] == 0.01 <= ev.iteration_time_s
    assert doc["status"] == "feasible" and dict(plan.meta)["status"] == "feasible"  # not "interrupted"
    assert "deadline" in doc["notes"][0] and "certified" not in doc["solver"]
    assert any("why-not" in s for s in doc["skipped"]) and any(str(png) in s for s in doc["skipped"])
    assert doc["explanation"]["why_not"] == [] and not png.exists()


def test_a_deadline_not_reached_skips_nothing(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The same run with the clock frozen at the process start: the search ends on its own, the
    why-not lines run (cluster b idle), nothing is skipped (so the test above fails for its reason)."""

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        plan = _plan()
        return PlanResult(planner="fake", status="feasible", plan=plan, lower_bound_s=0.01,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    doc = _run(monkeypatch, capsys, Deadline(10.0, 0.0, FakeClock(0.0)), planner)
    assert doc["skipped"] == [] and doc["status"] == "feasible"
    assert [w["cluster"] for w in doc["explanation"]["why_not"]] == ["b"]


def test_the_real_planner_past_its_deadline_returns_a_valid_plan_and_bound(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The milp planner stopped at once by a passed deadline: a plan that evaluate accepts and a
    bound no plan of its stated space beats (the heuristic's k identical pipelines, the uniform
    baseline's); a grouped plan [H9] below it must be named outside that space."""
    from hgopt.cost import build_tables
    from hgopt.search.hierarchical import heuristic_incumbent

    png = tmp_path / "t.png"  # asked for, so something is always skipped (the plan may use every cluster: no why-not)
    doc = _run(monkeypatch, capsys, Deadline(10.0, 0.0, FakeClock(1000.0)), None, "--timeline", str(png))
    inst = tiny_instance()
    assert doc["rc"] == 0 and doc["plan"] is not None and doc["skipped"] and not png.exists()
    ev = evaluate(Plan.from_dict(doc["plan"]), inst)
    assert ev.feasible and doc["iteration_time_s"] == pytest.approx(ev.iteration_time_s)
    lb = doc["lower_bound_s"]
    assert lb is not None and lb <= ev.iteration_time_s * (1 + 1e-9)
    inside = [heuristic_incumbent(inst, build_tables(inst), time_limit_s=5.0).plan,
              get_planner("uniform")(inst, PlanOptions(time_limit_s=5.0)).plan]
    for other in inside:
        assert other is not None and lb <= evaluate(other, inst).iteration_time_s * (1 + 1e-9)
    grouped = get_planner("heuristic")(inst, PlanOptions(time_limit_s=5.0)).plan
    assert grouped is not None
    if evaluate(grouped, inst).iteration_time_s < lb:
        assert "outside: data parallelism across cluster groups" in doc["plan_space"]


def test_a_search_stopped_by_the_deadline_before_any_plan_still_returns_a_valid_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """No incumbent when the deadline stops the search: the uniform baseline's plan (valid by
    evaluate), the bound the search had, status ``feasible`` (a plan and a bound), both named."""

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        assert options.progress is not None
        for _ in range(int(WAIT_S / 0.01)):
            if options.progress.stop_requested():
                break
            import time

            time.sleep(0.01)
        return PlanResult(planner="fake", status="error", plan=None, lower_bound_s=0.01)

    doc = _run(monkeypatch, capsys, Deadline(10.0, 0.0, FakeClock(1000.0)), planner)
    plan = Plan.from_dict(doc["plan"])
    ev = evaluate(plan, tiny_instance())
    assert doc["rc"] == 0 and plan.planner == "uniform" and ev.feasible
    assert doc["iteration_time_s"] == ev.iteration_time_s and doc["lower_bound_s"] == 0.01 <= ev.iteration_time_s
    assert doc["status"] == "feasible" and any("uniform baseline" in n for n in doc["notes"])
    assert "deadline" in doc["notes"][0]
