"""Measurements -> a :class:`~hgopt.spec.ModelProfile` in the project's format (pure Python, no torch).

The profile is built through its JSON form and read back with
:func:`~hgopt.spec.model_profile_from_dict`, so whatever this writes is loadable by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hgopt.spec import LayerKind, ModelProfile, TrainDtype, model_profile_from_dict, model_profile_to_dict

__all__ = ["LayerMeasurement", "TimingMeasurement", "build_model_profile", "profile_document"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerMeasurement:
    """Sizes of one layer, measured at tp = 1, per sample (one sequence)."""

    name: str
    kind: LayerKind
    params: float
    """Parameters of the layer (counted from the module)."""
    activation_bytes: float
    """Bytes of the layer's output per sample: what a stage ending at this layer sends on."""
    act_mem_bytes: float
    """Bytes per sample that the forward pass keeps for the backward pass (saved tensors, distinct
    storages, parameters excluded); on CUDA the peak allocation during forward if larger."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimingMeasurement:
    """Median seconds per layer for one (device, tp, mbs), and the spread the repeats showed."""

    gpu: str
    tp: int
    mbs: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    update: tuple[float, ...]
    spread: float = 0.0
    """Largest (p90 - p10) / median over the layers' fwd+bwd repeats, for the report."""


def profile_document(
    *,
    name: str,
    dtype: TrainDtype,
    seq_len: int,
    layers: list[LayerMeasurement],
    timings: list[TimingMeasurement],
    source: str,
) -> dict[str, Any]:
    """The JSON form of the profile (``version``, ``layers``, ``timings`` as the spec reads them)."""
    return model_profile_to_dict(
        build_model_profile(name=name, dtype=dtype, seq_len=seq_len, layers=layers, timings=timings, source=source)
    )


def build_model_profile(
    *,
    name: str,
    dtype: TrainDtype,
    seq_len: int,
    layers: list[LayerMeasurement],
    timings: list[TimingMeasurement],
    source: str,
) -> ModelProfile:
    """Validate the measurements through the spec reader; raises SpecError on anything it rejects."""
    n = len(layers)
    for t in timings:
        if not (len(t.fwd) == len(t.bwd) == len(t.update) == n):
            raise ValueError(f"timing for gpu={t.gpu} tp={t.tp} mbs={t.mbs} has {len(t.fwd)} layers, expected {n}")
    data = {
        "name": name,
        "dtype": dtype,
        "seq_len": seq_len,
        "source": source,
        "layers": [
            {"name": m.name, "kind": m.kind, "params": m.params, "activation_bytes": m.activation_bytes,
             "act_mem_bytes": m.act_mem_bytes}
            for m in layers
        ],
        "timings": [
            {"gpu": t.gpu, "tp": t.tp, "mbs": t.mbs, "fwd": list(t.fwd), "bwd": list(t.bwd), "update": list(t.update)}
            for t in timings
        ],
    }
    return model_profile_from_dict(data, source="<profiler>")
