"""Per-layer forward and backward time of the runner's model on this machine (one process, tp 1).
The runner's own step timing uses the same clock; a profiler (``hgopt profile``) or a cost-model
check can turn these figures into a model profile for the runner's model."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from hgopt.export.runner_plan import ModelConfig
from hgopt.runner.model import DTYPES, build_stage

__all__ = ["LayerTime", "layer_times"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerTime:
    layer: int
    fwd_s: float
    bwd_s: float
    """Median seconds for one microbatch of ``mbs`` samples."""


def layer_times(cfg: ModelConfig, mbs: int, *, dtype: str = "float32", repeats: int = 5, warmup: int = 1,
                threads: int | None = None) -> list[LayerTime]:
    """Time every layer's forward and backward on a microbatch of ``mbs`` samples."""
    if threads is not None:
        torch.set_num_threads(threads)
    out = []
    for i in range(cfg.num_layers):
        layer = build_stage(cfg, i, i + 1, dtype=dtype)
        fwd, bwd = [], []
        for rep in range(warmup + repeats):
            x = _input(cfg, i, mbs, dtype)
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            t2 = time.perf_counter()
            if rep >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        out.append(LayerTime(layer=i, fwd_s=statistics.median(fwd), bwd_s=statistics.median(bwd)))
    return out


def _input(cfg: ModelConfig, index: int, mbs: int, dtype: str) -> torch.Tensor:
    if index == 0:
        return torch.randint(0, cfg.vocab, (mbs, cfg.seq))
    return torch.randn(mbs, cfg.seq, cfg.hidden, dtype=DTYPES[dtype], requires_grad=True)
