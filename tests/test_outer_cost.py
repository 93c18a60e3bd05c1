"""Issue #15: the outer-sync plan fields ([C9] OuterSync), the kernel's price of an outer round
(hgopt/cost/outer.py) against hand computation, and the low-communication search."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hgopt.cost import evaluate
from hgopt.cost.outer import delta_bytes, evaluate_outer, fragment_ranges, group_instance, group_plan
from hgopt.plan import OUTER_PLAN_VERSION, OuterSync, Pipeline, Plan, ReplicaGroup, Stage, validate
from hgopt.search import PlanOptions
from hgopt.search.lowcomm import plan_low_comm
from tests.factories import tiny_instance


def _pipe(cluster: str, cuts: tuple[int, ...] = (0, 4), m: int = 4) -> Pipeline:
    return Pipeline(stages=tuple(Stage(start=a, end=b, groups=(ReplicaGroup(cluster=cluster),))
                                 for a, b in zip(cuts, cuts[1:])), num_microbatches=m)


def _plan(**outer: object) -> Plan:
    return Plan(pipelines=(_pipe("a"), _pipe("b")), outer=OuterSync(groups=((0,), (1,)), **outer))  # type: ignore[arg-type]


# ---- plan fields ---------------------------------------------------------------------------------
def test_outer_round_trips_and_old_plans_load() -> None:
    plan = _plan(steps=10, precision="int8", lr=0.5, momentum=0.8, nesterov=False, block=64, fragments=2, overlap=True)
    doc = json.loads(plan.to_json())
    assert doc["version"] == OUTER_PLAN_VERSION and doc["outer"]["steps"] == 10
    assert Plan.from_json(plan.to_json()) == plan
    old = dataclasses.replace(plan, outer=None)
    assert json.loads(old.to_json())["version"] == 1 and "outer" not in json.loads(old.to_json())
    assert Plan.from_json(old.to_json()).outer is None


def test_outer_validation_names_the_field() -> None:
    inst = tiny_instance(global_batch=8)
    assert validate(_plan(steps=10), inst) == []
    bad = dataclasses.replace(_plan(), outer=OuterSync(groups=((0, 1),), steps=0, momentum=1.0))
    text = "\n".join(str(v) for v in validate(bad, inst))
    assert "outer.groups: needs at least two" in text
    assert "outer.steps" in text and "outer.momentum" in text
    dup = dataclasses.replace(_plan(), outer=OuterSync(groups=((0,), (0,))))
    assert "exactly once" in "\n".join(str(v) for v in validate(dup, inst))


def test_bad_outer_json_is_a_plan_error() -> None:
    from hgopt.errors import PlanError

    doc = json.loads(_plan().to_json())
    doc["outer"]["precision"] = "fp4"
    with pytest.raises(PlanError, match="outer.precision"):
        Plan.from_json(json.dumps(doc))


# ---- kernel ----------------------------------------------------------------------------------------
def test_delta_bytes_by_hand() -> None:
    assert delta_bytes(1000, "fp32", 2.0, 128) == 4000
    assert delta_bytes(1000, "bf16", 4.0, 128) == 2000
    assert delta_bytes(1000, "native", 2.0, 128) == 2000
    assert delta_bytes(1000, "int8", 4.0, 128) == 1000 + 8 * 4  # ceil(1000 / 128) = 8 fp32 scales
    assert delta_bytes(1024, "fp8", 4.0, 128) == 1024 + 8 * 4
    assert fragment_ranges(4, 2) == [(0, 2), (2, 4)]
    assert fragment_ranges(5, 3) == [(0, 1), (1, 3), (3, 5)]


def _inner(plan: Plan, inst: object, g: int) -> float:
    sub = group_plan(plan, plan.outer.groups[g])  # type: ignore[union-attr]
    clusters = tuple(sub.gpus_by_cluster())
    return evaluate(sub, group_instance(inst, clusters, sum(p.samples for p in sub.pipelines))).iteration_time_s  # type: ignore[arg-type]


def test_outer_round_by_hand() -> None:
    """Two one-cluster groups, 4 layers of 1e6 fp32 parameters: the delta is 16 MB; the WAN is one
    1 GB/s pipe with 10 ms latency, so the K = 2 ring takes 2·(1/2)·16e6 / 1e9 + 2·0.01 = 0.036 s (the
    100 Gbit/s NICs take 16e6 / 12.5e9 s, less); one holder per group: no broadcast; the outer update
    is one optimizer step over the 4 layers (4 × 1 ms on GPU A and B alike, tp 1)."""
    inst = tiny_instance(global_batch=8)
    plan = _plan(steps=10, precision="fp32")
    ev = evaluate_outer(plan, inst)
    t_a, t_b = _inner(plan, inst, 0), _inner(plan, inst, 1)
    assert t_b > t_a  # GPU B is twice as slow: it paces the round (lock-step)
    assert ev.feasible, ev.violations
    assert ev.inner_step_s == pytest.approx(t_b)
    assert ev.sync_s == pytest.approx(0.036)
    assert ev.update_s == pytest.approx(0.004)
    round_s = 10 * t_b + 0.036 + 0.004
    assert ev.round_s == pytest.approx(round_s)
    assert ev.tokens_per_s == pytest.approx(10 * 8 * 128 / round_s)
    assert ev.fluid_tokens_per_s == pytest.approx(4 * 128 / t_a + 4 * 128 / t_b)
    assert ev.outer_wan_bytes_per_round == pytest.approx(2 * 16e6)  # 2 ring edges of 2·(1/2)·16e6
    assert ev.wan_bytes_per_step == pytest.approx(2 * 16e6 / 10)
    assert ev.syncs_per_billion_tokens == pytest.approx(1e9 / (10 * 8 * 128))
    assert ev.gpus_used == 2

    q = evaluate_outer(_plan(steps=10, precision="int8"), inst)
    assert q.sync_s == pytest.approx(4.125e6 / 1e9 + 0.02)  # 4e6 bytes + 31250 fp32 scales
    two = evaluate_outer(_plan(steps=10, precision="fp32", fragments=2), inst)
    assert two.sync_s == pytest.approx(2 * (8e6 / 1e9 + 0.02))  # latency paid per fragment
    hidden = evaluate_outer(_plan(steps=10, precision="fp32", overlap=True), inst)
    assert hidden.exposed_sync_s == pytest.approx(max(0.0, 0.036 - 10 * t_b))
    assert hidden.round_s == pytest.approx(10 * t_b + hidden.exposed_sync_s + 0.004)


def test_segments_follow_every_pipeline_cut() -> None:
    """Group 1 cuts its pipeline after layer 1: the delta goes as segments [0,1) and [1,4); their rings
    run at once and share the pipe's aggregate cap ([C5w]), so the sync is the capped ring of the
    whole 16 MB (per flow the largest segment, 12 MB, is less)."""
    inst = tiny_instance(global_batch=8)
    plan = Plan(pipelines=(_pipe("a"), _pipe("b", (0, 1, 4))), outer=OuterSync(groups=((0,), (1,)), steps=5))
    ev = evaluate_outer(plan, inst)
    assert ev.sync_s == pytest.approx(0.036)


def test_groups_sharing_a_cluster_are_refused() -> None:
    inst = tiny_instance(global_batch=8)
    plan = Plan(pipelines=(_pipe("a"), _pipe("a")), outer=OuterSync(groups=((0,), (1,))))
    ev = evaluate_outer(plan, inst)
    assert not ev.feasible and any("share cluster" in v for v in ev.violations)


def test_outer_state_is_charged_to_gpu_memory() -> None:
    """The runner keeps the outer parameters and momentum on the device (8 bytes per fp32 parameter:
    4 layers x 1e6 -> 32 MB per GPU of a one-stage pipeline). GPU memory set between the stage's own
    peak and peak + 32 MB: the synchronous plan fits, the outer plan does not, naming the stage."""
    from tests.factories import tiny_topology

    base = tiny_instance(global_batch=8)
    peak = max(r.peak_memory_bytes for r in evaluate(group_plan(_plan(), (0,)), group_instance(base, ("a",), 4)).stages)
    gb = (peak + 16e6) / 1e9  # half the outer state above the peak
    inst = tiny_instance(global_batch=8, topology=tiny_topology(clusters=(("a", "A", 2, 2, gb), ("b", "B", 2, 2, 40.0))))
    assert evaluate(group_plan(_plan(), (0,)), group_instance(inst, ("a",), 4)).feasible
    ev = evaluate_outer(_plan(steps=10), inst)
    assert ev.outer_state_bytes_per_gpu == pytest.approx(32e6)
    assert not ev.feasible and any("outer state" in v and "stage 0" in v for v in ev.violations), ev.violations
    roomy = tiny_instance(global_batch=8, topology=tiny_topology(clusters=(("a", "A", 2, 2, gb + 0.02), ("b", "B", 2, 2, 40.0))))
    assert evaluate_outer(_plan(steps=10), roomy).feasible


# ---- search ----------------------------------------------------------------------------------------
def test_low_comm_search_reports_every_h() -> None:
    inst = tiny_instance(global_batch=16)
    res = plan_low_comm(inst, [1, 10, 100], PlanOptions(time_limit_s=5), planner="heuristic")
    assert [c.steps for c in res.choices] == [1, 10, 100]
    tps = [c.evaluation.tokens_per_s for c in res.choices]
    assert tps == sorted(tps)  # amortising the same sync over more steps never slows a round down
    for c in res.choices:
        e = c.evaluation
        assert e.syncs_per_billion_tokens == pytest.approx(1e9 / (c.steps * 16 * 128))
        assert e.tokens_per_s <= e.fluid_tokens_per_s * (1 + 1e-9) <= res.compute_bound_tokens_per_s * (1 + 1e-9)
        assert c.plan.outer is not None and c.plan.outer.steps == c.steps
        assert validate(c.plan, inst) == []
        again = evaluate_outer(c.plan, inst)
        assert again.tokens_per_s == pytest.approx(e.tokens_per_s)
        assert sum(g.samples for g in e.groups) == 16
    assert res.sync.plan is not None and math.isfinite(res.sync.tokens_per_s)
    assert any("changes the optimisation" in n for n in res.notes)


def test_plan_command_with_outer_steps(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from hgopt.cli import main
    from hgopt.plan import load_plan
    from hgopt.spec import instance_from_dict
    from tests.factories import tiny_model, tiny_topology

    d = Path(str(tmp_path))
    (d / "two.yaml").write_text(json.dumps({"name": "two", "model": tiny_model(), "topology": tiny_topology(),
                                            "job": {"global_batch": 16, "seq_len": 128, "precision": "fp32"}}))
    code = main(["plan", str(d / "two.yaml"), "--outer-steps", "1,20", "--planner", "heuristic", "--time-limit", "2",
                 "--delta-precision", "fp32,int8", "-o", str(d / "p.json")])
    out = capsys.readouterr().out
    assert code == 0
    assert "tokens/s" in out and "syncs/1e9 tok" in out and "WAN/step" in out
    assert "changes the optimisation" in out and "your choice" in out
    for h in (1, 20):
        plan = load_plan(d / f"p.H{h}.json")
        assert plan.outer is not None and plan.outer.steps == h and plan.outer.precision in ("fp32", "int8")
    capsys.readouterr()
    assert main(["evaluate", str(d / "two.yaml"), str(d / "p.H20.json")]) == 0  # priced by [C9], not as synchronous
    shown = capsys.readouterr().out
    ev = evaluate_outer(load_plan(d / "p.H20.json"), instance_from_dict(json.loads((d / "two.yaml").read_text())))
    assert "outer sync every 20 steps" in shown and f"{ev.tokens_per_s:,.0f} tokens/s" in shown
    assert main(["plan", str(d / "two.yaml"), "--outer-steps", "0"]) == 2
    assert main(["plan", str(d / "two.yaml"), "--outer-steps", "5", "--delta-precision", "fp4"]) == 2


def test_overlap_and_fragments_in_the_search() -> None:
    """Overlapping the exchange with the next H/F inner steps never slows a round down; streaming in 2
    fragments pays the ring latency twice when not overlapped."""
    inst = tiny_instance(global_batch=16)
    opts = PlanOptions(time_limit_s=5)
    base = plan_low_comm(inst, [10], opts, planner="heuristic", precisions=["fp32"])
    hid = plan_low_comm(inst, [10], opts, planner="heuristic", precisions=["fp32"], overlap=True)
    two = plan_low_comm(inst, [10], opts, planner="heuristic", precisions=["fp32"], fragments=2)
    b, h, f = (r.choices[0].evaluation for r in (base, hid, two))
    assert h.tokens_per_s >= b.tokens_per_s and h.exposed_sync_s <= b.exposed_sync_s
    assert two.choices[0].plan.outer.fragments == 2  # type: ignore[union-attr]
    assert f.sync_s >= b.sync_s
