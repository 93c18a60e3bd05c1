"""The runner's GPT-style decoder, built layer by layer from the instance's layer list so that a
plan's layer ranges apply unchanged. Each rank builds only its stage's layers (and only its tensor-
parallel shard of them); ``build_stage(cfg, 0, L)`` with tp 1 is the whole model.

Initial weights depend only on ``(seed, layer index)``: every layer's full tensors are drawn from a
generator seeded with both, then sliced for the rank's tp shard. A stage, a tp shard and the single-
process model therefore start from identical numbers.
"""

from __future__ import annotations

import json

import torch
import torch.utils.checkpoint
from torch import nn

from hgopt.export.runner_plan import ModelConfig
from hgopt.runner.tp import ColumnLinear, RowLinear, TpGroup, enter_parallel, shard, split_dims, vocab_lookup

__all__ = ["Block", "Embedding", "Head", "Layer", "StageModel", "build_stage", "layer_of", "make_layer"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class Embedding(nn.Module):
    """Token table (vocabulary-parallel over the tp group: this rank's ``V / tp`` rows,
    :func:`~hgopt.runner.tp.vocab_lookup`) + learned positions (replicated)."""

    tp_split = {"tok": 0}

    def __init__(self, cfg: ModelConfig, tp: TpGroup) -> None:
        super().__init__()
        assert cfg.vocab % tp.size == 0, "checked when the runner plan is read"
        self.tp = tp
        self.tok = nn.Parameter(torch.empty(cfg.vocab // tp.size, cfg.hidden))
        self.pos = nn.Parameter(torch.empty(cfg.seq, cfg.hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_lookup(self.tok, tokens, self.tp) + self.pos[: tokens.shape[1]]


class Attention(nn.Module):
    """Causal self-attention; this rank computes ``heads / tp`` heads. The key projection has no bias:
    its gradient is zero in exact arithmetic, and Adam would turn the rounding noise into full steps."""

    def __init__(self, cfg: ModelConfig, tp: TpGroup) -> None:
        super().__init__()
        self.tp = tp
        self.local_heads = cfg.heads // tp.size
        self.head_dim = cfg.hidden // cfg.heads
        self.q = ColumnLinear(cfg.hidden, cfg.hidden, tp)
        self.k = ColumnLinear(cfg.hidden, cfg.hidden, tp, bias=False)  # a key bias cannot change softmax
        self.v = ColumnLinear(cfg.hidden, cfg.hidden, tp)
        self.o = RowLinear(cfg.hidden, cfg.hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = enter_parallel(x, self.tp)
        q, k, v = (m(x).view(b, t, self.local_heads, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup) -> None:
        super().__init__()
        self.tp = tp
        self.fc1 = ColumnLinear(cfg.hidden, cfg.ffn_mult * cfg.hidden, tp)
        self.fc2 = RowLinear(cfg.ffn_mult * cfg.hidden, cfg.hidden, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(enter_parallel(x, self.tp))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: ModelConfig, tp: TpGroup) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg, tp)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = Mlp(cfg, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm (replicated) and output projection to vocabulary logits, vocabulary-parallel over the
    tp group (this rank's ``V / tp`` logits; the loss is :func:`~hgopt.runner.tp.vocab_parallel_cross_entropy`)."""

    def __init__(self, cfg: ModelConfig, tp: TpGroup) -> None:
        super().__init__()
        self.tp = tp
        self.ln = nn.LayerNorm(cfg.hidden)
        self.out = ColumnLinear(cfg.hidden, cfg.vocab, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(enter_parallel(self.ln(x), self.tp))


class Layer(nn.Module):
    """Layer ``index`` of the instance's list. A block that is the model's first (last) layer when the
    list has no embedding (head) layer also embeds tokens (projects to logits)."""

    def __init__(self, cfg: ModelConfig, index: int, tp: TpGroup) -> None:
        super().__init__()
        kind, last = cfg.layers[index], cfg.num_layers - 1
        if kind == "embedding" and index != 0 or kind == "head" and index != last:
            raise ValueError(f"model layer {index} is a {kind} layer; embedding must be the first layer and head the last")
        self.embed = Embedding(cfg, tp) if kind == "embedding" or index == 0 else None
        self.block = Block(cfg, tp) if kind == "block" else None
        self.head = Head(cfg, tp) if kind == "head" or index == last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in (self.embed, self.block, self.head):
            if part is not None:
                x = part(x)
        return x


def make_layer(cfg: ModelConfig, index: int, tp: TpGroup) -> nn.Module:
    """Layer ``index``: the Hugging Face architecture of ``cfg.hf_config`` (:mod:`hgopt.runner.hf`,
    ``transformers`` imported only then) or the runner's own GPT block."""
    if cfg.hf_config:
        from hgopt.runner.hf import HfLayer

        return HfLayer(cfg.hf_config, cfg.layers, index, tp)
    return Layer(cfg, index, tp)


class StageModel(nn.Module):
    """Layers ``[start, end)``; parameters are named ``layers.<global index>.…`` on every stage."""

    def __init__(self, cfg: ModelConfig, start: int, end: int, tp: TpGroup, recompute: bool = False) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.recompute = recompute
        """Run every layer under ``torch.utils.checkpoint`` (non-reentrant): backward keeps each
        layer's input only and runs the layer's forward again."""
        self.layers = nn.ModuleDict({str(i): make_layer(cfg, i, tp) for i in range(start, end)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def layer_of(param_name: str) -> int:
    """The global layer index of a :class:`StageModel` parameter name."""
    return int(param_name.split(".")[1])


def build_stage(cfg: ModelConfig, start: int, end: int, tp: TpGroup | None = None, *, seed: int = 0,
                dtype: str = "float32", device: torch.device | str = "cpu", recompute: bool = False) -> StageModel:
    """Layers ``[start, end)`` with their seeded initial weights, tp shard of ``tp``, in ``dtype``, on
    ``device`` (weights are drawn on the CPU, so every device starts from the same numbers);
    ``recompute``: activation recomputation per layer (:class:`StageModel`)."""
    tp = tp or TpGroup()
    model = StageModel(cfg, start, end, tp, recompute)
    dims = split_dims(model)
    full = {}
    for i in range(start, end):
        ref = make_layer(cfg, i, TpGroup())
        if cfg.hf_config:
            from hgopt.runner.hf import init_hf_layer

            init_hf_layer(ref, seed, i, float(json.loads(cfg.hf_config).get("initializer_range", 0.02)))  # type: ignore[arg-type]
        else:
            _init_full(ref, seed, i)  # type: ignore[arg-type]
        full.update({f"layers.{i}.{k}": v for k, v in ref.state_dict().items()})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(full[name], dims[name], tp.size, tp.rank))
    return model.to(device=torch.device(device), dtype=DTYPES[dtype])


def _init_full(layer: Layer, seed: int, index: int) -> None:
    """GPT-2-style: matrices and embeddings N(0, 0.02), biases 0, norms 1 (drawn in float32)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in f".{name}" and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
