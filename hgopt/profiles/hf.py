"""Model profiles from a Hugging Face ``config.json`` (no weights, no network, no ``transformers``).

The config's ``model_type`` selects how its fields map onto the analytic generator's
:class:`~hgopt.profiles.analytic.TransformerConfig`; the per-layer parameters, FLOPs, boundary and
saved-activation bytes then follow :mod:`hgopt.profiles.analytic`. The mapping follows the module
definitions of ``transformers`` 5.23 (``src/transformers/models/<type>/modeling_<type>.py``):

* ``llama``, ``mistral``, ``qwen2``: ``{X}DecoderLayer`` = RMSNorm, attention with ``q_proj``
  (``heads · head_dim``), ``k_proj``/``v_proj`` (``num_key_value_heads · head_dim``, grouped-query
  attention), ``o_proj``, rotary positions (no table), RMSNorm, SwiGLU MLP ``gate_proj``, ``up_proj``
  (``intermediate_size``), ``down_proj``. Biases: Llama ``attention_bias`` on q/k/v/o and
  ``mlp_bias`` on the three MLP projections (both default false); Mistral none; Qwen2 on q/k/v only.
  ``tie_word_embeddings`` defaults to false.
* ``gpt2``: ``GPT2Block`` = LayerNorm, ``c_attn`` (3h, bias), ``c_proj`` (bias), LayerNorm, ``c_fc``
  (``n_inner`` or 4h, bias), GELU, ``c_proj``; learned positions ``wpe`` (``n_positions`` rows);
  ``ln_f``; tied ``lm_head`` (default true).
* ``opt``: ``OPTDecoderLayer`` = LayerNorm, q/k/v/out projections (bias ``enable_bias``), LayerNorm,
  ``fc1`` (``ffn_dim``), ReLU, ``fc2``; ``OPTLearnedPositionalEmbedding`` with
  ``max_position_embeddings + 2`` rows (offset 2); ``final_layer_norm``; tied ``lm_head`` (default
  true). ``word_embed_proj_dim != hidden_size`` (``project_in``/``project_out``, OPT-350m) and
  ``do_layer_norm_before: false`` are refused.
* ``gpt_neox``: ``GPTNeoXLayer`` = LayerNorm, ``query_key_value`` (3h, bias ``attention_bias``,
  default true), ``dense``, LayerNorm, ``dense_h_to_4h`` (``intermediate_size``), GELU,
  ``dense_4h_to_h``; rotary positions; ``final_layer_norm``; ``lm_head`` untied by default.

An unknown ``model_type`` or a missing field is a :class:`~hgopt.errors.SpecError` naming the file
and the field. The config's JSON is kept in the profile (``ModelProfile.hf_config``), so that the
export hands it to the runner, which builds the same architecture with ``transformers``' modules.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from hgopt.errors import SpecError
from hgopt.profiles.analytic import Optimizer, SavedTensors, TransformerConfig, generate_profile
from hgopt.profiles.gpus import GPUS, GpuSpec
from hgopt.spec import ModelProfile, TrainDtype

__all__ = ["HF_MODEL_TYPES", "hf_profile", "hf_transformer_config", "read_hf_config"]

HF_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "gpt2", "opt", "gpt_neox")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json``; SpecError naming the file when it cannot be read."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise SpecError(str(p), "<file>", f"cannot read the Hugging Face config: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SpecError(str(p), "<file>", f"is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(str(p), "<top>", f"expected a JSON object, got {type(data).__name__}")
    return data


_LLAMA_LIKE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
               "max_position_embeddings")
_REQUIRED: Mapping[str, tuple[str, ...]] = {
    "llama": _LLAMA_LIKE, "mistral": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE,
    "gpt2": ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"),
    "opt": ("hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim", "vocab_size",
            "max_position_embeddings"),
    "gpt_neox": _LLAMA_LIKE,
}
"""Fields without a default in ``transformers``' config class that the profile needs."""


