"""Mixed precision (runner dtype ``bfloat16``): bf16 weights, activations and gradients, fp32 master
weights and optimizer state. The optimizer's update equals fp32 Adam on the masters fed the bf16
gradients; the bytes per parameter are the cost model's for bf16 training; the export turns it on for
a bf16 job; a distributed run follows single-process bf16 training and resumes exactly (the masters
travel in the checkpoint)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from hgopt.cost.tables import optimizer_bytes_per_param  # noqa: E402
from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.instances import load_instance  # noqa: E402
from hgopt.runner.precision import MasterWeightOptimizer  # noqa: E402


def test_master_weights_step_like_fp32_adam_and_memory_matches_the_cost_model() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    ref = torch.optim.Adam(ref_params, lr=1e-2)
    opt = MasterWeightOptimizer(list(model.parameters()), lambda ps: torch.optim.Adam(ps, lr=1e-2))
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        opt.zero_grad()
        model(x).float().square().sum().backward()
        for p, r in zip(model.parameters(), ref_params):
            assert p.grad.dtype == torch.bfloat16
            r.grad = p.grad.float()
        opt.step()
        ref.step()
    for p, m, r in zip(model.parameters(), opt.masters, ref_params):
        assert torch.equal(m, r) and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16)) and not torch.equal(p.float(), m)  # bf16 copy, rounded
    # bytes per parameter: bf16 weight + bf16 gradient + fp32 master + two fp32 moments
    numel = sum(p.numel() for p in model.parameters())
    held = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # weight + gradient
    held += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)  # master + exp_avg + exp_avg_sq
    prof = load_instance("geo-3r-gpt1.3b").model
    assert held / numel == 2 * 2 + optimizer_bytes_per_param(prof, "bf16", "adam") == 16


def test_export_picks_bf16_for_a_bf16_job() -> None:
    from tests.runner_plans import plan_dp_tp, runner_instance

    inst = load_instance("hf-llama-tiny-2r")
    bf16 = replace(inst, job=replace(inst.job, precision="bf16"))
    from tests.test_runner_hf import _plan_dp_tp

    assert build_runner_plan(_plan_dp_tp(), bf16, ExportOptions()).train.dtype == "bfloat16"
    assert build_runner_plan(_plan_dp_tp(), inst, ExportOptions()).train.dtype == "float32"
    assert build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(dtype="float64")).train.dtype == "float64"


def test_distributed_bf16_run_follows_one_process_and_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from hgopt.runner.checkpoint import load_full_state
    from hgopt.runner.reference import train_reference
    from hgopt.runner.summary import read_metrics
    from tests.test_runner_hf import _plan_dp_tp, _run

    rp = build_runner_plan(_plan_dp_tp(), load_instance("hf-llama-tiny-2r"), ExportOptions(dtype="bfloat16", lr=3e-3))
    _run(rp, tmp_path / "full")
    ref, ref_losses = train_reference(rp, 3)
    got = load_full_state(tmp_path / "full")
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    # bf16 sums in another order (replicas, tp, all-reduce): parameters agree to a few bf16 steps, not exactly
    # per tensor: relative norm difference of a few bf16 units (2^-8 = 3.9e-3), where float64 agrees to 1e-10
    rel = {n: float((p.detach().float() - got[n].float()).norm() / p.detach().float().norm())
           for n, p in ref.named_parameters()}
    assert max(rel.values()) < 2e-2, max(rel.items(), key=lambda kv: kv[1])
    losses = [r["loss"] for r in read_metrics(tmp_path / "full")]
    assert losses == pytest.approx(ref_losses, rel=2e-2) and losses[-1] < losses[0]
    _run(rp, tmp_path / "resumed", steps=1)
    _run(rp, tmp_path / "resumed", steps=3, resume=True)
    again = load_full_state(tmp_path / "resumed")
    assert all(torch.equal(got[n], again[n]) for n in got)
