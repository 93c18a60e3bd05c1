"""Runner layers of a Hugging Face architecture, built from its ``config.json`` with ``transformers``'
own modules (``transformers`` is imported here only, lazily, never by the planner).

One runner layer per entry of the instance's layer list: ``embedding`` (token table, plus the learned
position table of GPT-2/OPT), ``block`` i (the family's decoder layer, ``layer_idx`` = i - 1, fed the
rotary ``(cos, sin)`` of the family's rotary module exactly as its ``…Model.forward`` does) and
``head`` (the final norm and ``lm_head``). The single-process model of :func:`hgopt.runner.model.build_stage`
over all layers computes what ``AutoModelForCausalLM.from_config`` computes with the same weights
(``tests/test_runner_hf.py`` checks logits and gradients in float64). Differences: dropout is forced to 0
(deterministic training), attention is SDPA with its causal flag (no padding mask: every sample is a
full sequence), and a tied ``lm_head`` is a separate copy (its own initial values equal the table's;
the copies then train apart, see ``docs/runner.md``).

Tensor parallelism (Megatron-style, hand-written collectives of :mod:`hgopt.runner.tp`): the token
table and ``lm_head`` are vocabulary-parallel (the loss from the logit shards); the family's
query/key/value and MLP input projections are replaced by :class:`ColumnLinear` (rows = whole heads,
contiguous; GQA: key/value heads split the same way), attention output and MLP output by
:class:`RowLinear`, and each norm feeding a parallel region gets :func:`enter_parallel` on its output.
The decoder layer's own forward then runs unchanged on the local heads (Llama/Mistral/Qwen2/NeoX infer
the head count from the tensor; OPT's ``num_heads`` is divided by tp). GPT-2 (fused ``Conv1D``) has no
tp path.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from hgopt.runner.tp import ColumnLinear, RowLinear, TpGroup, VocabEmbedding, enter_parallel

__all__ = ["HF_RUNNER_TYPES", "HfLayer", "hf_config_object", "init_hf_layer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Family:
    module: str
    layer: str
    rotary: str | None
    norm: str | None
    """Final-norm class in ``module`` (None: ``nn.LayerNorm``)."""
    column: tuple[str, ...]
    row: tuple[str, ...]
    tp_norms: tuple[str, ...]


_LLAMA_COL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_LLAMA_ROW = ("self_attn.o_proj", "mlp.down_proj")
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(module="llama", layer="LlamaDecoderLayer", rotary="LlamaRotaryEmbedding", norm="LlamaRMSNorm",
                     column=_LLAMA_COL, row=_LLAMA_ROW, tp_norms=("input_layernorm", "post_attention_layernorm")),
    "mistral": _Family(module="mistral", layer="MistralDecoderLayer", rotary="MistralRotaryEmbedding",
                       norm="MistralRMSNorm", column=_LLAMA_COL, row=_LLAMA_ROW,
                       tp_norms=("input_layernorm", "post_attention_layernorm")),
    "qwen2": _Family(module="qwen2", layer="Qwen2DecoderLayer", rotary="Qwen2RotaryEmbedding", norm="Qwen2RMSNorm",
                     column=_LLAMA_COL, row=_LLAMA_ROW, tp_norms=("input_layernorm", "post_attention_layernorm")),
    "gpt_neox": _Family(module="gpt_neox", layer="GPTNeoXLayer", rotary="GPTNeoXRotaryEmbedding", norm=None,
                        column=("attention.query_key_value", "mlp.dense_h_to_4h"),
                        row=("attention.dense", "mlp.dense_4h_to_h"),
                        tp_norms=("input_layernorm", "post_attention_layernorm")),
    "opt": _Family(module="opt", layer="OPTDecoderLayer", rotary=None, norm=None,
                   column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"),
                   row=("self_attn.out_proj", "fc2"), tp_norms=("self_attn_layer_norm", "final_layer_norm")),
    "gpt2": _Family(module="gpt2", layer="GPT2Block", rotary=None, norm=None, column=(), row=(), tp_norms=()),
}
HF_RUNNER_TYPES: tuple[str, ...] = tuple(_FAMILIES)


def _modeling(fam: _Family) -> Any:
    return importlib.import_module(f"transformers.models.{fam.module}.modeling_{fam.module}")


@lru_cache(maxsize=8)
def hf_config_object(text: str) -> Any:
    """The ``transformers`` config of a JSON text, with every dropout 0 and SDPA attention."""
    from transformers import AutoConfig

    data = json.loads(text)
    mt = data.pop("model_type")
    if mt not in _FAMILIES:
        raise ValueError(f"model_type {mt!r}: the runner builds {', '.join(HF_RUNNER_TYPES)}")
    for k in ("architectures", "torch_dtype", "dtype", "transformers_version"):
        data.pop(k, None)
    cfg = AutoConfig.for_model(mt, **data)
    for k, v in cfg.to_dict().items():  # the class defaults too (GPT-2's 0.1)
        if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
            setattr(cfg, k, 0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def _get(module: nn.Module, dotted: str) -> tuple[nn.Module, str, nn.Module]:
    parent_name, _, leaf = dotted.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    return parent, leaf, getattr(parent, leaf)


def _parallelize(block: nn.Module, fam: _Family, tp: TpGroup) -> None:
    """Swap the family's projections for tp shards (see the module docstring)."""
    for name in fam.column:
        parent, leaf, lin = _get(block, name)
        setattr(parent, leaf, ColumnLinear(lin.in_features, lin.out_features, tp, bias=lin.bias is not None))
    for name in fam.row:
        parent, leaf, lin = _get(block, name)
        setattr(parent, leaf, RowLinear(lin.in_features, lin.out_features, tp, bias=lin.bias is not None))
    for name in fam.tp_norms:
        block.get_submodule(name).register_forward_hook(lambda _m, _i, out: enter_parallel(out, tp))
    attn = getattr(block, "self_attn", None)
    if fam.module == "opt" and attn is not None:
        attn.num_heads //= tp.size


