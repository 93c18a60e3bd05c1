"""Per-stage checkpoints: the first replica of every stage writes one file per tp rank with its
parameters and optimizer state, keyed by parameter name; ``latest.json`` names the newest complete
checkpoint (written by rank 0 after every saver has finished). On resume every rank rebuilds the full
tensors of its stage from the files and takes its own tp shard, so a checkpoint can be resumed by a
replica with a different tp degree.

ZeRO-1: the optimizer state of a sharded sync group exists only in slices, so every member writes its
own slices (``zero.g<group>.m<member>.pt``, with the flat element ranges and the parameter names and
shapes it covers); on resume a member joins the slices of its group and takes its range. The first
replica's stage files then carry the parameters and the optimizer state of the unsharded ones only.
Tensors are written from host memory and read to the rank's device.

Layout: ``<out>/checkpoints/step<NNNNNN>/p<pipeline>.s<stage>.t<tp rank>.pt`` and
``zero.g<sync group>.m<member>.pt``."""

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
from hgopt.runner.zero import ZeroShard

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


def _host(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """State of the model parameters the optimizer steps directly (not ZeRO slices), by name."""
    by_param = {id(p): n for n, p in model.named_parameters()}
    return {by_param[id(p)]: _host(state) for p, state in opt.state.items() if id(p) in by_param}


def state_elements(opt: torch.optim.Optimizer) -> int:
    """Elements of every non-scalar tensor in the optimizer's state (Adam: two per stepped element)."""
    return sum(v.numel() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _write(blob: dict[str, Any], path: Path, name: str) -> None:
    tmp = path / f".{name}.tmp"
    torch.save(blob, tmp)
    os.replace(tmp, path / f"{name}.pt")


def save(rp: RunnerPlan, rank: int, model: nn.Module, opt: torch.optim.Optimizer, tp: TpGroup, out: Path, step: int,
         zero: tuple[ZeroShard, ...] = ()) -> None:
    """Collective over all ranks: ``step`` steps are done; write this stage's shard (first replica only)
    and this rank's ZeRO-1 slices."""
    info = rp.rank_info(rank)
    path = _dir(out, step)
    if rp.train.checkpoint_format == "dcp":  # torch.distributed.checkpoint (hfrunner)
        from hgopt.runner.dcp_checkpoint import save_dcp

        save_dcp(rp, rank, model, opt, tp, path, zero, next(model.parameters()).device)
    elif info.replica == 0 or zero:
        path.mkdir(parents=True, exist_ok=True)
    if info.replica == 0 and rp.train.checkpoint_format != "dcp":
        blob = {"step": step, "tp": tp.size, "tp_rank": tp.rank, "dims": split_dims(model),
                "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
                "optim": _optimizer_state(model, opt), "zero_sharded": sorted(n for z in zero for n in z.names)}
        _write(blob, path, f"p{info.pipeline}.s{info.stage}.t{tp.rank}")
    for z in (zero if rp.train.checkpoint_format != "dcp" else ()):
        _write({"step": step, "rank": rank, "names": z.names, "shapes": z.shapes, "numel": z.numel,
                "ranges": [list(r) for r in z.ranges], "state": _host(opt.state.get(z.shard, {})), "optimizer_elements": state_elements(opt),
                "model_elements": sum(p.numel() for p in model.parameters())},
               path, f"zero.g{z.index}.m{z.member}")
    dist.barrier()
    if rank == 0:
        marker = out / "checkpoints" / "latest.json"
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "samples": step * rp.global_batch, "data": rp.train.data,
                                   "format": rp.train.checkpoint_format}))
        os.replace(tmp, marker)
        _prune(out)
        log.info("checkpoint: %d steps done, saved to %s", step, path)