class _Fields:
    def __init__(self, cfg: Mapping[str, Any], source: str, model_type: str) -> None:
        self.cfg, self.source, self.model_type = cfg, source, model_type

    def fail(self, key: str, problem: str) -> SpecError:
        return SpecError(self.source, key, problem)

    def int(self, key: str, default: int | None = None) -> int:
        v = self.cfg.get(key)
        if v is None:
            if default is not None:
                return default
            raise self.fail(key, f"is required for model_type {self.model_type!r} but missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self.fail(key, f"expected an integer >= 1, got {v!r}")
        return v

    def flag(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, f"expected true or false, got {v!r}")
        return v


def hf_transformer_config(cfg: Mapping[str, Any], *, source: str = "<config>", seq_len: int | None = None,
                          dtype: TrainDtype = "bf16", name: str | None = None,
                          flash_attention: bool = True) -> TransformerConfig:
    """Map a Hugging Face config onto the analytic generator's shape. ``seq_len`` defaults to the
    config's ``max_position_embeddings`` (``n_positions`` for GPT-2)."""
    mt = cfg.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise SpecError(source, "model_type", f"{mt!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})"
                        if mt is not None else f"is required but missing (supported: {', '.join(HF_MODEL_TYPES)})")
    missing = [k for k in _REQUIRED[str(mt)] if cfg.get(k) is None]
    if missing:
        raise SpecError(source, ", ".join(missing), f"required for model_type {mt!r} but missing")
    f = _Fields(cfg, source, str(mt))
    if mt == "gpt2":
        h, positions = f.int("n_embd"), f.int("n_positions")
        base = dict(layers=f.int("n_layer"), hidden=h, heads=f.int("n_head"), vocab=f.int("vocab_size"),
                    ffn=f.int("n_inner", 4 * h), positions=positions,
                    tied_embeddings=f.flag("tie_word_embeddings", True))
        default_seq = positions
    elif mt == "opt":
        h = f.int("hidden_size")
        if f.int("word_embed_proj_dim", h) != h:
            raise f.fail("word_embed_proj_dim", f"{cfg['word_embed_proj_dim']} differs from hidden_size {h}: the "
                                                "project_in/project_out variant (OPT-350m) is not supported")
        if not f.flag("do_layer_norm_before", True):
            raise f.fail("do_layer_norm_before", "false (post-norm OPT-350m) is not supported")
        bias = f.flag("enable_bias", True)
        default_seq = f.int("max_position_embeddings")
        base = dict(layers=f.int("num_hidden_layers"), hidden=h, heads=f.int("num_attention_heads"),
                    vocab=f.int("vocab_size"), ffn=f.int("ffn_dim"), positions=default_seq + 2,
                    qkv_bias=bias, out_bias=bias, mlp_bias=bias, tied_embeddings=f.flag("tie_word_embeddings", True))
    elif mt == "gpt_neox":
        bias = f.flag("attention_bias", True)  # query_key_value and dense; the MLP always has biases
        default_seq = f.int("max_position_embeddings")
        base = dict(layers=f.int("num_hidden_layers"), hidden=f.int("hidden_size"),
                    heads=f.int("num_attention_heads"), vocab=f.int("vocab_size"), ffn=f.int("intermediate_size"),
                    positions=0, qkv_bias=bias, out_bias=bias, mlp_bias=True,
                    tied_embeddings=f.flag("tie_word_embeddings", False))
    else:  # llama, mistral, qwen2
        h, heads = f.int("hidden_size"), f.int("num_attention_heads")
        kv = f.int("num_key_value_heads", heads)
        if heads % kv:
            raise f.fail("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
        attn_bias = mt == "llama" and f.flag("attention_bias", False)
        default_seq = f.int("max_position_embeddings")
        head_dim = f.int("head_dim", h // heads)
        base = dict(layers=f.int("num_hidden_layers"), hidden=h, heads=heads, kv_heads=kv, vocab=f.int("vocab_size"),
                    ffn=f.int("intermediate_size"), glu=True, head_dim=None if head_dim * heads == h else head_dim,
                    qkv_bias=attn_bias or mt == "qwen2", out_bias=attn_bias,
                    mlp_bias=mt == "llama" and f.flag("mlp_bias", False), rms_norm=True, positions=0,
                    tied_embeddings=f.flag("tie_word_embeddings", False))
    if base.get("head_dim") is None and base["hidden"] % base["heads"]:
        raise f.fail("num_attention_heads", f"{base['heads']} does not divide the hidden size {base['hidden']}")
    # the runner trains with every dropout 0 (hgopt.runner.hf), so no masks are kept whatever the config says
    base["dropout"] = False
    base["saved"] = _saved_tensors(f, str(mt), base)
    tc = TransformerConfig(name=name or str(cfg.get("_name_or_path") or mt), seq_len=seq_len or default_seq,
                           dtype=dtype, flash_attention=flash_attention, **base)  # type: ignore[arg-type]
    return tc


_MLP_TENSORS: Mapping[str, int] = {"relu": 1, "gelu": 2, "gelu_pytorch_tanh": 2, "gelu_new": 5, "gelu_fast": 8}
"""``f``-wide tensors an ungated MLP keeps for backward, per ``transformers`` activation name
(``ACT2FN``): ``nn.ReLU`` keeps its output, which is also the down projection's input; ``F.gelu`` (exact or
``approximate="tanh"``) its input, and the down projection its output; ``NewGELUActivation``
(``gelu_new``) computes ``0.5·x·(1 + tanh(√(2/π)(x + 0.044715·x³)))`` in separate operations that keep the
input, the cube's input, the tanh output and two products; ``FastGELUActivation`` (its own tanh
formula) eight."""
_ACT_FIELD: Mapping[str, tuple[str, str]] = {
    "gpt2": ("activation_function", "gelu_new"), "opt": ("activation_function", "relu"),
    "gpt_neox": ("hidden_act", "gelu"),
}


def _saved_tensors(f: _Fields, mt: str, base: Mapping[str, Any]) -> SavedTensors:
    """What the family's ``transformers`` block keeps for backward (:class:`SavedTensors`; counted on
    the runner's layers, ``tests/test_hf_act_mem.py``)."""
    if mt in ("llama", "mistral", "qwen2"):  # RMSNorm upcast to fp32, rotary over the whole head, SwiGLU
        head_dim = base.get("head_dim") or base["hidden"] // base["heads"]
        return SavedTensors(norm="rms_fp32", rotary_dims=int(head_dim), mlp_tensors=4)
    key, default = _ACT_FIELD[mt]
    act = f.cfg.get(key, default) or default
    if act not in _MLP_TENSORS:
        raise f.fail(key, f"activation {act!r} is not supported (supported: {', '.join(_MLP_TENSORS)})")
    if mt == "gpt_neox":  # partial rotary, fused query_key_value kept through the value view, parallel residual
        rotary_pct = f.cfg.get("rotary_pct", 0.25)
        if not isinstance(rotary_pct, (int, float)) or isinstance(rotary_pct, bool) or not 0 <= rotary_pct <= 1:
            raise f.fail("rotary_pct", f"expected a number in [0, 1], got {rotary_pct!r}")
        rot = int(base["hidden"] // base["heads"] * rotary_pct)
        return SavedTensors(norm="layer", shared_norm_input=f.flag("use_parallel_residual", True), rotary_dims=rot,
                            fused_qkv_kept=True, out_copy=True, mlp_tensors=_MLP_TENSORS[act])
    return SavedTensors(norm="layer", mlp_tensors=_MLP_TENSORS[str(act)])


def hf_profile(cfg: Mapping[str, Any], gpus: Sequence[str | GpuSpec] | None = None, *, source: str = "<config>",
               seq_len: int | None = None, dtype: TrainDtype = "bf16", name: str | None = None,
               tps: Sequence[int] = (1, 2, 4, 8), mbss: Sequence[int] = (1, 2, 4, 8), optimizer: Optimizer = "adam",
               flash_attention: bool = True) -> ModelProfile:
    """The analytic profile of the architecture in ``cfg`` (a parsed ``config.json``) on ``gpus``
    (default: every GPU of the table that trains in ``dtype``), with the config kept in the profile."""
    tc = hf_transformer_config(cfg, source=source, seq_len=seq_len, dtype=dtype, name=name,
                               flash_attention=flash_attention)
    if gpus is None:
        gpus = [g for g, spec in GPUS.items() if spec.peak_flops(dtype) is not None]
    prof = generate_profile(tc, gpus, tps=tps, mbss=mbss, optimizer=optimizer)
    return replace(prof, hf_config=json.dumps(dict(cfg), sort_keys=True, separators=(",", ":")),
                   source=f"analytic from Hugging Face config {source} (model_type {cfg['model_type']}; "
                          f"mapping in hgopt.profiles.hf) · {prof.source}")
