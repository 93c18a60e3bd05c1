"""Cost as an objective (issue #14 item 4): the $ lower bound by hand and against every plan found,
--objective cost on a geo-* instance (prices set here, illustrative) cheaper than --objective time
with each objective's proven gap, --budget, --pareto, $/Mtoken in compare."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hgopt.cli import main
from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, get_planner
from hgopt.search.by_cost import cost_lower_bound, pareto, plan_by_cost, plan_usd
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology

GPUS = {"A100-40": 0.01, "V100-16": 0.02}
PRICES = {"a": 3.6, "b": 1.0}


def _tiny() -> dict:
    topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, 40.0), ("b", "V100-16", 2, 2, 40.0)))
    for c in topo["clusters"]:
        c["cost_per_gpu_hour"] = PRICES[c["name"]]
    return {"name": "tiny", "model": tiny_model(gpus=GPUS), "topology": topo,
            "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}


def _inst() -> Instance:
    d = _tiny()
    return tiny_instance(global_batch=8, model=d["model"], topology=d["topology"])


def test_cost_bound_by_hand() -> None:
    """tiny_model: per sample and layer tp x (fwd + bwd) / mbs = 3 x base for every tp and mbs, so the
    cheapest is min over clusters of price x 3 x base: a 3.6 x 0.03 = 0.108, b 1.0 x 0.06 = 0.06 $-s/h;
    8 samples x 4 layers of b's; plus each layer's optimizer step once: tp x update_s / tp = 0.001 s at
    b's $1 (cheaper than a's $3.6)."""
    assert cost_lower_bound(_inst()) == pytest.approx((8 * 4 * 1.0 * 3 * 0.02 + 4 * 1.0 * 0.001) / 3600)


@pytest.mark.parametrize("cluster, dp, mbs, m, tp", [("a", 4, 1, 2, 1), ("b", 2, 2, 2, 1), ("b", 1, 2, 4, 2),
                                                     ("a", 2, 4, 1, 2)])
def test_every_plan_costs_at_least_the_bound(cluster: str, dp: int, mbs: int, m: int, tp: int) -> None:
    inst = _inst()
    plan = Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(
        ReplicaGroup(cluster=cluster, tp=tp, dp=dp, mbs=mbs),)),), num_microbatches=m),))
    t, usd = plan_usd(plan, inst, build_tables(inst))
    assert math.isfinite(t) and usd is not None and usd >= cost_lower_bound(inst) * (1 - 1e-12)


def test_objective_cost_prefers_the_cheap_cluster_and_states_its_gap() -> None:
    inst = _inst()
    s = plan_by_cost(inst, get_planner("heuristic"), PlanOptions(time_limit_s=20), objective="cost")
    assert s.best is not None and s.best.result.plan is not None
    assert all(c.usd_per_iteration is None or c.usd_per_iteration >= s.best.usd_per_iteration for c in s.candidates)
    assert all(c.usd_per_iteration is None or c.usd_per_iteration >= s.lower_bound * (1 - 1e-12)  # type: ignore[operator]
               for c in s.candidates)
    assert s.gap == pytest.approx((s.best.usd_per_iteration - s.lower_bound) / s.best.usd_per_iteration)  # type: ignore[operator]
    t, usd = plan_usd(s.best.result.plan, inst, build_tables(inst))
    assert usd == s.best.usd_per_iteration and t == s.best.iteration_time_s


def test_budget_keeps_plans_within_it_and_pareto_is_nondominated() -> None:
    inst = _inst()
    free = plan_by_cost(inst, get_planner("heuristic"), PlanOptions(time_limit_s=20), objective="time")
    rates = sorted({c.usd_per_hour for c in free.candidates if c.usd_per_hour is not None})
    assert len(rates) >= 2
    budget = (rates[0] + rates[1]) / 2  # only the cheapest-per-hour plans fit
    s = plan_by_cost(inst, get_planner("heuristic"), PlanOptions(time_limit_s=20), objective="time",
                     budget_usd_per_hour=budget)
    assert s.best is not None and s.best.usd_per_hour <= budget  # type: ignore[operator]
    assert s.lower_bound is None or s.lower_bound <= s.best.iteration_time_s
    front = pareto(free.candidates)
    for c in front:
        assert not any(o.iteration_time_s < c.iteration_time_s and o.usd_per_iteration < c.usd_per_iteration  # type: ignore[operator]
                       for o in free.candidates if o.usd_per_iteration is not None)


def test_geo_instance_cost_objective_is_cheaper_than_time_each_with_its_proven_gap() -> None:
    """geo-3r-gpt1.3b with illustrative list prices (H100-80 $9.8, A100-80 $3.7, A100-40 $2.9 per
    GPU-hour): the fastest plan runs on the H100s, the cheapest per iteration elsewhere. The exact
    planner proves each: the time plan's gap to its time bound, the cost plan's to the $ bound."""
    from hgopt.instances import load_instance

    inst = load_instance("geo-3r-gpt1.3b")
    prices = {"H100-80": 9.8, "A100-80": 3.7, "A100-40": 2.9}
    topo = dataclasses.replace(inst.topology, clusters=tuple(
        dataclasses.replace(c, cost_per_gpu_hour=prices[c.gpu]) for c in inst.topology.clusters))
    inst = dataclasses.replace(inst, topology=topo)
    tables = build_tables(inst)
    # gap 5 %: the same plan and bound as at the default 1 % (1.3452 s, gap 0.55 %) in a fifth of the CPU
    # time (3.2 s instead of 16.3 s, measured): the property needs a proven gap, not the 1 % one
    fast = get_planner("milp")(inst, PlanOptions(time_limit_s=60, gap=0.05))
    assert fast.plan is not None and fast.lower_bound_s is not None and fast.gap is not None
    t_fast, usd_fast = plan_usd(fast.plan, inst, tables)
    assert fast.lower_bound_s <= t_fast
    cheap = plan_by_cost(inst, get_planner("milp"), PlanOptions(time_limit_s=120), objective="cost", tables=tables)
    assert cheap.best is not None and cheap.gap is not None and cheap.lower_bound is not None
    assert usd_fast is not None and cheap.best.usd_per_iteration < usd_fast  # type: ignore[operator]
    assert cheap.lower_bound <= cheap.best.usd_per_iteration  # type: ignore[operator]
    assert 0 <= cheap.gap < 1 and 0 <= fast.gap < 1


def test_cli_objective_cost_budget_pareto_and_unpriced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps(_tiny()))
    out = tmp_path / "p.json"
    assert main(["-q", "plan", str(path), "--planner", "heuristic", "--objective", "cost", "--time-limit", "20",
                 "--json", "-o", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    chosen = [c for c in doc["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and Plan.from_json(out.read_text()) == Plan.from_dict(chosen[0]["plan"])
    # <= up to rounding: on this instance the bound (with its optimizer term) is attained by the one-node plan
    assert doc["objective"] == "cost" and doc["lower_bound"] * (1 - 1e-12) <= chosen[0]["usd_per_iteration"]
    assert main(["-q", "plan", str(path), "--planner", "heuristic", "--pareto", "--time-limit", "20"]) == 0
    text = capsys.readouterr().out
    assert "Pareto front" in text and "lower bound on the time" in text
    bare = _tiny()
    del bare["topology"]["clusters"][1]["cost_per_gpu_hour"]
    path.write_text(json.dumps(bare))
    assert main(["-q", "plan", str(path), "--objective", "cost"]) == 2
    assert "cost_per_gpu_hour" in capsys.readouterr().err


def test_compare_shows_dollars_per_million_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps(_tiny()))
    assert main(["-q", "compare", str(path), "--planners", "heuristic,uniform", "--time-limit", "10", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    inst = _inst()
    for r in rows:
        plan = Plan.from_dict(r["plan"])
        ev = evaluate(plan, inst)
        _, usd = plan_usd(plan, inst, build_tables(inst))
        assert r["usd_per_million_tokens"] == pytest.approx(usd / (8 * 128) * 1e6)  # type: ignore[operator]
        assert ev.feasible
    assert main(["-q", "compare", str(path), "--planners", "heuristic", "--time-limit", "10"]) == 0
    assert "$/Mtoken" in capsys.readouterr().out


def test_sigint_during_the_cost_search_keeps_what_was_priced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import signal
    import time

    import hgopt.commands.plan_cost as plan_cost
    from hgopt.search import PlanResult

    ran: list[str] = []

    def planner(instance: Instance, options: PlanOptions) -> PlanResult:
        ran.append(instance.name)
        assert options.progress is not None
        os.kill(os.getpid(), signal.SIGINT)  # handled by the command: sets the stop flag
        end = time.monotonic() + 60
        while not options.progress.stop_requested() and time.monotonic() < end:
            time.sleep(0.01)
        plan = Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(
            ReplicaGroup(cluster="b", dp=4, mbs=1),)),), num_microbatches=2),))
        return PlanResult(planner="fake", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)

    monkeypatch.setattr(plan_cost, "get_planner", lambda name: planner)
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps(_tiny()))
    assert main(["-q", "plan", str(path), "--objective", "cost", "--json"]) == 130
    doc = json.loads(capsys.readouterr().out)
    assert len(ran) == 1 and len(doc["candidates"]) == 1 and "SIGINT" in doc["interrupted"]
    assert doc["candidates"][0]["chosen"] and doc["gap"] is not None
