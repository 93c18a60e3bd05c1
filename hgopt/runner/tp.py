"""Megatron-style tensor parallelism with explicit collectives: column-parallel linear layers split
their output features over the tp group, row-parallel ones their input features; ``f`` (identity
forward, all-reduce backward) enters a column-parallel region and ``g`` (all-reduce forward, identity
backward) leaves a row-parallel one.

The vocabulary is split too (Megatron's vocabulary-parallel embedding and output layer, what the cost
model's analytic profile assumes: ``V·h / tp`` parameters and ``4·s·V / tp`` bytes of fp32 softmax per
rank): :func:`vocab_lookup` gathers from this rank's rows of the token table and sums the ranks'
partial lookups (``g``); the output projection is a :class:`ColumnLinear` over the vocabulary, and
:func:`vocab_parallel_cross_entropy` computes the loss from the ranks' logit shards (global max and
sum of exponentials by all-reduce, the target's logit from the rank that holds it), keeping only this
rank's softmax shard for backward. ``tests/test_tp_api.py`` checks both against PyTorch's own
``RowwiseParallel`` embedding and ``ColwiseParallel`` + ``loss_parallel`` head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ColumnLinear", "RowLinear", "TpGroup", "VocabEmbedding", "shard", "split_dims", "unshard",
           "vocab_lookup", "vocab_parallel_cross_entropy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TpGroup:
    """A rank's tensor-parallel group; ``group`` is None when ``size`` is 1."""

    size: int = 1
    rank: int = 0
    group: Any = None


def _all_reduce(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=tp.group)
    return out


class _EnterParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TpGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad, ctx.tp), None


class _LeaveParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TpGroup) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def enter_parallel(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    return x if tp.size == 1 else _EnterParallel.apply(x, tp)


def leave_parallel(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    return x if tp.size == 1 else _LeaveParallel.apply(x, tp)


class ColumnLinear(nn.Module):
    """``y_shard = x @ W[rows of this rank].T + b[rows]``; input must already be in the parallel region."""

    def __init__(self, d_in: int, d_out: int, tp: TpGroup, bias: bool = True) -> None:
        super().__init__()
        assert d_out % tp.size == 0, "checked when the runner plan is read"
        self.weight = nn.Parameter(torch.empty(d_out // tp.size, d_in))
        self.bias = nn.Parameter(torch.empty(d_out // tp.size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """``y = sum over ranks (x_shard @ W[:, cols of this rank].T) + b``; the bias is replicated and added
    once, after the all-reduce."""

    def __init__(self, d_in: int, d_out: int, tp: TpGroup, bias: bool = True) -> None:
        super().__init__()
        assert d_in % tp.size == 0, "checked when the runner plan is read"
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(d_out, d_in // tp.size))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_parallel(nn.functional.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


def vocab_lookup(weight: torch.Tensor, ids: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """Rows ``ids`` of a token table whose rows are split contiguously over ``tp`` (``weight``: this
    rank's ``V / tp`` rows): each rank looks up the ids it holds, zeros elsewhere, and the all-reduce
    (``g``) sums the partial lookups; backward leaves every rank the gradient of its own rows."""
    if tp.size == 1:
        return nn.functional.embedding(ids, weight)
    rows = weight.shape[0]
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    part = nn.functional.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0.0)
    return leave_parallel(part, tp)


class VocabEmbedding(nn.Module):
    """A vocabulary-parallel ``nn.Embedding``: ``weight`` holds this rank's ``V / tp`` rows."""

    tp_split = {"weight": 0}

    def __init__(self, vocab: int, dim: int, tp: TpGroup) -> None:
        super().__init__()
        assert vocab % tp.size == 0, "checked when the runner plan is read"
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(vocab // tp.size, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_lookup(self.weight, ids, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,  # type: ignore[override]
                tp: TpGroup) -> torch.Tensor:
        rows = logits.shape[-1]
        top = logits.detach().amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        z = logits - top[:, None]
        local = target - tp.rank * rows
        here = (local >= 0) & (local < rows) & (target != ignore_index)
        local = local.clamp(0, rows - 1)
        picked = z.gather(1, local[:, None]).squeeze(1) * here
        exp = z.exp()
        total = exp.sum(dim=-1)
        both = torch.stack([picked, total])
        dist.all_reduce(both, group=tp.group)
        valid = target != ignore_index
        loss = ((torch.log(both[1]) - both[0]) * valid).sum()
        exp /= both[1][:, None]
        ctx.save_for_backward(exp, local, here, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        softmax, local, here, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(1, local[:, None], -here.to(g.dtype)[:, None])
        return g * (valid.to(g.dtype) * grad)[:, None], None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: TpGroup,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (``[N, V / tp]``, this rank's contiguous vocabulary columns)
    against ``target`` (``[N]``, global ids; ``ignore_index`` counts 0), equal on every tp rank; with
    tp 1 ``nn.functional.cross_entropy(..., reduction="sum")``."""
    if tp.size == 1:
        return nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    return _VocabParallelCrossEntropy.apply(logits, target, ignore_index, tp)


def split_dims(module: nn.Module) -> dict[str, int | None]:
    """Parameter name -> the dimension split over the tp group (None: replicated). A module may name
    its split parameters in a ``tp_split`` mapping (the vocabulary-parallel token tables)."""
    out: dict[str, int | None] = {}
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        marked: dict[str, int] = getattr(mod, "tp_split", {})
        for p_name, _ in mod.named_parameters(recurse=False):
            if isinstance(mod, ColumnLinear):
                dim: int | None = 0
            elif isinstance(mod, RowLinear):
                dim = 1 if p_name == "weight" else None
            else:
                dim = marked.get(p_name)
            out[prefix + p_name] = dim
    return out


def shard(full: torch.Tensor, dim: int | None, size: int, rank: int) -> torch.Tensor:
    """The part of ``full`` a tp rank holds (heads and MLP columns are split contiguously)."""
    if dim is None or size == 1:
        return full
    return full.chunk(size, dim=dim)[rank]


def unshard(parts: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    """Inverse of :func:`shard` given every rank's part in tp rank order."""
    return parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim=dim)
