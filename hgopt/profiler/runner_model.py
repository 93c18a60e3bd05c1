"""The runner's GPT layers as :class:`~hgopt.profiler.timing.LayerCase` s: each layer is built by
itself with :func:`hgopt.runner.model.build_stage` (``[i, i + 1)``), fed what the previous layer
would hand it (token ids for the first layer, ``(mbs, seq, hidden)`` activations otherwise), and the
last layer ends in the runner's loss (token cross-entropy, summed and divided by the token count), so
a stage's time is the sum of its layers' times. torch is imported here: import this module lazily."""

from __future__ import annotations

from typing import Any

import torch

from hgopt.export.runner_plan import ModelConfig
from hgopt.profiler.timing import LayerCase
from hgopt.runner.model import build_stage
from hgopt.runner.tp import TpGroup, vocab_parallel_cross_entropy

__all__ = ["runner_layer_cases"]


def runner_layer_cases(cfg: ModelConfig, *, names: list[str] | None = None, tp: TpGroup | None = None,
                       seed: int = 0, dtype: str = "float32") -> list[LayerCase]:
    """One case per layer of ``cfg`` (tp shard of ``tp``)."""
    names = names or [f"{kind}{i}" for i, kind in enumerate(cfg.layers)]
    if len(names) != cfg.num_layers:
        raise ValueError(f"{len(names)} layer names for {cfg.num_layers} layers")
    return [_case(cfg, i, names[i], tp, seed, dtype) for i in range(cfg.num_layers)]


def _case(cfg: ModelConfig, i: int, name: str, tp: TpGroup | None, seed: int, dtype: str) -> LayerCase:
    module = build_stage(cfg, i, i + 1, tp, seed=seed, dtype=dtype)
    compute = next(module.parameters()).dtype
    last = i == cfg.num_layers - 1
    return LayerCase(
        name=name,
        kind=cfg.layers[i],
        module=module,
        make_input=lambda mbs: _input(cfg, i, mbs, compute, seed),
        loss=_loss(cfg, seed, tp or TpGroup()) if last else None,
    )


def _input(cfg: ModelConfig, i: int, mbs: int, dtype: torch.dtype, seed: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed + 7919 * i + mbs)
    if i == 0:
        return (torch.randint(0, cfg.vocab, (mbs, cfg.seq), generator=g),)
    return (torch.randn(mbs, cfg.seq, cfg.hidden, generator=g).to(dtype),)


def _loss(cfg: ModelConfig, seed: int, tp: TpGroup) -> Any:
    def loss(logits: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + 1)
        targets = torch.randint(0, cfg.vocab, logits.shape[:-1], generator=g)
        # hfrec: the head's logits are vocabulary-parallel over tp (the runner's loss)
        return vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            tp) / targets.numel()
    return loss
