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
interpolated linearly, so its minimum is at a profiled size). Egress only adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hgopt.cost.evaluate import wan_bytes_per_iteration
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.spec import Instance

__all__ = ["Money", "cost_lower_bound", "egress_usd_per_byte", "gpu_usd_per_second", "money", "unpriced_clusters",
           "usd_per_hour"]


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


def cost_lower_bound(instance: Instance, tables: CostTables) -> float:
    """$ per iteration below which no plan's GPU-hours can go (the module docstring); needs
    ``cost_per_gpu_hour`` on every cluster (ValueError naming the field otherwise)."""
    for i, c in enumerate(instance.topology.clusters):
        if c.cost_per_gpu_hour is None:
            raise ValueError(f"{instance.source}: topology.clusters[{i}].cost_per_gpu_hour: not set for cluster "
                             f"{c.name!r} (the $ bound needs every cluster's price)")
    L, G = instance.model.num_layers, instance.job.global_batch
    best = [math.inf] * L
    for c in instance.topology.clusters:
        rate = gpu_usd_per_second(instance, c.name)
        assert rate is not None
        for tp in instance.model.tps(c.gpu):
            if c.gpus_per_node % tp or tp > c.num_gpus:
                continue
            tab = tables.table(c.gpu, tp)
            for mbs in instance.model.mbss(c.gpu, tp):
                for layer in range(L):
                    f, b = tab.times(mbs, layer, layer + 1)
                    best[layer] = min(best[layer], rate * tp * (f + b) / mbs)
    return G * sum(best)


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
