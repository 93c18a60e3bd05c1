"""The PyTorch runner on CPU/gloo: every parameter after 3 steps equals single-process training, for
plans with 2-4 stages, unequal replicas, tp 2, re-sharded boundaries, two pipelines and compressed
boundaries; bytes per boundary as logged; checkpoint and resume.

Ranks are children of a fork server that imported the runner once (``run_forked``), so that a run
costs no interpreter start-up per rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.export.runner_plan import RunnerPlan  # noqa: E402
from hgopt.plan import Plan  # noqa: E402
from hgopt.runner.checkpoint import load_full_state  # noqa: E402
from hgopt.runner.codec import RoundTrip, decode, encode, quantize  # noqa: E402
from hgopt.runner.launch import run_forked  # noqa: E402
from hgopt.runner.reference import train_reference  # noqa: E402
from hgopt.runner.schedule import stage_ops  # noqa: E402
from hgopt.runner.summary import read_metrics, summarize  # noqa: E402
from tests.runner_plans import plan_dp_tp, plan_four_stages, plan_reshard, plan_two_pipelines, runner_instance  # noqa: E402

COMPRESSED = [("native", "native"), ("bf16", "bf16"), ("fp8", "fp8")]
CASES: dict[str, tuple[Plan, Any, ExportOptions]] = {
    "dp-unequal+tp2": (plan_dp_tp(), runner_instance(), ExportOptions(dtype="float64")),
    "4-stage-gpipe-compressed": (plan_four_stages(COMPRESSED), runner_instance(6, 6, embed_head=True),
                                 ExportOptions(dtype="float64")),
    "reshard-3-stage": (plan_reshard(), runner_instance(), ExportOptions(dtype="float64")),
    "two-pipelines-mixed-tp": (plan_two_pipelines(), runner_instance(), ExportOptions(dtype="float64")),
    "fp8-fwd-bf16-bwd": (plan_dp_tp(("fp8", "bf16")), runner_instance(), ExportOptions(dtype="float64")),
    "fp32-sgd": (plan_dp_tp(), runner_instance(), ExportOptions(dtype="float32", optimizer="sgd")),
    "4-stage-compressed-fp32": (plan_four_stages(COMPRESSED, schedule="1f1b"), runner_instance(6, 6, embed_head=True),
                                ExportOptions(dtype="float32", optimizer="sgd")),
}


def _run(rp: RunnerPlan, out: Path, **kw: Any) -> None:
    codes = run_forked(rp, out, timeout_s=120, **kw)
    assert codes == {r: 0 for r in range(rp.world_size)}, f"rank exit codes {codes}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[RunnerPlan, Path]]:
    """Each case trained once (3 steps), shared by the tests below."""
    out = {}
    for name, (plan, inst, opts) in CASES.items():
        rp = build_runner_plan(plan, inst, opts)
        d = tmp_path_factory.mktemp(name)
        _run(rp, d)
        out[name] = (rp, d)
    return out


def _worst_relative(rp: RunnerPlan, out: Path, steps: int = 3) -> tuple[float, str]:
    ref, _ = train_reference(rp, steps)
    got = load_full_state(out)
    assert set(got) == {n for n, _ in ref.named_parameters()}
    worst = max(((float((p.detach() - got[n]).norm() / p.detach().norm()), n) for n, p in ref.named_parameters()))
    return worst


# ---- schedule and codec ----------------------------------------------------------------------------
def test_1f1b_warmup_and_order() -> None:
    ops = stage_ops("1f1b", 0, 4, 6)
    kinds = "".join(o.kind for o in ops)
    assert kinds == "FFF" + "FB" * 3 + "BBB"
    assert "".join(o.kind for o in stage_ops("1f1b", 3, 4, 6)) == "FB" * 6
    for s in range(4):
        ops = stage_ops("1f1b", s, 4, 6)
        pos = {(o.kind, o.microbatch): i for i, o in enumerate(ops)}
        assert all(pos[("F", m)] < pos[("B", m)] for m in range(6))
        assert [o.microbatch for o in ops if o.kind == "B"] == list(range(6))
    assert "".join(o.kind for o in stage_ops("gpipe", 1, 4, 3)) == "FFFBBB"


def test_codec_sizes_and_errors() -> None:
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))
    assert [t.dtype for t in encode(x, "bf16", "fwd")] == [torch.bfloat16]
    payload, scale = encode(x, "fp8", "fwd")
    assert payload.dtype == torch.uint8 and payload.shape == x.shape and scale.shape == (1,)
    # per-tensor scale: the largest magnitude maps onto the format's largest value
    assert float(scale) == pytest.approx(float(x.abs().max()) / 448.0)
    for prec, direction, bound in (("bf16", "fwd", 4e-3), ("fp8", "fwd", 7e-2), ("fp8", "bwd", 1.3e-1)):
        err = float(((quantize(x, prec, direction) - x).abs() / x.abs().clamp_min(1e-3)).median())
        assert 0 < err < bound, (prec, direction, err)
    back = decode(encode(x, "fp8", "bwd"), "fp8", "bwd", torch.float32)
    assert torch.equal(back, quantize(x, "fp8", "bwd"))


def test_roundtrip_quantises_the_gradient_with_the_backward_precision() -> None:
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, dtype=torch.float64)
    RoundTrip.apply(x, "bf16", "fp8").backward(g)
    assert torch.equal(x.grad, quantize(g, "fp8", "bwd"))
    assert not torch.equal(x.grad, g)


# ---- end to end ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_parameters_match_single_process_training(runs: dict[str, tuple[RunnerPlan, Path]], case: str) -> None:
    rp, out = runs[case]
    worst, name = _worst_relative(rp, out)
    assert worst <= 1e-5, f"{name} differs by {worst:.2e} (relative)"


def test_losses_match_and_fall(runs: dict[str, tuple[RunnerPlan, Path]]) -> None:
    rp, out = runs["dp-unequal+tp2"]
    _, ref_losses = train_reference(rp, 3)
    logged = [r["loss"] for r in read_metrics(out)]
    assert logged == pytest.approx(ref_losses, rel=1e-9)
    assert logged[-1] < logged[0]


@pytest.mark.parametrize("case, itemsize", [("4-stage-compressed-fp32", 4), ("4-stage-gpipe-compressed", 8)])
def test_bytes_per_boundary_from_logs(runs: dict[str, tuple[RunnerPlan, Path]], case: str, itemsize: int) -> None:
    """Boundaries native, bf16 and fp8 of one run carry the same tensors (3 microbatches of
    2 x 32 x 64 activations per step): the logged bytes of bf16 are 2/itemsize of native, fp8 1/itemsize
    plus one float32 scale per message."""
    rp, out = runs[case]
    b = read_metrics(out)[-1]["bytes"]
    native, bf16, fp8 = (b[f"p0.b{k}.fwd"] for k in range(3))
    assert native == 3 * 2 * 32 * 64 * itemsize
    assert bf16 * itemsize == native * 2
    assert fp8 == native // itemsize + 3 * 4
    assert [b[f"p0.b{k}.bwd"] for k in range(3)] == [native, bf16, fp8]
    assert b["p0.b1.fwd.wan"] == bf16 and b["p0.b0.fwd.wan"] == 0  # stage 1 -> 2 crosses a -> b


def test_precision_round_trips_through_export(runs: dict[str, tuple[RunnerPlan, Path]]) -> None:
    plan, _, _ = CASES["fp8-fwd-bf16-bwd"]
    rp, out = runs["fp8-fwd-bf16-bwd"]
    assert summarize(rp, out)["boundaries"] == {"p0.b0": {"fwd": "fp8", "bwd": "bf16"}}
    assert json.loads(plan.to_json())["pipelines"][0]["boundaries"] == [{"fwd": "fp8", "bwd": "bf16"}]
    b = read_metrics(out)[-1]["bytes"]
    assert b["p0.b0.fwd"] == 8 * 32 * 64 + 2 * 2 * 4  # 2 senders x 2 microbatches, each with a scale
    assert b["p0.b0.bwd"] == 8 * 32 * 64 * 2


def test_checkpoint_resume_equals_uninterrupted(runs: dict[str, tuple[RunnerPlan, Path]], tmp_path: Path) -> None:
    rp, full = runs["reshard-3-stage"]
    _run(rp, tmp_path, steps=1)
    _run(rp, tmp_path, steps=3, resume=True)
    a, b = load_full_state(full), load_full_state(tmp_path)
    assert max(float((a[n] - b[n]).abs().max()) for n in a) <= 1e-12
    # the resumed run logged steps 2 and 3 only: it started from the checkpoint, not from scratch
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_bf16_gradient_sync_only_across_clusters(tmp_path: Path) -> None:
    """Layer 2 is held by a cluster-a and a cluster-b replica (two pipelines): with
    grad_sync_precision bf16 only its all-reduce is narrowed, so after one step only its parameters
    differ from fp32 training, by about bf16's rounding."""
    from dataclasses import replace

    plan = replace(plan_two_pipelines(), grad_sync_precision="bf16")
    rp = build_runner_plan(plan, runner_instance(), ExportOptions(dtype="float64"))
    assert [(g.start, g.clusters) for g in rp.sync_groups if len(g.clusters) > 1] == [(2, ("b", "a"))]
    _run(rp, tmp_path, steps=1)
    ref, _ = train_reference(rp, 1)
    got = load_full_state(tmp_path)
    rel = {n: float((p.detach() - got[n]).norm() / p.detach().norm()) for n, p in ref.named_parameters()}
    narrowed = [v for n, v in rel.items() if n.startswith("layers.2.")]
    assert min(narrowed) > 1e-12 and 1e-5 < max(narrowed) < 1e-2, narrowed
    assert max(v for n, v in rel.items() if not n.startswith("layers.2.")) < 1e-12


def test_layer_times_cover_every_layer() -> None:
    from hgopt.runner.timing import layer_times

    rp = build_runner_plan(plan_four_stages(), runner_instance(6, 6, embed_head=True), ExportOptions(hidden=32, seq=16))
    times = layer_times(rp.model, mbs=2, repeats=1, warmup=0)
    assert [t.layer for t in times] == list(range(6))
    assert all(t.fwd_s > 0 and t.bwd_s > 0 for t in times)
