"""The link model [C1], [C4], [C4w], [C5], [C5w]: how concurrent flows share links and NICs.

Pure functions, no plan or instance in sight; ``evaluate`` and the bounds in ``hgopt.search`` call them.

Physics (``formulations/cost_model.md`` [C1]):

- An inter-cluster :class:`~hgopt.spec.Link` ``a -> b`` has a PER-FLOW bandwidth (one node of a to one
  node of b, what a VM-pair measurement gives, constant or Sailor's message-size curve) with its latency,
  and an optional AGGREGATE capacity per direction shared by every concurrent flow a -> b. n concurrent
  flows move together at most ``min(n · per_flow, aggregate)``; each flow at most ``per_flow``.
- A node's NIC (``Cluster.inter_node``) is one per node: every GPU of the node that sends to (or
  receives from) another node shares it.
- A flow is a node pair: what one node sends to one other node in one transfer.
"""

from __future__ import annotations

import math

from hgopt.cost.tables import _U_MAX, _U_MIN, allreduce_time, bandwidth_bytes_per_s, ring_latency_s, transfer_time
from hgopt.spec import Bandwidth, Link

__all__ = [
    "aggregate_rate",
    "flow_rate",
    "flows_time",
    "handover_floor",
    "handover_lower_bound",
    "least_allreduce_time_from",
    "least_time_from",
    "link_time_lower_bound",
    "max_rate_from",
    "nic_share",
    "nic_time",
    "node_samples",
    "replicas_per_node",
    "ring_bandwidth",
    "ring_time",
]


def aggregate_rate(per_flow_bytes_s: float, flows: int, aggregate_bytes_s: float | None) -> float:
    """Bytes/s that ``flows`` concurrent flows move together: ``min(n · per_flow, aggregate)`` [C4w]."""
    if flows <= 0:
        return 0.0
    total = flows * per_flow_bytes_s
    return total if aggregate_bytes_s is None else min(total, aggregate_bytes_s)


def flow_rate(per_flow_bytes_s: float, flows: int, aggregate_bytes_s: float | None) -> float:
    """Bytes/s of each of ``flows`` equal concurrent flows: ``min(per_flow, aggregate / n)`` [C4w]."""
    if flows <= 0:
        return per_flow_bytes_s
    return aggregate_rate(per_flow_bytes_s, flows, aggregate_bytes_s) / flows


def flows_time(link: Link, max_flow_bytes: float, total_bytes: float) -> float:
    """Seconds until every flow of one transfer over ``link`` is done [C4], [C4w].

    ``max_flow_bytes``: the largest flow (node pair) of this transfer; ``total_bytes``: every byte on
    that direction of the link at the same time (all boundaries of all pipelines that cross it). A flow
    moves at most at the per-flow rate; all of them together at most at the aggregate rate:
    ``λ + max(x_max / BW_flow(x_max), X / BW_agg(X))``. For n equal flows of x bytes alone on the link
    this is ``λ + x / min(per_flow, aggregate / n)``. Without an aggregate cap only the per-flow term
    remains; a ``shared_pipe`` link (aggregate = per flow) is ``transfer(link, X)``."""
    if max_flow_bytes <= 0 and total_bytes <= 0:
        return 0.0
    t = max_flow_bytes / bandwidth_bytes_per_s(link.bandwidth, max_flow_bytes) if max_flow_bytes > 0 else 0.0
    if link.aggregate is not None and total_bytes > 0:
        t = max(t, total_bytes / bandwidth_bytes_per_s(link.aggregate, total_bytes))
    return link.bandwidth.latency_s + t


