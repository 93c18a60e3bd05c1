"""Gradient synchronisation of one rank, bucketed and overlapped with the last microbatch's backward
(PyTorch DDP's buckets, Megatron's ``overlap_grad_reduce``), with the semantics the cost model prices
(``COMMON`` semantics of this project, ``formulations/cost_model.md`` [C5]):

* A stage accumulates gradients over its microbatches; only the backward of its **last** microbatch
  makes them final. Each gradient-sync group (:class:`SyncGroup`: the layers ``[start, end)`` of one
  segment and the ranks that hold them) is cut into **buckets**: its layers in reverse order,
  consecutive layers packed into buckets of at most ``grad_bucket_mb`` MiB of gradient bytes as the
  rank holds them (a layer larger than that is its own bucket; :func:`pack_buckets`). In ``full``
  mode (holders of different tp degrees) the bytes are those of the full-size buffer, the same on
  every member, so every member cuts the same buckets.
* With ``overlap_grad_sync``, a ``post_accumulate_grad`` hook on every parameter marks it ready during
  the last backward; a bucket whose parameters are all ready starts its asynchronous collective
  (``async_op=True``) on its group's process group, buckets of a group strictly in order (so every
  member issues the same collectives in the same order). Without overlap every bucket starts after the
  last backward. :meth:`GradSync.finish` waits for all of them before the optimizer step.
* ZeRO-1 groups are cut into the same buckets (:func:`hgopt.runner.zero.zero_buckets`), and each is
  **reduce-scattered** from the hooks like a plain bucket is all-reduced (Megatron's distributed
  optimizer with ``overlap_grad_reduce``): every member keeps its slice of every bucket
  (:class:`~hgopt.runner.zero.ZeroShard`), the optimizer steps the slices, and the group's parameters
  are all-gathered after the step.
* ``delay`` link emulation: a cross-cluster bucket's collective ends at ``max(start of its slowest
  member, end of this rank's previous emulated bucket) + ring time`` ([C5]'s ring over the group's
  slowest link, latency per bucket); the members' launch times are exchanged with a MAX all-reduce,
  and :meth:`GradSync.finish` sleeps until the last bucket's emulated end. (A member's own chain of
  earlier buckets is not exchanged: a small approximation when members sync different segments.)
  Where a member's ring edge crosses a link with a shared hop (aggregate cap, shared pipe), the
  edge's ``phases·(n−1)/n·bytes`` join that hop in the link emulation's ledger at the bucket's launch
  (this member's launch; one message, sharing the hop with the pipeline's messages there, [C7c]);
  the bucket ends no earlier than they are through. A group inside one cluster whose members sit on
  several nodes rings at the node NIC's rate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hgopt.cost.gradsync import MIB, bucket_ranges
from hgopt.export.runner_plan import RunnerPlan, SyncGroup
from hgopt.runner.model import layer_of
from hgopt.runner.tp import TpGroup, shard
from hgopt.runner.zero import ZeroShard

__all__ = ["BucketSpec", "GradSync", "LaunchRecord", "emulated_ring_s", "pack_buckets"]

log = logging.getLogger(__name__)


def pack_buckets(layer_bytes: Sequence[tuple[int, int]], cap_bytes: float) -> list[tuple[int, ...]]:
    """Layers (given as ``(layer, bytes)`` in forward order, consecutive) in reverse order, packed into
    buckets of at most ``cap_bytes`` (a larger layer is alone): the cost kernel's
    :func:`hgopt.cost.gradsync.bucket_ranges`, the one definition the cost model prices."""
    if not layer_bytes:
        return []
    lo, hi = layer_bytes[0][0], layer_bytes[-1][0] + 1
    if [layer for layer, _ in layer_bytes] != list(range(lo, hi)):
        raise ValueError(f"layers must be consecutive, got {[layer for layer, _ in layer_bytes]}")
    sizes = [0.0] * lo + [float(b) for _, b in layer_bytes]
    return [tuple(range(y - 1, x - 1, -1)) for x, y in bucket_ranges(sizes, lo, hi, cap_bytes)]


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketSpec:
    group: int
    """Index of the sync group in the runner plan."""
    index: int
    """Position of the bucket in its group (launch order)."""
    layers: tuple[int, ...]
    """Layers in reverse order."""
    names: tuple[str, ...]
    """Parameter names, in the group's (forward) parameter order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchRecord:
    """One bucket's launch, for the step's report (launch order against backward progress)."""

    group: int
    bucket: int
    layers: tuple[int, ...]
    wire_bytes: int
    pending_params: int
    """Parameters of this rank's stage whose final gradient was not yet accumulated at launch time
    (> 0: the collective started while the last backward still had work to do)."""
    during_backward: bool
    """Launched from a gradient hook inside the last backward (False: after it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "bucket": self.bucket, "layers": list(self.layers), "wire_bytes": self.wire_bytes,
                "pending_params": self.pending_params, "during_backward": self.during_backward}


@dataclass(kw_only=True, slots=True)
class _InFlight:
    spec: BucketSpec
    works: list[Any]
    flat: torch.Tensor
    """The tensor the collective runs on (maybe narrowed)."""
    dtype: torch.dtype
    launched: float
    stamp: torch.Tensor | None = None
    """``delay`` emulation: the members' latest launch time (MAX all-reduce)."""
    shared: Callable[[], float] | None = None
    """``delay`` emulation: waits for the ring edge's bytes on the link's shared hop; returns when."""
    zero_out: torch.Tensor | None = None


