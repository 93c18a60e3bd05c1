"""An outer-synchronised plan (``train.outer``, issue #15) trained in one process: per group one whole
model on the group's samples (its loss the mean over them), the runner's optimizer, data and codec, and
every H steps the runner's exchange (:func:`hgopt.runner.outer.average_deltas`, segment by segment in
the runner's order) and outer SGD. A correct distributed run ends with the same parameters up to
floating-point summation order (``tests/test_runner_outer.py``); ``bench/low_comm.py`` trains with it
because one process is far cheaper than a rank per replica on a shared CPU. Whole tensors (no tp)."""

from __future__ import annotations

import torch
from torch import nn

from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner.data import IGNORE, Dataset
from hgopt.runner.engine import make_optimizer
from hgopt.runner.model import StageModel, build_stage
from hgopt.runner.outer import _layer_of, _segments, average_deltas, sync_due
from hgopt.runner.reference import _forward

__all__ = ["train_outer"]


def train_outer(rp: RunnerPlan, steps: int | None = None) -> tuple[list[StageModel], list[float]]:
    """Train ``steps`` steps (default: the plan's); the groups' models and the global mean loss per step."""
    o = rp.train.outer
    if o is None:
        raise ValueError("train_outer: the runner plan has no train.outer")
    segs = [s for s in _segments(rp, o) if s.tp_rank <= 0]  # one per layer segment (whole tensors here)
    data = Dataset(rp.model, rp.train, rp.global_batch)
    models = [build_stage(rp.model, 0, rp.model.num_layers, seed=rp.train.seed, dtype=rp.train.dtype) for _ in o.groups]
    opts = [make_optimizer(rp, m) for m in models]
    first = next(models[0].parameters())
    dtype = first.dtype if first.dtype == torch.float64 else torch.float32
    theta = {n: p.detach().clone().to(dtype) for n, p in models[0].named_parameters()}
    outer = torch.optim.SGD(list(theta.values()), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0)
    names = sorted(theta, key=lambda n: (_layer_of(n), n))
    # group g's deltas enter the exchange in ascending order of its representative's rank (group rank order)
    losses = []
    for step in range(rp.train.steps if steps is None else steps):
        everything = data.global_tokens(step, rp.global_batch)
        total = 0.0
        for model, opt, members in zip(models, opts, o.groups):
            opt.zero_grad(set_to_none=True)
            pipes = [rp.pipelines[i] for i in members]
            tokens = sum(data.valid_tokens(step, r) for p in pipes for r in range(p.sample_offset, p.sample_offset + p.samples))
            for pipe in pipes:
                for m in range(pipe.num_microbatches):
                    start = pipe.sample_offset + m * pipe.microbatch
                    x, y = data.batch(step, range(start, start + pipe.microbatch))
                    logits = _forward(model, pipe, x)
                    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                       ignore_index=IGNORE, reduction="sum") / tokens
                    loss.backward()
                    total += float(loss.detach()) * tokens / everything
            opt.step()
        losses.append(total)
        due = [k for k in range(o.fragments) if sync_due(o, k, step + 1)]
        if not due:
            continue
        params = [dict(m.named_parameters()) for m in models]
        with torch.no_grad():
            for seg in segs:
                if seg.fragment not in due:
                    continue
                mine = [n for n in names if seg.lo <= _layer_of(n) < seg.hi]
                order = sorted(range(len(o.groups)), key=lambda g: seg.reps[g])
                deltas = [torch.cat([(theta[n] - params[g][n].to(dtype)).reshape(-1) for n in mine]) for g in order]
                avg = average_deltas(deltas, o.precision, o.block)
                offset = 0
                for n in mine:
                    theta[n].grad = avg[offset : offset + theta[n].numel()].view_as(theta[n]).clone()
                    offset += theta[n].numel()
                outer.param_groups[0]["params"] = [theta[n] for n in mine]
                outer.step()
                outer.param_groups[0]["params"] = list(theta.values())
                for g in range(len(models)):
                    for n in mine:
                        params[g][n].copy_(theta[n].to(params[g][n].dtype))
    return models, losses
