"""Fitting link figures to timed transfers (pure numpy).

Point to point: t(x) = λ + x / B. Ring all-reduce among n ranks: t(x) = 2(n−1)·λ + 2(n−1)/n · x / B,
the model of [C1]/[C5] in formulations/cost_model.md, so the fitted (B, λ) are exactly what the cost
model needs. Both are linear in x; the fit is least squares on the medians, weighted by 1/t (relative errors), with the intercept clamped
at 0 (a token bucket's burst can make small messages look faster than the line rate allows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LinkFit", "fit_allreduce", "fit_point_to_point"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkFit:
    bytes_per_s: float
    latency_s: float
    max_rel_residual: float
    """Largest |measured − fitted| / measured over the sizes: how well one (B, λ) explains the data."""

    @property
    def gbit_s(self) -> float:
        return self.bytes_per_s * 8 / 1e9


def _linear(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of times on sizes, intercept clamped to >= 0."""
    x = np.asarray(sizes, dtype=float)
    y = np.asarray(times, dtype=float)
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("need timings at two or more distinct message sizes")
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)  # relative errors: small and large sizes count alike
    if intercept < 0:  # refit through the origin, same weighting
        w2 = 1.0 / y**2
        slope, intercept = float((w2 * x) @ y / ((w2 * x) @ x)), 0.0
    if slope <= 0:
        raise ValueError("transfer time does not grow with message size; the link is too fast to measure at these sizes")
    return float(slope), float(intercept)


def _residual(sizes: list[float], times: list[float], slope: float, intercept: float) -> float:
    x, y = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    return float(np.max(np.abs(y - (intercept + slope * x)) / y))


def fit_point_to_point(sizes: list[float], times: list[float]) -> LinkFit:
    """(B, λ) from one-way transfer times of messages of ``sizes`` bytes."""
    slope, intercept = _linear(sizes, times)
    return LinkFit(bytes_per_s=1.0 / slope, latency_s=intercept, max_rel_residual=_residual(sizes, times, slope, intercept))


def fit_allreduce(sizes: list[float], times: list[float], n: int) -> LinkFit:
    """(B, λ) of the ring model from all-reduce times of ``sizes`` bytes among ``n`` ranks."""
    if n < 2:
        raise ValueError(f"an all-reduce needs >= 2 ranks, got {n}")
    slope, intercept = _linear(sizes, times)
    return LinkFit(
        bytes_per_s=2.0 * (n - 1) / n / slope,
        latency_s=intercept / (2.0 * (n - 1)),
        max_rel_residual=_residual(sizes, times, slope, intercept),
    )
