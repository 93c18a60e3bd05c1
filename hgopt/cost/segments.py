"""[C5]/[C7o] A sync segment's all-reduce, buckets, ZeRO-1 phases and ring flow: the pieces
``evaluate``'s gradient synchronisation ([C5], [C5w], [C7o], [C7c]) and the simulator are built from (moved
out of ``evaluate.py``, round 8, to keep that module short; ``evaluate`` re-exports every name)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hgopt.cost.comm import gradient_bytes
from hgopt.cost.gradsync import MIB, ZERO_PHASE, bucket_ranges
from hgopt.cost.sharing import CapFlow
from hgopt.cost.tables import CostTables, allreduce_time, bandwidth_bytes_per_s, link_bytes_factor, ring_latency_s
from hgopt.cost.links import ring_bandwidth, ring_time
from hgopt.plan import Stage
from hgopt.spec import Instance, Link, Topology


def _capped_ring(link: Link, load: float, k: int) -> float:
    """[C5w] Every segment's ring over one direction of ``link`` together, at its aggregate cap (rings of
    different segments run between different node pairs, so without a cap they do not share)."""
    return 0.0 if link.aggregate is None else allreduce_time(link.aggregate, load, k)


def segment_sharded(holders: list[Stage]) -> bool:
    """[C7o] Whether the layers a sync segment's ``holders`` share are ZeRO-1 sharded: every holder asks
    for it and all of them hold one tp degree (the export's rule, ``export/build.py`` ``_zero_level``);
    a sharded segment's buckets are reduce-scattered and its parameters all-gathered after the
    optimizer step (``segment_bucket_syncs``, ``segment_gather``)."""
    return bool(holders) and all(s.zero for s in holders) and len({g.tp for s in holders for g in s.groups}) == 1


@dataclass(frozen=True, slots=True)
class SegmentSync:
    """[C5] One sync segment's (or bucket's) hierarchical all-reduce (``segment_allreduce``)."""

    intra: float
    """Slowest cluster's ring [C5]."""
    inter: float
    """The cross-cluster ring on the slowest link between its clusters (per flow, and the NICs at its
    ends), alone on the WAN [C5]."""
    clusters: tuple[str, ...]
    wan_bytes: float
    cap_s: float = 0.0
    """[C5w] The cross-cluster ring with only the aggregate caps it crosses limiting it (the slowest
    capped direction's ring of ``wan_bytes``; 0 without one): its work on a cap, in seconds of it
    alone (``segment_ring_flow``)."""
    lat_s: float = 0.0
    """The latency part of ``inter`` (2(k − 1) hops of the per-flow link whose ring is slowest)."""

    def pairs(self) -> list[frozenset[str]]:
        return [frozenset((a, b)) for i, a in enumerate(self.clusters) for b in self.clusters[i + 1 :]]

    def scaled(self, f: float) -> SegmentSync:
        """This collective's seconds and WAN bytes times ``f`` (a ring's reduce-scatter or all-gather
        phase: ``gradsync.ZERO_PHASE``)."""
        return SegmentSync(intra=self.intra * f, inter=self.inter * f, clusters=self.clusters, wan_bytes=self.wan_bytes * f,
                           cap_s=self.cap_s * f, lat_s=self.lat_s * f)

    def plus(self, other: SegmentSync) -> SegmentSync:
        """Two collectives of the same holders one after the other."""
        return SegmentSync(intra=self.intra + other.intra, inter=self.inter + other.inter, clusters=self.clusters,
                           wan_bytes=self.wan_bytes + other.wan_bytes, cap_s=self.cap_s + other.cap_s,
                           lat_s=self.lat_s + other.lat_s)


SegmentsAndLoads = tuple[dict[tuple[int, int], SegmentSync], dict[frozenset[str], float]]
"""``_segments_and_loads``: every sync segment's [C5] all-reduce by layer range, [C5w] bytes per cluster pair."""


def segment_allreduce(
    inst: Instance, tables: CostTables, holders: list[Stage], lo: int, hi: int, wan_precision: str
) -> SegmentSync:
    """[C5] The all-reduce of layers ``[lo, hi)`` among every replica of ``holders`` (the stages of every
    pipeline that hold them): a ring inside each cluster (per tp shard; the slowest cluster's is
    ``intra``), then a ring across the clusters over the WAN carrying the whole gradient in
    ``wan_precision`` (``inter``: per flow on the slowest link between them, and the NICs at its
    ends). The scorer prices a sync segment with it and each gradient bucket of one [C7o]; the
    simulator runs the same two phases (``hgopt.simulate``)."""
    topo = inst.topology
    per_cluster: dict[str, list[tuple[int, int]]] = {}
    for s in holders:
        for g in s.groups:
            per_cluster.setdefault(g.cluster, []).append((g.tp, g.dp))
    intra = 0.0
    full_bytes = 0.0
    for name, groups in per_cluster.items():
        c = topo.cluster(name)
        n = sum(dp for _, dp in groups)
        tp_min = min(tp for tp, _ in groups)
        tab = tables.table(c.gpu, tp_min)
        shard_bytes = float(tab.params[hi] - tab.params[lo]) * tables.dtype_bytes
        full_bytes = max(full_bytes, shard_bytes * tp_min)
        ring_bw = ring_bandwidth(c.intra_node, c.inter_node, c.gpus_per_node, n, max(tp for tp, _ in groups), tp_min)
        intra = max(intra, allreduce_time(ring_bw, shard_bytes, n))
    names = tuple(per_cluster)
    k = len(names)
    inter = wan_bytes = cap_s = lat_s = 0.0
    if k > 1:
        wan_bytes = full_bytes * link_bytes_factor(inst.model.dtype, wan_precision)
        # each edge of the ring is one flow (node pair): per-flow rate, and the NICs at its ends
        edge, slowest = max(((ring_time(topo.link_spec(a, b), wan_bytes, k), topo.link_spec(a, b))
                             for a in names for b in names if a != b), key=lambda tl: tl[0])
        inter = max(edge, max(allreduce_time(topo.cluster(c).inter_node, wan_bytes, k) for c in names))
        lat_s = ring_latency_s(slowest.bandwidth.latency_s, k)
        cap_s = max(_capped_ring(topo.link_spec(a, b), wan_bytes, k) for a in names for b in names if a != b)
    return SegmentSync(intra=intra, inter=inter, clusters=names if k > 1 else (), wan_bytes=wan_bytes, cap_s=cap_s,
                       lat_s=lat_s)


