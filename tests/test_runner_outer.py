"""Issue #15: the runner's outer synchronisation (hgopt/runner/outer.py) on CPU/gloo.

Two groups of different pipeline shapes train 5 steps with H = 2 (outer steps after steps 2 and 4):
group 0 is one 2-stage pipeline on cluster a whose second stage has two replicas; group 1 is two
pipelines on cluster b, one of 2 stages and one of 1. Its parameters equal a hand-written float64
reference (each group a single model trained on its own samples, its loss the mean over them; every H
steps the averaged deltas through an outer SGD with Nesterov momentum written out by hand) to 1e-12,
after the last outer step and after a further inner step where the groups have drifted apart again.
Resume from a checkpoint taken between two outer steps continues exactly; the delta codecs keep
their error within half a quantisation step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from torch import nn  # noqa: E402

from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.export.runner_plan import RunnerPlan  # noqa: E402
from hgopt.plan import OuterSync, Plan  # noqa: E402
from hgopt.runner.checkpoint import load_full_state  # noqa: E402
from hgopt.runner.data import IGNORE, Dataset  # noqa: E402
from hgopt.runner.engine import make_optimizer  # noqa: E402
from hgopt.runner.launch import run_forked  # noqa: E402
from hgopt.runner.model import build_stage  # noqa: E402
from hgopt.runner.outer import decode_delta, encode_delta, sync_due  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from tests.runner_plans import G, pipeline, runner_instance  # noqa: E402

H, STEPS, LR, MU = 2, 5, 0.7, 0.9


def outer_plan(precision: str = "native") -> Plan:
    """8 samples per step: group 0 = pipeline 0 (4 samples), group 1 = pipelines 1 and 2 (2 + 2)."""
    return Plan(pipelines=(
        pipeline([((0, 2), [G("a", mbs=2)]), ((2, 4), [G("a", dp=2, mbs=1)])], m=2),
        pipeline([((0, 1), [G("b", mbs=2)]), ((1, 4), [G("b", mbs=2)])], m=1),
        pipeline([((0, 4), [G("b", mbs=2)])], m=1),
    ), outer=OuterSync(groups=((0,), (1, 2)), steps=H, lr=LR, momentum=MU, precision=precision))  # type: ignore[arg-type]


def _rp(precision: str = "native", **kw: Any) -> RunnerPlan:
    return build_runner_plan(outer_plan(precision), runner_instance(), ExportOptions(dtype="float64", steps=STEPS, **kw))


def _run(rp: RunnerPlan, out: Path, **kw: Any) -> None:
    codes = run_forked(rp, out, timeout_s=180, **kw)
    assert codes == {r: 0 for r in range(rp.world_size)}, f"rank exit codes {codes}"


def reference(rp: RunnerPlan, steps: int, every: int = H) -> list[dict[str, torch.Tensor]]:
    """Per group the whole model after ``steps`` steps with an outer step every ``every``, written without
    the runner's outer module."""
    groups = ((0,), (1, 2))
    data = Dataset(rp.model, rp.train, rp.global_batch)
    models = [build_stage(rp.model, 0, rp.model.num_layers, seed=rp.train.seed, dtype=rp.train.dtype) for _ in groups]
    opts = [make_optimizer(rp, m) for m in models]
    theta = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    buf: dict[str, torch.Tensor] = {}
    for step in range(steps):
        for model, opt, members in zip(models, opts, groups):
            opt.zero_grad(set_to_none=True)
            pipes = [rp.pipelines[i] for i in members]
            rows = [r for p in pipes for r in range(p.sample_offset, p.sample_offset + p.samples)]
            tokens = sum(data.valid_tokens(step, r) for r in rows)
            for p in pipes:
                for m in range(p.num_microbatches):
                    first = p.sample_offset + m * p.microbatch
                    x, y = data.batch(step, range(first, first + p.microbatch))
                    h = x
                    for i in range(rp.model.num_layers):
                        h = model.layers[str(i)](h)
                    loss = nn.functional.cross_entropy(h.reshape(-1, h.shape[-1]), y.reshape(-1),
                                                       ignore_index=IGNORE, reduction="sum") / tokens
                    loss.backward()
            opt.step()
        if (step + 1) % every == 0:
            with torch.no_grad():
                for n in theta:
                    avg = sum(theta[n] - dict(m.named_parameters())[n] for m in models) / len(models)
                    buf[n] = avg.clone() if n not in buf else MU * buf[n] + avg
                    theta[n] = theta[n] - LR * (avg + MU * buf[n])  # SGD, Nesterov momentum
                    for m in models:
                        dict(m.named_parameters())[n].copy_(theta[n])
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunnerPlan, Path]:
    rp = _rp(checkpoint_every=H)
    out = tmp_path_factory.mktemp("outer")
    _run(rp, out)
    return rp, out


