"""ZeRO-1 for a gradient-sync group (``SyncGroup.zero == 1``): the optimizer state of the group's layers
is sharded over its members, and the gradient reduction is bucketed and overlapped with the last
backward as in Megatron's distributed optimizer with ``overlap_grad_reduce``.

The group's parameters (this rank's tp shard of layers ``[start, end)``, identical in shape and order on
every member) are viewed as one flat vector of ``numel`` elements, cut into the group's gradient
**buckets** (:func:`zero_buckets`: the layers in reverse order packed into at most ``grad_bucket_mb``
MiB, the cost kernel's ``bucket_ranges``, the same buckets a plain group all-reduces). Each bucket is a
contiguous range of the flat vector; member ``i`` of ``n`` owns slice ``i`` of every bucket
(:func:`shard_ranges`: ``[i * c, min((i + 1) * c, size))`` of a bucket of ``size`` elements, ``c =
ceil(size / n)``). Per step:

1. as soon as the last backward has produced a bucket's gradients it is **reduce-scattered**
   asynchronously (:meth:`ZeroShard.launch_reduce`): each member receives the sum of its own slice of
   that bucket only;
2. the optimizer steps a flat parameter holding the member's slices (the optimizer never sees the
   group's model parameters, so its state — Adam's two moments — exists for the slices only);
3. the updated slices are **all-gathered** (one collective for the group) into every member's model
   parameters (:meth:`ZeroShard.gather`).

Why reduce-scatter per bucket and not all-reduce per bucket (then keeping the slice): a ring
reduce-scatter plus the all-gather move 2 (n-1)/n of the flat size per member, as one ring all-reduce
(plain data parallelism), while an all-reduce plus the all-gather move 3 (n-1)/n. The cost kernel prices
exactly this (``hgopt.cost.gradsync``: each bucket ``ZERO_PHASE`` of its all-reduce, overlapped; the
all-gather after the optimizer step). Adam and SGD are elementwise, so stepping the slices gives the
same numbers as stepping the whole tensors. Where the backend has no reduce-scatter (gloo before it
gained one), the bucket is all-reduced and the member keeps its slice."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hgopt.cost.gradsync import MIB, bucket_ranges
from hgopt.export.runner_plan import RunnerPlan, SyncGroup
from hgopt.runner.model import layer_of

__all__ = ["ZeroShard", "make_zero_shards", "optimizer_params", "shard_bounds", "shard_ranges", "zero_buckets"]

log = logging.getLogger(__name__)


def shard_bounds(numel: int, members: int, index: int) -> tuple[int, int]:
    """The flat element range ``[lo, hi)`` that member ``index`` of ``members`` owns (may be empty for the
    last members when ``numel < members``)."""
    if members < 1 or not 0 <= index < members:
        raise ValueError(f"member {index} of {members}: not a valid ZeRO member")
    chunk = math.ceil(numel / members)
    lo = min(numel, index * chunk)
    return lo, min(numel, lo + chunk)


def shard_ranges(bucket_spans: Sequence[tuple[int, int]], members: int, index: int) -> tuple[tuple[int, int], ...]:
    """The flat element ranges member ``index`` of ``members`` owns: slice ``index`` of every bucket
    (``bucket_spans``: each bucket's ``[start, end)`` in the flat vector), in ascending flat order;
    empty slices left out."""
    out = []
    for start, end in sorted(bucket_spans):
        lo, hi = shard_bounds(end - start, members, index)
        if hi > lo:
            out.append((start + lo, start + hi))
    return tuple(out)


def zero_buckets(params: Sequence[tuple[str, nn.Parameter]], cap_bytes: float) -> list[tuple[str, ...]]:
    """The group's gradient buckets as parameter names (each in the group's forward order), in launch
    order (last layers first): its layers packed by :func:`hgopt.cost.gradsync.bucket_ranges` with the
    gradient bytes this rank holds per layer."""
    if not params:
        return []
    layers = sorted({layer_of(n) for n, _ in params})
    lo, hi = layers[0], layers[-1] + 1
    sizes = [0.0] * hi
    for n, p in params:
        sizes[layer_of(n)] += float(p.numel() * p.element_size())
    return [tuple(n for n, _ in params if x <= layer_of(n) < y) for x, y in bucket_ranges(sizes, lo, hi, cap_bytes)]


def _reduce_scatter_fn() -> Any:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_fn() -> Any:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class _Bucket:
    names: tuple[str, ...]
    start: int
    """Its range [start, start + size) in the group's flat vector."""
    size: int
    chunk: int
    """ceil(size / members): every member's padded slice."""
    own: int
    """Elements of this member's slice (chunk, less at the end)."""
    shard_at: int
    """Where this member's slice sits in ``ZeroShard.shard``."""
    gather_at: int
    """Where the padded slice sits in one member's block of the all-gather."""


