"""determinism (issue #11 item 5): the backends' work limit (``SolveOptions.node_limit``). Conformance on every
available backend: a solve stopped by the work limit keeps a valid incumbent and a bound at or below the
brute-force optimum; it says which limit ended it; the same model, options and seed give the same result
(a node limit is counted in the solver's own work, not in seconds); cutoff and infeasible cases under a
work limit stay sound. No wall-clock verdicts: the time limits here are generous watchdogs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hgopt.solvers import SolveOptions, available_backends, solve
from tests.test_solvers import _tol, bottleneck_model, infeasible_model

BACKENDS = available_backends()
REACHES = {"highs": (7, 60, 25), "pulp-highs": (7, 60, 25), "scip": (7, 60, 25), "cp-sat": (8, 200, 90)}
"""Per backend, a model (seed, n, pick) on which one node (CP-SAT: one node's deterministic time) does not
finish the search (CBC closes these models at its root, so it has none here)."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nodes", (1, 4))
def test_a_work_limited_bound_is_below_the_brute_force_optimum(backend: str, nodes: int) -> None:
    m, best = bottleneck_model(5, n=16, pick=6)
    r = solve(m, backend, SolveOptions(time_limit_s=60, relative_gap=0.0, node_limit=nodes))
    assert r.status in ("optimal", "feasible", "no_solution"), r
    assert r.bound <= best * (1 + 10 * _tol(backend)), (r.bound, best)
    if r.values is not None:
        assert r.objective >= best * (1 - _tol(backend))
        assert m.violation(np.round(r.values, 6)) < 1e-4
    assert r.limit in ("", "work")  # the 60 s watchdog is not what ended it
    if r.status == "optimal":
        assert r.limit == ""


@pytest.mark.parametrize("backend", sorted(set(REACHES) & set(BACKENDS)))
def test_the_work_limit_is_reached_and_said(backend: str) -> None:
    seed, n, pick = REACHES[backend]
    m, _ = bottleneck_model(seed, n=n, pick=pick, brute=False)
    r = solve(m, backend, SolveOptions(time_limit_s=120, relative_gap=0.0, node_limit=1))
    full = solve(m, backend, SolveOptions(time_limit_s=120, relative_gap=0.0))
    assert r.status in ("feasible", "no_solution") and r.limit == "work", r
    assert full.status == "optimal" and full.limit == ""
    assert r.bound <= full.objective * (1 + 10 * _tol(backend))  # a valid (weaker) bound
    if r.values is not None:
        assert m.violation(np.round(r.values, 6)) < 1e-4 + 1e-4 * (backend == "cp-sat")
        assert r.objective >= full.objective * (1 - _tol(backend))
    if backend in ("highs", "pulp-highs", "scip"):
        assert 0 <= r.nodes <= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_work_limit_gives_the_same_result(backend: str) -> None:
    seed, n, pick = REACHES.get(backend, (7, 60, 25))
    m, _ = bottleneck_model(seed, n=n, pick=pick, brute=False)
    opts = SolveOptions(time_limit_s=120, relative_gap=0.0, node_limit=2, seed=3)
    a, b = solve(m, backend, opts), solve(m, backend, opts)
    assert (a.status, a.objective, a.bound, a.limit) == (b.status, b.objective, b.bound, b.limit)
    assert (a.values is None) == (b.values is None)
    if a.values is not None and b.values is not None:
        assert np.array_equal(a.values, b.values)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", (0.9, 1.1))
def test_a_cutoff_under_a_work_limit_never_bounds_above_the_optimum(backend: str, where: float) -> None:
    m, best = bottleneck_model(4)
    r = solve(m, backend, SolveOptions(time_limit_s=60, relative_gap=1e-9, bound_limit=where * best, node_limit=1))
    assert r.status in ("optimal", "feasible", "infeasible", "no_solution"), r
    assert r.bound <= best * (1 + 10 * _tol(backend)), (r.status, r.bound, best)
    if r.values is not None:
        assert r.objective >= best * (1 - _tol(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infeasible_model_under_a_work_limit_is_infeasible_or_unsolved(backend: str) -> None:
    m = infeasible_model("infeasible3")
    r = solve(m, backend, SolveOptions(time_limit_s=60, node_limit=1))
    assert r.values is None and not math.isfinite(r.objective)
    assert r.status in ("infeasible", "no_solution")
