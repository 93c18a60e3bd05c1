"""Session-wide fixtures: expensive planner runs shared by the tests that check properties of the same
result (each property still asserted by its own test), so that the suite pays for them once."""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest

UNLIMITED_HEURISTIC_OPTIONS: MappingProxyType[str, Any] = MappingProxyType({"time_limit_s": None, "cross_cluster_dp": False})
"""The options of :func:`unlimited_heuristic`: no clock (the search runs to its end whatever the machine's
load, so the plan is the same on every run) and no [H9] groups (the search whose work
``test_heuristic_scale`` counts)."""


@pytest.fixture(scope="session")
def unlimited_heuristic() -> Callable[[str], tuple[Any, Any]]:
    """``get(name) -> (instance, HeuristicResult)``: the shipped instance ``name`` planned once per session by
    ``plan_heuristic`` with :data:`UNLIMITED_HEURISTIC_OPTIONS` (scale-64r's search takes ~10 CPU s; the
    validity test of test_hierarchical and the work-counting test of test_heuristic_scale share it)."""
    from hgopt.instances import load_instance
    from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic

    done: dict[str, tuple[Any, Any]] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in done:
            inst = load_instance(name)
            done[name] = (inst, plan_heuristic(inst, options=HeuristicOptions(**UNLIMITED_HEURISTIC_OPTIONS)))
        return done[name]

    return get
