"""Event simulator of one training step: the reference the closed-form cost model is held to.

``simulate(plan, instance)`` replays the runner's operation order with the kernel's compute, transfer
and all-reduce times and link contention (see :mod:`hgopt.simulate.replay`). No torch."""

from hgopt.simulate.replay import Event, LinkUse, Simulation, StageUse, simulate
from hgopt.simulate.resources import Network, Resource

__all__ = ["Event", "LinkUse", "Network", "Resource", "Simulation", "StageUse", "simulate"]
