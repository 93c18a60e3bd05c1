"""Checkpoints in ``torch.distributed.checkpoint`` (``train.checkpoint_format: dcp``): per-rank shard
files plus DCP's global ``.metadata``, keyed by global parameter name, resharded on load.

What is written (collectively, by every rank): the parameters and the optimizer state of pipeline 0's
first replica of every stage — together the whole model once — under ``model.<name>`` and
``optim.<name>.<state key>``. A tensor-parallel shard is a ``DTensor`` on its tp group's mesh
(``Shard(dim)``), so DCP records its global shape and each tp rank writes its own piece; replicated
tensors are plain tensors (written once). A ZeRO-1 member's optimizer slice is first joined with its
sync group's other slices (all-gather), so the file holds every parameter's full state, independent of
the ZeRO layout. Loading builds the same entries for the *current* plan (its stage split, tp degrees and
ZeRO groups) and lets DCP read the overlapping pieces: a checkpoint loads under a different plan
(another split, tp degree, replica count or ZeRO setting), which the re-planning work builds on.

A missing, truncated or foreign checkpoint folder is a ValueError naming the file DCP could not use.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner.tp import TpGroup, split_dims
from hgopt.runner.zero import ZeroShard

__all__ = ["load_full_dcp", "load_full_dcp_state", "restore_dcp", "save_dcp", "state_keys"]

log = logging.getLogger(__name__)


def state_keys(rp: RunnerPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-parameter tensor state keys, scalar state keys) of the plan's optimizer."""
    tensors = ("exp_avg", "exp_avg_sq") if rp.train.optimizer == "adam" else ("momentum_buffer",)
    if rp.train.dtype == "bfloat16":
        tensors += ("master",)
    return tensors, ("step",) if rp.train.optimizer == "adam" else ()


def _mesh(tp: TpGroup, device: torch.device) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(tp.group, device_type=device.type)


def _wrap(t: torch.Tensor, dim: int | None, tp: TpGroup, mesh: Any) -> Any:
    if dim is None or tp.size == 1:
        return t
    from torch.distributed.tensor import DTensor, Shard

    full = list(t.shape)
    full[dim] *= tp.size
    return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False, shape=torch.Size(full),
                              stride=torch.empty(full, device="meta").stride())


def _local(v: Any) -> torch.Tensor:
    return v.to_local() if hasattr(v, "to_local") else v


