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

Inside a cluster [M1i]. A cluster that held layer l already feeds its own new holders. Under the new plan
n_{t,z} GPUs there hold l with tp t and ZeRO shard count z; the old plan had N_t GPUs with tp t and
N_{t,z} with that layout. They receive ``max(0, n_{t,z} − N_t) · params_l/t · w`` bytes of weights (the GPUs
beyond the earlier holders of that tp split) and ``max(0, n_{t,z} − N_{t,z}) · params_l/t · o/z`` of optimizer
state (a new shard count re-slices every holder's state; the weights stay). These bytes, with the WAN bytes into the cluster, go through the
receiving nodes' NICs (``nic_time`` over the nodes the new plan uses; ``intra_node`` bandwidth when the
old and the new plan use one node there). A cluster that receives a layer over the WAN is not charged
again for spreading it inside (the WAN flows land on its nodes).

How long [M1]. Every direction s -> d carries its bytes ``X_sd`` as ``n = min(nodes_s, nodes_d)``
node-pair flows (nodes: those the old plan used in s, those the new plan uses in d), all directions at
the same time:

    T_sd  = flows_time(link s->d, X_sd / n, X_sd)           (per-flow and aggregate caps, [C4w])
    T_nic = nic_time(NIC_c, bytes into (out of) c / nodes_c)  (each cluster's node NICs, [C4])
    T_in  = nic_time(NIC_c, (inside bytes + WAN bytes into c) / nodes_c)   ([M1i])
    T     = max over directions and clusters of T_sd, T_nic

Amortised over a horizon of N steps, a plan's total time is ``T + N · iteration_time``
(:func:`horizon_time`). Its WAN egress price: the bytes of each direction × that link's ``egress_usd_per_gb``
(:meth:`Migration.egress_usd`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hgopt.cost.links import flows_time, nic_time
from hgopt.cost.tables import optimizer_bytes_per_param, transfer_time
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
    inside: tuple[tuple[str, float, float], ...] = ()
    """(cluster, bytes, seconds) moved inside a cluster that held the layers already ([M1i])."""

    @property
    def bytes(self) -> float:
        """Bytes between clusters (the flows)."""
        return sum(f.bytes for f in self.flows)

    @property
    def inside_bytes(self) -> float:
        return sum(b for _, b, _ in self.inside)

    def egress_usd(self, instance: Instance) -> float | None:
        """WAN egress of the move: each flow's bytes (GB) × its link's ``egress_usd_per_gb``; None when no
        link the move uses has a price (a priced move over some unpriced links counts those as 0)."""
        prices = [instance.topology.link_spec(f.src, f.dst).egress_usd_per_gb for f in self.flows]
        if not any(p is not None for p in prices):
            return None
        return sum(f.bytes / 1e9 * (p or 0.0) for f, p in zip(self.flows, prices))


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


def _gpu_layouts(plan: Plan, num_layers: int) -> list[dict[str, dict[tuple[int, int], int]]]:
    """Per layer: cluster -> {(tp, ZeRO shard count): GPUs holding the layer that way}."""
    out: list[dict[str, dict[tuple[int, int], int]]] = [{} for _ in range(num_layers)]
    for p in plan.pipelines:
        for s in p.stages:
            shards = s.replicas if s.zero else 1
            for g in s.groups:
                for layer in range(s.start, min(s.end, num_layers)):
                    d = out[layer].setdefault(g.cluster, {})
                    d[(g.tp, shards)] = d.get((g.tp, shards), 0) + g.gpus
    return out


def _inside_bytes(old: dict[tuple[int, int], int], new: dict[tuple[int, int], int], per_param: tuple[float, float],
                  params: float) -> float:
    """[M1i] bytes the GPUs of one cluster receive from the cluster's earlier holders of one layer (see the
    module text): weights for the GPUs beyond the earlier holders of the same tp split, optimizer state for
    the GPUs beyond the earlier holders of the same (tp, shard count) layout."""
    w, o = per_param
    by_tp: dict[int, int] = {}
    for (t, _), n in old.items():
        by_tp[t] = by_tp.get(t, 0) + n
    out = 0.0
    for (t, z), n in new.items():
        out += max(0, n - by_tp.get(t, 0)) * params / t * w
        out += max(0, n - old.get((t, z), 0)) * params / t * o / z
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
    lay_old, lay_new = _gpu_layouts(old, L), _gpu_layouts(new, L)
    inside_b: dict[str, float] = {}
    for layer in range(L):
        for c, layout in lay_new[layer].items():
            if c in alive and c in lay_old[layer]:
                b = _inside_bytes(lay_old[layer][c], layout, (w, o), model.layers[layer].params)
                if b > 0:
                    inside_b[c] = inside_b.get(c, 0.0) + b
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
    inside = []
    for c, b in sorted(inside_b.items()):
        cl = instance.topology.cluster(c)
        one_node = nodes_new.get(c, 1) == 1 and nodes_old.get(c, 1) == 1
        t = transfer_time(cl.intra_node, b) if one_node else nic_time(cl.inter_node, (b + into.get(c, 0.0)) / nodes_new.get(c, 1))
        inside.append((c, b, t))
        times.append(t)
    for c, x in into.items():
        times.append(nic_time(instance.topology.cluster(c).inter_node, x / nodes_new.get(c, 1)))
    for c, x in out_of.items():
        times.append(nic_time(instance.topology.cluster(c).inter_node, x / nodes_old.get(c, 1)))
    return Migration(flows=tuple(flows), time_s=max(times, default=0.0), from_checkpoint=tuple(lost),
                     inside=tuple(inside))


def horizon_time(iteration_s: float, migration_s: float, horizon_steps: int) -> float:
    """Total seconds of a move and ``horizon_steps`` iterations after it: ``T + N · t_iter``."""
    return migration_s + horizon_steps * iteration_s
