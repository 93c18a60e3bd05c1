"""deadline2 (issue #11 item 4): every command that takes ``--time-limit`` shares one deadline among
its phases: ``plan --objective cost / --budget / --pareto``, ``compare`` and ``replan`` return their
best result with a valid bound (or say none was proven) when the deadline stops the search, and the
watchdog takes the incumbent last reported from a planner that ignores the stop. No wall-clock
verdict: the clock is a fake one (a deadline already passed, one frozen, or one the fake planners
move); only the watchdog's grace (1 s of real waiting) passes in real time."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import hgopt.commands.compare as compare_cmd
import hgopt.commands.plan as plan_cmd
import hgopt.commands.plan_cost as plan_cost_cmd
import hgopt.commands.replan as replan_cmd
from hgopt.cli import build_parser
from hgopt.commands._deadline import Deadline, search_limit
from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, PlanResult
from hgopt.search.by_cost import _subsets, cost_lower_bound, subset_shares
from hgopt.spec import Instance
from tests.factories import FakeClock, tiny_instance, tiny_model, tiny_topology

WAIT_S = 60.0  # generous: only reached when something is broken


def _priced() -> Instance:
    topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, 40.0), ("b", "V100-16", 2, 2, 40.0)))
    for c, price in zip(topo["clusters"], (3.6, 1.0)):
        c["cost_per_gpu_hour"] = price
    return tiny_instance(global_batch=8, model=tiny_model(gpus={"A100-40": 0.01, "V100-16": 0.02}), topology=topo)


def _plan(cluster: str = "a") -> Plan:
    return Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster=cluster, dp=4, mbs=1),)),),
                                    num_microbatches=2),), planner="fake")


def _wait_for_stop(options: PlanOptions) -> None:
    assert options.progress is not None
    for _ in range(int(WAIT_S / 0.01)):
        if options.progress.stop_requested():
            return
        time.sleep(0.01)


def _stoppable(seen: list[float], bound: float | None = 0.01):  # type: ignore[no-untyped-def]
    """A planner that runs until asked to stop, then returns its plan (on cluster a when the
    instance has it) with ``bound``."""

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        seen.append(options.time_limit_s)
        _wait_for_stop(options)
        plan = _plan(instance.topology.clusters[0].name)
        return PlanResult(planner="fake", status="feasible", plan=plan, lower_bound_s=bound,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s,
                          solver="none (highs not needed: the relaxation bounds certified the result)")

    return planner


def _parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


# --- plan --objective cost / --budget / --pareto -------------------------------------------------------------

def _run_cost(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], deadline: Deadline,
              planner: Any, *extra: str) -> dict[str, Any]:
    inst = _priced()
    monkeypatch.setattr(plan_cmd, "load_instance", lambda name: inst)
    monkeypatch.setattr(plan_cost_cmd, "get_planner", lambda name: planner)
    args = _parse("plan", "tiny", "-q", "--planner", "heuristic", "--time-limit", "10", *extra)
    rc = plan_cmd.run(args, deadline=deadline)
    out = capsys.readouterr().out
    doc: dict[str, Any] = json.loads(out) if "--json" in extra else {"text": out}
    doc["rc"] = rc
    return doc


@pytest.mark.parametrize("flags", [("--objective", "cost"), ("--budget", "1000")])
def test_a_passed_deadline_ends_the_cost_search_with_what_was_priced_and_a_valid_bound(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: tuple[str, str]) -> None:
    seen: list[float] = []
    doc = _run_cost(monkeypatch, capsys, Deadline(10.0, 0.0, FakeClock(1000.0)), _stoppable(seen), *flags, "--json")
    inst = _priced()
    n = len(_subsets(inst))
    assert n > 1 and seen == [subset_shares(search_limit(10.0), n)[0]]  # the whole instance only, its fixed share
    assert doc["rc"] == 0 and doc["unsearched_subsets"] == n - 1
    assert f"{n - 1} cluster subset(s) not searched" in doc["stopped_by_deadline"]
    chosen = doc["chosen"]
    plan = Plan.from_dict(chosen["plan"])
    ev = evaluate(plan, inst)
    assert ev.feasible and chosen["iteration_time_s"] == pytest.approx(ev.iteration_time_s)
    assert chosen["status"] == "feasible" and "certified" not in chosen["solver"]  # the deadline's words
    if flags[0] == "--objective":
        usd = doc["candidates"][0]["usd_per_iteration"]
        assert doc["lower_bound"] == pytest.approx(cost_lower_bound(inst, build_tables(inst))) and doc["lower_bound"] <= usd
    else:  # --budget under the time objective: the whole instance's time bound
        assert doc["lower_bound"] == 0.01 <= ev.iteration_time_s


def test_a_deadline_not_reached_searches_every_subset_with_fixed_shares(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The same run with the clock frozen at the start: every subset is searched, each planner run
    gets its fixed share of the search's limit (not what the wall clock left: determinism), nothing
    is named as left out (so the test above fails for its reason)."""
    seen: list[float] = []

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        seen.append(options.time_limit_s)
        plan = _plan(instance.topology.clusters[0].name)
        time.sleep(0.05)  # a wall-clock share would shrink with this; the fixed one does not
        return PlanResult(planner="fake", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    doc = _run_cost(monkeypatch, capsys, Deadline(10.0, 0.0, FakeClock(0.0)), planner, "--objective", "cost", "--json")
    n = len(_subsets(_priced()))
    assert seen == list(subset_shares(search_limit(10.0), n))
    assert doc["rc"] == 0 and doc["unsearched_subsets"] == 0 and doc["stopped_by_deadline"] is None


def test_the_watchdog_takes_the_last_reported_incumbent_when_the_cost_search_ignores_the_stop(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A planner that reports an incumbent and then never returns (a long solver call): the command
    still ends, with that incumbent as the one candidate, the cost bound and --pareto's listing."""
    release = threading.Event()

    def stuck(instance: Instance, options: PlanOptions) -> PlanResult:
        assert options.progress is not None
        options.progress.report("stuck", plan=_plan("b"), bound_s=0.01)
        release.wait(WAIT_S)
        raise AssertionError("released: the command did not wait for this")

    try:
        doc = _run_cost(monkeypatch, capsys, Deadline(10.0, 0.0, FakeClock(1000.0)), stuck, "--pareto")
    finally:
        release.set()
    text = doc["text"]
    assert doc["rc"] == 0
    assert "not searched" in text and "lower bound still holds" in text
    assert "no plan written" not in text and "Pareto front" in text
    inst = _priced()
    assert evaluate(_plan("b"), inst).feasible


# --- compare ---------------------------------------------------------------------------------------------------

def _compare_registry(monkeypatch: pytest.MonkeyPatch, clock: FakeClock, ends: list[float],
                      seen: dict[str, float]) -> None:
    """Four planners: p0 and p2 overrun their slots (they move the clock past the ends of theirs, to
    the search's stop for p2) and wait to be stopped; p1 returns at once; p3 would start after the
    search's stop."""  # (ends[-1] is the search's stop)

    def overrun(name: str, to: float):  # type: ignore[no-untyped-def]
        def planner(instance: Instance, options: PlanOptions) -> PlanResult:
            seen[name] = options.time_limit_s
            clock.now = to
            _wait_for_stop(options)
            plan = _plan()
            return PlanResult(planner=name, status="feasible", plan=plan, lower_bound_s=0.01,
                              iteration_time_s=evaluate(plan, instance).iteration_time_s)
        return planner

    def quick(instance: Instance, options: PlanOptions) -> PlanResult:
        seen["p1"] = options.time_limit_s
        plan = _plan("b")
        return PlanResult(planner="p1", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    fakes = {"p0": lambda: overrun("p0", ends[0] + 0.1), "p1": lambda: quick,
             "p2": lambda: overrun("p2", ends[-1]), "p3": lambda: quick}
    monkeypatch.setattr(compare_cmd, "get_planner", lambda n: fakes[n]())
    monkeypatch.setattr(compare_cmd, "planner_names", lambda: tuple(fakes))


def test_compare_shares_its_deadline_stops_overrunning_planners_and_skips_what_finds_no_time(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    clock = FakeClock(0.0)
    dl = Deadline(10.0, 0.0, clock)
    share, ends = compare_cmd.planner_slots(dl, 4)
    assert share == search_limit(10.0) / 4 and ends[-1] == dl.stop_at and list(ends) == sorted(ends)
    seen: dict[str, float] = {}
    _compare_registry(monkeypatch, clock, list(ends), seen)
    monkeypatch.setattr(compare_cmd, "load_instance", lambda name: tiny_instance())
    png = tmp_path / "bars.png"
    args = _parse("compare", "tiny", "-q", "--planners", "p0,p1,p2,p3", "--time-limit", "10", "--json",
                  "--plot", str(png))
    rc = compare_cmd.run(args, deadline=dl)
    rows = {r["planner"]: r for r in json.loads(capsys.readouterr().out)}
    assert rc == 0 and seen == {"p0": share, "p1": share, "p2": share}  # p3 never started
    inst = tiny_instance()
    for name in ("p0", "p2"):  # stopped by their watchdogs: plan and bound kept, the deadline named
        r = rows[name]
        assert r["status"] == "feasible" and "deadline" in r["note"] and r["lower_bound_s"] == 0.01
        assert r["iteration_time_s"] == pytest.approx(evaluate(Plan.from_dict(r["plan"]), inst).iteration_time_s)
    assert rows["p1"]["status"] == "heuristic" and "deadline" not in rows["p1"]["note"]
    assert rows["p3"]["status"] == "not run" and rows["p3"]["note"] == compare_cmd.NOT_RUN_DEADLINE
    assert not png.exists()  # no time left for the drawing


def test_compare_without_a_deadline_keeps_the_per_planner_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library call (no deadline): every planner gets ``time_limit_s`` and none is stopped."""
    seen: list[float] = []

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        seen.append(options.time_limit_s)
        plan = _plan()
        return PlanResult(planner="x", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    monkeypatch.setattr(compare_cmd, "get_planner", lambda n: planner)
    rows = compare_cmd.compare(tiny_instance(), ["uniform", "dp-only"], 7.0, heartbeat=False)
    assert seen == [7.0, 7.0] and all(r.status == "heuristic" for r in rows)


# --- replan ----------------------------------------------------------------------------------------------------

def test_replan_under_a_passed_deadline_keeps_the_planners_plan_and_bound_and_says_so(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inst = tiny_instance()
    old = tmp_path / "old.json"
    old.write_text(Plan(pipelines=_plan().pipelines, planner="x", instance="tiny").to_json())
    seen: list[float] = []
    monkeypatch.setattr(replan_cmd, "load_instance", lambda name: inst)
    monkeypatch.setattr(replan_cmd, "get_planner", lambda name: _stoppable(seen))
    args = _parse("replan", str(old), "--change", "drop=b", "--planner", "milp", "--time-limit", "10", "--json", "-q")
    rc = replan_cmd.run(args, deadline=Deadline(10.0, 0.0, FakeClock(1000.0)))
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and seen == [search_limit(10.0)]
    assert doc["planner_status"] == "feasible" and "deadline" in doc["planner_notes"][0]
    assert doc["lower_bound_s"] == 0.01 and doc["chosen"] is not None
    new = tiny_instance(topology=tiny_topology(clusters=(("a", "A", 2, 2, 40.0),)))
    assert evaluate(Plan.from_dict(doc["plan"]), new).feasible


def test_replan_with_time_left_is_not_stopped(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    inst = tiny_instance()
    old = tmp_path / "old.json"
    old.write_text(Plan(pipelines=_plan().pipelines, planner="x", instance="tiny").to_json())

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        plan = _plan()
        return PlanResult(planner="fake", status="optimal", plan=plan, lower_bound_s=0.01,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    monkeypatch.setattr(replan_cmd, "load_instance", lambda name: inst)
    monkeypatch.setattr(replan_cmd, "get_planner", lambda name: planner)
    args = _parse("replan", str(old), "--change", "drop=b", "--planner", "milp", "--time-limit", "10", "--json", "-q")
    rc = replan_cmd.run(args, deadline=Deadline(10.0, 0.0, FakeClock(0.0)))
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["planner_status"] == "optimal" and not any("deadline" in n for n in doc["planner_notes"])


# --- the watchdog parks a search it gave up on --------------------------------------------------------------

def test_a_search_the_watchdog_gave_up_on_is_parked_at_its_next_check() -> None:
    """A planner that ignores the stop but keeps checking the flag: once the command takes its last
    reported incumbent, the planner's thread blocks at its next check (it stops competing with the
    command's remaining phases for the interpreter), and the command's own calls still work."""
    from hgopt.commands._search import run_planner
    from hgopt.progress import Progress

    count = [0]
    inst = tiny_instance()

    def ignores_the_stop(instance: Instance, options: PlanOptions) -> PlanResult:
        assert options.progress is not None
        options.progress.report("busy", plan=_plan(), bound_s=0.01)
        for _ in range(10**9):
            count[0] += 1
            options.progress.stop_requested()
            time.sleep(0.001)
        raise AssertionError("never reached")

    progress = Progress("x", heartbeat=False)
    res = run_planner("x", ignores_the_stop, inst, PlanOptions(time_limit_s=1.0), progress, stop_at=0.0,
                      stop_grace_s=0.3, clock=FakeClock(1.0))
    assert res.plan is not None and evaluate(res.plan, inst).feasible and res.lower_bound_s == 0.01
    assert res.status == "feasible" and "deadline" in res.notes[0]
    before = count[0]
    time.sleep(0.3)
    assert count[0] - before <= 1  # parked (a free-running loop would have counted ~300 more)
    assert progress.stop_requested()  # the main thread is not parked


# --- honest words: the cost search's status is its own -------------------------------------------------------

def test_the_chosen_plans_status_is_the_cost_searchs_not_its_subset_planners(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A planner that calls every subset's plan ``optimal`` (optimal for that subset): the command's
    status is ``optimal`` only if the cost search's own gap is within --gap; here it is not."""

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        plan = _plan(instance.topology.clusters[0].name)
        return PlanResult(planner="fake", status="optimal", plan=plan, lower_bound_s=0.001,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    doc = _run_cost(monkeypatch, capsys, Deadline(10.0, 0.0, FakeClock(0.0)), planner, "--objective", "cost", "--json")
    assert doc["rc"] == 0 and doc["gap"] > 0.01  # the setting: the search's gap is over --gap (default 0.01)
    chosen = doc["chosen"]
    assert chosen["status"] == "feasible" and dict(Plan.from_dict(chosen["plan"]).meta)["status"] == "feasible"
    assert "the planner said optimal" in chosen["notes"][0]
    assert [c["status"] for c in doc["candidates"] if c["chosen"]] == ["feasible"]


def test_compare_gives_a_planner_stopped_before_any_plan_no_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planner stuck without an incumbent while the clock runs past the command's stop and its
    grace: the command gives up on it, its row says so (no uniform stand-in plan under its name) and
    the next planner is not run (no time left)."""
    from hgopt.commands._deadline import DEADLINE_GRACE_S

    clock = FakeClock(0.0)
    dl = Deadline(10.0, 0.0, clock)
    share, ends = compare_cmd.planner_slots(dl, 2)
    release = threading.Event()
    seen: list[float] = []

    def stuck(instance: Instance, options: PlanOptions) -> PlanResult:
        clock.now = ends[0]  # past its slot: asked to stop, ignores it
        _wait_for_stop(options)
        clock.now = dl.stop_at + DEADLINE_GRACE_S  # past the command's stop and grace: given up
        release.wait(WAIT_S)
        raise AssertionError("released: the command did not wait for this")

    def quick(instance: Instance, options: PlanOptions) -> PlanResult:
        seen.append(options.time_limit_s)
        plan = _plan()
        return PlanResult(planner="q", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    monkeypatch.setattr(compare_cmd, "get_planner", lambda n: stuck if n == "milp" else quick)
    try:
        rows = {r.planner: r for r in compare_cmd.compare(tiny_instance(), ["milp", "uniform"], 10.0,
                                                          heartbeat=False, deadline=dl)}
    finally:
        release.set()
    assert rows["milp"].status == compare_cmd.NOT_FOUND and rows["milp"].plan is None
    assert "deadline" in rows["milp"].note and rows["milp"].vs_best == 0.0
    assert rows["uniform"].status == "not run" and rows["uniform"].note == compare_cmd.NOT_RUN_DEADLINE and seen == []


# --- a slow machine keeps a longer post-search reserve ---------------------------------------------------------

def test_a_slow_machine_keeps_a_longer_post_search_reserve() -> None:
    """The watchdog fires earlier by the process's slowdown (wall over CPU seconds, in
    [1, MAX_SLOWDOWN]) times POST_RESERVE_S; the search's nominal limit does not change (determinism)."""
    from hgopt.commands._deadline import DEADLINE_GRACE_S, MAX_SLOWDOWN, POST_RESERVE_S, hard_limit, slowdown

    assert slowdown(3.0, 1.5) == 2.0
    assert slowdown(1.0, 2.0) == 1.0 and slowdown(0.0, 1.0) == 1.0 and slowdown(100.0, 1.0) == MAX_SLOWDOWN
    fast, slow = Deadline(5.0, 0.0), Deadline(5.0, 0.0, slowdown=3.0)
    assert fast.stop_at == pytest.approx(hard_limit(5.0) - POST_RESERVE_S - DEADLINE_GRACE_S)
    assert slow.stop_at == pytest.approx(fast.stop_at - 2 * POST_RESERVE_S) and slow.hard == fast.hard
    d = Deadline.for_command(5.0, None)
    assert 1.0 <= d.slowdown <= MAX_SLOWDOWN and d.time_limit_s == 5.0