def replicas_per_node(gpus_per_node: int, tp: int) -> int:
    """Replicas of ``tp`` GPUs one node holds: a replica group fills its nodes replica after replica."""
    return max(gpus_per_node // tp, 1)


def node_samples(gpus_per_node: int, tp: int, dp: int, mbs: int) -> int:
    """Samples per microbatch on the fullest node of a group of ``dp`` replicas (``mbs`` each): what
    that node's NIC carries when the stage sends its activations to another node [C4]."""
    return min(dp, replicas_per_node(gpus_per_node, tp)) * mbs


def ring_bandwidth(intra_node: Bandwidth, inter_node: Bandwidth, gpus_per_node: int, ring: int, tp_max: int,
                   tp_min: int) -> Bandwidth:
    """The bandwidth a cluster's gradient ring of ``ring`` replicas sees [C5]: ``intra_node`` when all of
    them (``tp_max`` GPUs each) fit in one node, else the node NIC, which the rings of the ``tp_min``
    shards cross at the same time (:func:`nic_share`)."""
    if ring * tp_max <= gpus_per_node:
        return intra_node
    return nic_share(inter_node, tp_min)


def nic_time(nic: Bandwidth, node_bytes: float) -> float:
    """Seconds for one node's NIC to carry ``node_bytes`` (the sum over every GPU of the node that sends
    to, or receives from, another node in one transfer): ``λ + bytes / BW(bytes)`` [C4]."""
    return transfer_time(nic, node_bytes)


def nic_share(nic: Bandwidth, concurrent: int) -> Bandwidth:
    """The NIC as each of ``concurrent`` flows through it sees it: 1/k of its bandwidth (the rings of the
    k tensor-parallel shards of a node cross its NIC at the same time) [C5]."""
    return nic if concurrent <= 1 else nic.scaled(1.0 / concurrent)


def ring_time(link: Link, own_bytes: float, n: int, shared_bytes: float | None = None) -> float:
    """A ring all-reduce across ``n`` clusters whose edge ``link.src -> link.dst`` is one flow [C5],
    [C5w]: the ring alone at the per-flow rate, and, when the link has an aggregate cap, every ring over
    that direction together (``shared_bytes``, default ``own_bytes``) at the aggregate rate."""
    t = allreduce_time(link.bandwidth, own_bytes, n)
    if link.aggregate is not None:
        t = max(t, allreduce_time(link.aggregate, own_bytes if shared_bytes is None else shared_bytes, n))
    return t


def max_rate_from(bw: Bandwidth, nbytes: float) -> float:
    """The highest bytes/s ``bw`` reaches for any message of at least ``nbytes`` (the curve is a
    quadratic in u = log2(bytes / 1e6), clamped): for lower bounds that must hold whatever the real
    message size is, as long as it is no smaller than ``nbytes``."""
    if bw.curve is None:
        return bw.gbyte_s * 1e9
    c0, c1, _ = bw.curve
    lo = min(max(_log2_mb(nbytes), _U_MIN), _U_MAX)
    candidates = [lo, _U_MAX]
    if c0 < 0 and lo < -c1 / (2 * c0) < _U_MAX:
        candidates.append(-c1 / (2 * c0))
    return max(bandwidth_bytes_per_s(bw, 1e6 * 2.0**u) for u in candidates)


def link_time_lower_bound(link: Link, boundary_bytes: float, max_flows: int, total_bytes: float) -> float:
    """The fastest ``flows_time`` can be for a transfer of ``boundary_bytes`` spread over at most
    ``max_flows`` node pairs, with ``total_bytes`` at least on that direction of the link: its largest
    flow carries at least boundary_bytes / max_flows, each flow at most the link's best per-flow rate,
    all together at most its best aggregate rate. A lower bound of :func:`flows_time` for every such
    transfer (for the MILP, the relaxation and the cheap bounds)."""
    if boundary_bytes <= 0 and total_bytes <= 0:
        return 0.0
    x = boundary_bytes / max(max_flows, 1)
    t = x / max_rate_from(link.bandwidth, x) if x > 0 else 0.0
    if link.aggregate is not None and total_bytes > 0:
        t = max(t, total_bytes / max_rate_from(link.aggregate, total_bytes))
    return link.bandwidth.latency_s + t


def handover_lower_bound(link: Link, src_nic: Bandwidth, dst_nic: Bandwidth, boundary_bytes: float,
                         total_bytes: float, samples: int, src_nodes: int, dst_nodes: int, copies: int = 1) -> float:
    """The fastest a boundary of ``samples`` samples (``boundary_bytes`` in all) of each of ``copies``
    identical pipelines, from at most ``src_nodes`` nodes of a to at most ``dst_nodes`` nodes of b, can
    be as ``stage_boundary_time`` prices it [C4]: one copy's node-pair flows (at most
    min(samples, src_nodes + dst_nodes − 1): both sides tile the microbatch with one block per node; the
    copies' flows only add to them) on the link (:func:`link_time_lower_bound`), and each side's fullest
    node (at least 1/nodes of all copies' bytes) through its NIC."""
    a = max(1, min(samples, src_nodes))
    b = max(1, min(samples, dst_nodes))
    flows = max(1, min(samples, a + b - 1))
    t = link_time_lower_bound(link, boundary_bytes, flows, total_bytes)
    for nic, nodes in ((src_nic, src_nodes), (dst_nic, dst_nodes)):
        y = copies * boundary_bytes / max(1, min(copies * samples, nodes))
        if y > 0:
            t = max(t, nic.latency_s + y / max_rate_from(nic, y))
    return t


def least_time_from(bw: Bandwidth, nbytes: float) -> float:
    """The least ``y / BW(y)`` over every message size y >= ``nbytes`` (no latency): a lower bound of
    the transfer seconds of any message of at least ``nbytes``, exact at ``nbytes`` wherever the curve
    never rises faster than the message grows. On the clamped quadratic curve of
    :func:`bandwidth_bytes_per_s` (in u = log2(bytes / 1e6)) the least lies at ``nbytes``, at the top
    of the fitted range, at a clamp's corner or where d ln BW / du = ln 2 (a quadratic in u)."""
    if nbytes <= 0:
        return 0.0
    best = nbytes / bandwidth_bytes_per_s(bw, nbytes)
    if bw.curve is None:
        return best
    c0, c1, c2 = bw.curve
    lo = max(_log2_mb(nbytes), _U_MIN)
    us = [_U_MAX]
    ln2 = math.log(2.0)
    for a, b, c in ((-ln2 * c0, 2 * c0 - ln2 * c1, c1 - ln2 * c2),  # stationary: 2c0u + c1 = ln2·B(u)
                    (c0, c1, c2 - bw.gbyte_s), (c0, c1, c2 - 0.01 * bw.gbyte_s)):  # the clamps' corners
        us.extend(_roots(a, b, c))
    for u in us:
        if lo <= u <= _U_MAX:
            y = 1e6 * 2.0**u
            best = min(best, y / bandwidth_bytes_per_s(bw, y))
    return best


def least_allreduce_time_from(bw: Bandwidth, nbytes: float, n: int) -> float:
    """gaps3: the least [C5] ring all-reduce seconds (``tables.allreduce_time``) among ``n`` of any
    message of at least ``nbytes``: allreduce_time(x) = 2(n − 1)·((x/n) / BW(x/n) + latency), and
    x/n >= nbytes/n, so at least 2(n − 1)·(:func:`least_time_from`(nbytes/n) + latency); exact at
    ``nbytes`` wherever the curve never rises faster than the message grows. A floor of a gradient
    bucket's all-reduce that holds a layer of ``nbytes``, whatever else the bucket holds."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return ring_latency_s(least_time_from(bw, nbytes / n) + bw.latency_s, n)


def _roots(a: float, b: float, c: float) -> list[float]:
    if abs(a) < 1e-300:
        return [-c / b] if abs(b) > 1e-300 else []
    d = b * b - 4 * a * c
    if d < 0:
        return []
    r = math.sqrt(d)
    return [(-b - r) / (2 * a), (-b + r) / (2 * a)]


NodeLayout = tuple[int, int, int]
"""(replicas per node, dp, mbs) of a one-group stage: all its node tiling depends on [C4]."""


def handover_floor(link: Link, src_nic: Bandwidth, dst_nic: Bandwidth, per_sample_bytes: float, samples: int,
                   src: list[NodeLayout], dst: list[NodeLayout], copies: int = 1) -> float:
    """[M8f] The least seconds (casts excluded) a hand-over of a microbatch of ``samples`` samples
    (``per_sample_bytes`` each) of each of ``copies`` identical pipelines, from a one-group stage of
    a layout in ``src`` on cluster a to one of a layout in ``dst`` on cluster b, takes as
    ``stage_boundary_time`` prices it, over every such layout pair; inf when either list is empty.

    From the node tiling: the replicas of every copy fill nodes one after another, ``ppn`` per node
    (copy c's replica r is replica c·dp + r), so the first node holds min(copies·dp, ppn) replicas
    (its NIC carries that many blocks of mbs samples), and of copy c it holds the rows [0, n_c·mbs),
    n_c = clamp(ppn − c·dp, 0, dp): the flow between the two sides' first nodes carries
    Σ_c min(n_c·mbs of a, n_c·mbs of b) samples, and the largest flow at least that; the link's
    direction carries all copies' samples (its aggregate cap, [C4w]). Each term is one of the terms
    ``stage_boundary_time`` takes the largest of (the flow's by :func:`least_time_from`, as the
    largest flow may be larger), so the floor is at most its value for every layout pair."""
    if not src or not dst:
        return math.inf
    total = copies * samples * per_sample_bytes

    def side(nic: Bandwidth, layouts: list[NodeLayout]) -> dict[tuple[int, ...], float]:
        out: dict[tuple[int, ...], float] = {}  # first node's rows per copy -> least NIC seconds there
        for ppn, dp, mbs in layouts:
            t = nic_time(nic, min(copies * dp, ppn) * mbs * per_sample_bytes)
            rows = tuple(min(max(ppn - c * dp, 0), dp) * mbs for c in range(copies))
            out[rows] = min(out.get(rows, math.inf), t)
        return out

    agg = total / bandwidth_bytes_per_s(link.aggregate, total) if link.aggregate is not None and total > 0 else 0.0
    best = math.inf
    a_side, b_side = side(src_nic, src), side(dst_nic, dst)
    for ra, ta in a_side.items():
        for rb, tb in b_side.items():
            first = sum(min(x, y) for x, y in zip(ra, rb))
            flow = link.bandwidth.latency_s + max(least_time_from(link.bandwidth, first * per_sample_bytes), agg)
            best = min(best, max(ta, tb, flow))
    return best


def _log2_mb(nbytes: float) -> float:
    return math.log2(max(nbytes, 1.0) / 1e6)
