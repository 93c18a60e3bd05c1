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


# ---- conformance under a cutoff, a time limit and a gap: every bound against brute force (issue #11) ----
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", (0.9, 1.0, 1.1))
def test_a_cutoff_never_yields_a_bound_above_the_optimum(backend: str, where: float) -> None:
    """``bound_limit`` (a cutoff) at 0.9, 1.0 and 1.1 times the brute-force optimum: whatever the
    backend makes of it, its bound stays at or below the optimum and any incumbent at or above."""
    m, best = bottleneck_model(4)
    r = solve(m, backend, SolveOptions(time_limit_s=20, relative_gap=1e-9, bound_limit=where * best))
    assert r.status in ("optimal", "feasible", "infeasible", "no_solution"), r
    assert r.bound <= best * (1 + 10 * _tol(backend)), (r.status, r.bound, best)
    if r.values is not None:
        assert r.objective >= best * (1 - _tol(backend))
        assert m.violation(np.round(r.values, 6)) < 1e-4
    if where > 1.0:  # the optimum lies below the cutoff: it must be found
        assert r.status == "optimal" and r.objective == pytest.approx(best, rel=_tol(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("limit", (0.01, 0.2))
def test_a_time_limited_bound_is_below_the_brute_force_optimum(backend: str, limit: float) -> None:
    m, best = bottleneck_model(5, n=16, pick=6)
    r = solve(m, backend, SolveOptions(time_limit_s=limit, relative_gap=0.0))
    assert r.status in ("optimal", "feasible", "no_solution"), r
    assert r.bound <= best * (1 + 10 * _tol(backend))
    if r.values is not None:
        assert r.objective >= best * (1 - _tol(backend))
        assert r.objective == pytest.approx(m.objective_value(r.values), rel=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gap", (0.02, 0.2))
def test_a_gap_limited_solve_bounds_the_optimum_from_both_sides(backend: str, gap: float) -> None:
    """Stopped at a relative gap: bound <= optimum <= objective, and 'optimal' only within the gap."""
    for seed in range(3):
        m, best = bottleneck_model(10 + seed, n=12, pick=5)
        r = solve(m, backend, SolveOptions(time_limit_s=20, relative_gap=gap))
        assert r.status == "optimal", r
        assert r.bound <= best * (1 + 10 * _tol(backend)) and r.objective >= best * (1 - _tol(backend))
        assert r.gap <= gap + 1e-6 + 1e-3 * (backend == "cp-sat")


def infeasible_model(name: str) -> LinearModel:
    """Pick at least 3 of 4 binaries and at most 1: infeasible; the objective T >= y0."""
    m = LinearModel(name=name)
    t = m.add_var("T", kind="time")
    ys = [m.add_binary(f"y{i}") for i in range(4)]
    m.add_row("pick3", {y: 1.0 for y in ys}, lb=3.0)
    m.add_row("pick1", {y: 1.0 for y in ys}, ub=1.0)
    m.add_row("T", {t: 1.0, ys[0]: -1.0}, lb=0.0, kind="time")
    m.set_objective({t: 1.0})
    return m


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infeasible_model_bounds_nothing_wrongly(backend: str) -> None:
    """Infeasible: no incumbent; the bound is +inf (every plan — there is none — is above it) or absent."""
    m = infeasible_model("infeasible2")
    r = solve(m, backend, SolveOptions(time_limit_s=10, bound_limit=5.0))
    assert r.status == "infeasible" and r.values is None
    assert r.bound >= 5.0  # nothing below the cutoff (and nothing at all)


def test_the_hint_reaches_the_solver(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LinearModel.hint`` is handed to MathOpt as a solution hint and to CP-SAT as AddHint."""
    m, _ = bottleneck_model(3)
    m.hint = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}
    seen: dict[str, object] = {}
    if "highs" in BACKENDS:
        from ortools.math_opt.python import mathopt

        real = mathopt.solve

        def spy(model: object, solver: object, **kw: object) -> object:
            hints = kw["model_params"].solution_hints  # type: ignore[attr-defined]
            seen["mathopt"] = sorted((v.name, x) for h in hints for v, x in h.variable_values.items())
            return real(model, solver, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(mathopt, "solve", spy)
        solve(m, "highs", SolveOptions(time_limit_s=10))
        assert seen["mathopt"] == [("y0", 1.0), ("y1", 1.0), ("y2", 1.0), ("y3", 1.0)]
    if "cp-sat" in BACKENDS:
        from ortools.sat.python import cp_model

        got: list[tuple[int, int]] = []
        real_solve = cp_model.CpSolver.Solve

        def spy_solve(self: object, model: object, *a: object, **kw: object) -> object:
            hint = model.Proto().solution_hint  # type: ignore[attr-defined]
            got.extend(zip(hint.vars, hint.values))
            return real_solve(self, model, *a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(cp_model.CpSolver, "Solve", spy_solve)
        solve(m, "cp-sat", SolveOptions(time_limit_s=10))
        assert sorted(got) == [(0, 1), (1, 1), (2, 1), (3, 1)]