def segment_ring_flow(topo: Topology, seg: SegmentSync) -> tuple[CapFlow, float] | None:
    """[C5w] A collective's cross-cluster ring on the aggregate caps of every ordered pair of its
    clusters (a ring over k clusters counted on each pair, as ``_segments_and_loads`` counts it): one
    flow of ``cap_s`` seconds of the slowest cap's rate (read at the ring's chunk, wan_bytes / k), at
    most that work / (``inter`` − tail) bytes/s, then its latency tail off the link (the ring's
    2(k − 1) hops ``lat_s``, at most ``inter`` − ``cap_s``: [C5] prices the ring as the larger of its
    per-flow time with latency and its cap time, so alone it takes ``inter``). Under sharing it gets
    the cap's rate / n, so rings over a cap of c flows' worth slow down only beyond c of them
    (min(n·per_flow, aggregate)). Returns (the flow, its latency tail); None without a capped
    direction. The simulator runs the same flow (``hgopt.simulate``)."""
    dirs = tuple((a, b) for a in seg.clusters for b in seg.clusters
                 if a != b and topo.link_spec(a, b).aggregate is not None)
    tail = min(seg.lat_s, seg.inter - seg.cap_s)  # [C5] takes max(per flow + latency, cap): alone = inter
    if not dirs or seg.cap_s <= 0 or seg.inter - tail <= 0:
        return None
    chunk = seg.wan_bytes / len(seg.clusters)
    solo = min(bandwidth_bytes_per_s(topo.link_spec(a, b).aggregate, chunk) for a, b in dirs)  # type: ignore[arg-type]
    work = seg.cap_s * solo
    return CapFlow(nbytes=work, limit=work / (seg.inter - tail), dirs=dirs, size=chunk), tail


# ---- bucketed gradient sync overlapped with the last backward [C7o] ------------------------------
def segment_buckets(inst: Instance, tables: CostTables, holders: list[Stage], lo: int, hi: int,
                    bucket_mb: float) -> list[tuple[int, int]]:
    """[C7o] The gradient buckets of sync segment ``[lo, hi)`` held by ``holders``, in sync order (last
    layers first): layers packed into buckets of at most ``bucket_mb`` MiB of the largest per-rank
    gradient among the holders' (GPU, tp) shards (``gradsync.bucket_ranges``); a ZeRO-1 sharded
    segment (:func:`segment_sharded`) is cut the same way (each bucket reduce-scattered)."""
    per_layer = np.zeros(tables.num_layers)
    for gt in {(inst.topology.cluster(g.cluster).gpu, g.tp) for st in holders for g in st.groups}:
        per_layer = np.maximum(per_layer, gradient_bytes(np.diff(tables.table(*gt).params), tables.dtype_bytes))
    return bucket_ranges(per_layer, lo, hi, bucket_mb * MIB)


def segment_bucket_syncs(inst: Instance, tables: CostTables, holders: list[Stage], lo: int, hi: int,
                         bucket_mb: float, wan_precision: str) -> list[tuple[tuple[int, int], SegmentSync]]:
    """[C7o] Each gradient bucket of sync segment ``[lo, hi)`` (``segment_buckets``, sync order) with its
    collective: the [C5] all-reduce of its layers, or in a ZeRO-1 sharded segment its reduce-scatter
    (``gradsync.ZERO_PHASE`` of that all-reduce). Evaluate and the simulator both price buckets so."""
    f = ZERO_PHASE if segment_sharded(holders) else 1.0
    return [((x, y), segment_allreduce(inst, tables, holders, x, y, wan_precision).scaled(f))
            for x, y in segment_buckets(inst, tables, holders, lo, hi, bucket_mb)]


def segment_gather(inst: Instance, tables: CostTables, holders: list[Stage], lo: int, hi: int) -> SegmentSync | None:
    """[C7o] The all-gather of a ZeRO-1 sharded segment's updated parameters among its holders after
    their optimizer steps (``gradsync.ZERO_PHASE`` of the [C5] all-reduce of its bytes, in the native
    dtype: parameters are never narrowed); None for a segment that is not sharded."""
    if not segment_sharded(holders):
        return None
    return segment_allreduce(inst, tables, holders, lo, hi, "native").scaled(ZERO_PHASE)


def segment_sync(inst: Instance, tables: CostTables, holders: list[Stage], lo: int, hi: int,
                 wan_precision: str) -> SegmentSync:
    """[C5] A sync segment's whole synchronisation in one piece: its all-reduce, or for a ZeRO-1
    sharded segment the reduce-scatter (in ``wan_precision``) plus the all-gather (native), each
    ``gradsync.ZERO_PHASE`` of an all-reduce, which is the all-reduce itself in native precision."""
    seg = segment_allreduce(inst, tables, holders, lo, hi, wan_precision)
    gather = segment_gather(inst, tables, holders, lo, hi)
    return seg if gather is None or wan_precision == "native" else seg.scaled(ZERO_PHASE).plus(gather)
