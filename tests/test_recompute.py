"""Activation recomputation per stage: the plan field (versioned JSON, old plans load), carried by the
export, run with ``torch.utils.checkpoint`` per layer: the same gradients as without, and only the
layer inputs saved for backward (counted with ``torch.autograd.graph.saved_tensors_hooks``); a
distributed run with recomputation on one stage trains like single-process training."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hgopt.errors import PlanError
from hgopt.plan import Plan, validate
from hgopt.instances import load_instance
from tests.runner_plans import G, pipeline

A, B = "us-a100-80", "eu-a100-40"


def _plan(recompute_stage: int | None) -> Plan:
    p = pipeline([((0, 1), [G(A, mbs=2)]), ((1, 2), [G(A, mbs=2)]), ((2, 3), [G(B, mbs=2)]), ((3, 4), [G(B, mbs=2)])],
                 m=4)
    stages = tuple(replace(s, recompute="full") if k == recompute_stage else s for k, s in enumerate(p.stages))
    return Plan(pipelines=(replace(p, stages=stages),))


def test_plan_field_round_trips_and_old_plans_load() -> None:
    plan = _plan(1)
    data = json.loads(plan.to_json())
    assert [s.get("recompute", "none") for s in data["pipelines"][0]["stages"]] == ["none", "full", "none", "none"]
    assert "recompute" not in data["pipelines"][0]["stages"][0]  # old readers see the same file as before
    assert Plan.from_dict(data) == plan
    old = json.loads(_plan(None).to_json())
    assert all(s.recompute == "none" for s in Plan.from_dict(old).pipelines[0].stages)
    data["pipelines"][0]["stages"][1]["recompute"] = "selective"
    with pytest.raises(PlanError, match=r"pipelines\[0\]\.stages\[1\]\.recompute: must be none or full"):
        Plan.from_dict(data)
    bad = Plan(pipelines=(replace(plan.pipelines[0], stages=(replace(plan.pipelines[0].stages[0], recompute="x"),)
                                  + plan.pipelines[0].stages[1:]),))
    assert any(v.where.endswith("stages[0].recompute") for v in validate(bad, load_instance("hf-llama-tiny-2r")))


def test_export_carries_recompute() -> None:
    from hgopt.export import ExportOptions, build_runner_plan
    from hgopt.export.runner_plan import RunnerPlan

    rp = build_runner_plan(_plan(2), load_instance("hf-llama-tiny-2r"), ExportOptions())
    assert [s.recompute for s in rp.pipelines[0].stages] == ["none", "none", "full", "none"]
    assert RunnerPlan.from_dict(json.loads(rp.to_json())) == rp


def _saved_bytes_and_grads(recompute: bool) -> tuple[int, dict[str, object], object]:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.runner.model import build_stage

    text = json.dumps(json.loads((Path(__file__).resolve().parents[1] / "instances/hf/llama-tiny/config.json").read_text()))
    cfg = ModelConfig(layers=("embedding", "block", "block", "head"), hidden=256, heads=4, vocab=256, seq=32,
                      hf_config=text)
    model = build_stage(cfg, 1, 3, dtype="float64", recompute=recompute)
    x = torch.randn(2, 32, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t):  # type: ignore[no-untyped-def]
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    y.square().sum().backward()
    return sum(storages.values()), {n: p.grad for n, p in model.named_parameters()}, x.grad


def test_recompute_same_gradients_and_only_layer_inputs_saved() -> None:
    plain_bytes, plain, plain_x = _saved_bytes_and_grads(False)
    rec_bytes, rec, rec_x = _saved_bytes_and_grads(True)
    assert all(bool((plain[n] == rec[n]).all()) for n in plain) and bool((plain_x == rec_x).all())  # type: ignore[union-attr]
    layer_input = 2 * 32 * 256 * 8  # float64 (b, s, h) per layer, two layers
    assert rec_bytes == 2 * layer_input
    assert plain_bytes > 10 * rec_bytes


@pytest.mark.parametrize("case", ["4-stages-recompute-stage-1", "tp2-stage-recompute"])
def test_distributed_run_with_recompute_equals_one_process(tmp_path: Path, case: str) -> None:
    pytest.importorskip("transformers")
    from hgopt.export import ExportOptions, build_runner_plan
    from tests.test_runner_hf import _plan_dp_tp, _run, _worst_abs

    if case.startswith("4-stages"):
        plan = _plan(1)
    else:
        p = _plan_dp_tp().pipelines[0]
        plan = Plan(pipelines=(replace(p, stages=(p.stages[0], replace(p.stages[1], recompute="full"))),))
    rp = build_runner_plan(plan, load_instance("hf-llama-tiny-2r"), ExportOptions(dtype="float64"))
    assert "full" in [s.recompute for s in rp.pipelines[0].stages]
    _run(rp, tmp_path)
    worst, name = _worst_abs(rp, tmp_path)
    assert worst <= 1e-10, f"{name} differs by {worst:.2e}"
