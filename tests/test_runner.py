"""The PyTorch runner on CPU/gloo: every parameter after 3 steps equals single-process training, for
plans with 2-4 stages, unequal replicas, tp 2, re-sharded boundaries, two pipelines, compressed
boundaries and ZeRO-1; bytes per boundary as logged; checkpoint and resume (also with ZeRO-1 optimizer
slices); device and backend resolution, and a run with ``--device cpu`` through the command line.

Ranks are children of a fork server that imported the runner once (``run_forked``), so that a run
costs no interpreter start-up per rank."""

from __future__ import annotations

import json
import math
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
from hgopt.cost.schedule import stage_ops  # noqa: E402
from hgopt.runner.summary import read_metrics, summarize  # noqa: E402
from tests.runner_plans import (  # noqa: E402
    G,
    pipeline,
    plan_dp_tp,
    plan_four_stages,
    plan_reshard,
    plan_two_pipelines,
    plan_zero_dp_tp,
    runner_instance,
    with_zero,
)

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
    "zero1-dp-unequal+tp2-dp2": (plan_zero_dp_tp(), runner_instance(), ExportOptions(dtype="float64")),
    "zero1-two-pipelines-mixed-tp": (with_zero(plan_two_pipelines()), runner_instance(), ExportOptions(dtype="float64")),
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


def _resumed_equals_uninterrupted(runs: dict[str, tuple[RunnerPlan, Path]], case: str, out: Path) -> Path:
    """Run ``case`` for 1 step, resume it to step 3 in ``out``; its parameters equal the uninterrupted
    run's and the resumed run logged steps 2 and 3 only (it started from the checkpoint). Returns the
    uninterrupted run's folder."""
    rp, full = runs[case]
    _run(rp, out, steps=1)
    _run(rp, out, steps=3, resume=True)
    a, b = load_full_state(full), load_full_state(out)
    assert max(float((a[n] - b[n]).abs().max()) for n in a) <= 1e-12
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    return full


def test_checkpoint_resume_equals_uninterrupted(runs: dict[str, tuple[RunnerPlan, Path]], tmp_path: Path) -> None:
    _resumed_equals_uninterrupted(runs, "reshard-3-stage", tmp_path)


@pytest.mark.parametrize("zero", [False, True], ids=["all-reduce", "zero1-reduce-scatter"])
def test_bf16_gradient_sync_only_across_clusters(tmp_path: Path, zero: bool) -> None:
    """Layer 2 is held by a cluster-a and a cluster-b replica (two pipelines): with
    grad_sync_precision bf16 only its all-reduce (with ZeRO-1: reduce-scatter) is narrowed, so after
    one step only its parameters differ from fp32 training, by about bf16's rounding."""
    from dataclasses import replace

    plan = replace(with_zero(plan_two_pipelines()) if zero else plan_two_pipelines(), grad_sync_precision="bf16")
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


# ---- ZeRO-1 ---------------------------------------------------------------------------------------------
def _zero_files(out: Path, step: int = 3) -> dict[tuple[int, int], dict[str, Any]]:
    path = out / "checkpoints" / f"step{step:06d}"
    return {(int(f.stem.split(".")[1][1:]), int(f.stem.split(".")[2][1:])): torch.load(f, weights_only=True)
            for f in path.glob("zero.g*.m*.pt")}


def test_zero1_optimizer_state_covers_only_the_own_slice(runs: dict[str, tuple[RunnerPlan, Path]]) -> None:
    """dp 3 + 1 and two tp-2 replicas, every stage zero 1: each sync-group member's Adam moments cover
    its half of the group's (one-bucket) flat parameters, and that is all the optimizer state the rank
    has; the stage files hold no optimizer state for sharded parameters."""
    rp, out = runs["zero1-dp-unequal+tp2-dp2"]
    assert [(g.start, g.ranks, g.zero) for g in rp.sync_groups] == [(0, (0, 1), 1), (2, (2, 4), 1), (2, (3, 5), 1)]
    files = _zero_files(out)
    assert sorted(files) == [(g, m) for g in range(3) for m in range(2)]
    for g in range(3):
        a, b = files[(g, 0)], files[(g, 1)]
        numel = a["numel"]
        # the tiny model's group is one 25 MiB bucket: member 0 owns its first half, member 1 the rest
        assert numel == sum(math.prod(s) for s in a["shapes"]) and (a["ranges"], b["ranges"]) == (
            [[0, math.ceil(numel / 2)]], [[math.ceil(numel / 2), numel]])
        for blob in (a, b):
            size = sum(hi - lo for lo, hi in blob["ranges"])
            assert {k: tuple(v.shape) for k, v in blob["state"].items() if v.dim() > 0} == {
                "exp_avg": (size,), "exp_avg_sq": (size,)}
            # the whole optimizer of this rank: two moments of its slice, nothing else
            assert blob["optimizer_elements"] == 2 * size and blob["model_elements"] == numel
    stage_files = list((out / "checkpoints" / "step000003").glob("p0.s*.t*.pt"))
    assert len(stage_files) == 3 and all(torch.load(f, weights_only=True)["optim"] == {} for f in stage_files)


