"""JSON output of results that may hold inf/NaN (an infeasible plan's time): one conversion for every command."""

from __future__ import annotations

import math


def json_safe(obj: object) -> object:
    """``obj`` with every non-finite float replaced by None (JSON has no inf/NaN), tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
