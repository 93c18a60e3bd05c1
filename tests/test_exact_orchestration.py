"""The exact planner's orchestration (issue #11): no import cycle, the warm start as a solver hint,
no cutoff handed to a solver, batch splits, and a tiny time limit that still returns a consistent
status, plan and bound."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import numpy as np
import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.cost.pipeline import stages_that_matter
from hgopt.search import PlanOptions
from hgopt.search import milp as milp_mod
from hgopt.search.blocks import Window, block_options, cheap_bounds
from hgopt.search.exact import plan_exact
from hgopt.search.milp import BatchSplit, batch_splits, build_milp, decode, plan_hint, plan_milp, work_lower_bound
from hgopt.solvers import SolveOptions, solve
from tests.factories import tiny_instance, tiny_model, tiny_topology
from tests.test_milp import _expected, _instance


@pytest.fixture(autouse=True)
def _k_identical_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    """colgen: this file checks the k-identical space's certificate against its own brute force;
    the certificate over grouped plans too is tests/test_master.py's."""
    monkeypatch.setattr("hgopt.search.exact.GROUPED_BOUND_DEFAULT", "off")


def test_the_milp_planner_imports_no_other_planner() -> None:
    """milp does not import the heuristic (the warm start is injected) and relax does not import milp."""
    code = ("import sys, hgopt.search.milp, hgopt.search.relax; "
            "print(sorted(m for m in sys.modules if m.startswith('hgopt.search.hierarchical')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert not hasattr(milp_mod, "ROUND_TRIP")


@pytest.mark.parametrize("batch", (1, 12, 36, 64, 97))
def test_batch_splits_are_every_factorisation(batch: int) -> None:
    inst = tiny_instance(global_batch=batch, model=tiny_model(num_layers=3),
                         topology=tiny_topology(clusters=(("a", "A", 2, 4, 40.0),)))
    kmax = inst.topology.num_gpus()
    want = [(k, b, batch // (k * b)) for k in range(1, min(batch, kmax) + 1) if batch % k == 0
            for b in range(1, batch // k + 1) if (batch // k) % b == 0]
    assert [(s.k, s.microbatch, s.num_microbatches) for s in batch_splits(inst)] == want


def _split_model(inst: object, sp: BatchSplit) -> object:
    tables = build_tables(inst)  # type: ignore[arg-type]
    cheap = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch,  # type: ignore[arg-type]
                         num_microbatches=sp.num_microbatches)
    opts = block_options(inst, tables, replicas=sp.k, microbatch=sp.microbatch,  # type: ignore[arg-type]
                         num_microbatches=sp.num_microbatches, d_cap=stages_that_matter(sp.num_microbatches),
                         window=Window(t_lb=cheap.t_lb, s_lb=cheap.s_lb, weight=cheap.weight))
    return build_milp(inst, tables, sp, opts, cheap)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
def test_the_hint_of_a_decoded_plan_decodes_to_that_plan(seed: int) -> None:
    """``plan_hint`` inverts ``decode``: the hint of a MILP solution's plan, unhinted variables at 0,
    decodes to the same plan, and sets exactly one block option per cluster of its chain."""
    inst = _instance(seed)
    for sp in batch_splits(inst)[:3]:
        form = _split_model(inst, sp)
        r = solve(form.model, "highs", SolveOptions(time_limit_s=20))  # type: ignore[attr-defined]
        if r.values is None:
            continue
        plan = decode(inst, form, r.values)  # type: ignore[arg-type]
        hint = plan_hint(inst, form, plan)  # type: ignore[arg-type]
        x = np.zeros(len(form.model.vars))  # type: ignore[attr-defined]
        for j, v in hint.items():
            x[j] = v
        assert decode(inst, form, x) == plan  # type: ignore[arg-type]
        chain = list(dict.fromkeys(st.groups[0].cluster for st in plan.pipelines[0].stages))
        assert sorted(form.y[j].cluster for j, v in hint.items() if v == 1.0 and j in form.y) == sorted(chain)  # type: ignore[attr-defined]
        other = type(form)(split=BatchSplit(k=sp.k, microbatch=sp.microbatch * 2,  # type: ignore[call-arg]
                                            num_microbatches=sp.num_microbatches), model=form.model)  # type: ignore[attr-defined]
        assert plan_hint(inst, other, plan) == {}  # type: ignore[arg-type]  # a plan of another split


def test_no_cutoff_reaches_the_solver_and_the_warm_start_is_a_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = _instance(1)
    seen: list[tuple[float, int]] = []
    real = milp_mod.solve

    def spy(model: object, name: str, options: SolveOptions) -> object:
        seen.append((options.bound_limit, len(model.hint)))  # type: ignore[attr-defined]
        return real(model, name, options)  # type: ignore[arg-type]

    monkeypatch.setattr(milp_mod, "solve", spy)
    tables = build_tables(inst)
    warm_plan = None

    def warm(i: object, t: object, seconds: float) -> object:
        return warm_plan

    # the warm start: the plan of one split's MILP, handed back to plan_milp as its first incumbent
    sp = batch_splits(inst)[-1]
    form = _split_model(inst, sp)
    r = real(form.model, "highs", SolveOptions(time_limit_s=20))  # type: ignore[attr-defined]
    assert r.values is not None
    warm_plan = decode(inst, form, r.values)  # type: ignore[arg-type]
    assert evaluate(warm_plan, inst, tables).feasible
    res = plan_milp(inst, PlanOptions(time_limit_s=60, gap=1e-7, extra={"relaxation": "off"}), warm_start=warm)
    assert seen and all(b == math.inf for b, _ in seen)
    assert any(h > 0 for _, h in seen)  # the warm start's split got its plan as a hint
    assert res.plan is not None and res.iteration_time_s <= evaluate(warm_plan, inst, tables).iteration_time_s + 1e-9


@pytest.mark.parametrize("limit", (1e-4, 0.02, 0.3))
@pytest.mark.parametrize("seed", (0, 3))
def test_a_tiny_limit_returns_a_consistent_status_plan_and_bound(limit: float, seed: int) -> None:
    """Whatever the limit cuts short: the plan is scored by evaluate, the bound is below the
    brute-force optimum (and the plan), 'optimal' only within --gap, 'feasible' with a plan."""
    inst = _instance(seed)
    best = _expected(seed)
    t0 = time.perf_counter()
    res = plan_exact(inst, PlanOptions(time_limit_s=limit, gap=0.01))
    assert time.perf_counter() - t0 < limit + 30.0
    assert res.status in ("optimal", "feasible", "infeasible")
    if res.lower_bound_s is not None:
        assert res.lower_bound_s <= best * (1 + 1e-9)
    if res.plan is None:
        assert res.status == "infeasible" and not math.isfinite(best)
        return
    ev = evaluate(res.plan, inst, build_tables(inst))
    assert ev.feasible and res.iteration_time_s == pytest.approx(ev.iteration_time_s, rel=1e-12)
    assert res.iteration_time_s >= best * (1 - 1e-9)
    assert res.lower_bound_s is not None and res.lower_bound_s <= res.iteration_time_s
    gap = res.gap
    assert gap is not None and (gap <= 0.01 + 1e-12) == (res.status == "optimal")
    assert ("certified" in res.solver) <= (res.status == "optimal"), res.solver  # no certificate claimed falsely
    if any(n.startswith("time limit reached before the cheap bounds") for n in res.notes):
        assert res.lower_bound_s <= work_lower_bound(inst, build_tables(inst)) * (1 + 1e-12)


def test_a_wider_link_policy_is_warm_started_with_the_native_searchs_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --link-precision auto the native search runs first and its plan is the wider search's
    warm start whenever it beats the heuristic's (here the heuristic offers nothing)."""
    import hgopt.search.exact as exact
    from hgopt.search.hierarchical import HeuristicResult

    inst = _instance(2)
    monkeypatch.setattr(exact, "heuristic_incumbent",
                        lambda *a, **k: HeuristicResult(plan=None, skeleton=None))
    calls: list[tuple[str, object, object]] = []
    real = exact.plan_milp

    def spy(instance: object, options: PlanOptions, *, warm_start: object = None, outside: object = None) -> object:
        res = real(instance, options, warm_start=warm_start, outside=outside)  # type: ignore[arg-type]
        offered = warm_start(instance, build_tables(instance), 1.0) if warm_start else None  # type: ignore[operator,arg-type]
        calls.append((options.extra.get("link_precision", "native"), offered, res.plan))
        return res

    monkeypatch.setattr(exact, "plan_milp", spy)
    res = exact.plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-6, extra={"link_precision": "auto"}))
    assert [c[0] for c in calls] == ["native", "auto"]
    assert calls[0][1] is None  # the heuristic offered nothing to the native search
    narrow = calls[0][2]
    assert narrow is not None and calls[1][1] == narrow  # the native plan is the wider search's warm start
    assert res.iteration_time_s <= evaluate(narrow, inst, build_tables(inst)).iteration_time_s + 1e-12  # type: ignore[arg-type]
    assert any(n.startswith("warm start of this search: the native-link search's plan") for n in res.notes)


@pytest.mark.parametrize("policy", ("native", "auto"))
def test_same_input_limit_and_seed_give_the_same_plan_when_the_search_completes(policy: str) -> None:
    inst = _instance(4)
    runs = [plan_exact(inst, PlanOptions(time_limit_s=120, gap=1e-7, seed=3, extra={"link_precision": policy}))
            for _ in range(2)]
    assert all(r.status == "optimal" for r in runs), [r.status for r in runs]
    assert runs[0].plan is not None and runs[0].plan.to_json() == runs[1].plan.to_json()  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", __import__("hgopt.solvers", fromlist=["x"]).available_backends())
@pytest.mark.parametrize("seed", (1, 5))
def test_every_backends_planner_bound_is_below_brute_force(backend: str, seed: int) -> None:
    """The planner's bound with each backend (short limit, no warm start, no relaxations: the MILPs
    decide) never exceeds the brute-force optimum, and its plan never beats it."""
    inst = _instance(seed)
    best = _expected(seed)
    res = plan_exact(inst, PlanOptions(time_limit_s=5.0, gap=1e-6, solver=backend,
                                       extra={"warm_start": "none", "relaxation": "off"}))
    if not math.isfinite(best):
        assert res.plan is None
        return
    assert res.lower_bound_s is not None and res.lower_bound_s <= best * (1 + 1e-6)
    if res.plan is not None:
        assert res.iteration_time_s >= best * (1 - 1e-9)


def test_an_infeasible_instance_says_what_binds() -> None:
    topo = tiny_topology(clusters=(("a", "A", 1, 2, 1.14), ("b", "A", 1, 2, 1.14)))
    inst = tiny_instance(global_batch=4, model=tiny_model(num_layers=4, params=5e8, gpus={"A": 0.01}), topology=topo)
    res = plan_exact(inst, PlanOptions(time_limit_s=10))
    assert res.status == "infeasible" and res.plan is None and res.lower_bound_s is None
    assert "certified" not in res.solver and "bounds are infinite" in res.solver
    assert any(n.startswith("no plan of this space fits: the bounds of all 6 batch splits") for n in res.notes)


@pytest.mark.parametrize("seed", range(6))
def test_the_work_bound_is_below_brute_force(seed: int) -> None:
    """``work_lower_bound`` (compute GPU-seconds over all GPUs: the bound of splits the time limit
    leaves without a cheap bound) never exceeds the best plan of the space, and is positive."""
    inst = _instance(seed)
    best = _expected(seed)
    lb = work_lower_bound(inst, build_tables(inst))
    assert lb > 0
    if math.isfinite(best):
        assert lb <= best * (1 + 1e-12)
