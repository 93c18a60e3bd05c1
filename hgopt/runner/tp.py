"""Megatron-style tensor parallelism with explicit collectives: column-parallel linear layers split
their output features over the tp group, row-parallel ones their input features; ``f`` (identity
forward, all-reduce backward) enters a column-parallel region and ``g`` (all-reduce forward, identity
backward) leaves a row-parallel one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ColumnLinear", "RowLinear", "TpGroup", "shard", "split_dims", "unshard"]


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


def split_dims(module: nn.Module) -> dict[str, int | None]:
    """Parameter name -> the dimension split over the tp group (None: replicated)."""
    out: dict[str, int | None] = {}
    for mod_name, mod in module.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for p_name, _ in mod.named_parameters(recurse=False):
            if isinstance(mod, ColumnLinear):
                dim: int | None = 0
            elif isinstance(mod, RowLinear):
                dim = 1 if p_name == "weight" else None
            else:
                dim = None
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