class _Embed(nn.Module):
    """Token table (vocabulary-parallel, :class:`~hgopt.runner.tp.VocabEmbedding`) + GPT-2/OPT's learned
    position table (replicated)."""

    def __init__(self, cfg: Any, mt: str, tp: TpGroup) -> None:
        super().__init__()
        self.mt = mt
        self.tok = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.pos: nn.Embedding | None = None
        if mt == "gpt2":
            self.pos = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        elif mt == "opt":
            self.pos = nn.Embedding(cfg.max_position_embeddings + 2, cfg.hidden_size)  # OPT's offset of 2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device) + (2 if self.mt == "opt" else 0)
            x = x + self.pos(pos)[None]
        return x


class _Head(nn.Module):
    """Final norm (replicated) + ``lm_head``, vocabulary-parallel (:class:`ColumnLinear` over the
    vocabulary; the loss is :func:`~hgopt.runner.tp.vocab_parallel_cross_entropy`)."""

    def __init__(self, cfg: Any, fam: _Family, tp: TpGroup) -> None:
        super().__init__()
        self.tp = tp
        if fam.norm is not None:
            self.norm: nn.Module = getattr(_modeling(fam), fam.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        else:
            eps = getattr(cfg, "layer_norm_eps", getattr(cfg, "layer_norm_epsilon", 1e-5))
            self.norm = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.lm_head = ColumnLinear(cfg.hidden_size, cfg.vocab_size, tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(enter_parallel(self.norm(x), self.tp))


class _Block(nn.Module):
    def __init__(self, cfg: Any, fam: _Family, layer_idx: int, tp: TpGroup) -> None:
        super().__init__()
        mod = _modeling(fam)
        self.layer = getattr(mod, fam.layer)(cfg, layer_idx)
        self.rotary = getattr(mod, fam.rotary)(config=cfg) if fam.rotary else None
        self.mt = fam.module
        if tp.size > 1:
            _parallelize(self.layer, fam, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None]
        kw: dict[str, Any] = {}
        if self.rotary is not None:
            kw["position_embeddings"] = self.rotary(x, pos)
        if self.mt != "gpt2":
            kw["position_ids"] = pos
        out = self.layer(x, attention_mask=None, **kw)
        return out[0] if isinstance(out, tuple) else out


class HfLayer(nn.Module):
    """Layer ``index`` of the instance's list, as in :class:`hgopt.runner.model.Layer` (a first/last
    block also embeds/projects when the list has no embedding/head layer)."""

    def __init__(self, text: str, kinds: tuple[str, ...], index: int, tp: TpGroup) -> None:
        super().__init__()
        cfg = hf_config_object(text)
        mt = json.loads(text)["model_type"]
        fam = _FAMILIES[mt]
        kind, last = kinds[index], len(kinds) - 1
        self.embed = _Embed(cfg, mt, tp) if kind == "embedding" or index == 0 else None
        block_idx = sum(1 for k in kinds[:index] if k == "block")
        self.block = _Block(cfg, fam, block_idx, tp) if kind == "block" else None
        self.head = _Head(cfg, fam, tp) if kind == "head" or index == last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in (self.embed, self.block, self.head):
            if part is not None:
                x = part(x)
        return x


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__


def init_hf_layer(layer: HfLayer, seed: int, index: int, std: float) -> None:
    """Seeded initialisation as ``transformers``' ``_init_weights`` does it: linear and embedding
    weights N(0, initializer_range), biases 0, norm scales 1 and shifts 0; drawn in float32 from a
    generator seeded with ``(seed, layer index)`` in parameter-name order."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    norms = {id(p) for m in layer.modules() if _is_norm(m) for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if id(p) in norms:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _prefixes(mt: str) -> tuple[str, str, str, str, str]:
    """(token table, position table, decoder layer j, final norm, lm head) names in ``transformers``'
    ``…ForCausalLM`` of ``mt``."""
    return {
        "gpt2": ("transformer.wte", "transformer.wpe", "transformer.h.{j}", "transformer.ln_f", "lm_head"),
        "opt": ("model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.layers.{j}",
                "model.decoder.final_layer_norm", "lm_head"),
        "gpt_neox": ("gpt_neox.embed_in", "", "gpt_neox.layers.{j}", "gpt_neox.final_layer_norm", "lm_head"),
    }.get(mt, ("model.embed_tokens", "", "model.layers.{j}", "model.norm", "lm_head"))


def to_hf_state_dict(params: dict[str, torch.Tensor], text: str, kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The runner's full parameters (``layers.<i>.…``, tp shards joined, e.g.
    :func:`hgopt.runner.checkpoint.load_full_state`) under ``transformers``' names, for
    ``AutoModelForCausalLM.from_config(...).load_state_dict``."""
    tok, pos, layer, norm, head = _prefixes(json.loads(text)["model_type"])
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        _, i, part, rest = name.split(".", 3)
        if part == "embed":
            out[(tok if rest.startswith("tok.") else pos) + rest[3:]] = t
        elif part == "block":
            j = sum(1 for k in kinds[: int(i)] if k == "block")
            out[layer.format(j=j) + rest[len("layer"):]] = t
        elif part == "head":
            out[(norm + rest[len("norm"):]) if rest.startswith("norm.") else head + rest[len("lm_head"):]] = t
    return out
