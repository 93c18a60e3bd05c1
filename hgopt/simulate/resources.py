"""Link resources of the event simulator: what a transfer between two replicas passes through.

A :class:`Resource` has an optional per-flow bandwidth and an optional aggregate capacity; ``n``
concurrent flows through it each get ``min(per_flow, aggregate / n)`` (processor sharing). A flow that
passes through several resources moves at the smallest of their shares. Achieved bandwidths (and their
dependence on the message size) come from the cost kernel's :func:`bandwidth_bytes_per_s`.

:func:`path` maps the instance's link model onto resources. Today's model ([C4], [C4w] in
``formulations/cost_model.md``):

- inside one cluster every sender has its own ``inter_node`` bandwidth (per flow, no aggregate: the
  closed form's simplification that the NIC does not degrade with concurrent flows);
- between two clusters one pipe per ordered pair whose bandwidth is shared by every flow on it
  (aggregate, no per-flow limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hgopt.cost.tables import bandwidth_bytes_per_s
from hgopt.spec import Bandwidth, Instance

__all__ = ["Resource", "path"]


@dataclass(frozen=True, slots=True)
class Resource:
    """One shared part of the network (a NIC direction, a WAN pipe direction)."""

    name: str
    per_flow: Bandwidth | None = None
    """Bandwidth one flow can reach on its own (None: no per-flow limit)."""
    aggregate: Bandwidth | None = None
    """Capacity shared by all concurrent flows (None: no shared cap)."""

    def rate(self, nbytes: float, n: int) -> float:
        """Bytes/s of each of ``n`` concurrent flows for a message of ``nbytes``."""
        r = math.inf
        if self.per_flow is not None:
            r = bandwidth_bytes_per_s(self.per_flow, nbytes)
        if self.aggregate is not None:
            r = min(r, bandwidth_bytes_per_s(self.aggregate, nbytes) / max(n, 1))
        return r

    @property
    def latency_s(self) -> float:
        return max((b.latency_s for b in (self.per_flow, self.aggregate) if b is not None), default=0.0)

    @property
    def capacity(self) -> Bandwidth | None:
        """The bandwidth utilisation is measured against (aggregate if any, else per flow)."""
        return self.aggregate if self.aggregate is not None else self.per_flow


def path(instance: Instance, src_cluster: str, dst_cluster: str) -> tuple[Resource, ...]:
    """The resources a point-to-point transfer from a replica in ``src_cluster`` to one in
    ``dst_cluster`` passes through, under today's link model (module docstring)."""
    topo = instance.topology
    if src_cluster == dst_cluster:
        return (Resource(f"{src_cluster} inter-node", per_flow=topo.cluster(src_cluster).inter_node),)
    return (Resource(f"{src_cluster}->{dst_cluster}", aggregate=topo.link(src_cluster, dst_cluster)),)
