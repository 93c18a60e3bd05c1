"""[H8] Global re-partition: keep a plan's stage hardware (per stage its cluster, tp, dp, mbs and
ZeRO setting, in pipeline order, the k identical pipelines and the boundary precisions) and choose the
layer range of every stage at once, across cluster boundaries.

The heuristic splits layers between clusters first and inside each cluster second; a split that is
balanced cluster by cluster can still be unbalanced along the whole pipeline (e.g. a fast cluster's
five stages of 4 layers feeding a slow cluster's seven stages of 1 layer, where 3+3+3+3+4 | 2+2+2+1+1+1+1
is faster). With the hardware fixed the problem is a chain partition: for a cap X on the steady-state
stage term, a dynamic programme over (stage, layer) minimises the fill Σ_s (t_s + c^f_s + c^b_s) subject
to max(t_s, c^f_s, c^b_s) ≤ X, each stage's memory [C6] and, optionally, a cap on its gradient
sync + optimizer time. Every cap from the smallest feasible one up to the current plan's bottleneck is
a candidate; each resulting plan is scored by ``evaluate`` and the best is kept. The DP's objective is
[C3]/[C7] without the 1F1B round-trip term, which ``evaluate`` adds when it scores the candidates.

Formulas are those of ``evaluate`` ([C2] compute, [C4]/[C4w]/[C4q] boundaries via
``stage_boundary_time``, [C5] intra-cluster ring over the k·dp replicas, [C6] memory); see
``formulations/hierarchical.md`` [H8].
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from hgopt.cost import evaluate
from hgopt.cost.evaluate import stage_boundary_time
from hgopt.cost.pipeline import ROUND_TRIP_WINDOWS, in_flight, stage_pace, trip_depth
from hgopt.cost.tables import CostTables
from hgopt.plan import Pipeline, Plan, Stage
from hgopt.search.intra import LocalConfig, StageModel
from hgopt.spec import Instance

__all__ = ["RepartitionResult", "repartition"]

log = logging.getLogger(__name__)
INF = math.inf
_CAPS = 24
"""Bottleneck caps tried between the smallest feasible one and the current plan's bottleneck."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RepartitionResult:
    plan: Plan
    iteration_time_s: float
    candidates: int
    """Distinct partitions scored by ``evaluate``."""


@dataclass(frozen=True, slots=True)
class _StageCosts:
    """Per stage, arrays over (a, b) = layers [a, b): fill term t, steady term x, tail (sync + opt);
    entries that do not fit in memory are inf in all three."""

    fill: np.ndarray
    steady: np.ndarray
    tail: np.ndarray
    comp: np.ndarray
    """fwd + bwd alone (a window's last stage contributes no send [C3])."""


def repartition(plan: Plan, instance: Instance, tables: CostTables) -> RepartitionResult | None:
    """The best re-partition of ``plan``'s layers over its stages by ``evaluate`` (None when the plan
    is not k identical pipelines of one-group stages, or nothing feasible is found). The returned
    plan may equal the input."""
    pipes = plan.pipelines
    if not pipes or any(p != pipes[0] for p in pipes) or any(len(s.groups) != 1 for s in pipes[0].stages):
        return None
    pipe, k = pipes[0], len(pipes)
    S, L = len(pipe.stages), tables.num_layers
    if S < 2:
        return None
    costs = [_stage_costs(instance, tables, pipe, s, k) for s in range(S)]
    base = evaluate(plan, instance, tables)
    best_t = base.iteration_time_s if base.feasible else INF
    best_plan, seen = plan, {_bounds(pipe)}
    cur_steady = max(stage_pace(r.fwd_s + r.bwd_s, r.send_fwd_s, r.send_bwd_s) for r in base.stages) if base.feasible else INF
    cur_tail = max(r.sync_s + r.optimizer_s for r in base.stages) if base.feasible else INF
    m = None if pipe.schedule == "gpipe" else pipe.num_microbatches
    caps = _caps(costs, L, max(cur_steady, _round_trip(base)), m)
    for tail_cap in (INF, cur_tail):
        for cap in caps:
            bounds = _min_fill(costs, L, cap, tail_cap, m)
            if bounds is None or bounds in seen:
                continue
            seen.add(bounds)
            cand = _with_bounds(plan, pipe, bounds)
            ev = evaluate(cand, instance, tables)
            if ev.feasible and ev.iteration_time_s < best_t - 1e-12:
                best_t, best_plan = ev.iteration_time_s, cand
    if not math.isfinite(best_t):
        return None
    log.debug("repartition: %d candidates, %.4g s -> %.4g s", len(seen) - 1, base.iteration_time_s, best_t)
    return RepartitionResult(plan=best_plan, iteration_time_s=best_t, candidates=len(seen) - 1)