class ZeroShard:
    """This rank's part of one ZeRO-1 sync group: the flat slices it steps (``shard``, an
    ``nn.Parameter`` handed to the optimizer) and the collectives around the step."""

    def __init__(self, index: int, sg: SyncGroup, pg: Any, rank: int, params: list[tuple[str, nn.Parameter]],
                 cap_bytes: float = math.inf) -> None:
        """``cap_bytes``: the gradient bucket cap (``grad_bucket_mb`` in bytes; default one bucket)."""
        if not params:
            raise ValueError(f"sync group {index} (layers [{sg.start}, {sg.end})): this rank holds none of its parameters")
        self.index, self.sg, self.pg = index, sg, pg
        self.members = len(sg.ranks)
        self.member = sorted(sg.ranks).index(rank)  # the group rank: new_group numbers its ranks in sorted order
        self.names = tuple(n for n, _ in params)
        self.params = tuple(p for _, p in params)
        self.numel = sum(p.numel() for p in self.params)
        self._by_name = dict(params)
        offset = {}
        at = 0
        for n, p in params:
            offset[n] = at
            at += p.numel()
        numel_of = {n: p.numel() for n, p in params}
        spans = []
        for names in zero_buckets(params, cap_bytes):
            start = offset[names[0]]
            spans.append((names, start, sum(numel_of[n] for n in names)))
        self.ranges = shard_ranges([(a, a + n) for _, a, n in spans], self.members, self.member)
        owns: dict[int, int] = {}
        for _, start, size in spans:
            lo, hi = shard_bounds(size, self.members, self.member)
            owns[start] = hi - lo
        self.buckets: list[_Bucket] = []
        gather_at = 0
        for names, start, size in spans:
            chunk = math.ceil(size / self.members)
            shard_at = sum(own for a, own in owns.items() if a < start)  # ``ranges`` ascend in the flat vector
            self.buckets.append(_Bucket(names=names, start=start, size=size, chunk=chunk, own=owns[start],
                                        shard_at=shard_at, gather_at=gather_at))
            gather_at += chunk
        self.gather_block = gather_at
        self.shard = nn.Parameter(self.take(self.flat_params()).clone())
        self._reduce_scatter_ok = True

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p.shape) for p in self.params)

    @property
    def bucket_names(self) -> list[tuple[str, ...]]:
        """The buckets' parameter names, in launch order (``GradSync`` launches these)."""
        return [b.names for b in self.buckets]

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """This member's elements of a group-sized flat vector (``ranges`` in order)."""
        return torch.cat([flat[lo:hi] for lo, hi in self.ranges]) if self.ranges else flat[:0]

    def refresh(self) -> None:
        """Copy the model parameters' slices into ``shard`` (after a checkpoint was loaded into them)."""
        with torch.no_grad():
            self.shard.copy_(self.take(self.flat_params()))

    @property
    def reduce_scatter_ok(self) -> bool:
        """False once the backend turned out to lack reduce-scatter (all-reduce and keep the slice)."""
        return self._reduce_scatter_ok

    def launch_reduce(self, k: int, flat: torch.Tensor, wire_dtype: torch.dtype | None) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Start summing bucket ``k`` (``flat``: this rank's gradients of its parameters, flattened)
        over the members, asynchronously; ``wire_dtype``: reduce in that dtype (narrowed cross-cluster
        sync). Returns (the work, the padded bucket on the wire, the tensor that will hold this
        member's slice of the sum); :meth:`complete_reduce` takes the slice once the work is done."""
        b = self.buckets[k]
        wire = flat if wire_dtype is None else flat.to(wire_dtype)
        pad = self.members * b.chunk - wire.numel()
        full = wire if pad == 0 else torch.cat([wire, wire.new_zeros(pad)])
        if self._reduce_scatter_ok:
            out = full.new_empty(b.chunk)
            try:
                return _reduce_scatter_fn()(out, full, group=self.pg, async_op=True), full, out
            except (NotImplementedError, RuntimeError) as exc:
                if "support" not in str(exc).lower():
                    raise
                log.info("zero 1: this backend has no reduce-scatter (%s); all-reduce and keep the own slice", exc)
                self._reduce_scatter_ok = False
        work = dist.all_reduce(full, group=self.pg, async_op=True)
        return work, full, full[self.member * b.chunk : (self.member + 1) * b.chunk]

    def complete_reduce(self, k: int, out: torch.Tensor, dtype: torch.dtype) -> None:
        """After the work of :meth:`launch_reduce` of bucket ``k``: its part of ``shard.grad`` = this
        member's slice of the sum (in ``dtype``); the bucket's model-parameter gradients are dropped."""
        b = self.buckets[k]
        if self.shard.grad is None:
            self.shard.grad = torch.zeros_like(self.shard)
        self.shard.grad[b.shard_at : b.shard_at + b.own] = out[: b.own].to(dtype)
        for n in b.names:
            self._by_name[n].grad = None

    def gather_flat(self, values: torch.Tensor) -> torch.Tensor:
        """All-gather a shard-shaped tensor (``values``: this member's elements, ``ranges`` order) into
        the group's whole flat vector (a collective over the members: one all-gather of every
        bucket's padded slice)."""
        mine = values.new_zeros(self.gather_block)
        for b in self.buckets:
            mine[b.gather_at : b.gather_at + b.own] = values[b.shard_at : b.shard_at + b.own]
        out = mine.new_empty(self.members * self.gather_block)
        _all_gather_fn()(out, mine, group=self.pg)
        rows = out.view(self.members, self.gather_block)
        flat = mine.new_empty(self.numel)
        for b in self.buckets:
            flat[b.start : b.start + b.size] = rows[:, b.gather_at : b.gather_at + b.chunk].reshape(-1)[: b.size]
        return flat

    def gather(self) -> int:
        """All-gather the members' updated slices into the model parameters; returns the bytes of the
        gathered vector."""
        flat = self.gather_flat(self.shard.detach())
        with torch.no_grad():
            for p, part in zip(self.params, torch.split(flat, [p.numel() for p in self.params])):
                p.copy_(part.view(p.shape))
        return self.members * self.gather_block * flat.element_size()


def make_zero_shards(rp: RunnerPlan, rank: int, model: nn.Module, sync: Iterable[tuple[SyncGroup, Any]]) -> tuple[ZeroShard, ...]:
    """A :class:`ZeroShard` for every ZeRO-1 sync group this rank is in, in the plan's group order."""
    out = []
    for sg, pg in sync:
        if not sg.zero:
            continue
        params = [(n, p) for n, p in model.named_parameters() if sg.start <= layer_of(n) < sg.end]
        z = ZeroShard(rp.sync_groups.index(sg), sg, pg, rank, params, cap_bytes=rp.train.grad_bucket_mb * MIB)
        if dist.get_group_rank(pg, rank) != z.member:
            raise RuntimeError(f"sync group {z.index}: rank {rank} is group rank {dist.get_group_rank(pg, rank)}, "
                               f"expected {z.member}")
        log.debug("zero 1: layers [%d, %d): member %d of %d, optimizer state for %d of %d elements in %d buckets",
                  sg.start, sg.end, z.member, z.members, z.shard.numel(), z.numel, len(z.buckets))
        out.append(z)
    return tuple(out)


def optimizer_params(model: nn.Module, shards: tuple[ZeroShard, ...]) -> list[nn.Parameter]:
    """What the optimizer steps: the model parameters outside every ZeRO group, then each group's slice."""
    sharded = {id(p) for z in shards for p in z.params}
    return [p for p in model.parameters() if id(p) not in sharded] + [z.shard for z in shards]