def test_zero1_falls_back_to_full_state_for_mixed_tp(runs: dict[str, tuple[RunnerPlan, Path]]) -> None:
    """Layers 0-1 are held by a tp-2 and a tp-1 replica: not sharded (full optimizer state in the stage
    files); layers 2 and 3 are held across the two pipelines and are sharded."""
    rp, out = runs["zero1-two-pipelines-mixed-tp"]
    assert [(g.start, g.mode, g.zero) for g in rp.sync_groups] == [(0, "full", 0), (2, "shard", 1), (3, "shard", 1)]
    assert sorted(_zero_files(out)) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    s0 = torch.load(out / "checkpoints" / "step000003" / "p0.s0.t0.pt", weights_only=True)
    assert set(s0["optim"]) == set(s0["params"])  # tp-2 stage 0 of pipeline 0: layers 0-1, full Adam state


def test_zero1_checkpoint_resume_equals_uninterrupted(runs: dict[str, tuple[RunnerPlan, Path]], tmp_path: Path) -> None:
    full = _resumed_equals_uninterrupted(runs, "zero1-dp-unequal+tp2-dp2", tmp_path)
    moments = {k: v["state"]["exp_avg"] for k, v in _zero_files(full).items()}
    assert all(torch.equal(moments[k], v["state"]["exp_avg"]) for k, v in _zero_files(tmp_path).items())


def test_zero1_resume_refuses_a_mismatched_checkpoint(runs: dict[str, tuple[RunnerPlan, Path]]) -> None:
    """A checkpoint written without zero 1 has no optimizer slices, one written with it no stage-file
    state for the sharded parameters: resuming across the change fails with a message instead of
    restarting Adam's moments silently. (``restore`` runs no collective, so rank 0 is built here.)"""
    from hgopt.runner.checkpoint import restore
    from hgopt.runner.engine import make_optimizer
    from hgopt.runner.model import build_stage, layer_of
    from hgopt.runner.tp import TpGroup
    from hgopt.runner.zero import ZeroShard, optimizer_params

    zero_rp, zero_out = runs["zero1-dp-unequal+tp2-dp2"]
    _, plain_out = runs["dp-unequal+tp2"]
    sg = zero_rp.sync_groups[0]
    model = build_stage(zero_rp.model, sg.start, sg.end, dtype="float64")
    z = ZeroShard(0, sg, None, 0, [(n, p) for n, p in model.named_parameters() if sg.start <= layer_of(n) < sg.end])
    assert z.ranges == ((0, math.ceil(z.numel / 2)),)  # one bucket: the first half of the flat vector
    opt = make_optimizer(zero_rp, model, optimizer_params(model, (z,)))
    assert restore(zero_rp, 0, model, opt, TpGroup(), zero_out, (z,)) == 3
    assert opt.state[z.shard]["exp_avg"].shape == (math.ceil(z.numel / 2),) and len(opt.state) == 1
    # the same checkpoint resumed with one bucket per layer: member 0's slice of every layer
    zb = ZeroShard(0, sg, None, 0, [(n, p) for n, p in model.named_parameters() if sg.start <= layer_of(n) < sg.end],
                   cap_bytes=1.0)
    assert len(zb.buckets) == sg.end - sg.start and len(zb.ranges) == len(zb.buckets)
    optb = make_optimizer(zero_rp, model, optimizer_params(model, (zb,)))
    assert restore(zero_rp, 0, model, optb, TpGroup(), zero_out, (zb,)) == 3
    whole = torch.zeros(z.numel, dtype=torch.float64)
    whole[: math.ceil(z.numel / 2)] = opt.state[z.shard]["exp_avg"]
    checked = 0
    for (lo, hi), got in zip(zb.ranges, torch.split(optb.state[zb.shard]["exp_avg"], [h - l for l, h in zb.ranges])):
        if hi <= math.ceil(z.numel / 2):  # what member 0 of the saving run held, read back at its place
            assert torch.equal(got, whole[lo:hi])
            checked += 1
    assert checked >= 1
    with pytest.raises(ValueError, match=r"no ZeRO-1 optimizer slices for sync group 0 .*saved without zero 1"):
        restore(zero_rp, 0, model, make_optimizer(zero_rp, model, optimizer_params(model, (z,))), TpGroup(), plain_out, (z,))
    with pytest.raises(ValueError, match=r"has no optimizer state for layers\.0\..*saved with ZeRO-1"):
        restore(zero_rp, 0, model, make_optimizer(zero_rp, model), TpGroup(), zero_out)


