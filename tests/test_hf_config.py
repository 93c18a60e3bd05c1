"""Model profiles from Hugging Face ``config.json`` files (hgopt.profiles.hf): parameters per layer equal
the modules ``transformers`` builds from the same config, forward FLOPs of a block equal PyTorch's
FLOP counter on that block, clear errors for unsupported or incomplete configs, the ``hf_config``
instance form, ``hgopt model import`` and planning of its output. The planner path never imports
transformers (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hgopt.cli import main
from hgopt.errors import SpecError
from hgopt.instances import load_instance
from hgopt.profiles.analytic import block_forward_flops, block_params, embedding_params, head_params, unique_params
from hgopt.profiles.hf import hf_profile, hf_transformer_config, read_hf_config
from hgopt.spec import model_profile_from_dict

REPO = Path(__file__).resolve().parents[1]
LLAMA_TINY = REPO / "instances" / "hf" / "llama-tiny" / "config.json"

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa": read_hf_config(LLAMA_TINY),
    "llama-biases-tied": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 300,
                          "max_position_embeddings": 32, "attention_bias": True, "mlp_bias": True,
                          "tie_word_embeddings": True},
    "mistral-head-dim": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 128,
                         "max_position_embeddings": 32},
    "qwen2-tied": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200,
                   "max_position_embeddings": 32, "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 40},
    "opt": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 200, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 300, "max_position_embeddings": 40, "word_embed_proj_dim": 64},
    "gpt-neox": {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "vocab_size": 300, "max_position_embeddings": 40, "rotary_pct": 0.25},
}


def _hf_model(cfg: dict[str, Any]) -> Any:
    transformers = pytest.importorskip("transformers")
    conf = transformers.AutoConfig.for_model(**cfg)
    return transformers.AutoModelForCausalLM.from_config(conf)


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _parts(model: Any, model_type: str) -> tuple[list[Any], list[Any], list[Any]]:
    """(embedding modules, decoder layers, head modules) of a transformers causal LM."""
    if model_type == "gpt2":
        t = model.transformer
        return [t.wte, t.wpe], list(t.h), [t.ln_f, model.lm_head]
    if model_type == "opt":
        d = model.model.decoder
        return [d.embed_tokens, d.embed_positions], list(d.layers), [d.final_layer_norm, model.lm_head]
    if model_type == "gpt_neox":
        g = model.gpt_neox
        return [g.embed_in], list(g.layers), [g.final_layer_norm, model.lm_head]
    m = model.model
    return [m.embed_tokens], list(m.layers), [m.norm, model.lm_head]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameters_per_layer_equal_transformers_modules(name: str) -> None:
    cfg = CONFIGS[name]
    tc = hf_transformer_config(cfg)
    model = _hf_model(cfg)
    emb, layers, head = _parts(model, cfg["model_type"])
    assert embedding_params(tc) == sum(_count(m) for m in emb)
    assert all(block_params(tc) == _count(layer) for layer in layers) and len(layers) == tc.layers
    # the head keeps its own copy of a tied table (counted per copy); unique_params counts it once
    assert head_params(tc) == _count(head[0]) + head[1].weight.numel()
    assert unique_params(tc) == model.num_parameters()
    assert tc.tied_embeddings == (model.lm_head.weight is emb[0].weight)


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-head-dim", "gpt2", "opt", "gpt-neox"])
def test_block_forward_flops_equal_torch_flop_counter(name: str) -> None:
    """Matmul FLOPs (2 per multiply-add) of one decoder layer's forward, counted by
    torch.utils.flop_counter on transformers' own module. Eager attention (two batched matmuls over
    the full ``s x s`` score matrix, as the formula counts them): the counter does not see CPU SDPA."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    cfg = dict(CONFIGS[name], _attn_implementation="eager")
    model = _hf_model(cfg)
    b, s = 2, 16
    tc = hf_transformer_config(cfg, seq_len=s)
    ids = torch.randint(0, cfg["vocab_size"], (b, s))
    with torch.no_grad():
        full = FlopCounterMode(display=False)
        with full:
            model(ids)
    counts = full.get_flop_counts()
    layer_name = {"gpt2": "transformer.h.0", "opt": "model.decoder.layers.0", "gpt_neox": "gpt_neox.layers.0"}.get(
        cfg["model_type"], "model.layers.0")
    per_module = {k: sum(v.values()) for k, v in counts.items()}
    got = next(v for k, v in per_module.items() if k.endswith(layer_name))
    assert got == block_forward_flops(tc, b)


def test_unknown_model_type_and_missing_fields_name_them(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"model_type: 'bert' is not supported \(supported: llama, mistral"):
        hf_transformer_config({"model_type": "bert"}, source="c.json")
    with pytest.raises(SpecError, match=r"c.json: model_type: is required but missing"):
        hf_transformer_config({"hidden_size": 8}, source="c.json")
    with pytest.raises(SpecError, match=r"c.json: num_attention_heads, intermediate_size: required for model_type 'llama'"):
        hf_transformer_config({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 9,
                               "max_position_embeddings": 4}, source="c.json")
    with pytest.raises(SpecError, match=r"num_key_value_heads: 3 does not divide num_attention_heads 4"):
        hf_transformer_config(dict(CONFIGS["llama-gqa"], num_key_value_heads=3))
    with pytest.raises(SpecError, match=r"word_embed_proj_dim: 32 differs from hidden_size 64"):
        hf_transformer_config(dict(CONFIGS["opt"], word_embed_proj_dim=32))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match=rf"{bad}: <file>: is not valid JSON"):
        read_hf_config(bad)


