"""Measured profiles: time the runner's model layer by layer on the local device, measure links
between ranks, and write both in the project's formats (``ModelProfile`` / topology link figures).

Nothing here imports torch at module import time: planning must work without torch. The torch-using
functions live in :mod:`hgopt.profiler.timing` and :mod:`hgopt.profiler.links` and import it lazily;
:mod:`hgopt.profiler.writer` and :mod:`hgopt.profiler.fit` are pure Python.
"""

from hgopt.profiler.fit import LinkFit, fit_allreduce, fit_point_to_point
from hgopt.profiler.writer import LayerMeasurement, TimingMeasurement, build_model_profile

__all__ = [
    "LayerMeasurement",
    "LinkFit",
    "TimingMeasurement",
    "build_model_profile",
    "fit_allreduce",
    "fit_point_to_point",
]