def _load(path: Path) -> dict[str, Any]:
    """One checkpoint file; a truncated, foreign or unreadable file is a ValueError naming it (torch's own
    message, e.g. "failed reading zip archive", names no file)."""
    try:
        blob = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises RuntimeError, pickle/zip errors or EOFError depending on the damage
        raise ValueError(f"{path}: not a readable hgopt checkpoint file (truncated or foreign?): "
                         f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    if not isinstance(blob, dict):
        raise ValueError(f"{path}: not an hgopt checkpoint file (holds a {type(blob).__name__}, not a dict)")
    return blob


def _prune(out: Path) -> None:
    dirs = sorted((out / "checkpoints").glob("step*"))
    for d in dirs[:-_KEEP]:
        shutil.rmtree(d, ignore_errors=True)


def _stage_tensors(path: Path, pipeline: int, stage: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Full (unsharded) parameters and optimizer state of one stage from its tp files."""
    files = sorted(path.glob(f"p{pipeline}.s{stage}.t*.pt"), key=lambda f: int(f.stem.split(".t")[-1]))
    if not files:
        raise ValueError(f"checkpoint {path} has no files for pipeline {pipeline} stage {stage} (was the plan changed?)")
    blobs = [_load(f) for f in files]
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
    return {"params": params, "dims": dims, "zero_sharded": blobs[0].get("zero_sharded", [])}, optim


def restore(rp: RunnerPlan, rank: int, model: nn.Module, opt: torch.optim.Optimizer, tp: TpGroup, out: Path,
            zero: tuple[ZeroShard, ...] = ()) -> int:
    """Load the newest complete checkpoint into this rank's stage (and its ZeRO-1 slices); returns the
    steps already done (0 when there is none)."""
    step = latest_step(out)
    if step is None:
        log.info("no checkpoint in %s: starting from step 0", out / "checkpoints")
        return 0
    marker = json.loads((out / "checkpoints" / "latest.json").read_text())
    if "samples" in marker and marker["samples"] != step * rp.global_batch:
        raise ValueError(f"{out / 'checkpoints' / 'latest.json'}: the run consumed {marker['samples']} samples in {step} "
                         f"steps; this plan's global batch {rp.global_batch} would continue the data stream at "
                         f"{step * rp.global_batch}")
    if marker.get("format", "torch") == "dcp":
        from hgopt.runner.dcp_checkpoint import restore_dcp

        restore_dcp(rp, rank, model, opt, tp, _dir(out, step), zero, next(model.parameters()).device)
        log.info("resumed from checkpoint (torch.distributed.checkpoint): %d steps done", step)
        return step
    info = rp.rank_info(rank)
    full, optim = _stage_tensors(_dir(out, step), info.pipeline, info.stage)
    dims = split_dims(model)
    params = dict(model.named_parameters())
    if set(params) != set(full["params"]):
        raise ValueError(f"checkpoint step {step} of pipeline {info.pipeline} stage {info.stage} holds other layers than this plan's stage")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(shard(full["params"][n], dims[n], tp.size, tp.rank))
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    direct = [n for n, p in params.items() if id(p) in stepped]
    missing = [n for n in direct if n not in optim]
    if missing and (optim or set(missing) & set(full["zero_sharded"])):
        raise ValueError(f"checkpoint step {step} of pipeline {info.pipeline} stage {info.stage} has no optimizer state "
                         f"for {missing[0]} (saved with ZeRO-1 sharding, resumed without?)")
    for n in direct:
        if n in optim:
            p = params[n]
            opt.state[p] = {k: (shard(v, dims[n], tp.size, tp.rank).clone().to(p.device) if isinstance(v, torch.Tensor)
                                and v.dim() > 0 and v.dim() == p.dim() else v) for k, v in optim[n].items()}
    for z in zero:
        z.refresh()
        opt.state[z.shard] = _zero_state(_dir(out, step), z, step)
    log.info("resumed from checkpoint: %d steps done", step)
    return step


def _zero_state(path: Path, z: ZeroShard, step: int) -> dict[str, Any]:
    """This member's slice of its group's optimizer state, joined from every member's file (so the
    member count may differ from the saving run's)."""
    files = sorted(path.glob(f"zero.g{z.index}.m*.pt"), key=lambda f: int(f.stem.split(".m")[-1]))
    if not files:
        raise ValueError(f"checkpoint step {step} has no ZeRO-1 optimizer slices for sync group {z.index} (layers "
                         f"[{z.sg.start}, {z.sg.end})): saved without zero 1, resumed with it?")
    blobs = [_load(f) for f in files]
    for f, b in zip(files, blobs):
        if tuple(b["names"]) != z.names or tuple(tuple(s) for s in b["shapes"]) != z.shapes:
            raise ValueError(f"{f}: covers other parameters than this rank's sync group {z.index} (was the plan changed?)")
    # each member's state is its elements of the flat vector, ``ranges`` in order (files before the
    # bucketed layout: one range ``[lo, hi)``); any member count and bucket layout resumes
    spans = [[tuple(r) for r in b["ranges"]] if "ranges" in b else [(b["lo"], b["hi"])] for b in blobs]
    pieces = sorted((lo, hi, i, sum(y - x for x, y in sp[:j])) for i, sp in enumerate(spans) for j, (lo, hi) in enumerate(sp))
    if [lo for lo, *_ in pieces] != [0] + [hi for _, hi, *_ in pieces[:-1]] or not pieces or pieces[-1][1] != z.numel:
        raise ValueError(f"checkpoint step {step}: the ZeRO-1 slices of sync group {z.index} do not cover its "
                         f"{z.numel} elements (a member's file is missing)")
    state: dict[str, Any] = {}
    for key, value in blobs[0]["state"].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            flat = torch.cat([blobs[i]["state"][key][at : at + hi - lo] for lo, hi, i, at in pieces])
            state[key] = z.take(flat).clone().to(z.shard.device)
        else:
            state[key] = value
    return state


def load_full_state(out: str | Path, pipeline: int = 0, step: int | None = None) -> dict[str, torch.Tensor]:
    """The whole model's parameters (tp shards joined) as saved by ``pipeline``'s stages."""
    out = Path(out)
    step = latest_step(out) if step is None else step
    if step is None:
        raise ValueError(f"no checkpoint under {out}")
    path = _dir(out, step)
    if (path / ".metadata").exists():
        from hgopt.runner.dcp_checkpoint import load_full_dcp

        return load_full_dcp(path)
    stages = sorted({int(f.name.split(".")[1][1:]) for f in path.glob(f"p{pipeline}.s*.pt")})
    state: dict[str, torch.Tensor] = {}
    for s in stages:
        state.update(_stage_tensors(path, pipeline, s)[0]["params"])
    return state
