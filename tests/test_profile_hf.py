"""``hgopt profile --hf-config``: times the Hugging Face architecture's layers (transformers' modules,
as the runner builds them) on this CPU, pools the identical blocks, writes the profile format with the
config inside; the output feeds ``hgopt plan`` and ``hgopt export`` unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hgopt.cli import main  # noqa: E402
from hgopt.profiles.analytic import block_params, embedding_params, head_params  # noqa: E402
from hgopt.profiles.hf import hf_transformer_config, read_hf_config  # noqa: E402
from hgopt.spec import model_profile_from_dict  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "instances" / "hf" / "llama-tiny" / "config.json"


def test_profile_hf_config_feeds_plan_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--hf-config", str(CONFIG), "-o", str(out), "--mbs", "1,2", "--tp", "1", "--warmup", "0",
                 "--repeat", "1", "--gpu", "cpu-test"]) == 0
    data = json.loads(out.read_text())
    prof = model_profile_from_dict(data, str(out))
    assert [layer.kind for layer in prof.layers] == ["embedding", "block", "block", "head"]
    assert json.loads(prof.hf_config) == read_hf_config(CONFIG) and prof.name == "llama-tiny"
    tc = hf_transformer_config(read_hf_config(CONFIG), seq_len=32)
    assert [layer.params for layer in prof.layers] == [embedding_params(tc), block_params(tc), block_params(tc),
                                                       head_params(tc)]
    for t in prof.timings:  # identical blocks pooled: the planner sees one class of blocks
        assert t.fwd[1] == t.fwd[2] > 0 and t.bwd[1] == t.bwd[2] > 0
    inst = {"name": "cpu-llama", "model": str(out),
            "topology": {"clusters": [{"name": c, "region": f"r-{c}", "gpu": "cpu-test", "gpu_memory_gb": 16, "nodes": 1,
                                       "gpus_per_node": 2, "intra_node": {"gbyte_s": 10}, "inter_node": {"gbit_s": 10}}
                                      for c in ("a", "b")],
                         "links": {"default": {"gbit_s": 1, "latency_ms": 5}}},
            "job": {"global_batch": 4, "seq_len": 32, "precision": "fp32"}}
    (tmp_path / "inst.yaml").write_text(yaml.safe_dump(inst))
    assert main(["plan", str(tmp_path / "inst.yaml"), "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["export", str(tmp_path / "plan.json"), "--instance", str(tmp_path / "inst.yaml"), "-o",
                 str(tmp_path / "x"), "--local"]) == 0
    rp = json.loads((tmp_path / "x" / "plan.json").read_text())
    assert rp["model"]["hf_config"]["model_type"] == "llama" and rp["model"]["hidden"] == 256


def test_profile_hf_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "t5"}))
    assert main(["profile", "--hf-config", str(bad), "-o", str(tmp_path / "p.json")]) == 2
    assert "model_type: 't5' is not supported" in capsys.readouterr().err
    assert main(["profile", "--hf-config", str(CONFIG), "--tp", "3", "-o", str(tmp_path / "p.json")]) == 2
    assert "--tp 3: tp 3 must divide num_attention_heads 4" in capsys.readouterr().err
