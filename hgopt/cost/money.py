"""Money: the one definition of what a plan costs (label [$1] in formulations/cost_model.md).

- GPU time: every GPU a plan uses is rented for the whole iteration, at its cluster's
  ``cost_per_gpu_hour`` (a per-GPU on-demand or reserved price the user states; hgopt ships no
  prices of its own). $ per iteration = Σ_clusters GPUs used × price / 3600 × iteration seconds.
- WAN egress: the bytes a plan sends per iteration over each directed inter-cluster link (the
  kernel's ``wan_bytes_per_iteration``: activations, activation gradients, cross-cluster gradient
  sync) × that link's ``egress_usd_per_gb`` (per 10^9 bytes, as clouds bill inter-region transfer).

Planners and bounds price with :func:`gpu_usd_per_second` and :func:`egress_usd_per_byte`;
``hgopt.explain`` and the cost search with :func:`money`.

The bound (:func:`cost_lower_bound`, valid for every plan of any planner): every sample passes forward
and backward through every layer on some GPU, and in every plan each GPU computes its share of
microbatches one after another within the iteration ([C3]: iteration time ≥ m × a stage's compute),
so a plan's GPU-seconds priced by ``cost_per_gpu_hour`` are at least Σ_layers global_batch × min over
(cluster, tp, profiled microbatch size) of price × tp × (forward + backward seconds of the layer) /
microbatch size — the kernel's [C2] times (``CostTables``; per-sample time between profiled sizes is
interpolated linearly, so its minimum is at a profiled size). Each GPU then runs its stage's optimizer
step after its last backward ([C6-opt]: the layers' update seconds / ZeRO-1 shards z; a stage's z ≤
replicas tp groups of t GPUs sum to at least t × the table's update seconds of one copy), so the bound
adds Σ_layers min over (cluster, tp) of price × tp × the layer's update seconds (a disjoint part of
every GPU's busy time, so the two sums add). Egress only adds.

The $/hour floor (:func:`usd_per_hour_floor`, label [$2], valid for every plan of any planner, on
any of its clusters' GPUs): a plan's $/hour is at least the price of the GPUs it uses (egress only
adds). Those GPUs hold at least one whole replica: for every layer some pipeline's stage keeps its
weights, gradients and optimizer state ([C6]: 2·P·w + P·o/z per GPU, z the ZeRO-1 shards; a tp
group of t GPUs holds t × the per-GPU parameters of its table, and z ≥ 1 shards of the optimizer
state sum to at least one whole copy), so Σ over the used GPUs of (memory − workspace) ≥
(2·w + o) · Σ_layers min over (GPU type, tp) of tp × the layer's per-GPU parameters. The floor is the
cheapest integer count of each cluster's GPUs (at most the cluster's GPUs) whose memory covers that:
a covering knapsack solved exactly on a grid of ``FLOOR_GRID`` parts of the need, each GPU's share
rounded up (so never above the true minimum). Activations, tp within a node and whole pipelines only
raise the true figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from hgopt.cost.compute import optimizer_time
from hgopt.cost.evaluate import wan_bytes_per_iteration
from hgopt.cost.memory import stage_memory
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.spec import Instance

__all__ = ["FLOOR_GRID", "Money", "budget_note", "cost_lower_bound", "egress_usd_per_byte", "gpu_usd_per_second",
           "money", "replica_state_bytes", "unpriced_clusters", "usd_per_hour", "usd_per_hour_floor"]

FLOOR_GRID = 4096
"""Parts of the replica's memory need the $/hour floor's knapsack counts in ([$2])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Money:
    usd_per_iteration: float | None
    """GPU-hours of the used GPUs (``cost_per_gpu_hour``) plus WAN egress; None when a used cluster
    has no price."""
    usd_per_million_tokens: float | None
    gpu_usd_per_iteration: float | None
    egress_usd_per_iteration: float | None
    """None when no link carrying traffic has ``egress_usd_per_gb`` or the WAN bytes are unknown."""
    notes: tuple[str, ...] = ()


def gpu_usd_per_second(instance: Instance, cluster: str) -> float | None:
    """Dollars one GPU of ``cluster`` costs per second of the iteration (None: no price set)."""
    price = instance.topology.cluster(cluster).cost_per_gpu_hour
    return None if price is None else float(price) / 3600.0