def test_export_keeps_gradient_sync_inside_groups() -> None:
    rp = _rp()
    assert rp.train.outer is not None and rp.train.outer.groups == ((0,), (1, 2))
    group_ranks = [{r for i in g for s in rp.pipelines[i].stages for rep in s.replicas for r in rep.ranks}
                   for g in rp.train.outer.groups]
    assert rp.sync_groups, "each group still all-reduces its gradients inside"
    for sg in rp.sync_groups:
        assert any(set(sg.ranks) <= ranks for ranks in group_ranks), sg
    assert RunnerPlan.from_dict(rp.to_dict()) == rp


def test_outer_sync_equals_hand_written_reference(straight: tuple[RunnerPlan, Path]) -> None:
    rp, out = straight
    after_sync = reference(rp, 4)
    for pipe in (0, 1, 2):  # step 4 ended with an outer step: every pipeline holds the outer parameters
        assert _worst(load_full_state(out, pipe, step=4), after_sync[0]) < 1e-12
    assert _worst(after_sync[0], after_sync[1]) == 0.0
    drifted = reference(rp, STEPS)
    assert _worst(drifted[0], drifted[1]) > 1e-6  # one more inner step: the groups differ again
    assert _worst(load_full_state(out, 0), drifted[0]) < 1e-12
    assert _worst(load_full_state(out, 1), drifted[1]) < 1e-12
    assert _worst(load_full_state(out, 2), drifted[1]) < 1e-12
    # and the result is not what synchronous training gives
    from hgopt.runner.reference import train_reference

    sync_model, _ = train_reference(dataclasses.replace(rp, train=dataclasses.replace(rp.train, outer=None)), STEPS)
    assert _worst(load_full_state(out, 0), {n: p.detach() for n, p in sync_model.named_parameters()}) > 1e-6


def test_resume_between_outer_steps_is_exact(straight: tuple[RunnerPlan, Path], tmp_path: Path) -> None:
    rp, out = straight
    rp3 = _rp(checkpoint_every=0)
    _run(rp3, tmp_path, steps=3)  # checkpoint after step 3: one inner step past the first outer step
    _run(rp3, tmp_path, steps=STEPS, resume=True)
    for pipe in (0, 1, 2):
        assert _worst(load_full_state(tmp_path, pipe), load_full_state(out, pipe)) < 1e-12
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]  # resumed, not restarted


def test_compressed_deltas_run_within_their_error(straight: tuple[RunnerPlan, Path], tmp_path: Path) -> None:
    """int8 deltas: after the first outer step the parameters differ from the exact average's by at most
    lr·(1 + μ) · (one quantisation step of each phase) = lr·(1 + μ)·2·max|δ|/127."""
    rp = _rp("int8")
    _run(rp, tmp_path, steps=H)
    ref = _rp()
    exact = reference(ref, H)[0]
    data_models = reference(ref, H, every=H + 1)  # the groups' inner models just before the first outer step
    init = {n: p.detach() for n, p in build_stage(ref.model, 0, ref.model.num_layers, seed=ref.train.seed,
                                                  dtype=ref.train.dtype).named_parameters()}
    dmax = max(float((init[n] - m[n]).abs().max()) for m in data_models for n in init)
    got = load_full_state(tmp_path, 0)
    err = max(float((got[n] - exact[n]).abs().max()) for n in exact)
    assert 0 < err <= LR * (1 + MU) * 2 * dmax / 127 * 1.01


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8", "int8"])
def test_codec_error_is_within_half_a_step(precision: str) -> None:
    x = torch.randn(4 * 128, dtype=torch.float64) * torch.logspace(-3, 1, 4 * 128, dtype=torch.float64)
    payload, scale = encode_delta(x, precision, 128)
    y = decode_delta(payload, scale, precision, 128, torch.float64)
    blocks = x.abs().reshape(-1, 128).amax(dim=1).repeat_interleave(128)
    rel = {"fp32": 2**-24, "bf16": 2**-8, "fp8": 2**-4}
    if precision == "int8":
        assert bool(((y - x).abs() <= blocks / 127 / 2 * (1 + 1e-6)).all())
        assert payload.dtype == torch.int8 and scale is not None and scale.numel() == 4
    else:
        assert bool(((y - x).abs() <= x.abs() * rel[precision] + blocks * 2**-9 * (precision == "fp8")).all())


def test_fragments_are_staggered() -> None:
    from hgopt.export.runner_plan import OuterConfig

    o = OuterConfig(groups=((0,), (1,)), steps=6, fragments=3)
    assert [n for n in range(1, 13) if sync_due(o, 0, n)] == [6, 12]
    assert [n for n in range(1, 13) if sync_due(o, 1, n)] == [4, 10]
    assert [n for n in range(1, 13) if sync_due(o, 2, n)] == [2, 8]
