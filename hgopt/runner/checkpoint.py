"""Per-stage checkpoints: the first replica of every stage writes one file per tp rank with its
parameters and optimizer state, keyed by parameter name; ``latest.json`` names the newest complete
checkpoint (written by rank 0 after every saver has finished). On resume every rank rebuilds the full
tensors of its stage from the files and takes its own tp shard, so a checkpoint can be resumed by a
replica with a different tp degree.

Layout: ``<out>/checkpoints/step<NNNNNN>/p<pipeline>.s<stage>.t<tp rank>.pt``."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner.tp import TpGroup, shard, split_dims, unshard

__all__ = ["latest_step", "load_full_state", "restore", "save"]

log = logging.getLogger(__name__)
_KEEP = 2
"""Complete checkpoints kept on disk."""


def _dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step{step:06d}"


def latest_step(out: Path) -> int | None:
    """Steps completed by the newest complete checkpoint, or None."""
    marker = out / "checkpoints" / "latest.json"
    if not marker.exists():
        return None
    return int(json.loads(marker.read_text())["step"])


def _optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    by_param = {id(p): n for n, p in model.named_parameters()}
    return {by_param[id(p)]: dict(state) for p, state in opt.state.items()}


def save(rp: RunnerPlan, rank: int, model: nn.Module, opt: torch.optim.Optimizer, tp: TpGroup, out: Path, step: int) -> None:
    """Collective over all ranks: ``step`` steps are done; write this stage's shard (first replica only)."""
    info = rp.rank_info(rank)
    path = _dir(out, step)
    if info.replica == 0:
        path.mkdir(parents=True, exist_ok=True)
        blob = {"step": step, "tp": tp.size, "tp_rank": tp.rank, "dims": split_dims(model),
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "optim": _optimizer_state(model, opt)}
        tmp = path / f".p{info.pipeline}.s{info.stage}.t{tp.rank}.tmp"
        torch.save(blob, tmp)
        os.replace(tmp, path / f"p{info.pipeline}.s{info.stage}.t{tp.rank}.pt")
    dist.barrier()
    if rank == 0:
        marker = out / "checkpoints" / "latest.json"
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, marker)
        _prune(out)
        log.info("checkpoint: %d steps done, saved to %s", step, path)


def _prune(out: Path) -> None:
    dirs = sorted((out / "checkpoints").glob("step*"))
    for d in dirs[:-_KEEP]:
        shutil.rmtree(d, ignore_errors=True)


def _stage_tensors(path: Path, pipeline: int, stage: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Full (unsharded) parameters and optimizer state of one stage from its tp files."""
    files = sorted(path.glob(f"p{pipeline}.s{stage}.t*.pt"), key=lambda f: int(f.stem.split(".t")[-1]))
    if not files:
        raise ValueError(f"checkpoint {path} has no files for pipeline {pipeline} stage {stage} (was the plan changed?)")
    blobs = [torch.load(f, weights_only=True) for f in files]
    if len(blobs) != blobs[0]["tp"]:
        raise ValueError(f"checkpoint {path}: pipeline {pipeline} stage {stage} has {len(blobs)} of {blobs[0]['tp']} tp files")
    dims = blobs[0]["dims"]
    params = {n: unshard([b["params"][n] for b in blobs], dims[n]) for n in blobs[0]["params"]}
    optim: dict[str, dict[str, Any]] = {}
    for n, state in blobs[0]["optim"].items():
        optim[n] = {}
        for k, v in state.items():
            sharded = isinstance(v, torch.Tensor) and v.shape == blobs[0]["params"][n].shape
            optim[n][k] = unshard([b["optim"][n][k] for b in blobs], dims[n]) if sharded else v
    return {"params": params, "dims": dims}, optim


def restore(rp: RunnerPlan, rank: int, model: nn.Module, opt: torch.optim.Optimizer, tp: TpGroup, out: Path) -> int:
    """Load the newest complete checkpoint into this rank's stage; returns the steps already done (0
    when there is none)."""
    step = latest_step(out)
    if step is None:
        log.info("no checkpoint in %s: starting from step 0", out / "checkpoints")
        return 0
    info = rp.rank_info(rank)
    full, optim = _stage_tensors(_dir(out, step), info.pipeline, info.stage)
    dims = split_dims(model)
    params = dict(model.named_parameters())
    if set(params) != set(full["params"]):
        raise ValueError(f"checkpoint step {step} of pipeline {info.pipeline} stage {info.stage} holds other layers than this plan's stage")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(shard(full["params"][n], dims[n], tp.size, tp.rank))
    for n, state in optim.items():
        p = params[n]
        opt.state[p] = {k: (shard(v, dims[n], tp.size, tp.rank).clone() if isinstance(v, torch.Tensor) and v.dim() > 0
                            and v.dim() == p.dim() else v) for k, v in state.items()}
    log.info("resumed from checkpoint: %d steps done", step)
    return step


def load_full_state(out: str | Path, pipeline: int = 0, step: int | None = None) -> dict[str, torch.Tensor]:
    """The whole model's parameters (tp shards joined) as saved by ``pipeline``'s stages."""
    out = Path(out)
    step = latest_step(out) if step is None else step
    if step is None:
        raise ValueError(f"no checkpoint under {out}")
    path = _dir(out, step)
    stages = sorted({int(f.name.split(".")[1][1:]) for f in path.glob(f"p{pipeline}.s*.pt")})
    state: dict[str, torch.Tensor] = {}
    for s in stages:
        state.update(_stage_tensors(path, pipeline, s)[0]["params"])
    return state
