"""Where a rank computes and which ``torch.distributed`` backend it uses: ``cpu`` with gloo or ``cuda``
with nccl (one GPU per rank). Everything else in the runner takes the resulting ``torch.device`` as a
parameter, so the CPU tests run exactly the code a GPU run runs, with ``device = cpu``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["DeviceChoice", "local_index", "rank_device", "resolve_device", "synchronize"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceChoice:
    kind: Literal["cpu", "cuda"]
    backend: Literal["gloo", "nccl"]


def resolve_device(requested: str, *, cuda_available: Callable[[], bool] | None = None) -> DeviceChoice:
    """``auto``: cuda when ``torch.cuda.is_available()``, else cpu; ``cuda`` without a GPU is an error.
    cuda computes with nccl, cpu with gloo."""
    available = (cuda_available or torch.cuda.is_available)()
    if requested == "auto":
        requested = "cuda" if available else "cpu"
    if requested == "cpu":
        return DeviceChoice(kind="cpu", backend="gloo")
    if requested == "cuda":
        if not available:
            raise ValueError("--device cuda: torch.cuda.is_available() is False on this machine (no GPU, no driver, "
                             "or a CPU-only torch build); use --device cpu")
        return DeviceChoice(kind="cuda", backend="nccl")
    raise ValueError(f"unknown device {requested!r} (use auto, cpu or cuda)")


def local_index(rank: int) -> int:
    """This process's index among the ranks of its machine: torchrun's ``$LOCAL_RANK``, else (the local
    launcher, which starts every rank on one machine) the global rank."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else rank


def rank_device(choice: DeviceChoice, index: int, *, device_count: int | None = None) -> torch.device:
    """The device of the rank with local index ``index``: the CPU, or GPU ``index mod device_count``
    (more ranks than GPUs share them round-robin; nccl then refuses two ranks on one GPU in a group,
    which is the clear error we want rather than a silent slowdown)."""
    if choice.kind == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if device_count is None else device_count
    if count < 1:
        raise ValueError("--device cuda: no CUDA device visible to this process (check CUDA_VISIBLE_DEVICES)")
    if index >= count:
        log.warning("local rank %d > %d visible GPUs: sharing GPU %d", index, count, index % count)
    return torch.device("cuda", index % count)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read afterwards measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
