"""[H3]/[H7] Inter-cluster boundaries: their transfer times as ``evaluate`` computes them, the
precisions ``--link-precision`` allows, and the per-boundary precision choice."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from hgopt.cost.evaluate import stage_boundary_time
from hgopt.cost.pipeline import pipeline_time
from hgopt.plan import Boundary, Pipeline, ReplicaGroup, Stage
from hgopt.search.hierarchical.context import Ctx
from hgopt.spec import DTYPE_BYTES, Instance


class Wan(NamedTuple):
    """A pipeline's inter-cluster boundaries at a block boundary's activation size (seconds)."""

    worst_s: float
    """Slowest single send (forward or backward)."""
    total_s: float
    """Sum of all sends, both ways."""
    per_boundary_s: tuple[float, ...]
    """Per boundary, forward + backward."""


LINK_PRECISIONS = ("native", "fp32", "bf16", "fp16", "fp8", "auto")


def allowed_link_precisions(instance: Instance, link_precision: str) -> tuple[str, ...]:
    """[H7] What an inter-cluster boundary may use under ``--link-precision``; precisions that are
    not narrower than the training dtype compress nothing and are dropped."""
    if link_precision not in LINK_PRECISIONS:
        raise ValueError(f"--link-precision: must be one of {', '.join(LINK_PRECISIONS)}, got {link_precision!r}")
    native = DTYPE_BYTES[instance.model.dtype]
    wanted = {"native": (), "fp32": (), "auto": ("bf16", "fp8")}.get(link_precision, (link_precision,))
    narrower = tuple(p for p in wanted if DTYPE_BYTES[p] < native)
    if link_precision == "auto":
        return ("native", *narrower)
    return narrower or ("native",)


def check_max_links(n: int | None) -> int | None:
    if n is not None and n < 0:
        raise ValueError(f"--max-compressed-links: must be >= 0, got {n}")
    return n


def link_times(ctx: Ctx, a: str, b: str, B: int, cut: int, prec: str = "native") -> tuple[float, float]:
    """(forward, backward) seconds for B samples per microbatch crossing a → b after layer cut−1 in
    precision ``prec``, as ``evaluate`` computes them ([C4], [C4q]). Callers pass B = k · microbatch:
    the k identical pipelines share the link ([C4w])."""
    key = (a, b, B, cut, prec)
    if key not in ctx.links:
        one = lambda c, lo, hi: Stage(start=lo, end=hi, groups=(ReplicaGroup(cluster=c, dp=B),))  # noqa: E731
        pipe = Pipeline(stages=(one(a, 0, cut), one(b, cut, ctx.tables.num_layers)), num_microbatches=1,
                        boundaries=(Boundary(fwd=prec, bwd=prec),))  # type: ignore[arg-type]
        ctx.links[key] = stage_boundary_time(ctx.instance, ctx.tables, pipe, 0)
    return ctx.links[key]


def best_link(ctx: Ctx, a: str, b: str, B: int, cut: int, m: int) -> tuple[str, float, float]:
    """[H7] The allowed precision with the smallest (m − 1)·max(fwd, bwd) + fwd + bwd on a → b."""
    best: tuple[float, str, float, float] | None = None
    for prec in ctx.allowed:
        f, bw = link_times(ctx, a, b, B, cut, prec)
        score = pipeline_time(m, max(f, bw), f + bw) + ctx.penalty.get(prec, 0.0)
        if best is None or score < best[0] - 1e-15:
            best = (score, prec, f, bw)
    assert best is not None
    return best[1], best[2], best[3]


def link_choice(ctx: Ctx, order: Sequence[str], B: int, m: int, cuts: Sequence[int]) -> tuple[str, ...]:
    """[H7] Precision per inter-cluster boundary: each boundary's best allowed one; with a limit on
    compressed links, only the boundaries where compression gains most keep it."""
    if ctx.allowed == ("native",):
        return ()
    picks = []
    for a, b, cut in zip(order, order[1:], cuts):
        prec, f, bw = best_link(ctx, a, b, B, cut, m)
        nf, nb = link_times(ctx, a, b, B, cut, "native")
        gain = pipeline_time(m, max(nf, nb), nf + nb) - pipeline_time(m, max(f, bw), f + bw) - ctx.penalty.get(prec, 0.0)
        picks.append((prec, gain))
    if ctx.max_links is not None:
        keep = {i for i, _ in sorted(((i, g) for i, (p, g) in enumerate(picks) if p != "native"),
                                     key=lambda x: -x[1])[: ctx.max_links]}
        picks = [(p if i in keep else "native", g) for i, (p, g) in enumerate(picks)]
    out = tuple(p for p, _ in picks)
    return () if all(p == "native" for p in out) else out


def block_cut(ctx: Ctx) -> int:
    """A layer boundary inside the blocks (where the estimates cost WAN transfers)."""
    cut = ctx.layout.pre + max(ctx.layout.blocks // 2, 1)
    return min(max(cut, 1), max(ctx.tables.num_layers - 1, 1))


def wan_times(
    ctx: Ctx, order: Sequence[str], B: int, links: Sequence[str] = ()
) -> Wan:
    """(slowest WAN send, sum of WAN sends both ways, per boundary forward + backward) of the
    pipeline at a block boundary's activation size (exact cut sizes are costed when realised), with
    the boundaries' precisions ``links`` (empty: native)."""
    cut = block_cut(ctx)
    worst = total = 0.0
    per = []
    for i, (a, b) in enumerate(zip(order, order[1:])):
        f, bw = link_times(ctx, a, b, B, cut, links[i] if links else "native")
        worst, total = max(worst, f, bw), total + f + bw
        per.append(f + bw)
    return Wan(worst, total, tuple(per))