@dataclass(kw_only=True, slots=True)
class _Group:
    index: int
    sg: SyncGroup
    pg: Any
    params: list[tuple[str, nn.Parameter]]
    buckets: list[BucketSpec]
    next: int = 0
    """Next bucket to launch."""
    ready: list[set[str]] = field(default_factory=list)


class GradSync:
    """This rank's gradient all-reduces for one step at a time: :meth:`arm` before the last microbatch's
    backward, :meth:`flush` after it, :meth:`finish` before the optimizer step."""

    def __init__(self, rp: RunnerPlan, model: nn.Module, sync: Sequence[tuple[SyncGroup, Any]], *, tp: TpGroup,
                 dims: dict[str, int | None], zero: dict[SyncGroup, ZeroShard],
                 wire_dtype: Callable[[SyncGroup, torch.dtype], torch.dtype | None],
                 emulate: Callable[[SyncGroup], tuple[float, float] | None],
                 ring_on_shared: Callable[[SyncGroup, float], Callable[[], float] | None] | None = None) -> None:
        """``wire_dtype(sg, dtype)``: the narrowed dtype of ``sg``'s collectives or None; ``emulate(sg)``:
        ``(bytes/s, latency s)`` of the link a ``delay``-emulated group runs over, or None;
        ``ring_on_shared(sg, bytes)`` (emulate, [C7c]), called at a bucket's launch: this member's ring
        edge's bytes join the link's shared hop; a function that waits until they are through (None:
        no shared hop)."""
        self.overlap = rp.train.overlap_grad_sync
        self.cap = rp.train.grad_bucket_mb * MIB
        self.tp, self.dims, self.zero = tp, dims, zero
        self.wire_dtype, self.emulate = wire_dtype, emulate
        self.ring_on_shared = ring_on_shared
        self.groups: list[_Group] = []
        self.owner: dict[str, tuple[_Group, int]] = {}
        for sg, pg in sync:
            params = [(n, p) for n, p in model.named_parameters() if sg.start <= layer_of(n) < sg.end]
            g = _Group(index=rp.sync_groups.index(sg), sg=sg, pg=pg, params=params, buckets=[])
            g.buckets = self._buckets(g)
            g.ready = [set() for _ in g.buckets]
            for k, b in enumerate(g.buckets):
                for n in b.names:
                    self.owner[n] = (g, k)
            self.groups.append(g)
        self._stage_params = {n: p for n, p in model.named_parameters()}
        self._done: set[str] = set()
        self._armed = False
        self._inflight: list[_InFlight] = []
        self.launches: list[LaunchRecord] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in model.named_parameters()]

    def _full_numel(self, name: str, p: nn.Parameter, sg: SyncGroup) -> int:
        dim = self.dims.get(name)
        return p.numel() * (self.tp.size if sg.mode == "full" and dim is not None else 1)

    def _buckets(self, g: _Group) -> list[BucketSpec]:
        names_by_layer: dict[int, list[str]] = {}
        for n, _ in g.params:
            names_by_layer.setdefault(layer_of(n), []).append(n)
        if g.sg in self.zero:  # ZeRO-1: the shard's own buckets (its slices are laid out per bucket)
            return [BucketSpec(group=g.index, index=k, layers=tuple(sorted({layer_of(n) for n in names}, reverse=True)),
                               names=names) for k, names in enumerate(self.zero[g.sg].bucket_names)]
        sizes = [(layer, sum(self._full_numel(n, p, g.sg) * p.element_size() for n, p in g.params if layer_of(n) == layer))
                 for layer in sorted(names_by_layer)]
        out = []
        for k, layers in enumerate(pack_buckets(sizes, self.cap)):
            keep = set(layers)
            out.append(BucketSpec(group=g.index, index=k, layers=layers,
                                  names=tuple(n for n, _ in g.params if layer_of(n) in keep)))
        return out

    @property
    def buckets(self) -> list[BucketSpec]:
        return [b for g in self.groups for b in g.buckets]

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    # ---- the step ---------------------------------------------------------------------------------
    def arm(self) -> None:
        """The next backward is the last microbatch's: mark parameters ready as their gradient is final
        (and, with overlap, start every bucket that is complete)."""
        self._armed = True
        self._done.clear()
        self.launches.clear()
        for g in self.groups:
            g.next = 0
            g.ready = [set() for _ in g.buckets]

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if not self._armed:
                return
            self._done.add(name)
            if name in self.owner:
                g, k = self.owner[name]
                g.ready[k].add(name)
                if self.overlap:
                    self._launch_ready(g, during_backward=True)
        return hook

    def _launch_ready(self, g: _Group, during_backward: bool) -> None:
        while g.next < len(g.buckets) and len(g.ready[g.next]) == len(g.buckets[g.next].names):
            self._launch(g, g.buckets[g.next], during_backward)
            g.next += 1

    def flush(self) -> None:
        """After the last backward: start every bucket not started yet (all of them without overlap; with
        overlap those whose parameters got no gradient), group by group, in order."""
        self._armed = False
        for g in sorted(self.groups, key=lambda x: -x.sg.end):
            while g.next < len(g.buckets):
                self._launch(g, g.buckets[g.next], during_backward=False)
                g.next += 1

    def _grad(self, p: nn.Parameter) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _launch(self, g: _Group, b: BucketSpec, during_backward: bool) -> None:
        params = dict(g.params)
        z = self.zero.get(g.sg)
        dtype = params[b.names[0]].dtype
        if z is not None:
            flat = torch.cat([self._grad(params[n]).reshape(-1) for n in b.names])
            low = self.wire_dtype(g.sg, flat.dtype)
            work, full, out = z.launch_reduce(b.index, flat, low)
            fl = _InFlight(spec=b, works=[work], flat=full, dtype=dtype, launched=time.time(), zero_out=out)
        else:
            if g.sg.mode == "full":
                parts = [self._full(n, params[n]) for n in b.names]
            else:
                parts = [self._grad(params[n]) for n in b.names]
            flat = torch.cat([t.reshape(-1) for t in parts])
            low = self.wire_dtype(g.sg, flat.dtype)
            if low is not None:
                flat = flat.to(low)
            fl = _InFlight(spec=b, works=[dist.all_reduce(flat, group=g.pg, async_op=True)], flat=flat, dtype=dtype,
                           launched=time.time())
        if self.emulate(g.sg) is not None:
            fl.stamp = torch.tensor([fl.launched], dtype=torch.float64, device=flat.device)
            fl.works.append(dist.all_reduce(fl.stamp, op=dist.ReduceOp.MAX, group=g.pg, async_op=True))
            if self.ring_on_shared is not None:  # emulate: the ring edge's bytes on a shared hop ([C7c])
                n = len(g.sg.ranks)
                phases = 1 if z is not None and z.reduce_scatter_ok else 2
                fl.shared = self.ring_on_shared(g.sg, phases * (n - 1) / n * fl.flat.numel() * fl.flat.element_size())
        self._inflight.append(fl)
        self.launches.append(LaunchRecord(group=g.index, bucket=b.index, layers=b.layers,
                                          wire_bytes=fl.flat.numel() * fl.flat.element_size(),
                                          pending_params=len(self._stage_params) - len(self._done),
                                          during_backward=during_backward))

    def _full(self, name: str, p: nn.Parameter) -> torch.Tensor:
        """Full-size gradient buffer of a ``full``-mode group: this rank's shard at its place (replicated
        tensors from tp rank 0 only), zeros elsewhere."""
        dim = self.dims.get(name)
        shape = list(p.shape)
        if dim is not None:
            shape[dim] *= self.tp.size
        full = torch.zeros(shape, dtype=p.dtype, device=p.device)
        g = self._grad(p)
        if dim is not None:
            full.chunk(self.tp.size, dim=dim)[self.tp.rank].copy_(g)
        elif self.tp.rank == 0:
            full.copy_(g)
        return full

    def finish(self) -> None:
        """Wait for every bucket (launch order) and put the summed gradients back: into ``p.grad``, or
        for ZeRO-1 into the member's ``shard.grad``; then wait out the emulated link time."""
        emulated_end = 0.0
        for fl in self._inflight:
            for w in fl.works:
                w.wait()
            g = next(x for x in self.groups if x.index == fl.spec.group)
            params = dict(g.params)
            z = self.zero.get(g.sg)
            if z is not None:
                assert fl.zero_out is not None
                z.complete_reduce(fl.spec.index, fl.zero_out, fl.dtype)
                phases = 1 if z.reduce_scatter_ok else 2
            else:
                flat = fl.flat.to(fl.dtype)
                sizes = [self._full_numel(n, params[n], g.sg) for n in fl.spec.names]
                for n, chunk in zip(fl.spec.names, torch.split(flat, sizes)):
                    p = params[n]
                    if g.sg.mode == "full":
                        shape = list(p.shape)
                        dim = self.dims.get(n)
                        if dim is not None:
                            shape[dim] *= self.tp.size
                        p.grad = shard(chunk.view(shape), dim, self.tp.size, self.tp.rank).contiguous().clone()
                    else:
                        p.grad = chunk.view(p.shape).clone()
                phases = 2
            link = self.emulate(g.sg)
            if link is not None and fl.stamp is not None:
                nbytes, n = fl.flat.numel() * fl.flat.element_size(), len(g.sg.ranks)
                start = max(float(fl.stamp[0]), emulated_end)
                emulated_end = start + emulated_ring_s(nbytes, n, *link, phases)
                if fl.shared is not None:  # emulate: the edge's bytes on a shared hop ([C7c])
                    emulated_end = max(emulated_end, fl.shared())
        self._inflight.clear()
        wait = emulated_end - time.time()
        if wait > 0:
            time.sleep(wait)

    def summary(self) -> dict[str, Any]:
        return {"overlap": self.overlap, "bucket_mb": self.cap / MIB,
                "launches": [r.to_dict() for r in self.launches]}



def emulated_ring_s(nbytes: float, members: int, bytes_per_s: float, latency_s: float, phases: int = 2) -> float:
    """``delay`` emulation of a ring collective over the group's slowest link: ``phases`` (2: all-reduce,
    1: reduce-scatter or all-gather) of ``(n-1)/n · bytes / bandwidth + (n-1) · latency`` ([C5])."""
    n = members
    return phases * ((n - 1) / n * nbytes / bytes_per_s + (n - 1) * latency_s)