def egress_usd_per_byte(instance: Instance, src: str, dst: str) -> float | None:
    """Dollars per byte sent from cluster ``src`` to ``dst`` (None: the link has no egress price)."""
    for link in instance.topology.links:
        if link.src == src and link.dst == dst:
            price = getattr(link, "egress_usd_per_gb", None)
            return None if price is None else float(price) / 1e9
    return None


def unpriced_clusters(instance: Instance) -> tuple[str, ...]:
    """The clusters without ``cost_per_gpu_hour`` (the cost objective, a budget and the bound need every price)."""
    return tuple(c.name for c in instance.topology.clusters if c.cost_per_gpu_hour is None)


def usd_per_hour(usd_per_iteration: float, iteration_time_s: float) -> float:
    """$ per hour of training at ``usd_per_iteration`` every ``iteration_time_s`` seconds (what ``--budget`` caps)."""
    return usd_per_iteration / iteration_time_s * 3600.0


def _per_layer_floors(instance: Instance, tables: CostTables) -> tuple[list[float], list[float]]:
    """Per layer: the least $ of one sample's forward + backward GPU-seconds, and the least $ of its
    optimizer step, over every (cluster, tp, profiled microbatch size) (module docstring); needs
    ``cost_per_gpu_hour`` on every cluster (ValueError naming the field otherwise)."""
    for i, c in enumerate(instance.topology.clusters):
        if c.cost_per_gpu_hour is None:
            raise ValueError(f"{instance.source}: topology.clusters[{i}].cost_per_gpu_hour: not set for cluster "
                             f"{c.name!r} (the $ bound needs every cluster's price)")
    L = instance.model.num_layers
    work = [math.inf] * L
    step = [math.inf] * L  # optimizer step, once per iteration (module docstring)
    for c in instance.topology.clusters:
        rate = gpu_usd_per_second(instance, c.name)
        assert rate is not None
        for tp in instance.model.tps(c.gpu):
            if c.gpus_per_node % tp or tp > c.num_gpus:
                continue
            tab = tables.table(c.gpu, tp)
            for layer in range(L):
                step[layer] = min(step[layer], rate * tp * float(optimizer_time(tab, layer, layer + 1)))
            for mbs in instance.model.mbss(c.gpu, tp):
                for layer in range(L):
                    f, b = tab.times(mbs, layer, layer + 1)
                    work[layer] = min(work[layer], rate * tp * (f + b) / mbs)
    return work, step


def cost_lower_bound(instance: Instance, tables: CostTables) -> float:
    """$ per iteration below which no plan's GPU-hours can go (the module docstring); needs
    ``cost_per_gpu_hour`` on every cluster (ValueError naming the field otherwise)."""
    work, step = _per_layer_floors(instance, tables)
    return instance.job.global_batch * sum(work) + sum(step)


def replica_state_bytes(tables: CostTables) -> float:
    """[$2] Bytes of weights, gradients and optimizer state every plan keeps of one replica, at least:
    [C6]'s 2·P·w + P·o (``stage_memory`` with no activations, no workspace, one shard) with P = Σ_layers
    min over (GPU type, tp) of tp × the layer's per-GPU parameters."""
    per_layer = np.min([tp * np.diff(tab.params) for (_, tp), tab in tables.by_gpu_tp.items()], axis=0)
    return float(stage_memory(float(per_layer.sum()), 0.0, 0, 1, dtype_bytes=tables.dtype_bytes,
                              optimizer_bytes=tables.optimizer_bytes_per_param, shards=1, workspace=0.0))


