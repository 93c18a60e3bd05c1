"""Boundary compression: how a tensor crossing a stage boundary is put on the wire and read back.

``native`` sends the compute dtype; ``fp32``/``bf16``/``fp16`` cast (at the sending stage's end) and
cast back (at the receiving stage's start), which is exactly what autograd does for
``y.to(bf16).to(float)``: the gradient of the cast travels back in the same narrow dtype. ``fp8``
scales per tensor to the format's range and sends the raw bytes (``.view(torch.uint8)``) plus a float32
scale: e4m3 for activations (forward), e5m2 for gradients (backward). Forward and backward precisions of
one boundary are independent. :class:`RoundTrip` applies the same quantisation inside one process
(for the single-process reference and for tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Direction", "RoundTrip", "WireSpec", "decode", "encode", "quantize", "wire_specs"]

Direction = Literal["fwd", "bwd"]
_FP8 = {"fwd": torch.float8_e4m3fn, "bwd": torch.float8_e5m2}
_CAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class WireSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def wire_specs(precision: str, direction: Direction, shape: tuple[int, ...], compute: torch.dtype) -> list[WireSpec]:
    """Shapes and dtypes of the tensors :func:`encode` produces (receive buffers are sized from this)."""
    if precision == "fp8":
        return [WireSpec(shape=shape, dtype=torch.uint8), WireSpec(shape=(1,), dtype=torch.float32)]
    return [WireSpec(shape=shape, dtype=compute if precision == "native" else _CAST[precision])]


def encode(t: torch.Tensor, precision: str, direction: Direction) -> list[torch.Tensor]:
    """The tensors to send for ``t`` (detached, contiguous)."""
    t = t.detach()
    if precision == "native":
        return [t.contiguous()]
    if precision in _CAST:
        return [t.to(_CAST[precision]).contiguous()]
    fmt = _FP8[direction]
    amax = t.abs().max().float()
    scale = torch.where(amax > 0, amax / torch.finfo(fmt).max, torch.ones_like(amax)).reshape(1)
    payload = (t.float() / scale).to(fmt)
    return [payload.view(torch.uint8).contiguous(), scale]


def decode(wire: list[torch.Tensor], precision: str, direction: Direction, compute: torch.dtype) -> torch.Tensor:
    """The tensor (in the compute dtype) that :func:`encode` sent."""
    if precision == "fp8":
        payload, scale = wire
        return payload.view(_FP8[direction]).to(compute) * scale.to(compute)
    return wire[0].to(compute)


def quantize(t: torch.Tensor, precision: str, direction: Direction) -> torch.Tensor:
    """``decode(encode(t))``: what the receiver gets for ``t``."""
    return decode(encode(t, precision, direction), precision, direction, t.dtype)


class RoundTrip(torch.autograd.Function):
    """Forward: quantise with the boundary's forward precision; backward: quantise the gradient with its
    backward precision. Inside one process this reproduces a compressed pipeline boundary."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: str, bwd: str) -> torch.Tensor:  # type: ignore[override]
        ctx.bwd = bwd
        return quantize(x, fwd, "fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return quantize(grad, ctx.bwd, "bwd"), None, None
