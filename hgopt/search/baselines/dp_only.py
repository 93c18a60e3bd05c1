"""``dp-only``: plain data parallelism (PyTorch DDP / DeepSpeed ZeRO-1 style).

Every GPU holds the whole model (one stage, tp = 1) and processes the same number of samples per
microbatch; gradient accumulation over ``m`` microbatches makes up the global batch; gradients are
all-reduced over every replica, across regions if the replicas span them. ZeRO-1 (optimizer state
sharded over the replicas, ``Stage.zero = 1``) is used only when the model does not fit without it.
The replicas are placed on the largest set of GPUs where the model fits, in the instance's cluster
order; among the choices on that many GPUs the one ``evaluate`` scores best is returned.
"""

from __future__ import annotations

from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Plan
from hgopt.search.baselines.uniform import search_grid
from hgopt.spec import Instance

__all__ = ["plan_dp_only"]


def plan_dp_only(
    instance: Instance, *, tables: CostTables | None = None, time_limit_s: float | None = None
) -> Plan | None:
    """The data-parallel plan on the most GPUs that can hold the model (``None``: it fits nowhere)."""
    tables = tables or build_tables(instance)
    return search_grid(instance, tables, pps=(1,), tps=(1,), zeros=(0, 1), planner="dp-only", time_limit_s=time_limit_s)
