"""One conformance suite run against every available MILP backend, plus the MPS/LP writers."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from hgopt.solvers import SolveOptions, available_backends, get_backend, solve
from hgopt.solvers.model import LinearModel

BACKENDS = available_backends()


def bottleneck_model(seed: int, n: int = 10, pick: int = 4, brute: bool = True) -> tuple[LinearModel, float]:
    """Pick ``pick`` of n items into 3 groups; minimise 3·(heaviest group) + 0.1·(total weight).
    Returns the model and its optimum by brute force (nan when ``brute`` is False)."""
    rng = random.Random(seed)
    w = [rng.uniform(0.1, 1.0) for _ in range(n)]
    m = LinearModel(name=f"toy{seed}")
    ys = [m.add_binary(f"y{i}") for i in range(n)]
    t = m.add_var("T", kind="time")
    for g in range(3):
        m.add_row(f"T{g}", {t: 1.0, **{ys[i]: -w[i] for i in range(g, n, 3)}}, lb=0.0, kind="time")
    m.add_row("pick", {y: 1.0 for y in ys}, lb=pick, ub=pick)
    m.set_objective({t: 3.0, **{ys[i]: 0.1 * w[i] for i in range(n)}}, offset=0.5)
    if not brute:
        return m, math.nan
    best = min(0.5 + 3 * max(sum(w[i] for i in s if i % 3 == g) for g in range(3)) + 0.1 * sum(w[i] for i in s)
               for s in itertools.combinations(range(n), pick))
    return m, best


def _tol(backend: str) -> float:
    return 1e-4 if backend == "cp-sat" else 1e-7  # CP-SAT works on times rounded to 1 µs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_optimum_and_bound_match_brute_force(backend: str, seed: int) -> None:
    m, best = bottleneck_model(seed)
    r = solve(m, backend, SolveOptions(time_limit_s=20, relative_gap=1e-9))
    assert r.status == "optimal", r
    assert r.objective == pytest.approx(best, rel=_tol(backend))
    assert r.bound <= best * (1 + 1e-9)
    assert r.bound >= best * (1 - 10 * _tol(backend))
    assert r.values is not None and m.violation(np.round(r.values, 6)) < 1e-5 + 1e-4 * (backend == "cp-sat")
    assert r.solver == backend and r.version and r.wall_s >= 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasible_model_is_reported_infeasible(backend: str) -> None:
    m = LinearModel(name="infeasible")
    a, b = m.add_binary("a"), m.add_binary("b")
    m.add_row("both", {a: 1.0, b: 1.0}, lb=2.0)
    m.add_row("one", {a: 1.0, b: 1.0}, ub=1.0)
    m.set_objective({a: 1.0})
    r = solve(m, backend, SolveOptions(time_limit_s=10))
    assert r.status == "infeasible"
    assert r.values is None and not math.isfinite(r.objective)


@pytest.mark.parametrize("backend", BACKENDS)
def test_time_limited_run_keeps_a_valid_incumbent_and_bound(backend: str) -> None:
    m, _ = bottleneck_model(7, n=60, pick=25, brute=False)
    r = solve(m, backend, SolveOptions(time_limit_s=0.5, relative_gap=0.0))
    assert r.status in ("optimal", "feasible", "no_solution")
    assert r.wall_s < 30
    if r.values is not None:
        assert m.violation(np.round(r.values, 6)) < 1e-4
        assert r.objective == pytest.approx(m.objective_value(r.values), rel=1e-9)
    if math.isfinite(r.bound) and r.values is not None:
        assert r.bound <= r.objective * (1 + 1e-9)
    if r.status == "optimal":
        assert r.gap <= 1e-6 + 1e-3 * (backend == "cp-sat")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_feasible_hint_is_accepted(backend: str) -> None:
    m, best = bottleneck_model(3)
    m.hint = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}  # items 0..3 picked: feasible, generally not optimal
    r = solve(m, backend, SolveOptions(time_limit_s=20, relative_gap=1e-9))
    assert r.status == "optimal"
    assert r.objective == pytest.approx(best, rel=_tol(backend))


def test_unknown_backend_names_the_setting() -> None:
    with pytest.raises(ValueError, match="--solver"):
        get_backend("gurobi-please")


def test_mps_text_round_trips_to_the_same_optimum() -> None:
    from ortools.math_opt.io.python import mps_converter
    from ortools.math_opt.python import mathopt

    m, best = bottleneck_model(1)
    proto = mps_converter.mps_to_model_proto(m.to_mps())
    res = mathopt.solve(mathopt.Model.from_model_proto(proto), mathopt.SolverType.HIGHS)
    assert res.termination.reason == mathopt.TerminationReason.OPTIMAL
    assert res.objective_value() == pytest.approx(best, rel=1e-9)


def test_lp_text_is_read_by_highs_to_the_same_optimum(tmp_path: object) -> None:
    highspy = pytest.importorskip("highspy")
    m, best = bottleneck_model(2)
    path = tmp_path / "toy.lp"  # type: ignore[operator]
    path.write_text(m.to_lp())
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    assert h.readModel(str(path)) == highspy.HighsStatus.kOk
    h.run()
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    assert h.getInfo().objective_function_value == pytest.approx(best, rel=1e-9)
