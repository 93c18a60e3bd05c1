"""[H7] The link precisions ``--link-precision`` allows on an inter-cluster boundary; read alike by
the heuristic and the exact planner (so neither imports the other)."""

from __future__ import annotations

from hgopt.spec import DTYPE_BYTES, Instance

__all__ = ["LINK_PRECISIONS", "allowed_link_precisions"]

LINK_PRECISIONS = ("native", "fp32", "bf16", "fp16", "fp8", "auto")


def allowed_link_precisions(instance: Instance, link_precision: str) -> tuple[str, ...]:
    """What an inter-cluster boundary may use under ``--link-precision``; precisions that are not
    narrower than the training dtype compress nothing and are dropped."""
    if link_precision not in LINK_PRECISIONS:
        raise ValueError(f"--link-precision: must be one of {', '.join(LINK_PRECISIONS)}, got {link_precision!r}")
    native = DTYPE_BYTES[instance.model.dtype]
    wanted = {"native": (), "fp32": (), "auto": ("bf16", "fp8")}.get(link_precision, (link_precision,))
    narrower = tuple(p for p in wanted if DTYPE_BYTES[p] < native)
    if link_precision == "auto":
        return ("native", *narrower)
    return narrower or ("native",)
