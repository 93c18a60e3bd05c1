"""The analytic profile generator against hand computations and published figures, and the analytic
instances (geo-*, scale-*) against the sizes the project promises."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import yaml

from hgopt.cost.evaluate import evaluate
from hgopt.errors import SpecError
from hgopt.instances import load_instance
from hgopt.profiles.analytic import (
    OPTIMIZER_BYTES_TOUCHED,
    TransformerConfig,
    block_act_mem_bytes,
    block_forward_flops,
    block_params,
    embedding_params,
    generate_profile,
    head_forward_flops,
    head_params,
    layer_times,
)
from hgopt.profiles.gpus import gpu_spec
from hgopt.spec import instance_from_dict, model_profile_from_dict, model_profile_to_dict
from tests.factories import tiny_topology
from tests.witness import witness_plan

REPO = Path(__file__).resolve().parents[1]
GPT = TransformerConfig(name="gpt", layers=4, hidden=2048, heads=16, vocab=50257, seq_len=2048,
                        flash_attention=False, dtype="fp16")
LLAMA7 = TransformerConfig(name="llama-7b", layers=32, hidden=4096, heads=32, vocab=32000, seq_len=4096,
                           ffn=11008, glu=True)
LLAMA70 = TransformerConfig(name="llama-70b", layers=80, hidden=8192, heads=64, kv_heads=8, vocab=32000,
                            seq_len=4096, ffn=28672, glu=True)


def _total_params(cfg: TransformerConfig) -> float:
    return embedding_params(cfg) + cfg.layers * block_params(cfg) + head_params(cfg)


# ---- FLOPs, parameters, memory against hand computation / published numbers -----------------
def test_gpt_block_flops_match_24bsh2_plus_4bs2h() -> None:
    b, s, h = 2, 2048, 2048
    assert block_forward_flops(GPT, b) == 24 * b * s * h**2 + 4 * b * s**2 * h


def test_gated_gqa_block_flops_by_hand() -> None:
    # LLaMA-70B block, one sequence: Q and output projection 2·s·h² each, K and V 2·s·h·1024 each
    # (8 of 64 heads), scores and values 4·s²·h, three MLP matrices 2·s·h·28672 each.
    s, h = 4096, 8192
    by_hand = 2 * (2 * s * h * h) + 2 * (2 * s * h * 1024) + 4 * s * s * h + 3 * (2 * s * h * 28672)
    assert block_forward_flops(LLAMA70, 1) == pytest.approx(by_hand, rel=1e-12)


def test_head_flops_is_2bshv() -> None:
    assert head_forward_flops(GPT, 4) == 2 * 4 * 2048 * 2048 * 50257


def test_parameter_counts_match_published_models() -> None:
    # Hugging Face model cards: LLaMA-7B 6,738,415,616 and Llama-2-70B 68,976,648,192 parameters
    # (untied head, RMSNorm, no biases).
    assert _total_params(LLAMA7) == 6_738_415_616
    assert _total_params(LLAMA70) == 68_976_648_192
    # GPT-2 small has 124,439,808 parameters with the head tied to the token table.
    gpt2 = TransformerConfig(name="gpt2", layers=12, hidden=768, heads=12, vocab=50257, seq_len=1024)
    assert _total_params(gpt2) - 50257 * 768 == 124_439_808


def test_activation_memory_is_korthikanti() -> None:
    # Korthikanti et al. 2022, eq. (1) and (2): s·b·h·(34 + 5as/h) and s·b·h·(10 + 24/t + 5as/(ht)).
    s, h, a = 2048, 2048, 16
    assert block_act_mem_bytes(GPT, 1) == pytest.approx(s * h * (34 + 5 * a * s / h), rel=1e-12)
    for t in (2, 4, 8):
        assert block_act_mem_bytes(GPT, t) == pytest.approx(s * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    fp32 = TransformerConfig(name="g", layers=1, hidden=h, heads=a, vocab=10, seq_len=s, flash_attention=False, dtype="fp32")
    assert block_act_mem_bytes(fp32, 1) == pytest.approx(2 * block_act_mem_bytes(GPT, 1))


def test_flash_attention_drops_the_score_term() -> None:
    flash = TransformerConfig(name="g", layers=1, hidden=2048, heads=16, vocab=10, seq_len=2048, dtype="fp16")
    diff = block_act_mem_bytes(GPT, 1) - block_act_mem_bytes(flash, 1)
    assert diff == pytest.approx(5 * 16 * 2048**2 - 4 * 16 * 2048)


# ---- times ----------------------------------------------------------------------------------------
def test_block_time_is_flops_over_effective_peak_plus_tp_allreduce() -> None:
    gpu = gpu_spec("A100-80")
    fwd, bwd, upd = layer_times(LLAMA7, gpu, tp=4, mbs=2)["block"]
    compute = block_forward_flops(LLAMA7, 2) / (4 * 312e12 * gpu.efficiency)
    act_bytes = 2 * 4096 * 4096 * 2
    allreduce = 2 * 3 / 4 * act_bytes / (gpu.intra_node_gbyte_s * 1e9)
    assert fwd == pytest.approx(compute + 2 * allreduce, rel=1e-12)
    assert bwd == pytest.approx(2 * compute + 2 * allreduce, rel=1e-12)
    norms = 2 * 4096  # two RMSNorm scales stay whole on every rank
    shard = (block_params(LLAMA7) - norms) / 4 + norms
    assert upd == pytest.approx(shard * 30 / (2039e9 * gpu.memory_efficiency), rel=1e-12)
    assert OPTIMIZER_BYTES_TOUCHED[("adam", True)] == 30


def test_generated_times_grow_with_mbs_and_shrink_with_tp() -> None:
    prof = generate_profile(LLAMA7, ["H100-80", "A100-40", "L40S", "A10-24"])
    by = {(t.gpu, t.tp, t.mbs): t for t in prof.timings}
    assert len(by) == 4 * 4 * 4
    for gpu in ("H100-80", "A100-40", "L40S", "A10-24"):
        for tp in (1, 2, 4, 8):
            for small, big in ((1, 2), (2, 4), (4, 8)):
                a, b = by[(gpu, tp, small)], by[(gpu, tp, big)]
                assert all(x < y for x, y in zip(a.fwd, b.fwd)) and all(x < y for x, y in zip(a.bwd, b.bwd))
        for mbs in (1, 2, 4, 8):
            for lo, hi in ((1, 2), (2, 4), (4, 8)):
                a, b = by[(gpu, lo, mbs)], by[(gpu, hi, mbs)]
                assert a.fwd[1] + a.bwd[1] > b.fwd[1] + b.bwd[1], (gpu, lo, hi, mbs)
                assert a.update[1] > b.update[1]


def test_faster_gpu_is_faster() -> None:
    t = {g: sum(layer_times(LLAMA7, gpu_spec(g), 1, 1)["block"][:2]) for g in ("H100-80", "A100-80", "L40S", "A10-24")}
    assert t["H100-80"] < t["A100-80"] < t["L40S"] < t["A10-24"]


def test_bf16_on_a_gpu_without_bf16_is_refused() -> None:
    with pytest.raises(ValueError, match="V100-16 cannot train in bf16"):
        generate_profile(LLAMA7, ["V100-16"])
    prof = generate_profile(TransformerConfig(name="x", layers=2, hidden=256, heads=4, vocab=100, seq_len=64, dtype="fp16"), ["V100-16", "T4"])
    assert prof.gpu_types() == ("T4", "V100-16")


def test_profile_round_trips_through_json_form() -> None:
    prof = generate_profile(LLAMA70, ["H100-80"], tps=(1, 8), mbss=(1, 2))
    assert prof.num_layers == 82 and [layer.kind for layer in prof.layers[:2]] == ["embedding", "block"]
    assert [m.tp for m in prof.tp_memory] == [8]
    assert model_profile_from_dict(model_profile_to_dict(prof)) == prof


def test_generator_from_an_instance_file() -> None:
    model = {"generator": "analytic", "name": "m", "layers": 3, "hidden": 512, "heads": 8, "vocab": 1000,
             "seq_len": 128, "dtype": "fp32", "gpus": ["A", "B"]}
    topo = tiny_topology()
    with pytest.raises(SpecError):  # A and B are not in the GPU table
        instance_from_dict({"name": "x", "model": model, "topology": topo,
                            "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}})
    for c in topo["clusters"]:
        c["gpu"] = "A100-40"
    model["gpus"] = ["A100-40"]
    inst = instance_from_dict({"name": "x", "model": model, "topology": topo,
                               "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}})
    assert inst.model.num_layers == 5 and inst.model.tps("A100-40") == (1, 2, 4, 8)


def test_bf16_v100_instance_names_the_model_field() -> None:
    topo = tiny_topology()
    for c in topo["clusters"]:
        c["gpu"] = "V100-16"
    model = {"generator": "analytic", "name": "m", "layers": 3, "hidden": 512, "heads": 8, "vocab": 1000,
             "seq_len": 128, "gpus": ["V100-16"]}
    with pytest.raises(SpecError, match="model") as exc:
        instance_from_dict({"name": "x", "model": model, "topology": topo,
                            "job": {"global_batch": 8, "seq_len": 128, "precision": "bf16"}})
    assert "bf16" in str(exc.value)


# ---- the analytic instances -----------------------------------------------------------------------
def _builder():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("build_analytic_instances", REPO / "instances" / "build_analytic_instances.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BUILDER = _builder()
ANALYTIC = [inst["name"] for inst in BUILDER.instances()]


def test_shipped_yaml_is_what_the_builder_writes() -> None:
    for inst in BUILDER.instances():
        text = (REPO / "instances" / f"{inst['name']}.yaml").read_text()
        assert yaml.safe_load(text) == _merged(inst), inst["name"]


def _merged(node: object) -> object:
    """The builder's dicts with their YAML merge keys (``<<``: scale-64r's shared link bodies) applied the way
    YAML's merge-key rule applies them on load: the merged mapping's keys, overridden by the node's own."""
    if isinstance(node, list):
        return [_merged(x) for x in node]
    if not isinstance(node, dict):
        return node
    own = {k: _merged(v) for k, v in node.items() if k != BUILDER.MERGE}
    base = node.get(BUILDER.MERGE, {})
    return {**_merged(base), **own} if base else own


