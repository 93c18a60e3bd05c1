"""The runner's training in one process: the whole model, the same initial weights, data, loss
normalisation and optimizer, and the plan's boundary compression applied to the same row ranges (each
piece of a re-sharded boundary gets its own fp8 scale, as on the wire). A correct distributed run ends
with the same parameters up to floating-point summation order."""

from __future__ import annotations

import torch
from torch import nn

from hgopt.export.runner_plan import RunnerPipeline, RunnerPlan
from hgopt.runner.codec import RoundTrip
from hgopt.runner.data import IGNORE, Dataset
from hgopt.runner.engine import make_optimizer
from hgopt.runner.model import StageModel, build_stage

__all__ = ["train_reference"]


def train_reference(rp: RunnerPlan, steps: int | None = None,
                    start: tuple[int, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]] | None = None,
                    ) -> tuple[StageModel, list[float]]:
    """Train until ``steps`` are done (default: the plan's) and return the model and the loss of every
    step trained. ``start``: (steps done, parameters, optimizer state per parameter) to continue from,
    e.g. :func:`hgopt.runner.dcp_checkpoint.load_full_dcp_state` of a checkpoint (re-planning, issue 14)."""
    model = build_stage(rp.model, 0, rp.model.num_layers, seed=rp.train.seed, dtype=rp.train.dtype)
    opt = make_optimizer(rp, model)
    data = Dataset(rp.model, rp.train, rp.global_batch)
    losses = []
    done = 0
    if start is not None:
        done, params, optim = start
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
                opt.state[p] = {k: v.clone() if v.dim() == 0 else v.to(p.dtype).clone() for k, v in optim[n].items()}
    for step in range(done, rp.train.steps if steps is None else steps):
        opt.zero_grad(set_to_none=True)
        tokens = data.global_tokens(step, rp.global_batch)
        total = 0.0
        for pipe in rp.pipelines:
            for m in range(pipe.num_microbatches):
                first = pipe.sample_offset + m * pipe.microbatch
                x, y = data.batch(step, range(first, first + pipe.microbatch))
                logits = _forward(model, pipe, x)
                logits = logits.float() if logits.dtype == torch.bfloat16 else logits
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                   ignore_index=IGNORE, reduction="sum") / tokens
                loss.backward()
                total += float(loss.detach())
        opt.step()
        losses.append(total)
    return model, losses


def _forward(model: StageModel, pipe: RunnerPipeline, x: torch.Tensor) -> torch.Tensor:
    h = x
    for k, stage in enumerate(pipe.stages):
        for i in range(stage.start, stage.end):
            h = model.layers[str(i)](h)
        if k < len(pipe.stages) - 1:
            h = _boundary(h, pipe, k)
    return h


def _boundary(h: torch.Tensor, pipe: RunnerPipeline, k: int) -> torch.Tensor:
    b = pipe.boundaries[k]
    if b.fwd == "native" and b.bwd == "native":
        return h
    pieces = sorted(pipe.pieces(k), key=lambda pc: pc.lo)
    return torch.cat([RoundTrip.apply(h[pc.lo : pc.hi], b.fwd, b.bwd) for pc in pieces])
