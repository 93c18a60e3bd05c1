"""Pictures of plans: the timeline of one simulated step (``plot_timeline``, drawn from
:func:`hgopt.simulate.simulate`) and a bar chart comparing planners (``plot_comparison``). matplotlib
is imported lazily with the Agg backend (no display needed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hgopt.cost import build_tables, evaluate
from hgopt.cost.tables import CostTables
from hgopt.plan import Plan
from hgopt.simulate import Simulation, simulate
from hgopt.spec import Instance

__all__ = ["Op", "plot_comparison", "plot_timeline", "timeline_ops"]

log = logging.getLogger(__name__)

_COLORS = {"F": "#4c72b0", "B": "#dd8452", "sendF": "#55a868", "sendB": "#c44e52", "sync": "#8c8c8c",
           "optimizer": "#8172b2"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Op:
    """One box of the timeline: ``kind`` F/B (compute), sendF/sendB (a boundary transfer leaving
    ``stage``), sync (one gradient bucket's all-reduce) or optimizer."""

    pipeline: int
    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


def timeline_ops(plan: Plan, instance: Instance, pipelines: Sequence[int] | None = None,
                 tables: CostTables | None = None, sim: Simulation | None = None) -> list[Op]:
    """The simulated step (:func:`hgopt.simulate.simulate`) of the given pipelines (default: all) as
    timeline boxes: replica 0 of every stage (its compute, the transfers it sends, its gradient
    buckets and optimizer step)."""
    sim = sim or simulate(plan, instance, tables)
    keep = set(range(len(plan.pipelines)) if pipelines is None else pipelines)
    return [Op(pipeline=e.pipeline, stage=e.stage, kind=e.kind, microbatch=e.microbatch, start=e.start, end=e.end)
            for e in sim.events if e.pipeline in keep and e.replica == 0]


_MAX_ROWS = 48
_LANES = {"sendF": (-0.14, 0.18), "sendB": (-0.36, 0.18)}
"""Row offset and height of the thin transfer lanes; compute, sync and optimizer use (0.08, 0.55)."""


def plot_timeline(plan: Plan, instance: Instance, path: str | Path, tables: CostTables | None = None,
                  label: str | None = None) -> Path:
    """Write a PNG of one simulated step (:func:`hgopt.simulate.simulate`): one row per stage
    (replica 0: forwards, backwards, the transfers it sends, its gradient buckets and optimizer step),
    each labelled with its hardware (GPU@cluster tp×dp mbs) and the precision of the boundary below it;
    the title gives the iteration time by ``evaluate`` and by ``simulate`` (dashed and solid lines).
    ``label``: the planner (variant) to name, default the plan's ``planner``. Identical pipelines are
    drawn once (labelled ×k); at most 48 rows are drawn. Few artists: one ``broken_barh`` per kind
    and row, so plans of thousands of operations draw in about a second."""
    tables = tables or build_tables(instance)
    ev = evaluate(plan, instance, tables)
    if not ev.pipelines:
        raise ValueError(f"cannot draw an invalid plan: {'; '.join(ev.violations)}")
    sim = simulate(plan, instance, tables)
    first: dict[object, int] = {}
    copies: dict[int, int] = {}
    for i, p in enumerate(plan.pipelines):
        j = first.setdefault(p, i)
        copies[j] = copies.get(j, 0) + 1
    rows = [(pi, si) for pi in sorted(copies) for si in range(len(plan.pipelines[pi].stages))][:_MAX_ROWS]
    y_of = {r: len(rows) - 1 - k for k, r in enumerate(rows)}
    boxes: dict[tuple[tuple[int, int], str], list[tuple[float, float]]] = {}
    for op in timeline_ops(plan, instance, sorted(copies), tables, sim):
        if (op.pipeline, op.stage) in y_of:
            boxes.setdefault(((op.pipeline, op.stage), op.kind), []).append((op.start, max(op.end - op.start, 0.0)))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 2.2))
    for (row, kind), spans in boxes.items():
        dy, h = _LANES.get(kind, (0.08, 0.55))
        ax.broken_barh(spans, (y_of[row] + dy, h), facecolors=_COLORS[kind], edgecolor="none")
    ax.axvline(ev.iteration_time_s, color="black", linestyle="--", linewidth=1)
    ax.axvline(sim.iteration_time_s, color="black", linestyle="-", linewidth=1)
    ax.set_yticks([y_of[r] + 0.2 for r in rows])
    ax.set_yticklabels([_row_label(plan, instance, p, s, copies[p]) for p, s in rows], fontsize=7)
    ax.set_xlabel("seconds (rows: replica 0 of each stage; thin lanes below: activations sent on, gradients "
                  "sent back; dashed: evaluate, solid: simulate)", fontsize=8)
    name = label or plan.planner
    ax.set_title(
        f"{instance.name} — {name}: iteration {ev.iteration_time_s:.3f} s by evaluate, "
        f"{sim.iteration_time_s:.3f} s by simulate ({sim.iteration_time_s / ev.iteration_time_s:.2f}×)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, ["forward", "backward", "send activations", "send gradients", "grad sync bucket", "optimizer"],
               loc="lower center", ncol=6, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0.0, 0.05, 1.0, 1.0))
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    log.info("timeline written to %s", out)
    return out


def _row_label(plan: Plan, instance: Instance, pi: int, si: int, copies: int) -> str:
    """``p0 (x2).s1 A100@c tp1×dp8 mbs1 ↓bf16/fp8``: the stage's replica groups and, when it is not
    native, the precision (forward/backward) of its boundary to the next stage."""
    pipe = plan.pipelines[pi]
    stage = pipe.stages[si]
    hw = " + ".join(f"{_where(instance, g.cluster)} tp{g.tp}×dp{g.dp} mbs{g.mbs}" for g in stage.groups)
    text = f"p{pi}{f' (x{copies})' if copies > 1 else ''}.s{si} {hw}"
    if si + 1 < len(pipe.stages):
        b = pipe.boundary(si)
        if (b.fwd, b.bwd) != ("native", "native"):
            text += f" ↓{b.fwd}/{b.bwd}"
    return text


def _where(instance: Instance, cluster: str) -> str:
    gpu = instance.topology.cluster(cluster).gpu
    return cluster if gpu in cluster else f"{gpu}@{cluster}"


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
