"""``hgopt compare``: every row scored by evaluate, ratios and gaps computed from those scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import hgopt.commands.compare as compare_mod
from hgopt.cli import main
from hgopt.cost import evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions, PlanResult
from hgopt.spec import Instance
from tests.factories import tiny_instance


def _plan(dp_a: int, mbs: int, m: int) -> Plan:
    return Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster="a", dp=dp_a, mbs=mbs),)),),
                                    num_microbatches=m),))


def _fake_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three fake planners with known plans; 'milp' reports a lower bound of 0.1 s."""

    def make(plan: Plan | None, bound: float | None, status: str):  # type: ignore[no-untyped-def]
        def planner(instance: Instance, options: PlanOptions) -> PlanResult:
            t = evaluate(plan, instance).iteration_time_s if plan else math.inf
            return PlanResult(planner="x", status=status, plan=plan, iteration_time_s=t,  # type: ignore[arg-type]
                              lower_bound_s=bound, search_time_s=0.5)
        return planner

    fakes = {"milp": make(_plan(4, 1, 2), 0.1, "feasible"), "slow": make(_plan(1, 1, 8), None, "heuristic"),
             "none": make(None, None, "infeasible")}

    def bad(instance: Instance, options: PlanOptions) -> PlanResult:
        raise ValueError("--planner bad: cannot handle this model")

    monkeypatch.setattr(compare_mod, "get_planner", lambda n: bad if n == "bad" else fakes[n])
    monkeypatch.setattr(compare_mod, "planner_names", lambda: ("milp", "slow", "none", "bad"))


def test_rows_are_scored_by_evaluate(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_registry(monkeypatch)
    inst = tiny_instance(global_batch=8)
    rows = {r.planner: r for r in compare_mod.compare(inst, ["milp", "slow", "none", "bad"], 10.0)}
    t_milp = evaluate(_plan(4, 1, 2), inst).iteration_time_s
    t_slow = evaluate(_plan(1, 1, 8), inst).iteration_time_s
    assert t_milp < t_slow
    assert rows["milp"].iteration_time_s == pytest.approx(t_milp)
    assert rows["milp"].vs_best == pytest.approx(1.0)
    assert rows["slow"].vs_best == pytest.approx(t_milp / t_slow)
    assert rows["slow"].throughput_samples_per_s == pytest.approx(8 / t_slow)
    assert rows["slow"].gap_to_bound == pytest.approx((t_slow - 0.1) / t_slow)
    assert rows["milp"].gap_to_bound == pytest.approx((t_milp - 0.1) / t_milp)
    assert rows["none"].plan is None and rows["none"].vs_best == 0.0 and rows["none"].gap_to_bound is None
    assert rows["bad"].status == "error" and "cannot handle" in rows["bad"].note
    assert rows["milp"].gpus == 4
    # the own gap uses the row's own bound; gap_to_bound names the row whose bound it uses
    assert rows["milp"].own_gap == pytest.approx((t_milp - 0.1) / t_milp) and rows["slow"].own_gap is None
    assert rows["slow"].bound_from == "milp" and rows["none"].bound_from is None
    text = compare_mod.render(inst, list(rows.values()))
    assert "own gap" in text and "gap to milp bound" in text


def test_bad_arguments_name_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_registry(monkeypatch)
    with pytest.raises(ValueError, match="--time-limit"):
        compare_mod.compare(tiny_instance(), ["milp"], 0.0)
    with pytest.raises(ValueError, match="--planners"):
        compare_mod._planner_list(["milp,nope"])
    assert compare_mod._planner_list(["milp,slow", "slow"]) == ["milp", "slow"]


def test_cli_json_plot_and_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, tl = tmp_path / "bars.png", tmp_path / "tl.png"
    rc = main(["compare", "default", "--planners", "uniform,dp-only", "--time-limit", "30", "--json",
               "--plot", str(plot), "--timeline", str(tl)])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["planner"] for r in rows] == ["uniform", "dp-only"]
    assert max(r["vs_best"] for r in rows) == pytest.approx(1.0)
    for r in rows:
        assert r["iteration_time_s"] > 0 and Plan.from_dict(r["plan"]).planner == r["planner"]
    assert plot.read_bytes()[:4] == b"\x89PNG" and tl.read_bytes()[:4] == b"\x89PNG"


def test_cli_table_and_unknown_planner(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "default", "--planners", "dp-only"]) == 0
    out = capsys.readouterr().out
    assert "dp-only" in out and "samples/s" in out
    assert main(["compare", "default", "--planners", "nope"]) == 2
    assert "--planners" in capsys.readouterr().err


def test_variants_set_the_planner_option(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, dict[str, str]]] = []

    def planner(name: str):  # type: ignore[no-untyped-def]
        def run(instance: Instance, options: PlanOptions) -> PlanResult:
            seen.append((name, dict(options.extra)))
            return PlanResult(planner=name, status="heuristic", plan=_plan(4, 1, 2))
        return run

    monkeypatch.setattr(compare_mod, "get_planner", planner)
    monkeypatch.setattr(compare_mod, "planner_names", lambda: ("heuristic", "metis"))
    rows = compare_mod.compare(tiny_instance(global_batch=8), ["heuristic", "heuristic:fp8", "metis:slowest-link"],
                               5.0, {"max_compressed_links": "1"})
    assert [r.planner for r in rows] == ["heuristic", "heuristic:fp8", "metis:slowest-link"]
    assert seen == [("heuristic", {"max_compressed_links": "1"}),
                    ("heuristic", {"max_compressed_links": "1", "link_precision": "fp8"}),
                    ("metis", {"max_compressed_links": "1", "bandwidth": "slowest-link"})]
    assert compare_mod._default_planners()[-1] == "heuristic:auto"


def test_milp_auto_row_and_the_bound_of_the_milp_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """`milp:auto` is a default row next to `heuristic:auto`; it runs the exact planner with
    link_precision auto, and the gap column uses the least bound of the milp rows (it holds for the
    plans of both spaces)."""
    seen: list[tuple[str, dict[str, str]]] = []

    def planner(name: str):  # type: ignore[no-untyped-def]
        def run(instance: Instance, options: PlanOptions) -> PlanResult:
            seen.append((name, dict(options.extra)))
            bound = 0.05 if options.extra.get("link_precision") == "auto" else 0.1
            return PlanResult(planner=name, status="optimal", plan=_plan(4, 1, 2), lower_bound_s=bound)
        return run

    monkeypatch.setattr(compare_mod, "get_planner", planner)
    monkeypatch.setattr(compare_mod, "planner_names", lambda: ("milp", "heuristic"))
    assert compare_mod._default_planners() == ["milp", "heuristic", "milp:auto", "heuristic:auto"]
    rows = compare_mod.compare(tiny_instance(global_batch=8), ["milp", "milp:auto"], 5.0)
    assert seen == [("milp", {}), ("milp", {"link_precision": "auto"})]
    t = rows[0].iteration_time_s
    assert rows[0].gap_to_bound == pytest.approx((t - 0.05) / t)
    # the milp row's gap is measured against the milp:auto row's bound, and the table says so
    assert rows[0].bound_from == "milp:auto" and rows[0].own_gap == pytest.approx((t - 0.1) / t)
    assert "gap to milp:auto bound" in compare_mod.render(tiny_instance(global_batch=8), rows)