def _zero_full(z: ZeroShard, state: dict[str, Any], keys: tuple[str, ...],
               dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's full (tp-local) state of a ZeRO-1 group, joined from the members' slices."""
    out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in z.names}
    for key in keys:
        mine = z.shard.detach().new_zeros(z.shard.numel(), dtype=dtype)
        if key in state:
            mine.copy_(state[key].to(mine.dtype))
        flat = z.gather_flat(mine)
        for n, part in zip(z.names, torch.split(flat, [p.numel() for p in z.params])):
            out[n][key] = part.view(z.params[z.names.index(n)].shape).clone()
    return out


def _entries(rp: RunnerPlan, model: nn.Module, opt: Any, tp: TpGroup, zero: tuple[ZeroShard, ...],
             device: torch.device, template: bool) -> dict[str, Any]:
    """This rank's state-dict entries (``template``: zero tensors to load into)."""
    tensor_keys, scalar_keys = state_keys(rp)
    mesh = _mesh(tp, device) if tp.size > 1 else None
    dims = split_dims(model)
    zero_full: dict[str, dict[str, torch.Tensor]] = {}
    if not template:
        for z in zero:
            state_dtype = torch.float32 if rp.train.dtype == "bfloat16" else z.shard.dtype
            zero_full.update(_zero_full(z, opt.state.get(z.shard, {}), tensor_keys, state_dtype))
    out: dict[str, Any] = {}
    for n, p in model.named_parameters():
        out[f"model.{n}"] = _wrap(torch.zeros_like(p) if template else p.detach(), dims[n], tp, mesh)
        state = zero_full.get(n) if n in zero_full else (None if template else opt.state.get(p))
        for key in tensor_keys:
            v = torch.zeros_like(p, dtype=torch.float32 if key == "master" or rp.train.dtype == "bfloat16"
                                 else p.dtype) if template or state is None or key not in state else state[key]
            out[f"optim.{n}.{key}"] = _wrap(v, dims[n], tp, mesh)
        for key in scalar_keys:
            src = state if state is not None and key in state else None
            if src is None and not template:
                src = next((opt.state.get(z.shard, {}) for z in zero if n in z.names), None)
            v = src[key] if src is not None and key in src else torch.zeros((), dtype=torch.float32)
            out[f"optim.{n}.{key}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    return out


def _writer(rp: RunnerPlan, rank: int) -> bool:
    info = rp.rank_info(rank)
    return info.pipeline == 0 and info.replica == 0


def save_dcp(rp: RunnerPlan, rank: int, model: nn.Module, opt: Any, tp: TpGroup, path: Path,
             zero: tuple[ZeroShard, ...], device: torch.device) -> None:
    """Collective over all ranks: write the checkpoint folder ``path``."""
    entries = _entries(rp, model, opt, tp, zero, device, template=False)  # ZeRO gathers run on every member
    dcp.save(entries if _writer(rp, rank) else {}, checkpoint_id=str(path))


def _fail(path: Path, exc: BaseException) -> ValueError:
    meta = path / ".metadata"
    if not meta.exists():
        return ValueError(f"{meta}: missing: {path} is not a complete torch.distributed.checkpoint folder")
    text = str(exc)
    for f in sorted(path.glob("*.distcp")):  # DCP's shard files are torch.save zip archives
        if f.name in text or not _sound_zip(f):
            return ValueError(f"{f}: truncated or corrupt shard of the checkpoint in {path}")
    return ValueError(f"{meta}: the checkpoint cannot be loaded into this plan's model "
                      f"({type(exc).__name__}: {text.strip().splitlines()[-1][:400] if text.strip() else ''})")


def _sound_zip(f: Path) -> bool:
    import zipfile

    try:
        with zipfile.ZipFile(f) as z:
            return z.testzip() is None
    except (OSError, zipfile.BadZipFile):
        return False


def _reraise(exc: BaseException) -> None:
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc


def restore_dcp(rp: RunnerPlan, rank: int, model: nn.Module, opt: Any, tp: TpGroup, path: Path,
                zero: tuple[ZeroShard, ...], device: torch.device) -> None:
    """Load ``path`` into this rank's stage, optimizer and ZeRO slices (any saving plan)."""
    entries = _entries(rp, model, opt, tp, zero, device, template=True)
    try:
        dcp.load(entries, checkpoint_id=str(path))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException; also RuntimeError, pickle errors
        _reraise(exc)
        raise _fail(path, exc) from None
    tensor_keys, scalar_keys = state_keys(rp)
    sharded = {n for z in zero for n in z.names}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_local(entries[f"model.{n}"]))
            if n in sharded:
                continue
            state = {k: _local(entries[f"optim.{n}.{k}"]).to(p.device).clone() for k in tensor_keys}
            state.update({k: entries[f"optim.{n}.{k}"].clone() for k in scalar_keys})
            if not rp.train.dtype == "bfloat16":
                state = {k: v.to(p.dtype) if v.dim() > 0 else v for k, v in state.items()}
            opt.state[p] = state
    for z in zero:
        z.refresh()
        state: dict[str, Any] = {}
        for k in tensor_keys:
            flat = torch.cat([_local(entries[f"optim.{n}.{k}"]).reshape(-1) for n in z.names])
            state[k] = z.take(flat).clone().to(z.shard.device)
        for k in scalar_keys:
            state[k] = entries[f"optim.{z.names[0]}.{k}"].clone()
        if rp.train.dtype != "bfloat16":
            state = {k: v.to(z.shard.dtype) if v.dim() > 0 else v for k, v in state.items()}
        opt.state[z.shard] = state


def load_full_dcp(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the model (full tensors) from a DCP folder, in one process."""
    return load_full_dcp_state(path)[0]


def load_full_dcp_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(every parameter, every parameter's optimizer state by state key) of the whole model, full
    tensors, from a DCP folder, in one process (the keys are per layer, whatever plan wrote them)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    import warnings

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            data = _load_state_dict_from_keys(checkpoint_id=str(path))
    except BaseException as exc:
        _reraise(exc)
        raise _fail(path, exc) from None
    params = {k[len("model."):]: v for k, v in data.items() if k.startswith("model.")}
    optim: dict[str, dict[str, torch.Tensor]] = {n: {} for n in params}
    for k, v in data.items():
        if k.startswith("optim."):
            name, _, key = k[len("optim."):].rpartition(".")
            optim.setdefault(name, {})[key] = v
    return params, optim
