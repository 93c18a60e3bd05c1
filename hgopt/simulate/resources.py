"""Link resources of the event simulator: what a transfer between two replicas passes through.

A :class:`Resource` has an optional per-flow bandwidth and an optional aggregate capacity; ``n``
concurrent flows through it each get ``min(per_flow, aggregate / n)`` (processor sharing). A flow that
passes through several resources moves at the smallest of their shares. Achieved bandwidths (and their
dependence on the message size) come from the cost kernel's :func:`bandwidth_bytes_per_s`.

:class:`Network` maps the instance's link model onto resources ([C1], [C4], [C4w] in
``formulations/cost_model.md``). With per-flow links (``Link.aggregate``, ``Topology.link_spec``):

- every node's NIC (``Cluster.inter_node``, per node) is one resource per direction, shared by the
  flows of all GPUs of the node that send (receive) to (from) another node;
- between two clusters, what one node sends to one node is one flow of the link's per-flow bandwidth
  (a node-pair resource), and a link with an aggregate cap is one more resource shared by every flow
  of that direction.

With the older topology model (one shared pipe per ordered cluster pair, ``inter_node`` per GPU):
inside a cluster every sender has its own ``inter_node`` bandwidth (per flow, no aggregate), between
two clusters one pipe per ordered pair shared by every flow on it (aggregate, no per-flow limit).

Nodes: a stage's replica group of ``dp`` replicas of ``tp`` GPUs fills nodes of ``gpus_per_node``
GPUs, ``gpus_per_node // tp`` replicas per node, each (stage, group) on nodes of its own; identical
pipelines pack the replicas of one (stage, group) together, copy after copy (replica d of copy c on
node (c·dp + d) // (gpus_per_node // tp)), as the cost kernel's placement (``evaluate._node_pieces``)
assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hgopt.cost.tables import bandwidth_bytes_per_s
from hgopt.plan import Plan
from hgopt.spec import Bandwidth, Instance

__all__ = ["Network", "Resource"]


@dataclass(frozen=True, slots=True)
class Resource:
    """One shared part of the network (a NIC direction, a WAN pipe direction, a node pair)."""

    name: str
    per_flow: Bandwidth | None = None
    """Bandwidth one flow can reach on its own (None: no per-flow limit)."""
    aggregate: Bandwidth | None = None
    """Capacity shared by all concurrent flows (None: no shared cap)."""

    def rate(self, nbytes: float, n: int, total_bytes: float | None = None) -> float:
        """Bytes/s of each of ``n`` concurrent flows, for a flow whose message is ``nbytes`` while
        the ``n`` flows' messages add up to ``total_bytes`` (default ``n · nbytes``): the per-flow
        bandwidth at the flow's own message size, the aggregate at the total (as [C4w] prices a
        link's load: concurrent messages fill the pipe like one of their summed size)."""
        r = math.inf
        if self.per_flow is not None:
            r = bandwidth_bytes_per_s(self.per_flow, nbytes)
        if self.aggregate is not None:
            total = max(n, 1) * nbytes if total_bytes is None else total_bytes
            r = min(r, bandwidth_bytes_per_s(self.aggregate, total) / max(n, 1))
        return r

    @property
    def latency_s(self) -> float:
        return max((b.latency_s for b in (self.per_flow, self.aggregate) if b is not None), default=0.0)


Endpoint = tuple[str, str]
"""(cluster, node label) of a replica."""


class Network:
    """The resources of one plan on one instance (see the module docstring)."""

    def __init__(self, plan: Plan, instance: Instance) -> None:
        self.inst = instance
        topo = instance.topology
        self.per_flow_links = hasattr(topo, "link_spec")
        self._cache: dict[tuple[Endpoint, Endpoint], tuple[Resource, ...]] = {}
        self.node_of: dict[tuple[int, int, int], Endpoint] = {}
        first: dict[object, int] = {}
        copies: dict[int, int] = {}
        for pi, pipe in enumerate(plan.pipelines):
            rep = first.setdefault(pipe, pi)  # identical pipelines share their stages' nodes, copy after copy
            c = copies[rep] = copies.get(rep, -1) + 1
            for si, st in enumerate(pipe.stages):
                ri = 0
                for gi, g in enumerate(st.groups):
                    per_node = max(topo.cluster(g.cluster).gpus_per_node // g.tp, 1)
                    for d in range(g.dp):
                        if self.per_flow_links:
                            node = f"p{rep}.s{si}.g{gi}.n{(c * g.dp + d) // per_node}"
                        else:
                            node = f"p{pi}.s{si}.r{ri}"
                        self.node_of[(pi, si, ri)] = (g.cluster, node)
                        ri += 1

    def path(self, src: Endpoint, dst: Endpoint) -> tuple[Resource, ...]:
        """The resources a point-to-point transfer from ``src`` to ``dst`` passes through."""
        key = (src, dst)
        if key not in self._cache:
            self._cache[key] = self._path(src, dst)
        return self._cache[key]

    def _path(self, src: Endpoint, dst: Endpoint) -> tuple[Resource, ...]:
        topo = self.inst.topology
        (a, na), (b, nb) = src, dst
        if not self.per_flow_links:
            if a == b:
                return (Resource(f"{a} inter-node", per_flow=topo.cluster(a).inter_node),)
            return (Resource(f"{a}->{b}", aggregate=topo.link(a, b)),)
        out = [Resource(f"{a} {na} NIC out", aggregate=topo.cluster(a).inter_node),
               Resource(f"{b} {nb} NIC in", aggregate=topo.cluster(b).inter_node)]
        if a != b:
            link = topo.link_spec(a, b)  # type: ignore[attr-defined]
            out.append(Resource(f"{a} {na}->{b} {nb}", aggregate=link.bandwidth))  # one node pair = one flow
            if link.aggregate is not None:
                out.append(Resource(f"{a}->{b}", aggregate=link.aggregate))
        return tuple(out)

    def ring(self, clusters: tuple[str, ...]) -> tuple[Resource, ...]:
        """The shared resources a cross-cluster all-reduce ring over ``clusters`` occupies: every
        ordered pair's pipe (old model) or aggregate cap (per-flow links; without a cap, rings of
        different segments run between different node pairs and do not share)."""
        topo = self.inst.topology
        pairs = [(a, b) for a in clusters for b in clusters if a != b]
        if not self.per_flow_links:
            return tuple(Resource(f"{a}->{b}", aggregate=topo.link(a, b)) for a, b in pairs)
        out = []
        for a, b in pairs:
            link = topo.link_spec(a, b)  # type: ignore[attr-defined]
            if link.aggregate is not None:
                out.append(Resource(f"{a}->{b}", aggregate=link.aggregate))
        return tuple(out)
