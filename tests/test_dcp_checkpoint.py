"""Checkpoints in ``torch.distributed.checkpoint`` (``--checkpoint-format dcp``): per-rank shard files and
DCP metadata; a checkpoint written under one plan resumes under another (different stage split, tp 2 -> 1,
dp 3 + 1 -> 1, ZeRO-1 on or off) and ends where uninterrupted single-process training ends; a truncated
or foreign checkpoint is an error naming the file."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)

from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.instances import load_instance  # noqa: E402
from hgopt.plan import Plan  # noqa: E402
from hgopt.runner.checkpoint import load_full_state  # noqa: E402
from hgopt.runner.reference import train_reference  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from tests.test_runner_hf import _plan_dp_tp, _plan_four_stages, _run  # noqa: E402

OPTS = ExportOptions(dtype="float64", checkpoint_format="dcp")


def _rp(plan: Plan):  # type: ignore[no-untyped-def]
    return build_runner_plan(plan, load_instance("hf-llama-tiny-2r"), OPTS)


def _zero_stage0(plan: Plan) -> Plan:
    p = plan.pipelines[0]
    return Plan(pipelines=(replace(p, stages=(replace(p.stages[0], zero=1),) + p.stages[1:]),))


def _worst(rp, out: Path, steps: int) -> float:  # type: ignore[no-untyped-def]
    ref, _ = train_reference(rp, steps)
    got = load_full_state(out)
    assert set(got) == {n for n, _ in ref.named_parameters()}
    return max(float((p.detach() - got[n]).abs().max()) for n, p in ref.named_parameters())


@pytest.mark.parametrize("first, second", [("dp_tp", "four"), ("four", "dp_tp+zero")])
def test_resume_under_another_plan(tmp_path: Path, first: str, second: str) -> None:
    plans = {"dp_tp": _plan_dp_tp(), "four": _plan_four_stages(), "dp_tp+zero": _zero_stage0(_plan_dp_tp())}
    a, b = _rp(plans[first]), _rp(plans[second])
    _run(a, tmp_path, steps=2)
    step = tmp_path / "checkpoints" / "step000002"
    assert (step / ".metadata").is_file() and len(list(step.glob("*.distcp"))) >= 1
    assert _worst(a, tmp_path, 2) <= 1e-10
    _run(b, tmp_path, steps=3, resume=True)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # the second plan ran step 3 only
    assert _worst(b, tmp_path, 3) <= 1e-10  # moments and parameters resharded: same as never stopping


def test_truncated_or_foreign_checkpoint_names_the_file(tmp_path: Path) -> None:
    rp = _rp(_plan_four_stages())
    _run(rp, tmp_path / "run", steps=1)
    good = tmp_path / "run" / "checkpoints" / "step000001"
    shards = sorted(good.glob("*.distcp"))
    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    victim = cut / shards[0].name
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{victim}: truncated or corrupt shard"):
        _load(cut)
    gone = tmp_path / "gone"
    shutil.copytree(good, gone)
    (gone / ".metadata").unlink()
    with pytest.raises(ValueError, match=rf"{gone}/\.metadata: missing"):
        _load(gone)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / ".metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=rf"{foreign}/\.metadata"):
        _load(foreign)


def _load(path: Path):  # type: ignore[no-untyped-def]
    from hgopt.runner.dcp_checkpoint import load_full_dcp

    return load_full_dcp(path)
