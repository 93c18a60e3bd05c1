"""ZeRO-1 for a gradient-sync group (``SyncGroup.zero == 1``): the optimizer state of the group's layers
is sharded over its members.

The group's parameters (this rank's tp shard of layers ``[start, end)``, identical in shape and order on
every member) are viewed as one flat vector of ``numel`` elements; member ``i`` of ``n`` owns elements
``[i * c, min((i + 1) * c, numel))`` with ``c = ceil(numel / n)``. Per step:

1. the summed gradient is **reduce-scattered**: each member receives the sum of its own slice only;
2. the optimizer steps a flat parameter holding that slice (the optimizer never sees the group's model
   parameters, so its state — Adam's two moments — exists for the slice only);
3. the updated slices are **all-gathered** into every member's model parameters.

Adam and SGD are elementwise, so stepping a slice gives the same numbers as stepping the whole tensors.
A ring reduce-scatter plus all-gather moves as many bytes as one ring all-reduce (2 (n-1)/n of the
flat size per member). Where the backend has no reduce-scatter (gloo before it gained one), the
gradients are all-reduced and the member keeps its slice: 3 (n-1)/n, 1.5 x the bytes of plain data
parallelism."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hgopt.export.runner_plan import RunnerPlan, SyncGroup
from hgopt.runner.model import layer_of

__all__ = ["ZeroShard", "make_zero_shards", "optimizer_params", "shard_bounds"]

log = logging.getLogger(__name__)


def shard_bounds(numel: int, members: int, index: int) -> tuple[int, int]:
    """The flat element range ``[lo, hi)`` that member ``index`` of ``members`` owns (may be empty for the
    last members when ``numel < members``)."""
    if members < 1 or not 0 <= index < members:
        raise ValueError(f"member {index} of {members}: not a valid ZeRO member")
    chunk = math.ceil(numel / members)
    lo = min(numel, index * chunk)
    return lo, min(numel, lo + chunk)


def _reduce_scatter_fn() -> Any:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_fn() -> Any:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ZeroShard:
    """This rank's part of one ZeRO-1 sync group: the flat slice it steps (``shard``, an
    ``nn.Parameter`` handed to the optimizer) and the collectives around the step."""

    def __init__(self, index: int, sg: SyncGroup, pg: Any, rank: int, params: list[tuple[str, nn.Parameter]]) -> None:
        if not params:
            raise ValueError(f"sync group {index} (layers [{sg.start}, {sg.end})): this rank holds none of its parameters")
        self.index, self.sg, self.pg = index, sg, pg
        self.members = len(sg.ranks)
        self.member = sorted(sg.ranks).index(rank)  # the group rank: new_group numbers its ranks in sorted order
        self.names = tuple(n for n, _ in params)
        self.params = tuple(p for _, p in params)
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = math.ceil(self.numel / self.members)
        self.lo, self.hi = shard_bounds(self.numel, self.members, self.member)
        self.shard = nn.Parameter(self.flat_params()[self.lo : self.hi].clone())
        self._reduce_scatter_ok = True

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p.shape) for p in self.params)

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def refresh(self) -> None:
        """Copy the model parameters' slice into ``shard`` (after a checkpoint was loaded into them)."""
        with torch.no_grad():
            self.shard.copy_(self.flat_params()[self.lo : self.hi])

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        pad = self.members * self.chunk - flat.numel()
        return flat if pad == 0 else torch.cat([flat, flat.new_zeros(pad)])

    @property
    def reduce_scatter_ok(self) -> bool:
        """False once the backend turned out to lack reduce-scatter (all-reduce and keep the slice)."""
        return self._reduce_scatter_ok

    def launch_reduce(self, flat: torch.Tensor, wire_dtype: torch.dtype | None) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Start summing ``flat`` (this rank's gradients of the group, flattened) over the members,
        asynchronously; ``wire_dtype``: reduce in that dtype (narrowed cross-cluster sync). Returns
        (the work, the padded full vector on the wire, the tensor that will hold this member's slice of
        the sum); :meth:`complete_reduce` takes the slice once the work is done."""
        full = self._padded(flat if wire_dtype is None else flat.to(wire_dtype))
        if self._reduce_scatter_ok:
            out = full.new_empty(self.chunk)
            try:
                return _reduce_scatter_fn()(out, full, group=self.pg, async_op=True), full, out
            except (NotImplementedError, RuntimeError) as exc:
                if "support" not in str(exc).lower():
                    raise
                log.info("zero 1: this backend has no reduce-scatter (%s); all-reduce and keep the own slice", exc)
                self._reduce_scatter_ok = False
        work = dist.all_reduce(full, group=self.pg, async_op=True)
        return work, full, full[self.member * self.chunk : (self.member + 1) * self.chunk]

    def complete_reduce(self, out: torch.Tensor, dtype: torch.dtype) -> None:
        """After the work of :meth:`launch_reduce`: ``shard.grad`` = this member's slice of the sum (in
        ``dtype``); the model parameters' gradients are dropped."""
        self.shard.grad = out[: self.hi - self.lo].to(dtype).clone()
        for p in self.params:
            p.grad = None

    def gather(self) -> int:
        """All-gather the members' updated slices into the model parameters; returns the bytes of the
        full vector."""
        mine = self.shard.detach().new_zeros(self.chunk)
        mine[: self.hi - self.lo] = self.shard.detach()
        out = mine.new_empty(self.members * self.chunk)
        _all_gather_fn()(out, mine, group=self.pg)
        with torch.no_grad():
            for p, part in zip(self.params, torch.split(out[: self.numel], [p.numel() for p in self.params])):
                p.copy_(part.view(p.shape))
        return out.numel() * out.element_size()


def make_zero_shards(rp: RunnerPlan, rank: int, model: nn.Module, sync: Iterable[tuple[SyncGroup, Any]]) -> tuple[ZeroShard, ...]:
    """A :class:`ZeroShard` for every ZeRO-1 sync group this rank is in, in the plan's group order."""
    out = []
    for sg, pg in sync:
        if not sg.zero:
            continue
        params = [(n, p) for n, p in model.named_parameters() if sg.start <= layer_of(n) < sg.end]
        z = ZeroShard(rp.sync_groups.index(sg), sg, pg, rank, params)
        if dist.get_group_rank(pg, rank) != z.member:
            raise RuntimeError(f"sync group {z.index}: rank {rank} is group rank {dist.get_group_rank(pg, rank)}, "
                               f"expected {z.member}")
        log.debug("zero 1: layers [%d, %d): member %d of %d, optimizer state for elements [%d, %d) of %d",
                  sg.start, sg.end, z.member, z.members, z.lo, z.hi, z.numel)
        out.append(z)
    return tuple(out)


def optimizer_params(model: nn.Module, shards: tuple[ZeroShard, ...]) -> list[nn.Parameter]:
    """What the optimizer steps: the model parameters outside every ZeRO group, then each group's slice."""
    sharded = {id(p) for z in shards for p in z.params}
    return [p for p in model.parameters() if id(p) not in sharded] + [z.shard for z in shards]
