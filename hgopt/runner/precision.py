"""Mixed precision with fp32 master weights (``train.dtype: bfloat16``), as Megatron-LM's
``Float16OptimizerWithFloat16Params`` does it: the model's parameters, activations and gradients are
bf16; the optimizer steps an fp32 copy of every parameter it owns (of a ZeRO-1 slice only its slice)
with fp32 state, and the updated master is rounded back into the bf16 parameter after each step.

Bytes per parameter, as the cost model counts them ([C6], ``hgopt.cost.tables.optimizer_bytes_per_param``
for ``precision: bf16``): bf16 weight 2 + bf16 gradient 2 (``2 · dtype_bytes``) + fp32 master 4 +
Adam's two fp32 moments 8 (SGD: one, 4); the master and the moments are sharded by ZeRO-1.

The masters travel in checkpoints as one more optimizer-state entry (``"master"``), so resume is
exact and reshards like the moments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

__all__ = ["MasterWeightOptimizer"]


class _StateView(MutableMapping):  # type: ignore[type-arg]
    """``opt.state`` keyed by the model's (bf16) parameters: the inner optimizer's state of the master,
    plus the master itself under ``"master"``."""

    def __init__(self, owner: MasterWeightOptimizer) -> None:
        self.owner = owner

    def __getitem__(self, p: nn.Parameter) -> dict[str, Any]:
        m = self.owner.master_of(p)
        return {**self.owner.inner.state.get(m, {}), "master": m.detach()}

    def __setitem__(self, p: nn.Parameter, state: dict[str, Any]) -> None:
        m = self.owner.master_of(p)
        state = dict(state)
        if "master" in state:
            with torch.no_grad():
                m.copy_(state.pop("master"))
        self.owner.inner.state[m] = {k: v.float() if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                     for k, v in state.items()}

    def __delitem__(self, p: nn.Parameter) -> None:
        del self.owner.inner.state[self.owner.master_of(p)]

    def __iter__(self) -> Iterator[nn.Parameter]:
        return iter(self.owner.params)

    def __len__(self) -> int:
        return len(self.owner.params)


class MasterWeightOptimizer:
    """Steps fp32 masters of ``params`` (bf16) with ``make(masters)`` and copies them back."""

    def __init__(self, params: list[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        self.masters = [nn.Parameter(p.detach().to(torch.float32).clone()) for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.inner = make(self.masters)
        self.state = _StateView(self)
        self.param_groups = [{"params": self.params}]

    def master_of(self, p: nn.Parameter) -> nn.Parameter:
        return self.masters[self._index[id(p)]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