def test_llama_tiny_profile_by_hand() -> None:
    """The shipped test config: h 256, 4 heads of 64, 2 KV heads (kv width 128), SwiGLU 512, V 256."""
    prof = hf_profile(read_hf_config(LLAMA_TINY), ["A100-80"], seq_len=32, dtype="fp32", tps=(1,), mbss=(1,))
    emb, b0, b1, head = prof.layers
    h, kv, f, v = 256, 128, 512, 256
    assert emb.params == v * h
    assert b0.params == b1.params == h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    assert head.params == h + v * h
    assert emb.activation_bytes == 4 * 32 * h  # fp32 boundary: s x h values
    # saved activations per token, fp32 (4 B), as transformers' LlamaDecoderLayer keeps them: per RMSNorm
    # the fp32 input, rsqrt, normalised tensor and output (4h + 4 + 4h + 4h); rotary cos and sin (2 x 64);
    # SDPA's query, key, value and output (h + 2kv + h) and its log-sum-exp per head (4); SwiGLU's gate,
    # SiLU, up and product outputs (4f)
    per_token = 2 * (12 * h + 4) + 4 * 2 * 64 + 4 * (2 * h + 2 * kv) + 4 * 4 + 4 * 4 * f
    assert b0.act_mem_bytes == pytest.approx(32 * per_token)
    assert emb.act_mem_bytes == 8 * 32  # the int64 token ids
    assert head.act_mem_bytes == pytest.approx(32 * (12 * h + 4 + 4 * v + 8))  # norm, fp32 log-softmax, targets
    assert json.loads(prof.hf_config) == read_hf_config(LLAMA_TINY)
    assert not hf_transformer_config(read_hf_config(LLAMA_TINY)).dropout
    # the runner trains with dropout 0 whatever the config says: no masks in the profile
    assert not hf_transformer_config(CONFIGS["gpt2"]).dropout and not hf_transformer_config(CONFIGS["opt"]).dropout


def test_instance_with_hf_config_and_model_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inst = load_instance("hf-llama-tiny-2r")
    assert [layer.kind for layer in inst.model.layers] == ["embedding", "block", "block", "head"]
    assert inst.model.name == "llama-tiny" and json.loads(inst.model.hf_config)["num_key_value_heads"] == 2
    out = tmp_path / "profile.json"
    assert main(["model", "import", str(LLAMA_TINY), "-o", str(out), "--gpus", "A100-80,A100-40", "--seq-len", "32",
                 "--dtype", "fp32", "--tps", "1,2"]) == 0
    data = json.loads(out.read_text())
    prof = model_profile_from_dict(data, str(out))
    assert prof.layers == inst.model.layers and prof.hf_config == inst.model.hf_config
    assert {(t.gpu, t.tp, t.mbs): t for t in prof.timings}[("A100-80", 2, 4)] == \
        {(t.gpu, t.tp, t.mbs): t for t in inst.model.timings}[("A100-80", 2, 4)]
    # an instance that takes the imported profile file plans like the hf_config one
    text = (REPO / "instances" / "hf-llama-tiny-2r.yaml").read_text()
    import yaml

    raw = yaml.safe_load(text)
    raw["model"] = str(out)
    (tmp_path / "inst.yaml").write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "inst.yaml"), "-o", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["pipelines"]
    assert main(["model", "import", str(tmp_path / "nope.json"), "-o", str(out)]) == 2
    assert "cannot read the Hugging Face config" in capsys.readouterr().err


def test_planner_path_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, hgopt.cli, hgopt.plan, hgopt.spec, hgopt.cost, hgopt.search, hgopt.profiles.hf, "
            "hgopt.commands.model; from hgopt.instances import load_instance; load_instance('hf-llama-tiny-2r'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_instance_hf_config_errors(tmp_path: Path) -> None:
    import yaml

    from hgopt.spec import instance_from_dict

    raw = yaml.safe_load((REPO / "instances" / "hf-llama-tiny-2r.yaml").read_text())
    (tmp_path / "x.yaml").write_text("")  # relative hf_config paths are taken from the instance file's folder
    raw["model"]["hf_config"] = "nope/config.json"
    with pytest.raises(SpecError, match=r"x.yaml: model.hf_config: file .*nope/config.json does not exist"):
        instance_from_dict(raw, str(tmp_path / "x.yaml"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    raw["model"]["hf_config"] = "config.json"
    with pytest.raises(SpecError, match=r"config.json: num_hidden_layers, num_attention_heads, intermediate_size, "
                                        r"vocab_size, max_position_embeddings: required"):
        instance_from_dict(raw, str(tmp_path / "x.yaml"), tmp_path)
    raw["model"] = {"hf_config": str(LLAMA_TINY), "seq_len": 32, "dtype": "fp32", "gpus": ["A100-80", "A100-40"],
                    "layers": 3}
    with pytest.raises(SpecError, match=r"model.layers: unknown field"):
        instance_from_dict(raw, str(tmp_path / "x.yaml"), tmp_path)
