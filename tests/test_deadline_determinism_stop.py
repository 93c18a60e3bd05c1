"""determinism (issue #11 item 5): the bound routines that took only a deadline — ``mixed_bound`` [H11b],
``master.grouped_bound`` [G3] and ``polish`` — take the search's stop flag (``Progress.stop_requested``): a set
stop returns at once (counted in the work done, not in seconds) with a valid, weaker bound (at most the
unstopped one) or the plan it started from."""

from __future__ import annotations

from typing import Any

import pytest

import hgopt.search.master as master
import hgopt.search.polish as polish_mod
from hgopt.cost import build_tables, evaluate
from hgopt.search import PlanOptions
from hgopt.search.milp import link_policy, plan_milp
from hgopt.search.mixed import compute_floor
from hgopt.search.mixed_bound import mixed_bound
from hgopt.spec import instance_from_dict
from tests.test_deadline_determinism import _three_clusters


def _inst() -> Any:
    return instance_from_dict(_three_clusters())


def test_a_set_stop_ends_mixed_bound_at_the_compute_floor() -> None:
    inst = _inst()
    tables = build_tables(inst)
    full = mixed_bound(inst, tables)
    stopped = mixed_bound(inst, tables, stop=lambda: True)
    floor = compute_floor(inst, tables)
    assert full.complete and not stopped.complete
    assert stopped.value == pytest.approx(floor) and stopped.value <= full.value * (1 + 1e-12)


def test_a_set_stop_ends_grouped_bound_before_any_share_table(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = _inst()
    tables = build_tables(inst)
    links = link_policy(inst, {})
    full = master.grouped_bound(inst, tables, links, target=10.0)
    calls = {"n": 0}
    real = master.cheap_bounds

    def counted(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(master, "cheap_bounds", counted)
    stopped = master.grouped_bound(inst, tables, links, target=10.0, stop=lambda: True)
    assert calls["n"] == 0  # nothing built after the stop
    assert not stopped.complete
    assert stopped.value <= full.value * (1 + 1e-12)  # weaker, still a bound


def test_a_stop_seen_midway_keeps_grouped_bound_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop answers True from its third query on: the partitions left keep their floors [G4]."""
    inst = _inst()
    tables = build_tables(inst)
    links = link_policy(inst, {})
    full = master.grouped_bound(inst, tables, links, target=10.0)
    asked = {"n": 0}

    def stop() -> bool:
        asked["n"] += 1
        return asked["n"] > 2

    part = master.grouped_bound(inst, tables, links, target=10.0, stop=stop)
    assert part.value <= full.value * (1 + 1e-12)


def test_a_set_stop_ends_polish_after_scoring_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = _inst()
    tables = build_tables(inst)
    res = plan_milp(inst, PlanOptions(time_limit_s=600, work_limit_s=30.0), warm_start=None)
    assert res.plan is not None
    count = {"n": 0}
    real = polish_mod.evaluate

    def counted(*a: Any, **k: Any) -> Any:
        count["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(polish_mod, "evaluate", counted)
    plan, value = polish_mod.polish(inst, tables, res.plan, penalty=lambda p: 0.0, stop=lambda: True)
    assert count["n"] == 1 and plan is res.plan
    assert value == pytest.approx(evaluate(res.plan, inst, tables).iteration_time_s)
    count["n"] = 0
    polish_mod.polish(inst, tables, res.plan, penalty=lambda p: 0.0)
    assert count["n"] > 1  # unstopped, it walks to the neighbours
