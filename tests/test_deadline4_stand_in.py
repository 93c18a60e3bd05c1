"""deadline4 (issue #11 item 4): the stand-in plan a deadline-stopped search returns when it had no
incumbent (``_search.stand_in``, the uniform grid) was the phase that overran ``--time-limit 5`` on
scale-64r: 2.7 CPU s at 16384 GPUs (``_needs_shards`` once per cluster and DP degree, then four
``evaluate`` runs of the same grid), i.e. 20+ s of wall at a fraction of a core. Counted work, no
wall-clock verdicts: the grid's memory checks are paid once per GPU type, and the stand-in is
evaluated once on the way to the result (the grid search's own finalists, as many as fit in
``QUICK_PLAN_S``, are not counted: that count depends on the machine's speed)."""

from __future__ import annotations

import math

import pytest

import hgopt.commands._search as search_mod
import hgopt.search.baselines.uniform as uniform
from hgopt.commands._search import at_deadline, stand_in
from hgopt.cost import build_tables, evaluate
from hgopt.instances import load_instance
from hgopt.progress import Progress
from hgopt.search import PlanResult
from hgopt.search.baselines._common import block_layout


def _reference_grid(inst, tables, pp, tp, mbs, zero):  # type: ignore[no-untyped-def]
    """``_largest_grid`` as it was before the cache: every cluster's shard need asked afresh."""
    G = inst.job.global_batch
    usable = [c for c in inst.topology.clusters if tp in inst.model.tps(c.gpu) and c.gpus_per_node % tp == 0]
    if not usable:
        return None
    ranges = block_layout(inst).stage_ranges(pp)
    for dp in range(sum(c.num_gpus for c in usable) // (pp * tp), 0, -1):
        if G % (dp * mbs):
            continue
        m = G // (dp * mbs)
        fit = tuple(c for c in usable
                    if uniform._needs_shards(inst, tables, c, tp, mbs, m, ranges) <= (dp if zero else 1))
        if sum(c.num_gpus for c in fit) >= pp * tp * dp:
            return uniform.GridConfig(pp=pp, tp=tp, dp=dp, mbs=mbs, zero=zero), fit
    return None


@pytest.mark.parametrize("name", ["sailor-geo-5x32", "geo-8r-llama70b"])
def test_the_cached_grid_search_finds_the_uncached_grids_asking_once_per_gpu_type(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inst = load_instance(name)
    tables = build_tables(inst)
    layout = block_layout(inst)
    pps = [p for p in range(1, layout.blocks + 1) if layout.blocks % p == 0][:4]
    tps = sorted({t for c in inst.topology.clusters for t in inst.model.tps(c.gpu)})
    keys = [(pp, tp, mbs, zero) for pp in pps for tp in tps for mbs in uniform._mbs_choices(inst, tp) for zero in (0, 1)]
    want = [_reference_grid(inst, tables, *k) for k in keys]

    asked: list[tuple[object, ...]] = []
    real = uniform._needs_shards

    def counted(instance, tabs, c, tp, mbs, m, ranges):  # type: ignore[no-untyped-def]
        asked.append((c.gpu, c.gpu_memory_bytes, len(ranges), tp, mbs, m))
        return real(instance, tabs, c, tp, mbs, m, ranges)

    monkeypatch.setattr(uniform, "_needs_shards", counted)
    cache: dict[tuple[object, ...], float] = {}
    got = [uniform._largest_grid(inst, tables, *k, cache) for k in keys]
    assert got == want and any(g is not None for g in got)
    assert len(asked) == len(set(asked))  # each (GPU type, memory, grid, m) asked once
    types = {(c.gpu, c.gpu_memory_bytes) for c in inst.topology.clusters}
    assert len({a[2:] for a in asked}) * len(types) >= len(asked)
    if len(types) < len(inst.topology.clusters):  # repeated types: fewer asks than the per-cluster loop made
        monkeypatch.setattr(uniform, "_needs_shards", real)
        before = len(asked)
        asked.clear()
        monkeypatch.setattr(uniform, "_needs_shards", counted)
        for k in keys:
            _reference_grid(inst, tables, *k)
        assert before < len(asked)


def test_the_stand_in_is_evaluated_once_and_its_time_is_evaluates(monkeypatch: pytest.MonkeyPatch) -> None:
    inst = load_instance("sailor-geo-5x32")
    calls: list[object] = []

    def counted(plan, instance, tables=None):  # type: ignore[no-untyped-def]
        calls.append(plan)
        return evaluate(plan, instance, tables)

    monkeypatch.setattr(search_mod, "evaluate", counted)
    res = at_deadline(PlanResult(planner="milp", status="interrupted", plan=None, lower_bound_s=0.5),
                      Progress("milp"), inst)
    assert res.plan is not None and res.plan.planner == "uniform" and dict(res.plan.meta)["status"] == "feasible"
    ev = evaluate(res.plan, inst)
    assert ev.feasible and res.iteration_time_s == ev.iteration_time_s
    assert not calls  # the grid search's evaluate of it is reused (before: quick_plan's and at_deadline's, two more)
    assert any("uniform baseline" in n for n in res.notes)


def test_no_grid_no_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uniform, "search_grid", lambda *a, **k: None)
    plan, notes, t = stand_in(load_instance("sailor-geo-5x32"))
    assert plan is None and math.isinf(t) and "no feasible plan" in notes[0]


def _waiting_planner(report_plan: bool):  # type: ignore[no-untyped-def]
    """A search that (optionally) reports an incumbent, then waits for the stop (at most WAIT_S):
    its result says whether it saw one."""
    import time

    def planner(instance, options):  # type: ignore[no-untyped-def]
        assert options.progress is not None
        plan = uniform.plan_uniform(instance) if report_plan else None
        if plan is not None:
            options.progress.report("heuristic", plan=plan)
        for _ in range(int(WAIT_S / 0.01)):
            if options.progress.stop_requested():
                break
            time.sleep(0.01)
        return PlanResult(planner="fake", status="heuristic" if plan else "interrupted", plan=plan,
                          notes=("saw the stop",) if options.progress.stop_is_set() else ())
    return planner


WAIT_S = 3.0  # only reached when nothing stops the search (the incumbent case, and a broken stop)


@pytest.mark.parametrize("report_plan", [False, True])
def test_without_an_incumbent_the_stand_in_is_made_before_the_stop(report_plan: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake clock stands 5 s before ``stop_at`` with ``stand_in_s`` = 10: a search with no
    incumbent gets the stand-in made then (once: the clock moves to the stop only when it is made,
    and the deadline path takes it instead of making another); one with an incumbent gets none."""
    from hgopt.commands._search import run_planner
    from hgopt.search import PlanOptions
    from tests.factories import FakeClock, tiny_instance

    clock = FakeClock(95.0)
    made: list[object] = []
    real = search_mod.stand_in

    def counted(instance):  # type: ignore[no-untyped-def]
        made.append(instance)
        clock.now = 100.0  # the stop is due right after it
        return real(instance)

    monkeypatch.setattr(search_mod, "stand_in", counted)
    res = run_planner("fake", _waiting_planner(report_plan), tiny_instance(), PlanOptions(time_limit_s=5.0),
                      Progress("fake"), stop_at=100.0, stand_in_s=10.0, clock=clock, grace_s=WAIT_S + 5)
    if report_plan:
        assert not made and res.plan is not None and res.plan.planner == "uniform" and res.status == "heuristic"
        assert not any("deadline" in n for n in res.notes)
    else:
        assert len(made) == 1 and res.plan is not None and res.plan.planner == "uniform"
        assert any("deadline" in n for n in res.notes) and any("uniform baseline" in n for n in res.notes)
        assert res.iteration_time_s == evaluate(res.plan, tiny_instance()).iteration_time_s


def test_the_reserve_grows_with_the_gpus_and_the_slowdown() -> None:
    small, big = load_instance("default"), load_instance("scale-64r-16384-gpt175b")
    from hgopt.commands._search import STAND_IN_CPU_S, stand_in_reserve_s

    assert stand_in_reserve_s(small) < stand_in_reserve_s(big) == pytest.approx(STAND_IN_CPU_S[0] + STAND_IN_CPU_S[1] * 16384)
    assert stand_in_reserve_s(big, 4.0) == pytest.approx(4.0 * stand_in_reserve_s(big))