def test_shard_bounds_tile_the_flat_parameters() -> None:
    from hgopt.runner.zero import shard_bounds

    for numel, n in ((10, 3), (9, 3), (2, 4), (1, 1)):
        spans = [shard_bounds(numel, n, i) for i in range(n)]
        assert spans[0][0] == 0 and spans[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(hi - lo for lo, hi in spans) == math.ceil(numel / n)
    with pytest.raises(ValueError, match="member 3 of 3"):
        shard_bounds(10, 3, 3)


# ---- device and backend ------------------------------------------------------------------------------
def test_device_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from hgopt.runner.device import DeviceChoice, local_index, rank_device, resolve_device

    cpu, cuda = DeviceChoice(kind="cpu", backend="gloo"), DeviceChoice(kind="cuda", backend="nccl")
    assert resolve_device("auto") == (cuda if torch.cuda.is_available() else cpu)  # this machine
    assert resolve_device("auto", cuda_available=lambda: False) == cpu
    assert resolve_device("auto", cuda_available=lambda: True) == cuda
    assert resolve_device("cuda", cuda_available=lambda: True) == cuda
    assert resolve_device("cpu", cuda_available=lambda: True) == cpu
    with pytest.raises(ValueError, match=r"--device cuda: torch.cuda.is_available\(\) is False"):
        resolve_device("cuda", cuda_available=lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    assert rank_device(cpu, 3) == torch.device("cpu")
    assert rank_device(cuda, 1, device_count=2) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="no CUDA device visible"):
        rank_device(cuda, 0, device_count=0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert local_index(7) == 2
    monkeypatch.delenv("LOCAL_RANK")
    assert local_index(7) == 7


def test_local_launcher_device_and_emulation_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    """With (mocked) GPUs: cuda for the local launcher needs one GPU per rank (auto falls back to the CPU,
    explicit cuda is an error); netns emulation is refused with cuda and auto means delay."""
    from hgopt.runner.launch import local_device, resolve_emulation

    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions())
    assert rp.device == "auto" and rp.world_size == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert local_device(rp, "auto") == "cuda" and local_device(rp, "cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_device(rp, "auto") == "cpu"
    with pytest.raises(ValueError, match="4 ranks but 2 GPU"):
        local_device(rp, "cuda")
    with pytest.raises(ValueError, match="netns is CPU/gloo-only"):
        resolve_emulation("netns", rp, "cuda")
    assert resolve_emulation("auto", rp, "cuda") == "delay"
    assert resolve_emulation("delay", rp, "cuda") == "delay"


def _two_rank_export(tmp_path: Path):  # type: ignore[no-untyped-def]
    from hgopt.export import write_export

    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=2)]), ((2, 4), [G("b", mbs=2)])], m=4),))
    rp = build_runner_plan(plan, runner_instance(), ExportOptions(local=True, master_port=0, dtype="float64",
                                                                  device="cuda"))
    return rp, write_export(rp, tmp_path)


def test_cli_run_with_device_cpu(tmp_path: Path) -> None:
    """`python -m hgopt.runner --device cpu` overrides the plan's device (cuda here) and trains with gloo
    on the CPU; the result is single-process training's."""
    import subprocess
    import sys

    rp, files = _two_rank_export(tmp_path)
    res = subprocess.run([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan), "--threads", "1",
                          "--device", "cpu"], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "device: cpu" in res.stderr and "device cpu (gloo)" in res.stderr
    worst, name = _worst_relative(rp, tmp_path / "run")
    assert worst <= 1e-12, f"{name} differs by {worst:.2e}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cli_device_cuda_without_gpu_is_a_clear_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    _, files = _two_rank_export(tmp_path)
    res = subprocess.run([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "hgopt.runner: error: --device cuda: torch.cuda.is_available() is False" in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("damage", ["truncated", "foreign", "not-a-dict"])
def test_a_damaged_checkpoint_file_is_named_in_the_error(tmp_path: Path, damage: str) -> None:
    """torch's own message for a truncated zip ("failed reading zip archive") names no file: the loader's does."""
    import torch

    from hgopt.runner.checkpoint import _load

    path = tmp_path / "p0.s0.t0.pt"
    torch.save({"tp": 1, "params": {"w": torch.ones(64)}}, path)
    assert _load(path)["tp"] == 1
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "foreign":
        path.write_text("this is not a checkpoint\n")
    else:
        torch.save([1, 2, 3], path)
    with pytest.raises(ValueError, match=str(path)):
        _load(path)