def usd_per_hour_floor(instance: Instance, tables: CostTables, nodes: Mapping[str, int] | None = None) -> float:
    """[$2] $/hour below which no plan of any planner can go (module docstring), on every cluster's
    GPUs or, with ``nodes``, on that many nodes of each named cluster (0 or absent from a given
    mapping: the cluster's own count; 0: left out); ``math.inf`` when no set of those GPUs
    can hold one replica. Needs every used cluster's ``cost_per_gpu_hour`` (ValueError naming the field)."""
    need = replica_state_bytes(tables)
    workspace = instance.job.workspace_bytes
    dp = np.full(FLOOR_GRID + 1, math.inf)
    dp[0] = 0.0
    j = np.arange(FLOOR_GRID + 1)
    for i, c in enumerate(instance.topology.clusters):
        count = (c.nodes if nodes is None else nodes.get(c.name, c.nodes)) * c.gpus_per_node
        room = c.gpu_memory_bytes - workspace
        if count <= 0 or room <= 0:
            continue
        if c.cost_per_gpu_hour is None:
            raise ValueError(f"{instance.source}: topology.clusters[{i}].cost_per_gpu_hour: not set for cluster "
                             f"{c.name!r} (the $/hour floor needs every cluster's price)")
        units = FLOOR_GRID if need <= 0 else min(FLOOR_GRID, math.ceil(FLOOR_GRID * room / need))
        count = min(count, math.ceil(FLOOR_GRID / units))  # more of them never helps
        q = 1
        while count > 0:  # bounded knapsack by binary splitting: items of q GPUs
            take = min(q, count)
            dp = np.minimum(dp, dp[np.maximum(j - take * units, 0)] + take * float(c.cost_per_gpu_hour))
            count -= take
            q *= 2
    return float(dp[FLOOR_GRID])


def budget_note(budget: float | None, cheapest: float | None, floor: float) -> str:
    """Why no plan is within ``budget``: the cheapest $/hour found and the floor [$2]."""
    found = "" if cheapest is None else f"the cheapest found costs ${cheapest:.4g}/hour; "
    bound = ("no set of the instance's GPUs can hold one replica's weights, gradients and optimizer state"
             if not math.isfinite(floor) else
             f"no plan of any planner costs less than ${floor:.4g}/hour (the cheapest GPUs that can hold one "
             "replica's weights, gradients and optimizer state [$2])")
    return f"no plan within the budget of ${budget:g}/hour: {found}{bound}"


def money(plan: Plan, instance: Instance, tables: CostTables, iteration_time_s: float, tokens: int) -> Money:
    """$ per iteration of ``plan`` taking ``iteration_time_s`` and processing ``tokens`` tokens."""
    notes: list[str] = []
    used = plan.gpus_by_cluster()
    rates = {c: gpu_usd_per_second(instance, c) for c in used}
    unpriced = [c for c, r in rates.items() if r is None]
    gpu_usd: float | None = None
    if unpriced:
        notes.append(f"no cost_per_gpu_hour for {', '.join(unpriced)}")
    elif math.isfinite(iteration_time_s):
        gpu_usd = sum(n * (rates[c] or 0.0) for c, n in used.items()) * iteration_time_s
    egress = _egress_usd(plan, instance, tables, notes)
    total = None if gpu_usd is None else gpu_usd + (egress or 0.0)
    return Money(usd_per_iteration=total, usd_per_million_tokens=None if total is None else total / tokens * 1e6,
                 gpu_usd_per_iteration=gpu_usd, egress_usd_per_iteration=egress, notes=tuple(notes))


def _egress_usd(plan: Plan, instance: Instance, tables: CostTables, notes: list[str]) -> float | None:
    """WAN bytes per iteration per directed link (from the cost kernel) × the link's egress price."""
    if not any(getattr(link, "egress_usd_per_gb", None) is not None for link in instance.topology.links):
        return None
    total = 0.0
    for (a, b), nbytes in wan_bytes_per_iteration(plan, instance, tables).items():
        rate = egress_usd_per_byte(instance, a, b)
        if nbytes > 0 and rate is None:
            notes.append(f"link {a} -> {b} carries traffic but has no egress_usd_per_gb (counted as 0)")
        total += nbytes * (rate or 0.0)
    return total


def layer_work_usd(instance: Instance, tables: CostTables) -> tuple[float, ...]:
    """costmilp: per layer, the least $ per iteration any plan pays for that layer's forward +
    backward GPU-seconds: global_batch × min over (cluster, tp, profiled microbatch size) of price ×
    tp × (fwd + bwd of the layer) / microbatch size — the compute part of :func:`cost_lower_bound`,
    layer by layer (their sum is that part). Disjoint layers run on disjoint GPU time, so the
    layers of any set add (``hgopt.search.milp_cost``'s per-option $ floor [C4])."""
    work, _ = _per_layer_floors(instance, tables)
    return tuple(instance.job.global_batch * x for x in work)
