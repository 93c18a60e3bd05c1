"""What one rank really holds, per step, in bytes: its stage's parameters, their gradients, the
optimizer state and the tensors autograd saves for backward, the last as the peak over the schedule
(1F1B keeps several microbatches in flight). The cost model's [C6] terms are compared with these
(``bench/memory_check.py``).

Saved activations are counted with :func:`torch.autograd.graph.saved_tensors_hooks` around each
microbatch's forward: every tensor autograd saves is recorded by its storage (so a tensor saved by
several operations, or views of one storage, count once), storages of the stage's parameters are not
activations and are left out. A microbatch's saved tensors live from its forward until its backward
has run (the graph is freed then), so the live bytes are the sum over microbatches that are in
flight, and the peak is taken after each forward. Gradients are counted after the last backward (all
of them exist then; ZeRO-1 drops them after its reduce-scatter), the optimizer state after the
optimizer step (every tensor in ``optimizer.state``, step counters included). On a CUDA device the
allocator's own peak (``torch.cuda.max_memory_allocated``) is reported next to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["MemoryMeter", "optimizer_state_bytes", "tensor_bytes"]


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


class MemoryMeter:
    """Per-step byte counts of one rank (see the module docstring). Use :meth:`forward` around each
    microbatch's forward and call :meth:`backward_done` after its backward."""

    def __init__(self, model: nn.Module, device: torch.device | None = None) -> None:
        self.model = model
        self.device = device or torch.device("cpu")
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._live: dict[int, dict[int, int]] = {}
        self.saved_per_microbatch: dict[int, int] = {}
        self.peak_saved = 0
        self.peak_in_flight = 0
        self.gradients = 0
        self.optimizer = 0

    def start_step(self) -> None:
        self._live.clear()
        self.saved_per_microbatch.clear()
        self.peak_saved = self.peak_in_flight = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextmanager
    def forward(self, microbatch: int) -> Iterator[None]:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self._param_storages and ptr != 0:
                seen[ptr] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._live[microbatch] = seen
        self.saved_per_microbatch[microbatch] = sum(seen.values())
        live: dict[int, int] = {}
        for d in self._live.values():  # a storage saved by two microbatches (none here) counts once
            live.update(d)
        self.peak_saved = max(self.peak_saved, sum(live.values()))
        self.peak_in_flight = max(self.peak_in_flight, len(self._live))

    def backward_done(self, microbatch: int) -> None:
        self._live.pop(microbatch, None)

    def after_backward(self) -> None:
        """After the last backward: every gradient the stage's parameters hold."""
        self.gradients = tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer_state_bytes(opt)

    def summary(self) -> dict[str, Any]:
        out = {
            "parameters": tensor_bytes(self.model.parameters()),
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.peak_saved,
            "in_flight": self.peak_in_flight,
            "activations_per_microbatch": max(self.saved_per_microbatch.values(), default=0),
        }
        if self.device.type == "cuda":
            out["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated(self.device))
        return out