def test_wan_links_follow_the_distance_rule() -> None:
    # Dublin - Tokyo is ~9,600 km: 2 Gbit/s, 5 + 96 ms.
    d = BUILDER.distance_km("eu-west", "ap-northeast")
    assert 9400 < d < 9800
    assert BUILDER.wan_link("eu-west", "ap-northeast") == {"gbit_s": 2.0, "latency_ms": round(5 + d / 100, 1)}
    # Dublin - Frankfurt is ~1,090 km: the fastest class, 25 Gbit/s.
    assert 1000 < BUILDER.distance_km("eu-west", "eu-central") < 1200
    assert BUILDER.wan_link("eu-west", "eu-central")["gbit_s"] == 25.0


@pytest.mark.parametrize("name", [n for n in ANALYTIC if n.startswith("geo-")])
def test_geo_instances_are_geo_distributed_and_heterogeneous(name: str) -> None:
    inst = load_instance(name)
    regions = {c.region for c in inst.topology.clusters}
    assert 3 <= len(regions) <= 8 and len(regions) == len(inst.topology.clusters)
    assert len({c.gpu for c in inst.topology.clusters}) >= 3
    for link in inst.topology.links:
        gbit = link.bandwidth.gbyte_s * 8
        assert 1 <= gbit <= 25 and 0.010 <= link.bandwidth.latency_s <= 0.150
    assert 1.2e9 <= inst.model.total_params() <= 75e9


def test_scale_instances_are_large_enough() -> None:
    a, b = load_instance("scale-8r-1024-llama70b"), load_instance("scale-16r-4096-gpt175b")
    assert len(a.topology.clusters) >= 8 and a.topology.num_gpus() >= 1024 and a.model.num_layers >= 80
    assert len(b.topology.clusters) >= 16 and b.topology.num_gpus() >= 4096


@pytest.mark.parametrize("name", ANALYTIC)
def test_analytic_instances_are_trainable(name: str) -> None:
    inst = load_instance(name)
    plan = witness_plan(inst)
    assert plan is not None, f"{name}: no memory-feasible plan"
    ev = evaluate(plan, inst)
    assert ev.feasible, ev.violations
    assert math.isfinite(ev.iteration_time_s) and ev.iteration_time_s > 0
