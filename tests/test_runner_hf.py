"""The runner trains the Hugging Face architecture of an instance's ``config.json`` with
``transformers``' own modules: the single-process runner model equals ``AutoModelForCausalLM`` with the
same weights (every supported family, float64), and ``hgopt plan`` of the Llama-shaped instance
``hf-llama-tiny-2r`` exported ``--local`` — and hand-written plans of it with 2 and 4 stages,
data parallelism 3 + 1 and tp 2 — train under the runner on CPU (gloo) to the parameters of
single-process training after 3 steps (float64, 1e-10)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)

from hgopt.export import ExportOptions, build_runner_plan, write_export  # noqa: E402
from hgopt.export.runner_plan import ModelConfig, RunnerPlan, load_runner_plan  # noqa: E402
from hgopt.instances import load_instance  # noqa: E402
from hgopt.plan import Plan, load_plan  # noqa: E402
from hgopt.runner.checkpoint import load_full_state  # noqa: E402
from hgopt.runner.hf import hf_config_object, to_hf_state_dict  # noqa: E402
from hgopt.runner.launch import run_forked  # noqa: E402
from hgopt.runner.model import build_stage  # noqa: E402
from hgopt.runner.reference import train_reference  # noqa: E402
from tests.runner_plans import G, pipeline  # noqa: E402
from tests.test_hf_config import CONFIGS  # noqa: E402

INSTANCE = "hf-llama-tiny-2r"
A, B = "us-a100-80", "eu-a100-40"


def _kinds(cfg: dict[str, Any]) -> tuple[str, ...]:
    n = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    return ("embedding",) + ("block",) * n + ("head",)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_runner_model_equals_transformers_causal_lm(name: str) -> None:
    """Logits and every gradient of the runner's whole model (layers built one by one) equal
    transformers' own causal LM loaded with the same weights (float64)."""
    from transformers import AutoModelForCausalLM

    cfg = dict(CONFIGS[name], tie_word_embeddings=False)  # the runner keeps the head's copy separate
    text = json.dumps(cfg, sort_keys=True)
    kinds = _kinds(cfg)
    mc = ModelConfig(layers=kinds, hidden=0, heads=1, vocab=cfg["vocab_size"], seq=12, hf_config=text)
    ours = build_stage(mc, 0, len(kinds), seed=3, dtype="float64")
    theirs = AutoModelForCausalLM.from_config(hf_config_object(text)).double()
    state = to_hf_state_dict({n: p.detach() for n, p in ours.named_parameters()}, text, kinds)
    theirs.load_state_dict(state, strict=True)
    x = torch.randint(0, cfg["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(1))
    a, b = ours(x), theirs(x).logits
    assert float((a - b).detach().abs().max()) <= 1e-10 * float(b.detach().abs().max())
    a.square().mean().backward()
    b.square().mean().backward()
    ref = dict(theirs.named_parameters())
    grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, text, kinds)
    assert set(grads) == set(ref)
    for n, g in grads.items():
        assert float((g - ref[n].grad).abs().max()) <= 1e-10 * max(float(ref[n].grad.abs().max()), 1e-30), n


def test_layers_have_independent_seeded_weights() -> None:
    """A stage built alone starts from the numbers of the same layers of the whole model."""
    inst = load_instance(INSTANCE)
    rp = build_runner_plan(_plan_four_stages(), inst, ExportOptions(dtype="float64"))
    whole = dict(build_stage(rp.model, 0, 4, seed=5).named_parameters())
    part = dict(build_stage(rp.model, 2, 3, seed=5).named_parameters())
    assert part and all(torch.equal(p, whole[n]) for n, p in part.items())
    assert not torch.equal(whole["layers.1.block.layer.self_attn.q_proj.weight"],
                           whole["layers.2.block.layer.self_attn.q_proj.weight"])


# ---- distributed runs -------------------------------------------------------------------------------
def _plan_dp_tp() -> Plan:
    """Stage 0 (embedding + block 1): replicas with 3 and 1 samples per microbatch; stage 1 (block 2 +
    head): tp 2 (GQA: 2 query heads and 1 key/value head per rank)."""
    return Plan(pipelines=(pipeline([((0, 2), [G(A, mbs=3), G(A, mbs=1)]), ((2, 4), [G(B, tp=2, mbs=4)])], m=2),))


def _plan_four_stages() -> Plan:
    return Plan(pipelines=(pipeline([((0, 1), [G(A, mbs=2)]), ((1, 2), [G(A, mbs=2)]), ((2, 3), [G(B, mbs=2)]),
                                     ((3, 4), [G(B, mbs=2)])], m=4),))


def _run(rp: RunnerPlan, out: Path, **kw: Any) -> None:
    codes = run_forked(rp, out, timeout_s=240, **kw)
    assert codes == {r: 0 for r in range(rp.world_size)}, f"rank exit codes {codes}"


def _worst_abs(rp: RunnerPlan, out: Path, steps: int = 3) -> tuple[float, str]:
    ref, _ = train_reference(rp, steps)
    got = load_full_state(out)
    assert set(got) == {n for n, _ in ref.named_parameters()}
    return max((float((p.detach() - got[n]).abs().max()), n) for n, p in ref.named_parameters())


def test_hgopt_plan_of_the_hf_instance_exported_local_trains_like_one_process(tmp_path: Path) -> None:
    from hgopt.cli import main

    assert main(["plan", INSTANCE, "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["export", str(tmp_path / "plan.json"), "--instance", INSTANCE, "-o", str(tmp_path / "x"), "--local",
                 "--dtype", "float64", "--master-port", "0"]) == 0
    rp = load_runner_plan(tmp_path / "x" / "plan.json")
    assert json.loads(rp.model.hf_config)["model_type"] == "llama" and rp.model.hidden == 256
    _run(rp, tmp_path / "run")
    worst, name = _worst_abs(rp, tmp_path / "run")
    assert worst <= 1e-10, f"{name} differs by {worst:.2e}"
    plan = load_plan(tmp_path / "plan.json")
    assert sum(g.tp * g.dp for p in plan.pipelines for s in p.stages for g in s.groups) == rp.world_size


@pytest.mark.parametrize("case", ["dp3+1-then-tp2", "4-stages"])
def test_hand_written_plans_train_like_one_process(tmp_path: Path, case: str) -> None:
    plan = _plan_dp_tp() if case == "dp3+1-then-tp2" else _plan_four_stages()
    rp = build_runner_plan(plan, load_instance(INSTANCE), ExportOptions(dtype="float64"))
    _run(rp, tmp_path)
    worst, name = _worst_abs(rp, tmp_path)
    assert worst <= 1e-10, f"{name} differs by {worst:.2e}"
    ref, losses = train_reference(rp, 3)
    assert losses[-1] < losses[0]


def test_export_refuses_what_the_architecture_cannot_do() -> None:
    inst = load_instance(INSTANCE)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        build_runner_plan(_plan_dp_tp(), inst, ExportOptions(seq=65))
    bad = Plan(pipelines=(pipeline([((0, 4), [G(A, tp=2, mbs=1)])], m=8),))
    from dataclasses import replace

    cfg = json.loads(inst.model.hf_config)
    cfg["num_key_value_heads"] = 1
    inst1 = replace(inst, model=replace(inst.model, hf_config=json.dumps(cfg)))
    with pytest.raises(ValueError, match="tp 2 must divide num_key_value_heads 1"):
        build_runner_plan(bad, inst1, ExportOptions())


def test_exported_node_scripts_train_under_torchrun(tmp_path: Path) -> None:
    """The two node scripts of the dp 3 + 1 / tp 2 plan, run as two torchrun nodes on this machine (4
    ranks, gloo), end where single-process training ends."""
    import os
    import subprocess
    import sys

    from hgopt.profiler.run import free_port

    rp = build_runner_plan(_plan_dp_tp(), load_instance(INSTANCE),
                           ExportOptions(dtype="float64", local=True, master_port=free_port()))
    files = write_export(rp, tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(["sh", str(s), "--threads", "1", "--device", "cpu"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for s in files.node_scripts]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    worst, name = _worst_abs(rp, tmp_path / "run")
    assert worst <= 1e-10, f"{name} differs by {worst:.2e}"
