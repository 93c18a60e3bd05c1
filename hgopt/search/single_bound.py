"""[R0] under the exact timeline: a lower bound on every one-cluster plan of a batch split, stage count
by stage count (formulations/cluster_milp.md "Against the exact timeline", [R0s]).

A one-cluster plan of S stages hides at most min(S − 1, m − 1) warm-up forwards of any stage under
microbatch 0's trip, so the replay-valid weight of its largest piece is ``pipeline.bound_weight(m, S, ρ)``
at its own S, not at the split's most stages S̄ (which the cheap bound [B4] must assume). For each
cluster, layout and S, the intra DP's exact partition search [I4] (``intra.solve_trunk``) with that
weight gives the least w_S·B + R_0 + U of the plans of S stages; blended with the busy chain m·B' + U
(``pipeline.busy_blend_weight`` / ``busy_blend_bound``, several shares) it bounds them. The least over
S, layouts and clusters bounds every one-cluster plan of the split. Ranges that are not trunk-shaped
(no [I4]) take [I5]'s Pareto points per stage count (``intra.generic_stage_points``), exact for any
weight.
"""

from __future__ import annotations

import math
import numpy as np

from hgopt.cost.compute import forward_share_of
from hgopt.cost.pipeline import (BUSY_SHARES, bound_offset, bound_weight, busy_blend_bound, busy_blend_weight,
                                 stage_fill, weighted_time)
from hgopt.cost.tables import CostTables
from hgopt.search.intra import (StageModel, TrunkCosts, TrunkGeometry, generic_stage_points, layer_classes,
                                local_configs, solve_trunk)
from hgopt.spec import Instance

__all__ = ["single_cluster_replay_bound"]

INF = math.inf


def single_cluster_replay_bound(instance: Instance, tables: CostTables, *, replicas: int, microbatch: int,
                                num_microbatches: int, tail_floor: float, target: float = INF) -> float:
    """[R0s] A lower bound of the exact timeline (``evaluate`` under the replay) of every plan of the split
    (``replicas`` identical pipelines of ``microbatch`` samples, ``num_microbatches``) that runs on one
    cluster. ``tail_floor``: a floor of every plan's first-stage tail (``CheapBounds.s_lb``). Layouts are
    visited in order of a quick floor (a stage's m microbatches back to back, at least the mean of the
    layers' compute over the most stages; one microbatch's trip, at least all of it) and skipped once
    that floor reaches the bound so far or ``target`` (then the floor stands for them: the result is
    still a bound, and it reaches ``target`` whenever the full search would)."""
    m = num_microbatches
    rho, excess = forward_share_of(tables, microbatch)
    L = instance.model.num_layers
    todo = []
    for c in instance.topology.clusters:
        budget = c.num_gpus // replicas
        for idx, cfg in enumerate(local_configs(instance, c.name, microbatch, tables)):
            if cfg.gpus > budget:
                continue
            sm = StageModel(instance, tables, c, cfg, replicas)
            s_max = min(budget // cfg.gpus, L)
            work = float(sm.compute(np.array([0]), np.array([L]))[0])
            todo.append((max(m * work / s_max, work) + tail_floor, c.name, idx, c, cfg, sm, s_max))
    todo.sort(key=lambda x: x[:3])
    best = INF
    for floor, _, _, c, cfg, sm, s_max in todo:
        if floor >= min(best, target):
            best = min(best, floor)
            break  # every later layout's floor is at least this one
        lat = c.inter_node.latency_s  # every intra-cluster send's latency part (evaluate.boundary_latency)
        classes = tables.layer_classes or layer_classes(instance)
        if cfg.recompute:  # [C6r] layer 0 keeps token ids: its own class (as intra._search_range)
            classes = (-1, *classes[1:])
        geo = TrunkGeometry.for_range(classes, 0, L)
        if geo is None:
            comp, pts = generic_stage_points(sm, 0, L, s_max, 0, m)
            for s, ps in enumerate(pts, start=1):
                best = min(best, _points_bound(comp, ps, s, m, rho, excess, lat if s > 1 else 0.0, tail_floor))
            continue
        tc = TrunkCosts(sm, geo, geo.trunk)
        for s in range(1, s_max + 1):
            best = min(best, _stage_count_bound(tc, s, m, rho, excess, lat if s > 1 else 0.0, tail_floor))
    return best


def _points_bound(comp: float, points: list[tuple[float, float, float]], s: int, m: int, rho: float,
                  excess: float, latency: float, tail_floor: float) -> float:
    """As :func:`_stage_count_bound` over [I5]'s Pareto points (T, U, sends) of the plans of ``s`` stages."""
    if not points:
        return INF
    w, off = bound_weight(m, s, rho), bound_offset(m, s, excess)
    t, u, sd = (np.array(x) for x in zip(*points))
    fill = stage_fill(comp, sd, sd)
    out = -INF
    for share in BUSY_SHARES:
        w2 = busy_blend_weight(w, m, share)
        out = max(out, busy_blend_bound(float(np.min(weighted_time(w2, t, fill) + u)), share, w2, latency, off,
                                        tail_floor))
    return out


def _stage_count_bound(tc: TrunkCosts, s: int, m: int, rho: float, excess: float, latency: float,
                       tail_floor: float) -> float:
    """The bound of every plan of ``s`` stages of one layout: the largest over the busy shares."""
    w, off = bound_weight(m, s, rho), bound_offset(m, s, excess)
    out = -INF
    ns = np.array([tc.geo.trunk])
    for share in BUSY_SHARES:
        w2 = busy_blend_weight(w, m, share)
        sol = solve_trunk(tc, s, 0, m, ns, weight=w2)
        if sol is None or not sol.feasible[0]:
            return INF  # no plan of s stages of this layout fits (memory does not depend on the weight)
        out = max(out, busy_blend_bound(float(sol.value[0]), share, w2, latency, off, tail_floor))
    return out