def _bounds(pipe: Pipeline) -> tuple[int, ...]:
    return tuple(s.end for s in pipe.stages)


def _with_bounds(plan: Plan, pipe: Pipeline, ends: tuple[int, ...]) -> Plan:
    starts = (0, *ends[:-1])
    stages = tuple(Stage(start=a, end=b, groups=s.groups, zero=s.zero, recompute=s.recompute)
                   for s, a, b in zip(pipe.stages, starts, ends))
    new = Pipeline(stages=stages, num_microbatches=pipe.num_microbatches, boundaries=pipe.boundaries,
                   schedule=pipe.schedule)
    return Plan(pipelines=(new,) * len(plan.pipelines), planner=plan.planner, instance=plan.instance,
                grad_sync_precision=plan.grad_sync_precision, meta=plan.meta)


def _stage_costs(inst: Instance, tables: CostTables, pipe: Pipeline, s: int, k: int) -> _StageCosts:
    """Cost arrays of stage ``s``'s hardware over every layer range, as ``evaluate`` computes them."""
    st = pipe.stages[s]
    g = st.groups[0]
    c = inst.topology.cluster(g.cluster)
    sm = StageModel(inst, tables, c, LocalConfig(tp=g.tp, dp=g.dp, mbs=g.mbs, recompute=st.recompute == "full"), k)
    L = tables.num_layers
    lo, hi = np.triu_indices(L + 1, k=1)  # every [a, b) with a < b
    comp = sm.compute(lo, hi)
    send_f, send_b = _sends(inst, tables, pipe, s, k, hi)
    depth = in_flight(len(pipe.stages), s, pipe.num_microbatches, pipe.schedule)
    # one group per stage: evaluate's ZeRO shards (the stage's replicas) are the group's dp
    tail = sm.sync_opt(lo, hi, zero=bool(st.zero))
    ok = sm.memory(lo, hi, depth, zero=bool(st.zero)) <= c.gpu_memory_bytes
    full = lambda v: _square(L, lo, hi, np.where(ok, v, INF))  # noqa: E731
    return _StageCosts(fill=full(comp + send_f + send_b), steady=full(stage_pace(comp, send_f, send_b)),
                       tail=full(tail), comp=full(comp))


