"""[H2]/[H4]/[H6] Fast per-cluster estimates: the tables of local alternatives (``hier_tables``) per
cluster, role and stages after it; their combination over the clusters of a pipeline ([C3]/[C7]
form); the choice of each cluster's local alternative by coordinate descent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from hgopt.cost.pipeline import pipeline_time, trip_depth
from hgopt.search.hier_tables import ClusterTable, LazyTables, MOST_STAGES, lazy_cluster_tables
from hgopt.search.hierarchical.context import Ctx
from hgopt.search.hierarchical.links import Wan, wan_times


def local_weights(m: int) -> tuple[int, ...]:
    """Bottleneck weights of the local alternatives [H6]: the real m; fill/sync-leaning ones (for a
    cluster whose bottleneck is not the pipeline's); a bottleneck-leaning one (for a cluster whose
    gradient sync hides under another cluster's)."""
    return tuple(dict.fromkeys((m, max(1, m // 8), 1, 4 * m + 4, MOST_STAGES)))


def alt_tables(ctx: Ctx, name: str, role: str, k: int, B: int, m: int, after: int) -> LazyTables:
    """[H2]/[H6] The cluster's tables of local alternatives (per weight of ``local_weights``), each built
    when first read (``cells`` reads one layer count of all of them without building them)."""
    key = (alike(ctx, name), role, k, B, after)
    if key not in ctx.tabs:
        c = ctx.instance.topology.cluster(name)
        ctx.tabs[key] = lazy_cluster_tables(ctx.instance, ctx.tables, ctx.layout, c, role,  # type: ignore[arg-type]
                                            microbatch=B, num_microbatches=m, gpu_budget=c.num_gpus // k,
                                            replicas=k, stages_after=after, weights=local_weights(m),
                                            cache=ctx.parts)  # type: ignore[arg-type]
    return ctx.tabs[key]  # type: ignore[return-value]


def cells(tabs: Mapping[int, ClusterTable], n: int) -> dict[int, Cell]:
    """Every weight's :func:`cell` at ``n`` layers (of a :class:`LazyTables` without building its tables)."""
    if isinstance(tabs, LazyTables):
        return {w: Cell(*c) for w, c in tabs.cells(n).items()}
    return {w: cell(t, n) for w, t in tabs.items()}


def alike(ctx: Ctx, name: str) -> tuple[object, ...]:
    """What a cluster's estimates [H2] read of it: clusters that agree on all of it share tables."""
    if name not in ctx.alike:
        c = ctx.instance.topology.cluster(name)
        ctx.alike[name] = (c.gpu, c.gpus_per_node, c.num_gpus, c.gpu_memory_bytes, c.intra_node, c.inter_node)
    return ctx.alike[name]


def real_table(ctx: Ctx, name: str, role: str, k: int, B: int, m: int, after: int) -> ClusterTable:
    return alt_tables(ctx, name, role, k, B, m, after)[m]


def round_up(d: int) -> int:
    """Stages after a cluster, rounded up to a power of two for the estimates (more stages after
    means more microbatches in flight, so rounding up is the cautious side) — keeps tables shared."""
    return 0 if d <= 0 else 1 << (d - 1).bit_length()


@dataclass(frozen=True, slots=True)
class Lists:
    """A cluster table as Python lists (fast scalar access in the split loops)."""

    bott: list[float]
    fill: list[float]
    sync: list[float]
    stages: list[int]


def as_lists(tb: ClusterTable) -> Lists:
    return Lists(tb.bottleneck.tolist(), tb.fill.tolist(), tb.sync_opt.tolist(), tb.stages.tolist())


class Cell(NamedTuple):
    """One cluster's estimate [H2] at one layer count."""

    bottleneck: float
    fill: float
    sync_opt: float
    stages: int
    """Local pipeline stages."""


def cell(tb: ClusterTable, n: int) -> Cell:
    """``tb`` at ``n`` layers."""
    return Cell(float(tb.bottleneck[n]), float(tb.fill[n]), float(tb.sync_opt[n]), int(tb.stages[n]))


def combine(vals: Sequence[Cell], m: int, wan: Wan) -> float:
    """[H4] The [C3]/[C7] form over clusters, from (bottleneck, fill, sync_opt, local stages) per
    cluster: (m − 1)·pace + Σ fill + WAN trips + max sync_opt, the pace being the slowest stage or
    link or the 1F1B round trip of a suffix over the microbatches it can hold in flight — suffixes
    from a cluster's first and from its last local stage — or of the window of a cluster's last and
    the next cluster's first local stage around their WAN link (local stages taken as equal; the
    exact pace of every window is ``evaluate``'s, [C3])."""
    bott, fill, sync = wan.worst_s, wan.total_s, 0.0
    trip, count, head = 0.0, 0, -1.0
    per = wan.per_boundary_s
    for i in range(len(vals) - 1, -1, -1):  # maxima as comparisons (max() of two is slower; same value)
        b, f, s_, k = vals[i]
        if b > bott:
            bott = b
        fill += f
        if s_ > sync:
            sync = s_
        link = per[i] if i < len(per) else 0.0
        if k:  # the suffix from the cluster's last local stage (one stage and its WAN link)
            fk = f / k  # one local stage's fill
            pace = (fk + link + trip) / trip_depth(1 + count, m)
            if pace > bott:
                bott = pace
            if head >= 0.0:  # the window of that stage and the next cluster's first stage
                pace = (fk + link + head) / trip_depth(2, m)
                if pace > bott:
                    bott = pace
            head = fk
        else:
            head = -1.0
        trip += f + link
        count += k
        if count:
            pace = trip / trip_depth(count, m)
            if pace > bott:
                bott = pace
    return pipeline_time(m, bott, fill) + sync


def trip_depths(t: Sequence[Lists], m: int) -> list[int]:
    """``trip_depth(c, m)`` for every stage count c a pipeline on the tables ``t`` can reach (read by
    ``estimate_at`` in the split's loops instead of a call per cluster)."""
    return [trip_depth(c, m) for c in range(sum(max(ti.stages) for ti in t) + 2)]


def estimate_at(t: Sequence[Lists], n: Sequence[int], m: int, wan: Wan, depth: Sequence[int] | None = None) -> float:
    """``combine`` on the tables at the layer counts ``n`` (written out: it runs in the split's loops);
    ``depth``: ``trip_depths(t, m)`` (built here when not given)."""
    if depth is None:
        depth = trip_depths(t, m)
    bott, fill, sync = wan.worst_s, wan.total_s, 0.0
    trip, count, head = 0.0, 0, -1.0
    per = wan.per_boundary_s
    last = len(per)
    for i in range(len(t) - 1, -1, -1):
        ti, ni = t[i], n[i]
        b, f, s_ = ti.bott[ni], ti.fill[ni], ti.sync[ni]
        if b > bott:
            bott = b
        fill += f
        if s_ > sync:
            sync = s_
        link = per[i] if i < last else 0.0
        k = ti.stages[ni]
        if k:  # the suffix from the cluster's last local stage (one stage and its WAN link)
            fk = f / k  # one local stage's fill
            pace = (fk + link + trip) / depth[count + 1]
            if pace > bott:
                bott = pace
            if head >= 0.0:  # the window of that stage and the next cluster's first stage
                pace = (fk + link + head) / depth[2]
                if pace > bott:
                    bott = pace
            head = fk
        else:
            head = -1.0
        trip += f + link
        count += k
        if count:
            pace = trip / depth[count]
            if pace > bott:
                bott = pace
    return pipeline_time(m, bott, fill) + sync


def choose_weights(
    ctx: Ctx, order: tuple[str, ...], tabs: Sequence[Mapping[int, ClusterTable]], layers: Sequence[int], B: int, m: int,
    links: Sequence[str] = (),
) -> tuple[float, tuple[int, ...]]:
    """[H6] Per cluster, the local alternative (bottleneck weight) that lowers the pipeline's
    estimate, by coordinate descent; returns (estimate, weights)."""
    wan = wan_times(ctx, order, B, links)
    ws = [m] * len(order)

    val = [cells(tb, n) for tb, n in zip(tabs, layers)]

    def est(choice: Sequence[int]) -> float:
        return combine([v[w] for v, w in zip(val, choice)], m, wan)

    cur = est(ws)
    improved = True
    while improved:
        improved = False
        for i, tb in enumerate(tabs):
            for w in tb:
                if w == ws[i]:
                    continue
                trial = ws[:i] + [w] + ws[i + 1 :]
                t = est(trial)
                if t < cur - 1e-12:
                    ws, cur, improved = trial, t, True
    return cur, tuple(ws)
