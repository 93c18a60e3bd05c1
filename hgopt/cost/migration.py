"""Migration [M1]: the state that must cross clusters when a job moves from plan A to plan B, and how
long that takes on the link model [C1]/[C4w]. The one definition; ``hgopt replan`` and the elastic
launcher call it.

What moves. Per layer l, the state is its parameters (``params_l · w`` bytes, w the training dtype's
bytes) and its optimizer state (``params_l · o`` bytes, o of [C6]: Adam's moments, plus fp32 masters
when training in 16 bit). A cluster c *holds* layer l under a plan with

- parameter share ``p_c(l)`` = 1 when any stage of the plan with l in its range has a replica group
  in c (its tp shards together are a full copy), else 0;
- optimizer share ``q_c(l)`` = the largest share one stage copy there holds: 1 for a ZeRO-0 stage,
  ``dp_c / replicas`` for a ZeRO-1 stage (its state is sharded over the stage's replicas), max over
  the stages with l (shares, not element ranges: two copies' shards in c are not assumed disjoint).

Cluster c must receive, of layer l, ``max(0, p^B_c − p^A_c) · params_l · w`` plus
``max(0, q^B_c − q^A_c) · params_l · o`` bytes over the WAN. Sources are the clusters of plan A that are
still in the new topology (a cluster that shrank keeps its share: its surviving GPUs or its region's
checkpoint copy), fastest per-flow link first; a deficit no source can cover (the only holders were
dropped) comes from the last checkpoint and is listed, unpriced, in :attr:`Migration.from_checkpoint`.
Moves inside a cluster (new GPUs of a cluster that held the layer already) are not priced: they run on
the intra-cluster fabric, concurrently, and are small against the WAN.

How long [M1]. Every direction s -> d carries its bytes ``X_sd`` as ``n = min(nodes_s, nodes_d)``
node-pair flows (nodes: those the old plan used in s, those the new plan uses in d), all directions at
the same time:

    T_sd  = flows_time(link s->d, X_sd / n, X_sd)           (per-flow and aggregate caps, [C4w])
    T_nic = nic_time(NIC_c, bytes into (out of) c / nodes_c)  (each cluster's node NICs, [C4])
    T     = max over directions and clusters of T_sd, T_nic

Amortised over a horizon of N steps, a plan's total time is ``T + N · iteration_time``
(:func:`horizon_time`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hgopt.cost.links import flows_time, nic_time
from hgopt.cost.tables import optimizer_bytes_per_param
from hgopt.plan import Plan
from hgopt.spec import DTYPE_BYTES, Instance

__all__ = ["Flow", "Migration", "horizon_time", "layer_shares", "migration"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Flow:
    """State sent over one direction ``src -> dst``."""

    src: str
    dst: str
    param_bytes: float
    optimizer_bytes: float
    layers: tuple[int, ...]
    time_s: float
    """``T_sd`` of [M1] (this direction alone; the move takes :attr:`Migration.time_s`)."""

    @property
    def bytes(self) -> float:
        return self.param_bytes + self.optimizer_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Migration:
    flows: tuple[Flow, ...]
    time_s: float
    """[M1]: the whole move, every direction at once."""
    from_checkpoint: tuple[tuple[str, int, float], ...] = ()
    """(cluster, layer, bytes) that no surviving cluster holds: read from the last checkpoint (unpriced)."""

    @property
    def bytes(self) -> float:
        return sum(f.bytes for f in self.flows)


def layer_shares(plan: Plan, num_layers: int) -> list[dict[str, tuple[float, float]]]:
    """Per layer: cluster -> (parameter share, optimizer share) under ``plan`` (see the module text)."""
    out: list[dict[str, tuple[float, float]]] = [{} for _ in range(num_layers)]
    for p in plan.pipelines:
        for s in p.stages:
            dp: dict[str, int] = {}
            for g in s.groups:
                dp[g.cluster] = dp.get(g.cluster, 0) + g.dp
            for c, n in dp.items():
                q = n / s.replicas if s.zero else 1.0
                for layer in range(s.start, min(s.end, num_layers)):
                    old = out[layer].get(c, (0.0, 0.0))
                    out[layer][c] = (1.0, max(old[1], q))
    return out


def _nodes_used(plan: Plan, inst: Instance) -> dict[str, int]:
    out = {}
    for c, gpus in plan.gpus_by_cluster().items():
        try:
            cl = inst.topology.cluster(c)
        except KeyError:
            continue
        out[c] = max(1, min(cl.nodes, math.ceil(gpus / cl.gpus_per_node)))
    return out


def migration(old: Plan, new: Plan, instance: Instance) -> Migration:
    """[M1] for moving from ``old`` to ``new`` on ``instance`` (the new resources; the model, dtype and
    optimizer are the job's)."""
    model = instance.model
    L = model.num_layers
    w = DTYPE_BYTES[model.dtype]
    o = optimizer_bytes_per_param(model, instance.job.precision, instance.job.optimizer)
    have, need = layer_shares(old, L), layer_shares(new, L)
    alive = {c.name for c in instance.topology.clusters}
    acc: dict[tuple[str, str], list[float]] = {}
    layers: dict[tuple[str, str], set[int]] = {}
    lost: list[tuple[str, int, float]] = []
    for layer in range(L):
        P = model.layers[layer].params
        sources = [(c, s) for c, s in have[layer].items() if c in alive]
        for dst, (p_new, q_new) in need[layer].items():
            p_old, q_old = have[layer].get(dst, (0.0, 0.0)) if dst in alive else (0.0, 0.0)
            p_def, q_def = max(0.0, p_new - p_old), max(0.0, q_new - q_old)
            if p_def <= 0 and q_def <= 0:
                continue
            order = sorted((c for c, _ in sources if c != dst),
                           key=lambda c: -instance.topology.link(c, dst).gbyte_s)
            shares = dict(sources)
            if p_def > 0:
                src = next((c for c in order if shares[c][0] >= 1.0), None)
                if src is None:
                    lost.append((dst, layer, p_def * P * w))
                else:
                    acc.setdefault((src, dst), [0.0, 0.0])[0] += p_def * P * w
                    layers.setdefault((src, dst), set()).add(layer)
            for src in order:
                if q_def <= 1e-12:
                    break
                take = min(q_def, shares[src][1])
                if take <= 0:
                    continue
                acc.setdefault((src, dst), [0.0, 0.0])[1] += take * P * o
                layers.setdefault((src, dst), set()).add(layer)
                q_def -= take
            if q_def > 1e-12:
                lost.append((dst, layer, q_def * P * o))
    nodes_old, nodes_new = _nodes_used(old, instance), _nodes_used(new, instance)
    flows = []
    into: dict[str, float] = {}
    out_of: dict[str, float] = {}
    for (src, dst), (pb, ob) in sorted(acc.items()):
        x = pb + ob
        n = max(1, min(nodes_old.get(src, 1), nodes_new.get(dst, 1)))
        t = flows_time(instance.topology.link_spec(src, dst), x / n, x)
        flows.append(Flow(src=src, dst=dst, param_bytes=pb, optimizer_bytes=ob,
                          layers=tuple(sorted(layers[(src, dst)])), time_s=t))
        into[dst] = into.get(dst, 0.0) + x
        out_of[src] = out_of.get(src, 0.0) + x
    times = [f.time_s for f in flows]
    for c, x in into.items():
        times.append(nic_time(instance.topology.cluster(c).inter_node, x / nodes_new.get(c, 1)))
    for c, x in out_of.items():
        times.append(nic_time(instance.topology.cluster(c).inter_node, x / nodes_old.get(c, 1)))
    return Migration(flows=tuple(flows), time_s=max(times, default=0.0), from_checkpoint=tuple(lost))


def horizon_time(iteration_s: float, migration_s: float, horizon_steps: int) -> float:
    """Total seconds of a move and ``horizon_steps`` iterations after it: ``T + N · t_iter``."""
    return migration_s + horizon_steps * iteration_s