def _square(L: int, lo: np.ndarray, hi: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.full((L + 1, L + 1), INF)
    out[lo, hi] = v
    return out


def _sends(inst: Instance, tables: CostTables, pipe: Pipeline, s: int, k: int, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) boundary seconds after stage ``s`` for each end layer in ``hi`` (0 for the
    last stage): ``stage_boundary_time`` on a two-stage pipeline of this stage's and the next stage's
    hardware, as one of k identical pipelines; computed once per distinct activation size."""
    if s + 1 >= len(pipe.stages):
        z = np.zeros(len(hi))
        return z, z
    a, b = pipe.stages[s], pipe.stages[s + 1]
    per = tables.activation_bytes[hi - 1]
    uniq, inv = np.unique(per, return_inverse=True)
    out_f, out_b = np.empty(len(uniq)), np.empty(len(uniq))
    L = tables.num_layers
    for j, v in enumerate(uniq):
        cut = int(hi[np.argmax(per == v)])
        if cut >= L:  # the last layer cannot end a non-final stage; its entries are never used
            out_f[j] = out_b[j] = INF
            continue
        two = Pipeline(stages=(Stage(start=0, end=cut, groups=a.groups, zero=a.zero, recompute=a.recompute),
                               Stage(start=cut, end=L, groups=b.groups, zero=b.zero, recompute=b.recompute)),
                       num_microbatches=pipe.num_microbatches, boundaries=(pipe.boundary(s),), schedule=pipe.schedule)
        out_f[j], out_b[j] = stage_boundary_time(inst, tables, two, 0, copies=k)
    return out_f[inv], out_b[inv]


def _round_trip(ev: object) -> float:
    """The steady-state pace of the (first) pipeline of an evaluation (bottleneck incl. the round trip)."""
    pipes = getattr(ev, "pipelines", ())
    return max((p.bottleneck_s for p in pipes), default=0.0)


def _caps(costs: list[_StageCosts], L: int, current: float, m: int | None) -> list[float]:
    """Pace caps to try: the smallest feasible one X* (binary search over the distinct stage values,
    then bisection below the first feasible value, since a round-trip limit R_s / min(S − s, m) is not
    a stage value), up to ``_CAPS`` stage values between X* and the current pace, and a geometric
    grid over the same interval."""
    vals = np.unique(np.concatenate([c.steady[np.isfinite(c.steady)] for c in costs]))
    if len(vals) == 0:
        return []
    top_cap = max(float(vals[-1]), current) * (1 + 1e-9)
    if _min_fill(costs, L, top_cap, INF, m) is None:
        return []
    vals = np.unique(np.append(vals[vals <= top_cap], top_cap))
    lo, hi = 0, len(vals) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_fill(costs, L, float(vals[mid]), INF, m) is None:
            lo = mid + 1
        else:
            hi = mid
    x_hi = float(vals[lo])
    x_lo = float(vals[lo - 1]) if lo > 0 else 0.0
    for _ in range(10):  # the least feasible pace lies in (x_lo, x_hi]
        mid = 0.5 * (x_lo + x_hi)
        if _min_fill(costs, L, mid, INF, m) is None:
            x_lo = mid
        else:
            x_hi = mid
    upper = max(current, x_hi)
    inner = vals[(vals > x_hi) & (vals <= upper)]
    if len(inner) > _CAPS:
        inner = inner[np.unique(np.linspace(0, len(inner) - 1, _CAPS).round().astype(int))]
    grid = x_hi * (upper / x_hi) ** (np.arange(1, 9) / 8) if x_hi > 0 else np.array([])
    return sorted({x_hi, *map(float, inner), *map(float, grid)})


def _min_fill(costs: list[_StageCosts], L: int, cap: float, tail_cap: float, m: int | None = None) -> tuple[int, ...] | None:
    """Stage end layers minimising R_0 = Σ fill subject to steady ≤ cap, tail ≤ tail_cap and, with
    ``m`` (1F1B), the round-trip limit of [C3] for every window the kernel prices
    (``pipeline.ROUND_TRIP_WINDOWS``). The suffix windows alone are exact in a one-dimensional DP
    (:func:`_min_fill_suffix`); when its answer breaks a window that ends before the last stage, a
    Pareto DP over (R_s, H_s) (:func:`_min_fill_windows`) finds the exact answer."""
    ends = _min_fill_suffix(costs, L, cap, tail_cap, m)
    if ends is None or m is None or ROUND_TRIP_WINDOWS == "suffix" or _windows_ok(costs, ends, cap):
        return ends
    return _min_fill_windows(costs, L, cap, tail_cap, m)


def _windows_ok(costs: list[_StageCosts], ends: tuple[int, ...], cap: float) -> bool:
    """Every window s..j within cap·(j − s + 1) (the m cap of longer windows is implied by the
    suffix limit R_s ≤ cap·min(S − s, m), as W(s, j) ≤ R_s)."""
    starts = (0, *ends[:-1])
    t = [float(c.comp[a, b]) for c, a, b in zip(costs, starts, ends)]
    sends = [float(c.fill[a, b]) - x for c, a, b, x in zip(costs, starts, ends, t)]
    for s in range(len(t)):
        w = 0.0
        for j in range(s, len(t)):
            w += t[j] + (sends[j - 1] if j > s else 0.0)
            if w > cap * (j - s + 1) * (1 + 1e-12):
                return False
    return True


def _min_fill_windows(costs: list[_StageCosts], L: int, cap: float, tail_cap: float, m: int) -> tuple[int, ...] | None:
    """Exact [H8] DP with every window: backwards over the stages, for each (stage s, first layer a)
    the Pareto set of (R_s, H_s), R_s the suffix fill and H_s = max_j (W(s, j) − cap·(j − s + 1)) the
    worst window from s (H_s = max(t_s − cap, t_s + c_s − cap + H_{s+1})); a window constraint is
    H_s ≤ 0, the suffix cap R_s ≤ cap·min(S − s, m); both grow with (R_{s+1}, H_{s+1}), so the
    dominated points can be dropped."""
    S = len(costs)
    tol = 1e-12
    # front[a] = list of (R, H, end layer, index in the next front), R ascending, H descending
    nxt: dict[int, list[tuple[float, float, int, int]]] = {L: [(0.0, -INF, L, -1)]}
    fronts = []
    for s in range(S - 1, -1, -1):
        c = costs[s]
        ok = (c.steady <= cap) & (c.tail <= tail_cap) & np.isfinite(c.fill)
        limit = cap * trip_depth(S - s, m) * (1 + tol)
        h_cap = cap * tol
        cur: dict[int, list[tuple[float, float, int, int]]] = {}
        for a in range(L):
            cands = []
            for b, front in nxt.items():
                if b <= a or not ok[a, b]:
                    continue
                f = float(c.fill[a, b])
                fc, tc = f - cap, float(c.comp[a, b]) - cap
                for i, (r, h, _, _) in enumerate(front):
                    rr, y = f + r, fc + h
                    hh = y if y > tc else tc  # max(t - cap, f - cap + h), its tie and NaN rule
                    if rr <= limit and hh <= h_cap:
                        cands.append((rr, hh, b, i))
            if cands:
                cands.sort()
                kept, h_min = [], INF
                for cand in cands:
                    if cand[1] < h_min:
                        kept.append(cand)
                        h_min = cand[1]
                cur[a] = kept
        fronts.append(cur)
        nxt = cur
    if 0 not in nxt:
        return None
    ends, a, i = [], 0, 0
    for front in reversed(fronts):
        _, _, b, i = front[a][i]
        ends.append(b)
        a = b
    return tuple(ends)


def _min_fill_suffix(costs: list[_StageCosts], L: int, cap: float, tail_cap: float, m: int | None = None) -> tuple[int, ...] | None:
    """Stage end layers minimising the round trip R_0 = Σ fill subject to steady ≤ cap, tail ≤
    tail_cap and, with ``m`` (1F1B), the round-trip limit R_s ≤ cap · min(S − s, m) of [C3] for every
    stage s (None: no split qualifies). Backwards over the stages: for each (stage, first layer) the
    least suffix sum R_s is kept; every constraint bounds a suffix sum from above, so the least one
    dominates and the DP is exact."""
    S = len(costs)
    best = np.full(L + 1, INF)
    best[L] = 0.0
    choice = []
    for s in range(S - 1, -1, -1):
        c = costs[s]
        mat = np.where((c.steady <= cap) & (c.tail <= tail_cap), c.fill, INF)
        tot = mat + best[None, :]
        arg = np.argmin(tot, axis=1)
        best = tot[np.arange(L + 1), arg]
        if m is not None:
            best = np.where(best <= cap * trip_depth(S - s, m) * (1 + 1e-12), best, INF)
        choice.append(arg)
    if not math.isfinite(best[0]):
        return None
    ends, a = [], 0
    for arg in reversed(choice):
        a = int(arg[a])
        ends.append(a)
    return tuple(ends)
