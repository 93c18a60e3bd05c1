"""The GPU table's new entries, the cluster defaults it supplies, and an instance's own ``gpus:``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hgopt.cli import main
from hgopt.errors import SpecError
from hgopt.profiles.analytic import TransformerConfig, block_forward_flops, generate_profile
from hgopt.profiles.gpus import GPUS, GpuSpec, gpu_spec
from hgopt.spec import GB, instance_from_dict


@pytest.mark.parametrize("name, fp32, bf16, mem_gb, mem_gbs", [
    # dense figures as the datasheets print them (sparsity figures halved)
    ("L4", 30.3, 121, 24, 300),
    ("RTX-4090", 82.6, 165.2, 24, 1008),
    ("A10G", 31.2, 125, 24, 600),
    ("A40", 37.4, 149.7, 48, 696),
    ("H100-PCIe", 51, 756, 80, 2000),
])
def test_new_table_entries(name: str, fp32: float, bf16: float, mem_gb: float, mem_gbs: float) -> None:
    g = gpu_spec(name)
    assert (g.fp32_flops, g.bf16_flops, g.memory_gb, g.memory_gbyte_s) == (fp32 * 1e12, bf16 * 1e12, mem_gb, mem_gbs)
    assert "http" in g.source and g.link == "pcie"
    assert g.intra_node_gbyte_s == pytest.approx(g.link_bidir_gbyte_s / 2 * 0.8)


def test_every_entry_cites_a_source_and_is_sane() -> None:
    for g in GPUS.values():
        assert "https://" in g.source, g.name
        assert g.fp16_flops > g.fp32_flops > 0 and 0 < g.efficiency <= 1 and g.node_network_gbit_s > 0


def _instance(cluster: dict[str, Any], gpus: list[dict[str, Any]] | None = None, model_gpu: str = "L4") -> dict[str, Any]:
    inst: dict[str, Any] = {
        "name": "t",
        "model": {"generator": "analytic", "name": "m", "layers": 2, "hidden": 256, "heads": 4, "vocab": 1000,
                  "seq_len": 128, "dtype": "bf16", "gpus": [model_gpu], "tps": [1], "mbss": [1]},
        "topology": {"clusters": [cluster]},
        "job": {"global_batch": 8, "seq_len": 128, "precision": "bf16"},
    }
    if gpus is not None:
        inst["gpus"] = gpus
    return inst


def test_cluster_defaults_come_from_the_table() -> None:
    inst = instance_from_dict(_instance({"name": "a", "region": "r", "gpu": "L4", "nodes": 2, "gpus_per_node": 8}))
    c = inst.topology.clusters[0]
    assert c.gpu_memory_bytes == 24 * GB
    assert c.intra_node.gbyte_s == pytest.approx(64 / 2 * 0.8) and c.intra_node.latency_s == pytest.approx(5e-6)
    assert c.inter_node.gbyte_s == pytest.approx(100 / 8)
    assert c.defaults == ("gpu_memory_gb", "intra_node", "inter_node")


def test_given_fields_win_over_the_defaults() -> None:
    cluster = {"name": "a", "region": "r", "gpu": "L4", "nodes": 1, "gpus_per_node": 8, "gpu_memory_gb": 20,
               "inter_node": {"gbit_s": 25}}
    c = instance_from_dict(_instance(cluster)).topology.clusters[0]
    assert c.gpu_memory_bytes == 20 * GB and c.inter_node.gbyte_s == pytest.approx(25 / 8)
    assert c.defaults == ("intra_node",)


def test_unknown_gpu_without_the_fields_names_the_missing_field() -> None:
    data = _instance({"name": "a", "region": "r", "gpu": "Z9", "nodes": 1, "gpus_per_node": 8}, model_gpu="Z9")
    with pytest.raises(SpecError) as err:
        instance_from_dict(data)
    assert err.value.field == "model.gpus[0]" and "declare it under `gpus:`" in err.value.problem
    data["model"]["gpus"] = ["L4"]
    with pytest.raises(SpecError) as err:
        instance_from_dict(data)
    assert err.value.field == "topology.clusters[0].gpu_memory_gb" and "missing" in err.value.problem


MY_GPU = {"name": "Z9", "fp32_tflops": 50, "fp16_tflops": 200, "bf16_tflops": 200, "memory_gb": 32,
          "memory_gbyte_s": 1000, "link_bidir_gbyte_s": 100, "link": "pcie", "efficiency": 0.5,
          "node_network_gbit_s": 200, "source": "vendor datasheet Z9 rev 1"}


def test_declared_gpu_feeds_the_generator_and_the_defaults() -> None:
    inst = instance_from_dict(_instance({"name": "a", "region": "r", "gpu": "Z9", "nodes": 1, "gpus_per_node": 4},
                                        gpus=[MY_GPU], model_gpu="Z9"))
    c = inst.topology.clusters[0]
    assert c.gpu_memory_bytes == 32 * GB and c.intra_node.gbyte_s == pytest.approx(40) and c.inter_node.gbyte_s == 25
    t = inst.model.timings[0]
    assert t.gpu == "Z9"
    cfg = TransformerConfig(name="m", layers=2, hidden=256, heads=4, vocab=1000, seq_len=128, dtype="bf16")
    # a block's forward = its FLOPs / (peak · efficiency), by hand
    assert t.fwd[1] == pytest.approx(block_forward_flops(cfg, 1) / (200e12 * 0.5))
    spec = GpuSpec(name="Z9", fp32_flops=50e12, fp16_flops=200e12, bf16_flops=200e12, memory_gb=32,
                   memory_gbyte_s=1000, link_bidir_gbyte_s=100, link="pcie", efficiency=0.5, source="x")
    assert t.fwd == generate_profile(cfg, [spec], tps=(1,), mbss=(1,)).timings[0].fwd


def test_declared_gpu_overrides_a_table_entry() -> None:
    mine = dict(MY_GPU, name="L4", memory_gb=22)
    inst = instance_from_dict(_instance({"name": "a", "region": "r", "gpu": "L4", "nodes": 1, "gpus_per_node": 4},
                                        gpus=[mine]))
    assert inst.topology.clusters[0].gpu_memory_bytes == 22 * GB


@pytest.mark.parametrize("edit, field, words", [
    (lambda g: g.pop("source"), "gpus[0].source", "missing"),
    (lambda g: g.update(efficiency=1.5), "gpus[0].efficiency", "(0, 1]"),
    (lambda g: g.update(fp16_tflops=1e9), "gpus[0].fp16_tflops", "sane limit"),
    (lambda g: g.update(tflops=3), "gpus[0].tflops", "unknown field"),
])
def test_bad_declared_gpu_names_the_field(edit: Any, field: str, words: str) -> None:
    g = copy.deepcopy(MY_GPU)
    edit(g)
    with pytest.raises(SpecError) as err:
        instance_from_dict(_instance({"name": "a", "region": "r", "gpu": "Z9", "nodes": 1, "gpus_per_node": 4},
                                     gpus=[g], model_gpu="Z9"))
    assert err.value.field == field and words in err.value.problem


def test_show_marks_the_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "i.yaml"
    p.write_text(yaml.safe_dump(_instance({"name": "a", "region": "r", "gpu": "L4", "nodes": 2, "gpus_per_node": 8})))
    assert main(["show", str(p)]) == 0
    out = capsys.readouterr().out
    assert "from the GPU table" in out and "a: gpu_memory_gb, intra_node, inter_node" in out
    assert main(["show", str(p), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["topology"]["clusters"][0]["defaults"] == ["gpu_memory_gb", "intra_node", "inter_node"]
    assert doc["topology"]["clusters"][0]["gpu_memory_gb"] == 24
