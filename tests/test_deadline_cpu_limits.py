"""deadline3 (issue #11 item 5, determinism under load): the cost search's subset loop (``by_cost``) ends by
CPU seconds of the process, not by the wall clock: a wall clock that runs fast (a loaded machine) gives the
same candidates as a frozen one while the CPU limit does not bind; the wall deadline is the command's
watchdog's (the stop flag, tests/test_deadline_commands.py). No wall-clock verdict: the wall is a fake one."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest

import hgopt.search.by_cost as by_cost
from hgopt.search import PlanOptions, PlanResult, get_planner
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology


def _priced() -> Instance:
    topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, 40.0), ("b", "V100-16", 2, 2, 40.0)))
    for c, price in zip(topo["clusters"], (3.6, 1.0)):
        c["cost_per_gpu_hour"] = price
    return tiny_instance(global_batch=8, model=tiny_model(gpus={"A100-40": 0.01, "V100-16": 0.02}), topology=topo)


def _counting(calls: list[float]):  # type: ignore[no-untyped-def]
    uniform = get_planner("uniform")

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        calls.append(options.time_limit_s)
        return uniform(instance, options)

    return planner


def _wall(step: float) -> SimpleNamespace:
    """``by_cost``'s ``time`` with a wall clock that moves ``step`` seconds per reading."""
    ticks = itertools.count()
    return SimpleNamespace(monotonic=lambda: step * next(ticks), perf_counter=lambda: step * next(ticks),
                           process_time=time.process_time)


def _key(search: by_cost.CostSearch) -> list[tuple[str, float]]:
    return [(c.result.plan.to_json() if c.result.plan else "", c.iteration_time_s) for c in search.candidates]


def test_a_fast_running_wall_clock_leaves_the_cost_search_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = _priced()
    runs = []
    for step in (0.0, 1000.0):  # frozen wall; 1000 s per reading (before: every subset after the first cut)
        monkeypatch.setattr(by_cost, "time", _wall(step))
        calls: list[float] = []
        s = by_cost.plan_by_cost(inst, _counting(calls), PlanOptions(time_limit_s=30.0))
        runs.append((_key(s), calls, s.unsearched))
    assert runs[0] == runs[1]
    assert runs[0][2] == 0 and len(runs[0][1]) == len(by_cost._subsets(inst)) > 1


def test_the_cpu_limit_still_ends_the_subset_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A limit far below the CPU the first planner run takes: the later subsets are left out, counted."""
    inst = _priced()
    monkeypatch.setattr(by_cost, "time", _wall(0.0))
    calls: list[float] = []
    s = by_cost.plan_by_cost(inst, _counting(calls), PlanOptions(time_limit_s=1e-9))
    assert len(calls) == 1 and s.unsearched == len(by_cost._subsets(inst)) - 1 > 0
