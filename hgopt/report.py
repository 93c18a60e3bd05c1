"""Pictures of plans: a 1F1B pipeline timeline (``plot_timeline``) and a bar chart comparing planners
(``plot_comparison``). matplotlib is imported lazily with the Agg backend (no display needed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hgopt.cost import Evaluation, evaluate
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.spec import Instance

__all__ = ["Op", "plot_comparison", "plot_timeline", "simulate_1f1b"]

log = logging.getLogger(__name__)

_COLORS = {"F": "#4c72b0", "B": "#dd8452", "sendF": "#55a868", "sendB": "#c44e52", "sync": "#8c8c8c"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One box of the timeline: ``kind`` F/B (compute), sendF/sendB (a boundary transfer leaving
    ``stage``), or sync (gradient all-reduce + optimizer)."""

    pipeline: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


def _order_1f1b(S: int, m: int, s: int) -> list[tuple[str, int]]:
    """Operation order of stage ``s`` under 1F1B: warm-up forwards, alternate, drain backwards."""
    warm = min(S - s - 1, m)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    order += [("B", i) for i in range(b, m)]
    return order


def simulate_1f1b(
    fwd: Sequence[float], bwd: Sequence[float], send_f: Sequence[float], send_b: Sequence[float], m: int, pipeline: int = 0
) -> list[Op]:
    """Event-level 1F1B schedule of one pipeline from per-stage times: a stage runs one operation at
    a time in 1F1B order; F(s, i) waits for F(s−1, i) and its transfer, B(s, i) for B(s+1, i) and its
    transfer; each link direction carries one transfer at a time (first come, first served)."""
    S = len(fwd)
    orders = [_order_1f1b(S, m, s) for s in range(S)]
    arrive: dict[tuple[str, int, int], float] = {}  # (F|B, stage, mb) -> time its input is there
    link_free = {("F", s): 0.0 for s in range(S)} | {("B", s): 0.0 for s in range(S)}
    ptr, clock, ops = [0] * S, [0.0] * S, []
    while any(ptr[s] < len(orders[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            if ptr[s] >= len(orders[s]):
                continue
            kind, i = orders[s][ptr[s]]
            # stage 0's forwards need nothing; the last stage's backward follows its own forward,
            # which precedes it in the stage's order (so the stage clock covers it)
            first = (kind == "F" and s == 0) or (kind == "B" and s == S - 1)
            ready = 0.0 if first else arrive.get((kind, s, i))
            if ready is None:
                continue
            start = max(clock[s], ready)
            end = start + (fwd[s] if kind == "F" else bwd[s])
            ops.append(Op(pipeline=pipeline, stage=s, kind=kind, microbatch=i, start=start, end=end))
            clock[s], ptr[s], progressed = end, ptr[s] + 1, True
            nxt = s + 1 if kind == "F" else s - 1
            if 0 <= nxt < S:
                link = (kind, min(s, nxt))
                t0 = max(end, link_free[link])
                dur = send_f[s] if kind == "F" else send_b[nxt]
                link_free[link] = t0 + dur
                ops.append(Op(pipeline=pipeline, stage=min(s, nxt), kind="send" + kind, microbatch=i, start=t0, end=t0 + dur))
                arrive[(kind, nxt, i)] = t0 + dur
        assert progressed, "1F1B simulation deadlocked"
    return ops


def timeline_ops(plan: Plan, ev: Evaluation, pipelines: Sequence[int] | None = None) -> list[Op]:
    """The simulated schedule of the given pipelines (default: all) plus each of their stages' sync +
    optimizer, which starts after the slowest pipeline drains (as in [C7])."""
    keep = set(range(len(ev.pipelines)) if pipelines is None else pipelines)
    ops: list[Op] = []
    ends = []
    for pr in ev.pipelines:
        st = [s for s in ev.stages if s.pipeline == pr.index]
        sim = simulate_1f1b(
            [s.fwd_s for s in st], [s.bwd_s for s in st], [s.send_fwd_s for s in st], [s.send_bwd_s for s in st],
            pr.num_microbatches, pr.index,
        )
        ends.append(max(op.end for op in sim))
        if pr.index in keep:
            ops += sim
    end = max(ends)
    for s in ev.stages:
        if s.pipeline in keep:
            ops.append(Op(pipeline=s.pipeline, stage=s.stage, kind="sync", microbatch=-1, start=end,
                          end=end + s.sync_s + s.optimizer_s))
    return ops


_MAX_ROWS = 48


def plot_timeline(plan: Plan, instance: Instance, path: str | Path, tables: CostTables | None = None) -> Path:
    """Write a PNG of the plan's 1F1B timeline: one row per stage (forward, backward, the transfers
    it sends, then gradient sync + optimizer), and the iteration time ``evaluate`` predicts. Identical
    pipelines are drawn once (labelled ×k); at most 48 rows are drawn."""
    ev = evaluate(plan, instance, tables)
    if not ev.pipelines:
        raise ValueError(f"cannot draw an invalid plan: {'; '.join(ev.violations)}")
    first: dict[object, int] = {}
    copies: dict[int, int] = {}
    for i, p in enumerate(plan.pipelines):
        j = first.setdefault(p, i)
        copies[j] = copies.get(j, 0) + 1
    rows = [(s.pipeline, s.stage) for s in ev.stages if s.pipeline in copies][:_MAX_ROWS]
    ops = [op for op in timeline_ops(plan, ev, sorted(copies)) if (op.pipeline, op.stage) in set(rows)]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 2.2))
    y_of = {r: len(rows) - 1 - k for k, r in enumerate(rows)}
    for op in ops:
        y = y_of[(op.pipeline, op.stage)]
        lane = {"sendF": (y - 0.14, 0.18), "sendB": (y - 0.36, 0.18)}.get(op.kind, (y + 0.08, 0.55))
        ax.broken_barh([(op.start, max(op.end - op.start, 0.0))], lane, facecolors=_COLORS[op.kind],
                       edgecolor="white" if op.kind in ("F", "B") else "none", linewidth=0.3)
    ax.axvline(ev.iteration_time_s, color="black", linestyle="--", linewidth=1)
    by_key = {(s.pipeline, s.stage): s for s in ev.stages}
    ax.set_yticks([y_of[r] + 0.2 for r in rows])
    ax.set_yticklabels([f"p{p}{f' (x{copies[p]})' if copies[p] > 1 else ''}.s{s} {'/'.join(by_key[(p, s)].clusters)}"
                        for p, s in rows], fontsize=7)
    ax.set_xlabel("seconds (rows: compute; thin lanes below: activations sent on, gradients sent back)", fontsize=8)
    ax.set_title(
        f"{instance.name} — {plan.planner}: iteration {ev.iteration_time_s:.3f} s by evaluate (dashed), "
        f"simulated 1F1B ends {max(o.end for o in ops):.3f} s", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, ["forward", "backward", "send activations", "send gradients", "grad sync + optimizer"],
               loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0.0, 0.05, 1.0, 1.0))
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    log.info("timeline written to %s", out)
    return out


def plot_comparison(
    instance: str, rows: Sequence[tuple[str, float]], path: str | Path, *, ylabel: str = "throughput (samples/s)"
) -> Path:
    """Bar chart of one value per planner (``rows`` = (planner, value)), best bar highlighted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(rows) + 2), 3.6))
    names = [r[0] for r in rows]
    values = [r[1] for r in rows]
    top = max(values, default=0.0)
    bars = ax.bar(names, values, color=["#dd8452" if v == top and v > 0 else "#4c72b0" for v in values])
    for bar, v in zip(bars, values):
        ax.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{instance}: plans scored by evaluate", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
