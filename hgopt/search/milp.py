"""The exact planner: a cluster-level MILP over intra-cluster block options, one model per batch
split, with a certified lower bound on the iteration time.

Plan space (what "optimal" and "gap" refer to; formulations/cluster_milp.md):
k identical pipelines, each a chain of distinct clusters; each cluster of the chain hosts one
contiguous block of layers as a local pipeline of identical (tp, dp, mbs) stages with ZeRO-1 (the
block options of hgopt.search.blocks); microbatch B and m = global_batch / (k·B) microbatches per
pipeline; inter-cluster boundaries at a (forward, backward) precision pair the link policy allows
(native unless ``link_precision`` says otherwise), boundaries inside a cluster native. Labels
[M1]..[M19] refer to the formulation document.
"""

from __future__ import annotations

import logging
import math
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from hgopt.cost import build_tables, evaluate
from hgopt.cost.compute import stage_compute_v
import hgopt.cost.pipeline as _pipeline
from hgopt.cost.pipeline import (ROUND_TRIP_WINDOWS, Composition, search_composition, search_windows,
                                 stages_that_matter)
from hgopt.cost.tables import CostTables
from hgopt.plan import Boundary, Pipeline, Plan, Stage
from hgopt.search import PlanOptions, PlanResult, link_penalties
from hgopt.search.blocks import (
    NATIVE_PAIR,
    FLOOR_MAX_CLUSTERS,
    ArcPrecision,
    ArcTable,
    BlockOption,
    CheapBounds,
    LinkPolicy,
    OutOfTime,
    Window,
    arc_precisions,
    arc_table,
    block_options,
    cheap_bounds,
    model_shape,
)
from hgopt.search.polish import polish
from hgopt.search.precisions import allowed_link_precisions
from hgopt.search.work import (WorkMeter, block_options_work, cheap_bound_work, milp_root_work, milp_work, node_limit,
                               relaxation_work)
from hgopt.solvers import SolveOptions, SolveResult, solve
from hgopt.solvers.model import LinearModel
from hgopt.spec import Instance

__all__ = ["PLAN_SPACE", "BatchSplit", "Formulation", "LinkVar", "OutsideCheck", "SplitOutcome", "WarmStart",
           "batch_splits", "build_milp", "decode", "estimated_nonzeros", "intra_latency", "link_policy",
           "milp_composition", "plan_hint", "plan_milp",
           "plan_space", "solve_split", "work_lower_bound"]

log = logging.getLogger(__name__)

PLAN_SPACE = (
    "k identical pipelines; each a chain of distinct clusters, one contiguous layer block per cluster run as "
    "uniform (tp, dp, mbs) local stages with ZeRO-1; cluster boundaries between identical layers; native "
    "link precision; microbatch B and m = global_batch/(k*B) enumerated"
)
WarmStart = Callable[[Instance, CostTables, float], "Plan | None"]
"""(instance, tables, seconds) -> a plan of this planner's space under the run's link policy (or None):
the first incumbent. Injected by the caller (``hgopt.search.exact``: the heuristic's), so that this
module does not import another planner."""
OutsideCheck = Callable[[Instance, CostTables, float, float], "tuple[float, str] | None"]
"""(instance, tables, iteration time of the best plan, seconds) -> (iteration time, description) of a
faster plan outside this plan space, or None. Injected like ``WarmStart``."""
OPENING = 0.2
"""Share of the time limit the cheap bounds of the splits may take before the warm start (twice it in all)."""
RELAX_SHARE = 0.75
"""gaps2: share of the time limit (from the start) until which the relaxation phase bounds the weakest
split next, before the MILPs (was 0.5): on the five-zone instances a split's MILP rarely lifts the
global bound (it is the weakest split's), its relaxation does, and a relaxation is cheap since the
best-first refinement; every split's MILP still follows in the order of the bounds."""
OUTSIDE_MIN_S = 0.5
"""Seconds that must be left for the outside-space check to run."""
MAX_NONZEROS = 5_000_000
"""The size guard: a MILP estimated above this many nonzeros is not built (some 2 GB with the
model's Python rows, its MathOpt proto and the solver's copy)."""
LOAD_S_PER_NONZERO = 2e-5
"""Seconds per nonzero to build, convert and load a MILP (12 µs measured for build + proto on a loaded
2-core machine, sailor-het-32+96): a MILP is built only when the time left covers its estimate."""
WIDEN = 1.6
"""Factor by which the bottleneck cap grows when the cap, not the MILP, limits the bound."""
WARM_START_CHARGE = 0.5
"""determinism: the work (share of its seconds) charged for the warm start, whose own limit is in work units
(``exact.warm_start_work``): a fixed charge, so that the phases after it start at the same point of the budget."""
POLISH_WITHIN = 1.02
"""gaps3: a split's plan is polished (``_polished``) when it is within this factor of the incumbent."""


def plan_space(links: LinkPolicy) -> str:
    """The one-line plan space for a link policy (PLAN_SPACE for native links)."""
    if not links.compresses:
        return PLAN_SPACE
    precs = list(dict.fromkeys(p for pair in links.pairs for p in pair))
    each = set(links.pairs) == {(f, b) for f in precs for b in precs} and len(precs) > 1
    allowed = (", ".join(precs) + "} per direction") if each else \
        (", ".join(f"{f}/{b}" if f != b else f for f, b in links.pairs) + "}")
    cap = "" if links.max_compressed is None else f", at most {links.max_compressed} compressed per pipeline"
    return PLAN_SPACE.replace("native link precision", f"inter-cluster boundaries in {{{allowed}{cap}, "
                                                        "boundaries inside a cluster native")


def link_policy(instance: Instance, extra: object) -> LinkPolicy:
    """The link policy of ``PlanOptions.extra`` (``link_precision``, ``max_compressed_links``,
    ``link_penalty``): the precisions of ``allowed_link_precisions`` (as the heuristic reads them),
    each direction of a boundary chosen independently under ``auto``; a fixed precision on every
    inter-cluster boundary, or native where ``max_compressed_links`` leaves a boundary uncompressed."""
    ex = dict(extra)  # type: ignore[call-overload]
    policy = ex.get("link_precision", "native") or "native"
    raw = ex.get("max_compressed_links")
    try:
        cap = None if raw in (None, "") else int(raw)
    except ValueError:
        raise ValueError(f"--max-compressed-links: expected an integer, got {raw!r}") from None
    if cap is not None and cap < 0:
        raise ValueError(f"--max-compressed-links: must be >= 0, got {cap}")
    allowed = allowed_link_precisions(instance, policy)
    pairs = [(f, b) for f in allowed for b in allowed] if policy == "auto" else [(p, p) for p in allowed]
    if cap == 0:
        pairs = [NATIVE_PAIR]
    elif cap is not None and NATIVE_PAIR not in pairs:
        pairs.insert(0, NATIVE_PAIR)  # boundaries beyond the cap stay native
    pen = {k: v for k, v in link_penalties(ex).items() if v > 0}
    return LinkPolicy(pairs=tuple(pairs), max_compressed=cap, penalty_s=tuple(sorted(pen.items())))


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSplit:
    """k pipelines, each with ``num_microbatches`` microbatches of ``microbatch`` samples."""

    k: int
    microbatch: int
    num_microbatches: int

    def __str__(self) -> str:
        return f"k={self.k} B={self.microbatch} m={self.num_microbatches}"


def batch_splits(instance: Instance) -> list[BatchSplit]:
    """Every (k, B, m) with k·B·m = global batch and k at most the number of GPUs (k, then B
    ascending), from the divisors of the global batch (O(√batch) work, not O(batch))."""
    g = instance.job.global_batch
    kmax = instance.topology.num_gpus()
    divs = _divisors(g)
    out = []
    for k in divs:
        if k > kmax:
            break
        per = g // k
        out.extend(BatchSplit(k=k, microbatch=b, num_microbatches=per // b) for b in divs if b <= per and per % b == 0)
    return out


def _divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Formulation:
    """The MILP of one split and what is needed to turn a solution back into a plan."""

    split: BatchSplit
    model: LinearModel
    y: dict[int, BlockOption] = field(default_factory=dict)
    z: dict[tuple[str, str], int] = field(default_factory=dict)
    wan: dict[tuple[str, str], float] = field(default_factory=dict)
    """Pace of a hand-over: the slower of its two directions [C4w] (the slowest allowed precision
    at the largest microbatch size: the big-M data)."""
    wan_fill: dict[tuple[str, str], float] = field(default_factory=dict)
    """Fill of a hand-over: both directions [C4w] (as ``wan``, the largest)."""
    links: dict[tuple[str, str], tuple[LinkVar, ...]] = field(default_factory=dict)
    """Per arc, one variable per allowed precision pair [M17] (z itself when there is one)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkVar:
    """Arc a→b at one precision pair: binary ``z`` and, when compressed, ``mu`` >= min(mbs_a, mbs_b)
    when z = 1 [M19] (the samples of the largest block cast by one replica [C4q])."""

    z: int
    mu: int | None
    arc: ArcPrecision

    def fill_terms(self) -> dict[int, float]:
        """The hand-over's fill (both directions, casts included) as linear terms."""
        out = {self.z: self.arc.fwd + self.arc.bwd}
        if self.mu is not None:
            out[self.mu] = self.arc.q_fwd + self.arc.q_bwd
        return out


def _add_terms(row: dict[int, float], terms: dict[int, float], scale: float = 1.0) -> dict[int, float]:
    for j, v in terms.items():
        row[j] = row.get(j, 0.0) + scale * v
    return row


def build_milp(
    instance: Instance, tables: CostTables, split: BatchSplit, options: dict[tuple[str, str, int], list[BlockOption]],
    bounds: CheapBounds, links: LinkPolicy | None = None, arcs: ArcTable | None = None, stage_term: bool = False,
) -> Formulation:
    """data -> variables -> constraints [M1]..[M19] -> objective (formulations/cluster_milp.md).
    With native links only (the default policy) the model is the one of §3, row for row. ``arcs``:
    the split's ``arc_table`` (with the layout floor [M8f]); computed here without it when omitted.
    ``stage_term``: under the replay, add the composition's stage term [C3b] (only valid when the
    options were generated with ``Window.per_stage`` = its β, as ``solve_split`` does)."""
    arcs_in = arcs
    pol = links or LinkPolicy()
    shape = model_shape(instance)
    names = [c.name for c in instance.topology.clusters]
    lm = LinearModel(name=f"hgopt_{instance.name}_{split.k}x{split.microbatch}x{split.num_microbatches}")
    form = Formulation(split=split, model=lm)
    by_cluster: dict[str, list[int]] = {c: [] for c in names}
    # variables: y[c,role,n,o] one binary per block option
    for (c, role, n), opts in sorted(options.items()):
        for i, o in enumerate(opts):
            j = lm.add_binary(f"y[{c},{role},{n},{i}]")
            form.y[j] = o
            by_cluster[c].append(j)
    ys = form.y
    mu_max = float(max((o.cfg.mbs for o in ys.values()), default=1))
    hands = {c for c in names if any(form.y[j].role in ("first", "middle") for j in by_cluster[c])}
    takes = {c for c in names if any(form.y[j].role in ("middle", "end") for j in by_cluster[c])}
    # variables: z[c,c'] cluster c hands its last activations to c'; per precision pair z[c,c',π] [M17]
    for a in names:
        for b in names:
            if a != b and a in hands and b in takes:
                z = form.z[(a, b)] = lm.add_binary(f"z[{a},{b}]")
                arcs = arcs_in[(a, b)] if arcs_in is not None else \
                    arc_precisions(instance, tables, a, b, split.microbatch, split.k, pol, shape)
                lv = []
                for e in arcs:
                    tag = f"{e.pair[0]}/{e.pair[1]}"
                    ze = z if len(arcs) == 1 else lm.add_binary(f"z[{a},{b},{tag}]")
                    mu = lm.add_var(f"mu[{a},{b},{tag}]", lb=0.0, ub=mu_max) if e.compressed else None
                    lv.append(LinkVar(z=ze, mu=mu, arc=e))
                form.links[(a, b)] = tuple(lv)
                form.wan[(a, b)] = max(e.pace(mu_max) for e in arcs)
                form.wan_fill[(a, b)] = max(e.fill(mu_max) for e in arcs)
                if len(arcs) > 1:  # [M17] an arc in use carries exactly one precision pair
                    lm.add_row(f"M17_precision[{a},{b}]", {z: -1.0, **{v.z: 1.0 for v in lv}}, 0.0, 0.0)
    t = lm.add_var("T", lb=bounds.t_lb, kind="time")
    u = lm.add_var("U", lb=bounds.s_lb, kind="time")
    w_max = float(sum(max((form.y[j].s for j in js), default=0) for js in by_cluster.values()))
    w = {c: lm.add_var(f"W[{c}]", lb=0.0, ub=w_max) for c in names}
    start = {j: 1.0 for j in ys if ys[j].role in ("first", "only")}
    end = {j: 1.0 for j in ys if ys[j].role in ("end", "only")}
    lm.add_row("M2_start", start, 1.0, 1.0)  # [M2] one block starts the pipeline
    lm.add_row("M3_end", end, 1.0, 1.0)  # [M3] one block ends it
    lm.add_row("M4_cover", {j: float(ys[j].n) for j in ys}, shape.trunk, shape.trunk)  # [M4] trunk layers covered
    for c in names:
        js = by_cluster[c]
        lm.add_row(f"M1_once[{c}]", {j: 1.0 for j in js}, ub=1.0)  # [M1] at most one block per cluster
        out = {form.z[(c, b)]: 1.0 for b in names if (c, b) in form.z}
        out.update({j: -1.0 for j in js if ys[j].role in ("first", "middle")})
        lm.add_row(f"M5_out[{c}]", out, 0.0, 0.0)  # [M5] a first/middle block hands over once
        inc = {form.z[(a, c)]: 1.0 for a in names if (a, c) in form.z}
        inc.update({j: -1.0 for j in js if ys[j].role in ("middle", "end")})
        lm.add_row(f"M6_in[{c}]", inc, 0.0, 0.0)  # [M6] a middle/end block is handed to once
        lm.add_row(f"M7_bottleneck[{c}]", {t: 1.0, **{j: -ys[j].bottleneck for j in js}}, lb=0.0, kind="time")
        _wan_pace_rows(form, c, names, t)  # [M8] WAN send paces (occupancies under the replay) too
        # [M9] U >= the tail of the pipeline's first stage [C7o] (options of other roles carry 0)
        lm.add_row(f"M9_tail[{c}]", {u: 1.0, **{j: -ys[j].sync_opt for j in js if ys[j].sync_opt}}, lb=0.0, kind="time")
        # [M10] W[c] >= own stages (+ W of the next cluster when c hands over to it)
        lm.add_row(f"M10_own[{c}]", {w[c]: 1.0, **{j: -float(ys[j].s) for j in js}}, lb=0.0)
        for b in names:
            if (c, b) in form.z:
                row = {w[c]: 1.0, w[b]: -1.0, form.z[(c, b)]: -w_max, **{j: -float(ys[j].s) for j in js}}
                lm.add_row(f"M10_chain[{c},{b}]", row, lb=-w_max)
        # [M11] stages after the block <= what its option tolerates
        if any(ys[j].dmax < w_max for j in js):
            row = {w[c]: 1.0, **{j: -(float(ys[j].s) + min(ys[j].dmax, w_max) - w_max) for j in js}}
            lm.add_row(f"M11_memory[{c}]", row, ub=w_max)
    if pol.compresses:
        _precision_rows(form, by_cluster, pol)
    if search_windows():  # [C3b] under the replay the windows may not carry the weight: rows left out
        _round_trip_rows(form, by_cluster, names, t, w, w_max, bounds, split)
    comp = milp_composition(instance, split, bounds)
    obj = {t: comp.weight, u: 1.0}
    if stage_term and comp.per_stage > 0 and comp.warmup > 0:  # [C3b] q >= warm-up cap + 1 − S: the stages the plan lacks
        q = lm.add_var("Q_stages", lb=0.0, ub=float(comp.warmup))
        lm.add_row("C3b_stages", {q: 1.0, **{j: float(ys[j].s) for j in ys}}, lb=float(comp.warmup + 1))
        obj[q] = comp.per_stage
    obj.update({j: ys[j].fill for j in ys})
    for lv in form.links.values():  # WAN fill (casts included) and the link penalty per precision pair
        for v in lv:
            _add_terms(obj, v.fill_terms())
            _add_terms(obj, {v.z: v.arc.penalty})
    lm.set_objective(obj, offset=-comp.constant)
    return form


def intra_latency(instance: Instance) -> float:
    """The largest latency part of a send inside one cluster (``evaluate.boundary_latency``: its NIC's)."""
    return max(c.inter_node.latency_s for c in instance.topology.clusters)


def milp_composition(instance: Instance, split: BatchSplit, bounds: CheapBounds) -> Composition:
    """[C3b] The objective's composition: ``pipeline.search_composition`` with the split's most stages,
    forward share and bottleneck bound (those of its cheap bounds) and the instance's largest
    intra-cluster latency; (m − 1, 0, 0) under the closed form."""
    rho, excess = bounds.fwd_share
    return search_composition(split.num_microbatches, bounds.max_stages, rho, excess, intra_latency(instance),
                              t_floor=bounds.t_lb if math.isfinite(bounds.t_lb) else 0.0)


def _wan_pace_rows(form: Formulation, c: str, names: list[str], t: int) -> None:
    """[M8] T >= the pace of c's hand-over: one row with each pair's slower direction when no
    cast time varies, else one row per direction (forward a→b, backward b→a, casts per [M19])."""
    lm = form.model
    outs = [v for b in names if (c, b) in form.links for v in form.links[(c, b)]]
    if not outs:
        return
    if not search_windows():  # [C3b] the replay: a message occupies its boundary for its transfer less latency
        row = {t: 1.0}
        for v in outs:
            _add_terms(row, {v.z: -v.arc.occupancy(0.0)})
        lm.add_row(f"M8_wan[{c}]", row, lb=0.0, kind="time")
        return
    if all(v.mu is None for v in outs):
        row: dict[int, float] = {t: 1.0}
        for v in outs:
            _add_terms(row, {v.z: -v.arc.pace(0.0)})
        lm.add_row(f"M8_wan[{c}]", row, lb=0.0, kind="time")
        return
    for tag, send, cast in (("fwd", "fwd", "q_fwd"), ("bwd", "bwd", "q_bwd")):
        row = {t: 1.0}
        for v in outs:
            _add_terms(row, {v.z: -getattr(v.arc, send)})
            if v.mu is not None:
                _add_terms(row, {v.mu: -getattr(v.arc, cast)})
        lm.add_row(f"M8_wan_{tag}[{c}]", row, lb=0.0, kind="time")


def _precision_rows(form: Formulation, by_cluster: dict[str, list[int]], pol: LinkPolicy) -> None:
    """[M18] at most N compressed boundaries per pipeline; [M19] the cast block of a compressed
    hand-over a→b: mu >= min(mbs_a, mbs_b) when its pair is chosen. With Y_cν = Σ_{o of c, mbs ν} y_o
    (a variable with its defining row, so the cast rows stay short; at most one is 1 per cluster),
    min(mbs_a, mbs_b) = ν exactly when Y_aν = 1 and Σ_{ν' >= ν} Y_bν' = 1 or the same with a and b
    swapped, so mu >= ν·(Y_aν + Σ_{ν'>=ν} Y_bν' + z − 2) for every ν and both orders is exact for
    binaries (mu only costs, so it settles at the largest right-hand side)."""
    lm, ys = form.model, form.y
    compressed = {v.z: 1.0 for lv in form.links.values() for v in lv if v.arc.compressed}
    if pol.max_compressed is not None and compressed:
        lm.add_row("M18_compressed_links", compressed, ub=float(pol.max_compressed))
    by_mbs: dict[str, dict[int, list[int]]] = {c: {} for c in by_cluster}
    for c, js in by_cluster.items():
        for j in js:
            by_mbs[c].setdefault(ys[j].cfg.mbs, []).append(j)
    used = {c for (a, b), lv in form.links.items() if any(v.mu is not None for v in lv) for c in (a, b)}
    big_y: dict[str, dict[int, int]] = {c: {} for c in used}  # Y[c,ν] = Σ_{o of c, mbs ν} y_o
    for c in sorted(used):
        for nu, js in sorted(by_mbs[c].items()):
            big_y[c][nu] = lm.add_var(f"Y[{c},{nu}]", lb=0.0, ub=1.0)
            lm.add_row(f"M19_mbs[{c},{nu}]", {big_y[c][nu]: 1.0, **{j: -1.0 for j in js}}, 0.0, 0.0)
    for (a, b), lv in form.links.items():
        for v in lv:
            if v.mu is None:
                continue
            for one, other in ((a, b), (b, a)):
                for nu, ynu in big_y[one].items():
                    row = {v.mu: 1.0, v.z: -float(nu), ynu: -float(nu)}
                    row.update({y2: -float(nu) for nu2, y2 in big_y[other].items() if nu2 >= nu})
                    lm.add_row(f"M19_cast[{a},{b},{v.arc.pair[0]}/{v.arc.pair[1]},{one}{nu}]", row, lb=-2.0 * nu)


def _round_trip_rows(form: Formulation, by_cluster: dict[str, list[int]], names: list[str], t: int,
                     w: dict[str, int], w_max: float, bounds: CheapBounds, split: BatchSplit) -> None:
    """[M12]-[M16] The 1F1B round trip [C3]: a stage with R stages from it to the end of the
    pipeline keeps min(R, m) microbatches in flight, so T·min(R, m) >= Phi, the fill of the stages
    from it to the end. With v[o] = y[o]·T (exact for binary y), psi[c] = fill after block c and
    x[c] = sum over the stages after block c of (their fill − T), the stage r-th from the end of
    block c needs suffix_fill_o(r) + 2·wan(out of c) − r·T + x[c] <= 0 and
    suffix_fill_o(r) + psi[c] <= m·T (psi[c] includes c's own WAN send). A hand-over's fill is the
    linear form of its precision variables (``LinkVar.fill_terms``: transfers and casts)."""
    lm, ys = form.model, form.y
    m = split.num_microbatches
    f_max = sum(max((ys[j].fill for j in js), default=0.0) for js in by_cluster.values())
    f_max += sum(form.wan_fill[e] for e in form.z) if form.z else 0.0
    t_ub = max(bounds.t_lb, max((o.bottleneck for o in ys.values()), default=0.0),
               max(form.wan.values(), default=0.0), f_max)
    lm.vars[t] = type(lm.vars[t])(name="T", lb=lm.vars[t].lb, ub=t_ub, integer=False, kind="time")
    big_x = f_max + t_ub * w_max
    v = {}
    for j, o in ys.items():  # [M12] v[o] = y[o]·T
        v[j] = lm.add_var(f"v[{j}]", lb=0.0, ub=t_ub, kind="time")
        lm.add_row(f"M12_v_le_T[{j}]", {v[j]: 1.0, t: -1.0}, ub=0.0, kind="time")
        lm.add_row(f"M12_v_le_y[{j}]", {v[j]: 1.0, j: -t_ub}, ub=0.0, kind="time")
        lm.add_row(f"M12_v_ge[{j}]", {v[j]: 1.0, t: -1.0, j: -t_ub}, lb=-t_ub, kind="time")
    psi = {c: lm.add_var(f"psi[{c}]", lb=0.0, ub=f_max, kind="time") for c in names}
    x = {c: lm.add_var(f"x[{c}]", lb=0.0, ub=2 * big_x, kind="time") for c in names}  # stores x + big_x
    big_x_m = 2 * big_x + 2 * f_max  # slack of [M14] when its arc is unused

    def arc_fill(arc: tuple[str, str], scale: float) -> dict[int, float]:
        row: dict[int, float] = {}
        for lv in form.links[arc]:
            _add_terms(row, lv.fill_terms(), scale)
        return row

    for (a, b), zj in form.z.items():
        fill_b = {j: -ys[j].fill for j in by_cluster[b]}
        # [M13] psi[a] >= 2·wan(a,b) + fill of b + psi[b] when a hands over to b
        row = {psi[a]: 1.0, psi[b]: -1.0, **fill_b}
        _add_terms(row, arc_fill((a, b), -1.0))
        _add_terms(row, {zj: -f_max})
        lm.add_row(f"M13_psi[{a},{b}]", row, lb=-f_max, kind="time")
        # [M14] x[a] >= fill of b (its stages and its own WAN send out) − s_b·T + x[b] when a hands
        # over to b (a's own WAN send belongs to a's last stage, counted in [M15])
        mx = big_x_m
        row = {x[a]: 1.0, x[b]: -1.0, **fill_b, zj: -mx}
        for j in by_cluster[b]:
            row[v[j]] = float(ys[j].s)
        for (b2, c2) in form.z:
            if b2 == b:
                _add_terms(row, arc_fill((b2, c2), -1.0))
        lm.add_row(f"M14_x[{a},{b}]", row, lb=-mx, kind="time")
    for c in names:
        js = by_cluster[c]
        ends = {j: -big_x for j in js if ys[j].role in ("end", "only")}
        if ends:  # [M14] nothing after the end block: x[c] >= 0 (stored as big_x)
            lm.add_row(f"M14_x_end[{c}]", {x[c]: 1.0, **ends}, lb=0.0, kind="time")
        # [M15] suffix_fill(r) − r·T + (2·wan out) + x[c] <= 0, x stored shifted by big_x
        _suffix_trip_rows(form, names, c, js, v, x[c], big_x, f_max, t_ub, arc_fill, "M15_round_trip")
        # [M16] the block's first stage: fill from it to the end <= m·T (covers min(R, m) = m)
        row = {psi[c]: 1.0, t: -float(m)}
        for j in js:
            row[j] = ys[j].fill + f_max
        if js:
            lm.add_row(f"M16_round_trip_cap[{c}]", row, ub=f_max, kind="time")
    if ROUND_TRIP_WINDOWS == "all":
        _window_rows(form, by_cluster, names, v, big_x, big_x_m, f_max, arc_fill)


def _window_rows(form: Formulation, by_cluster: dict[str, list[int]], names: list[str], v: dict[int, int],
                 big_x: float, big_m: float, f_max: float, arc_fill: Callable[[tuple[str, str], float], dict[int, float]]) -> None:
    """[M15w] The 1F1B round trip of every window of stages [C3] that starts in block c and ends in a
    later block: with h[c] = max over windows starting at the first stage after c of (round trip −
    T·stages) (stored shifted by big_x), the stage r-th from the end of c's block needs
    suffix_fill_o(r) + fill(out of c) − r·T + h[c] <= 0. h[a] >= prefix_trip_o(r') − r'·T for b's
    option o with >= r' stages, and h[a] >= F_b + fill(out of b) − s_b·T + h[b], when a hands over to b.
    Windows inside one block are in its option's bottleneck; windows longer than m are covered by
    [M16] (their trip is at most a suffix's)."""
    lm, ys = form.model, form.y
    h = {c: lm.add_var(f"h[{c}]", lb=0.0, ub=2 * big_x, kind="time") for c in names}
    big = big_x + 2 * f_max + big_m
    for (a, b), zj in form.z.items():
        js = by_cluster[b]
        for r in range(1, max((ys[j].s for j in js), default=0) + 1):
            row: dict[int, float] = {h[a]: 1.0, zj: -big}
            for j in js:
                if ys[j].s >= r:
                    row[j] = -ys[j].prefix_trip[r - 1]
                    row[v[j]] = float(r)
                else:
                    row[j] = big
            lm.add_row(f"M15w_enter[{a},{b},{r}]", row, lb=big_x - big, kind="time")
        # h[a] >= F_b + fill(out of b) − s_b·T + h[b] (shifts cancel)
        row = {h[a]: 1.0, h[b]: -1.0, zj: -big_m, **{j: -ys[j].fill for j in js}}
        for j in js:
            row[v[j]] = float(ys[j].s)
        for (b2, c2) in form.z:
            if b2 == b:
                _add_terms(row, arc_fill((b2, c2), -1.0))
        lm.add_row(f"M15w_pass[{a},{b}]", row, lb=-big_m, kind="time")
    for c in names:
        _suffix_trip_rows(form, names, c, by_cluster[c], v, h[c], big_x, f_max, big_m, arc_fill, "M15w_window")


def _suffix_trip_rows(form: Formulation, names: list[str], c: str, js: list[int], v: dict[int, int], shift: int,
                      big_x: float, f_max: float, slope: float,
                      arc_fill: Callable[[tuple[str, str], float], dict[int, float]], label: str) -> None:
    """For each r: suffix_fill_o(r) + fill(out of c) − r·T + shift <= 0 on the option o chosen for c's block
    (its last r stages; ``shift`` is x[c] for [M15] or h[c] for [M15w], stored + big_x), relaxed by
    f_max + big_x + slope·r when no option with >= r stages is chosen."""
    lm, ys = form.model, form.y
    out: dict[int, float] = {}
    for b in names:
        if (c, b) in form.z:
            _add_terms(out, arc_fill((c, b), 1.0))
    for r in range(1, max((ys[j].s for j in js), default=0) + 1):
        big = f_max + big_x + slope * r
        row = {shift: 1.0, **out}
        for j in js:
            if ys[j].s >= r:
                row[j] = ys[j].suffix_fill[r - 1] + big
                row[v[j]] = row.get(v[j], 0.0) - float(r)
        lm.add_row(f"{label}[{c},{r}]", row, ub=big_x + big, kind="time")


def decode(instance: Instance, form: Formulation, values: object) -> Plan:
    """The plan of a MILP solution: follow the z arcs from the starting block; each inter-cluster
    boundary gets the precision pair whose variable is set, boundaries inside a cluster native."""
    shape = model_shape(instance)
    chosen = {o.cluster: o for j, o in form.y.items() if values[j] > 0.5}  # type: ignore[index]
    nxt = {a: b for (a, b), j in form.z.items() if values[j] > 0.5}  # type: ignore[index]
    first = next(o for o in chosen.values() if o.role in ("first", "only"))
    stages: list[Stage] = []
    bounds: list[Boundary] = []
    pos, cur = 0, first
    while True:
        placed = _placed(cur, pos, shape.p)
        if stages:
            pair = next(v.arc.pair for v in form.links[(stages[-1].groups[0].cluster, cur.cluster)]
                        if values[v.z] > 0.5)  # type: ignore[index]
            bounds.append(Boundary(fwd=pair[0], bwd=pair[1]))  # type: ignore[arg-type]
        bounds.extend(Boundary() for _ in placed[1:])
        stages.extend(placed)
        pos = stages[-1].end
        if cur.role in ("end", "only"):
            break
        cur = chosen[nxt[cur.cluster]]
    native = all(b == Boundary() for b in bounds)
    pipe = Pipeline(stages=tuple(stages), num_microbatches=form.split.num_microbatches,
                    boundaries=() if native else tuple(bounds))
    return Plan(pipelines=(pipe,) * form.split.k, planner="milp", instance=instance.name)


def plan_hint(instance: Instance, form: Formulation, plan: Plan) -> dict[int, float]:
    """``decode`` backwards, as far as the formulation reaches: for ``plan``'s first pipeline, z = 1
    on its hand-overs (and on the precision pair each boundary carries), 0 on the other arcs; per
    cluster y = 1 on the block option with the plan's role, trunk layers, (tp, dp, mbs) and local
    stage boundaries, 0 on its other options (a cluster whose block is not among the options, e.g.
    non-uniform local stages, is left out). A hint for the solver's first incumbent (``LinearModel.hint``):
    it changes no bound. Empty when the plan is not of this split."""
    if len(plan.pipelines) != form.split.k or any(p != plan.pipelines[0] for p in plan.pipelines):
        return {}
    pipe = plan.pipelines[0]
    if pipe.num_microbatches != form.split.num_microbatches or pipe.microbatch != form.split.microbatch:
        return {}
    shape = model_shape(instance)
    runs: list[tuple[str, list[Stage]]] = []
    for st in pipe.stages:
        if len(st.groups) != 1:
            return {}
        c = st.groups[0].cluster
        if runs and runs[-1][0] == c:
            runs[-1][1].append(st)
        else:
            runs.append((c, [st]))
    if len({c for c, _ in runs}) != len(runs):
        return {}  # a cluster visited twice is outside the space
    hint: dict[int, float] = {j: 0.0 for j in form.y}
    hint.update({v.z: 0.0 for lv in form.links.values() for v in lv})
    hint.update({j: 0.0 for j in form.z.values()})
    trunk_lo, trunk_hi = shape.p, shape.p + shape.trunk
    cut = 0
    for i, (c, stages) in enumerate(runs):
        role = "only" if len(runs) == 1 else "first" if i == 0 else "end" if i == len(runs) - 1 else "middle"
        lo, hi = stages[0].start, stages[-1].end
        n = max(0, min(hi, trunk_hi) - max(lo, trunk_lo))
        g = stages[0].groups[0]
        rel = tuple(b - lo for b in (*(s.start for s in stages), hi))
        for j, o in form.y.items():
            if (o.cluster, o.role, o.n) == (c, role, n) and (o.cfg.tp, o.cfg.dp, o.cfg.mbs) == (g.tp, g.dp, g.mbs) \
                    and tuple(b - o.bounds[0] for b in o.bounds) == rel \
                    and all(s.groups[0] == g for s in stages):
                hint[j] = 1.0
                break
        else:
            for j, o in form.y.items():
                if o.cluster == c:
                    del hint[j]
        if i + 1 < len(runs):
            arc = (c, runs[i + 1][0])
            if arc not in form.z:
                return {}
            hint[form.z[arc]] = 1.0
            cut += len(stages)
            bd = pipe.boundary(cut - 1)
            for v in form.links[arc]:
                if v.arc.pair == (bd.fwd, bd.bwd):
                    hint[v.z] = 1.0
    return hint


def _placed(o: BlockOption, pos: int, p: int) -> list[Stage]:
    """The option's stages shifted so the block starts at layer ``pos`` (trunk layers are identical,
    so a middle block costs the same wherever it sits)."""
    from hgopt.plan import ReplicaGroup

    shift = pos - o.bounds[0]
    assert o.role == "middle" or shift == 0, (o, pos)
    g = ReplicaGroup(cluster=o.cluster, tp=o.cfg.tp, dp=o.cfg.dp, mbs=o.cfg.mbs)
    rc = "full" if o.cfg.recompute else "none"  # hfrec: [I3r] layouts with recomputation
    return [Stage(start=lo + shift, end=hi + shift, groups=(g,), zero=1, recompute=rc)
            for lo, hi in zip(o.bounds, o.bounds[1:])]


# --------------------------------------------------------------------------------------------
# One split: window loop [M0]
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class SplitOutcome:
    split: BatchSplit
    plan: Plan | None
    value: float
    """The objective: evaluate(plan).iteration_time_s plus the plan's link penalty (inf without a plan)."""
    lower_bound: float
    """Valid lower bound on the objective of every plan of this split."""
    penalty: float = 0.0
    """The plan's link penalty (value − penalty = evaluate's time)."""
    solves: tuple[SolveResult, ...] = ()
    variables: int = 0
    rows: int = 0
    unfinished: bool = False
    """The time limit ran out before this split's (next) MILP could be built."""


def solve_split(
    instance: Instance, tables: CostTables, split: BatchSplit, bounds: CheapBounds, *, solver: str,
    solve_options: SolveOptions, incumbent: float = math.inf, deadline: float = math.inf,
    lb_above: Callable[[float], float] | None = None, links: LinkPolicy | None = None, hint: Plan | None = None,
    arcs: ArcTable | None = None, meter: WorkMeter | None = None,
) -> SplitOutcome:
    """Solve the split's MILP with a bottleneck cap; widen the cap while it, not the MILP, limits
    the bound [M0]. Plans using an option above the cap cost at least weight·cap + f_lb + s_lb.
    ``hint`` (a plan of this split, e.g. the warm start) goes to the solver as a hint (``plan_hint``).
    No cutoff is passed to the solver: with HiGHS's ``objective_bound`` a split of sailor-het-32+96
    came back 'optimal' at 4.75459 whose optimum is 4.67836 (issue #11); ``incumbent`` only sets
    the first cap and the stopping test, so every bound taken from a solve is the solver's own.
    determinism: with ``meter`` each solve gets the node limit its work left allows (``work.node_limit``)
    and is charged what it explored; a MILP whose root the work left does not cover is not built."""
    pol = links or LinkPolicy()
    w = bounds.weight
    t_cap = _cap_for(bounds, incumbent)
    if not math.isfinite(t_cap):
        t_cap = bounds.t_lb * WIDEN if w > 0 else math.inf
    best_plan, best_val, best_pen, lb = None, math.inf, 0.0, bounds.value
    solves: list[SolveResult] = []
    nv = nr = 0
    while True:
        cap_lb = math.inf
        if math.isfinite(t_cap):  # [C3b] an option's bottleneck counts sends by pace: less the latency
            t_above = t_cap if search_windows() else max(t_cap - intra_latency(instance), 0.0)
            cap_lb = max(bounds.lb_above(t_above), lb_above(t_above) if lb_above else -math.inf)
        window = Window(t_lb=bounds.t_lb, s_lb=bounds.s_lb, t_cap=t_cap, weight=w, mbs_matters=pol.compresses,
                        per_stage=milp_composition(instance, split, bounds).per_stage)
        t_opts = time.perf_counter()
        try:
            opts = block_options(instance, tables, replicas=split.k, microbatch=split.microbatch,
                                 num_microbatches=split.num_microbatches, d_cap=stages_that_matter(split.num_microbatches),
                                 window=window, deadline=deadline)
            log.debug("split %s cap %.4g: %d block options in %.1f s", split, t_cap,
                      sum(len(v) for v in opts.values()), time.perf_counter() - t_opts)
            if meter is not None:  # determinism: generating the options is work too
                meter.charge(block_options_work(sum(len(v) for v in opts.values())))
        except OutOfTime:
            # the time limit ran out while generating the options: no MILP for this cap; the split
            # keeps the bound it has (a MILP over incomplete options would not bound anything)
            log.info("split %s: time limit reached while generating block options (cap %.4g); MILP not built",
                     split, t_cap)
            return SplitOutcome(split=split, plan=best_plan, value=best_val, lower_bound=min(lb, best_val),
                                solves=tuple(solves), variables=nv, rows=nr, penalty=best_pen, unfinished=True)
        size = estimated_nonzeros(opts, len(instance.topology.clusters))
        left = deadline - time.perf_counter()
        by_work = meter is not None and milp_root_work(size) > meter.left()  # determinism: the work left
        if meter is not None and not by_work and size <= MAX_NONZEROS and size * LOAD_S_PER_NONZERO > left:
            meter.note_cut("MILP phase")  # the watchdog, not the work budget, leaves it unbuilt
        if size > MAX_NONZEROS or by_work or size * LOAD_S_PER_NONZERO > left:
            # the size guard: a MILP that the remaining time (or memory) cannot load is not built
            log.info("split %s: MILP of ~%d nonzeros not built (%.1f s left, %.3g nominal s of work; limit %d "
                     "nonzeros)", split, size, left, meter.left() if meter is not None else math.inf, MAX_NONZEROS)
            return SplitOutcome(split=split, plan=best_plan, value=best_val, lower_bound=min(lb, best_val),
                                solves=tuple(solves), variables=nv, rows=nr, penalty=best_pen, unfinished=True)
        if arcs is None:  # [M8f] once per split, not per cap
            arcs = arc_table(instance, tables, split.microbatch, split.k, pol, model_shape(instance))
        form = build_milp(instance, tables, split, opts, bounds, pol, arcs, stage_term=True)
        if hint is not None:
            form.model.hint = plan_hint(instance, form, hint)
        nv, nr = len(form.model.vars), len(form.model.rows)
        limit = max(0.5, min(solve_options.time_limit_s, deadline - time.perf_counter()))
        nnz = form.model.num_nonzeros
        nodes = node_limit(nnz, meter.left()) if meter is not None else solve_options.node_limit
        res = solve(form.model, solver, SolveOptions(time_limit_s=limit, relative_gap=solve_options.relative_gap,
                                                     threads=solve_options.threads, seed=solve_options.seed,
                                                     time_quantum_s=solve_options.time_quantum_s, node_limit=nodes))
        if meter is not None:  # determinism: charged by the nodes explored; the clock's cut is recorded
            meter.charge(milp_work(nnz, res.nodes, nodes or 1))
            if res.limit == "time":
                meter.note_cut("MILP phase")
        solves.append(res)
        log.debug("split %s cap %.4g: %s, %s -> %s obj %.6g bound %.6g in %.2fs", split, t_cap, form.model.size(),
                  res.solver, res.status, res.objective, res.bound, res.wall_s)
        if res.values is not None:
            plan = decode(instance, form, res.values)
            ev = evaluate(plan, instance, tables)
            pen = pol.plan_penalty(plan.pipelines)
            if ev.feasible and ev.iteration_time_s + pen < best_val:
                best_plan, best_val, best_pen = plan, ev.iteration_time_s + pen, pen
        milp_lb = res.bound if res.status in ("optimal", "feasible", "no_solution", "infeasible") else bounds.value
        lb = max(bounds.value, min(milp_lb, cap_lb))
        capped = cap_lb <= min(milp_lb, best_val, incumbent) * (1 + 1e-12) and math.isfinite(t_cap)
        if not capped or time.perf_counter() >= deadline or res.status == "error":
            break
        if meter is not None and meter.left() <= 0:  # determinism: the work budget is spent
            break
        t_cap = max(t_cap * WIDEN, _cap_for(bounds, best_val)) if math.isfinite(best_val) else t_cap * WIDEN
    return SplitOutcome(split=split, plan=best_plan, value=best_val, lower_bound=min(lb, best_val),
                        solves=tuple(solves), variables=nv, rows=nr, penalty=best_pen)


def estimated_nonzeros(options: dict[tuple[str, str, int], list[BlockOption]], clusters: int) -> int:
    """An estimate (from above, on the instances measured) of the nonzeros ``build_milp`` writes for
    these block options: the round-trip rows [M15]/[M15w] hold each option once per local stage,
    with its y and v, [M12] and the per-cluster rows a few per option, the arcs a few per pair
    (sailor-het-32+96, k=4 B=4: 814 options, 3,475 local stages, 43,444 nonzeros; estimate 41.6 k + arcs)."""
    n = sum(len(v) for v in options.values())
    if not search_windows():  # [C3b] under the replay no round-trip rows: each option in <= 11 + C rows
        return (12 + clusters) * n + 40 * clusters * clusters
    stages = sum(o.s for v in options.values() for o in v)
    return 8 * stages + 16 * n + 40 * clusters * clusters


def _cap_for(bounds: CheapBounds, incumbent: float) -> float:
    """Smallest grid bottleneck above which no plan can beat ``incumbent`` [M0]."""
    if not math.isfinite(incumbent) or bounds.weight <= 0:
        return math.inf
    for tau in bounds.grid:
        if bounds.lb_above(tau) >= incumbent:
            return tau
    # beyond the grid lb_above(t) = w·t + f_lb + s_lb
    t = (incumbent - bounds.f_lb - bounds.s_lb + bounds.offset) / bounds.weight
    return max(t, bounds.grid[-1] if bounds.grid else 0.0) if math.isfinite(t) else math.inf


# --------------------------------------------------------------------------------------------
# The planner: all splits, best first, pruned by their bounds
# --------------------------------------------------------------------------------------------
def plan_milp(instance: Instance, options: PlanOptions, *, warm_start: WarmStart | None = None,
              outside: OutsideCheck | None = None) -> PlanResult:
    """Best plan of the space with a proven lower bound (the planner ``milp`` runs it through
    ``hgopt.search.exact`` with the heuristic's warm start and outside-space check). The link
    policy (``link_precision``, ``max_compressed_links``, ``link_penalty`` in ``options.extra``)
    sets which precisions inter-cluster boundaries may carry [M17]-[M19]."""
    t_start = time.perf_counter()
    deadline = t_start + options.time_limit_s
    # determinism: the phases end by counted work (hgopt.search.work), the deadline is the watchdog
    meter = WorkMeter(options.time_limit_s if options.work_limit_s is None else options.work_limit_s, deadline)
    tables = build_tables(instance)
    model_shape(instance)  # fails early, naming the setting, when the model is not trunk-shaped
    links = link_policy(instance, options.extra)
    splits = batch_splits(instance)
    prog = options.progress  # progress (cli-explain): heartbeat state + cooperative stop
    if prog:  # progress (cli-explain)
        prog.report("cheap bounds", total=len(splits))
    # [M0] the cheap bounds of the splits, for up to OPENING of the budget before the warm start and
    # up to twice that after it; a split without one is bounded by work_lower_bound and gets no MILP
    cheap: dict[BatchSplit, CheapBounds] = {}
    _cheap_until(instance, tables, splits, cheap, links, OPENING, prog, meter)
    floor = work_lower_bound(instance, tables)  # the bound of a split without a cheap bound
    lbs = {sp: cheap[sp].value if sp in cheap else floor for sp in splits}
    if prog:  # progress (cli-explain)
        prog.report("warm start", bound_s=_global_lb(lbs, None))
    best = _polished(instance, tables, _warm_start(instance, tables, options, t_start, links, warm_start, meter),
                     links, options, deadline)
    first = best.split if best else None
    if first is not None:
        _cheap_until(instance, tables, [first], cheap, links, math.inf, prog, meter)
    _cheap_until(instance, tables, splits, cheap, links, 2 * OPENING, prog, meter)
    lbs = {sp: cheap[sp].value if sp in cheap else floor for sp in splits}
    log.debug("cheap bounds of %d of %d splits after %.1f s", len(cheap), len(splits), time.perf_counter() - t_start)
    solver_name = ""
    sopts = SolveOptions(time_limit_s=options.time_limit_s, relative_gap=options.gap / 2, threads=options.threads,
                         seed=options.seed)
    relaxed: dict[BatchSplit, Callable[[float], float] | None] = {}
    unfinished: list[BatchSplit] = []
    arc_tables: dict[BatchSplit, ArcTable] = {}

    def arcs_for(sp: BatchSplit) -> ArcTable | None:
        """[M8f] The split's arc table with the layout floor, once for its relaxation and its MILP
        (None where the floor does not apply: each computes its own layout-free arcs)."""
        if len(instance.topology.clusters) > FLOOR_MAX_CLUSTERS:
            return None
        if sp not in arc_tables:
            arc_tables[sp] = arc_table(instance, tables, sp.microbatch, sp.k, links, model_shape(instance))
        return arc_tables[sp]

    use_relax = options.extra.get("relaxation", "on") != "off"
    if use_relax:
        # [R4] the relaxation bounds of the splits first, for up to RELAX_SHARE of the budget: the global bound
        # then holds them even when one split's MILP takes the rest of the time (with compressed links
        # the first split's MILP can), and the MILPs are visited in the order of those bounds.
        # gaps2: the weakest split first (the global bound is the least split bound), a split the
        # opening left without a cheap bound getting it here (it is bounded by `floor` until then)
        visited: set[BatchSplit] = set()
        while meter.within(RELAX_SHARE, "relaxation phase"):  # determinism: by work, the clock the watchdog
            target = (best.value if best else math.inf) * (1 - options.gap / 2)
            todo = [sp for sp in splits if sp not in visited and lbs[sp] < target and math.isfinite(lbs[sp])]
            if not todo:
                break
            if prog:  # progress (cli-explain)
                prog.report("relaxation bounds", done=len(visited), total=len(visited) + len(todo),
                            bound_s=_global_lb(lbs, best), incumbent_s=best.value if best else None,
                            plan=best.plan if best else None)
                if prog.stop_requested():  # progress (cli-explain)
                    break
            sp = min(todo, key=lambda x: (lbs[x], splits.index(x)))
            if sp not in cheap:  # the cheap bound first (it is the weakest: bounded by `floor`)
                _cheap_until(instance, tables, [sp], cheap, links, math.inf, prog, meter)
                if sp not in cheap:
                    break
                lbs[sp] = max(lbs[sp], cheap[sp].value)
                continue
            visited.add(sp)
            value, relaxed[sp] = _relaxation_bound(instance, tables, sp, cheap[sp], target, deadline, links,
                                                   arcs_for(sp))
            meter.charge(relaxation_work(instance))
            lbs[sp] = max(lbs[sp], value)
    unbounded = [sp for sp in splits if sp not in cheap]
    order = sorted(cheap, key=lambda sp: (sp != first, lbs[sp]))
    for i, sp in enumerate(order):
        if prog:  # progress (cli-explain)
            prog.report("splits", done=i, total=len(order), bound_s=_global_lb(lbs, best),
                        incumbent_s=best.value if best else None, plan=best.plan if best else None)
        ub = best.value if best else math.inf
        target = ub * (1 - options.gap / 2)
        if lbs[sp] >= target or not math.isfinite(lbs[sp]):
            continue
        if (meter.left() <= 0 or meter.past_deadline("MILP phase")
                or (prog and prog.stop_requested())):  # progress (cli-explain): stop; determinism: work spent
            unfinished.append(sp)  # not pruned by its bound, and no time left for its MILP
            continue
        if use_relax and sp not in relaxed:
            value, relaxed[sp] = _relaxation_bound(instance, tables, sp, cheap[sp], target, deadline, links,
                                                   arcs_for(sp))
            meter.charge(relaxation_work(instance))
            lbs[sp] = max(lbs[sp], value)
        above = relaxed.get(sp)
        if lbs[sp] >= target:
            log.debug("split %s pruned by the relaxation: %.6g >= %.6g", sp, lbs[sp], target)
            continue
        out = solve_split(instance, tables, sp, cheap[sp], solver=options.solver, solve_options=sopts,
                          incumbent=ub, deadline=deadline, lb_above=above, links=links,
                          hint=best.plan if best is not None and best.split == sp else None, arcs=arcs_for(sp),
                          meter=meter)
        if out.unfinished:
            unfinished.append(sp)
        solver_name = out.solves[-1].version if out.solves else solver_name
        lbs[sp] = max(lbs[sp], out.lower_bound)
        if out.plan is not None and out.value < ub * POLISH_WITHIN:
            out = _polished(instance, tables, out, links, options, deadline)  # gaps3: one layer away, etc.
        if out.plan is not None and out.value < ub:
            best = out
        elif best is not None and out.split == best.split:
            best = SplitOutcome(split=best.split, plan=best.plan, value=best.value, lower_bound=out.lower_bound,
                                solves=out.solves, variables=out.variables, rows=out.rows, penalty=best.penalty,
                                unfinished=out.unfinished)
        log.info("split %s: plan %.4g s, bound %.4g s; best %.4g s, global bound %.4g s (%.1f s)", sp, out.value,
                 out.lower_bound, best.value if best else math.inf, _global_lb(lbs, best), time.perf_counter() - t_start)
    notes = []
    if unbounded:
        notes.append(f"time limit reached before the cheap bounds of {len(unbounded)} of {len(splits)} batch splits "
                     f"were computed: each is bounded by the compute work over all GPUs alone ({floor:.4g} s), so "
                     "the bound is weak; a longer --time-limit bounds them")
    if unfinished:
        notes.append(f"time limit reached before the MILP of split {unfinished[0]}"
                     + (f" and of {len(unfinished) - 1} more split(s)" if len(unfinished) > 1 else "")
                     + " was built (their bounds still hold); a longer --time-limit lets them run")
        if best is not None and best.split in unfinished and not best.solves:
            best = SplitOutcome(split=best.split, plan=best.plan, value=best.value, lower_bound=best.lower_bound,
                                penalty=best.penalty, unfinished=True)
    if best is not None and best.plan is not None and not (prog and prog.stop_requested()):  # (cli-explain)
        notes.extend(_outside_space_note(instance, tables, best.value - best.penalty, options, deadline, outside))
    if meter.cut:  # determinism: the watchdog, not the work budget, ended a phase: say so
        notes.append(f"stopped by the time limit: the wall clock ended the {meter.cut} before its work share "
                     f"({meter.spent_s:.3g} of {meter.budget_s:.3g} nominal s spent) — the same input, limit and seed "
                     "may give another plan on a faster or less loaded machine; the bound still holds")
    return _result(instance, best, lbs, options, solver_name, time.perf_counter() - t_start, links, tuple(notes))


def work_lower_bound(instance: Instance, tables: CostTables) -> float:
    """A bound on every plan's iteration time, whatever its batch split: the GPU-seconds of compute
    one iteration needs, spread over every GPU of the topology. Each stage's GPUs run its m
    microbatches one after another ([C3]: (m − 1)·bottleneck + fill >= m · the stage's fwd + bwd), and a
    stage replica of tp GPUs spends tp · (fwd + bwd)(mbs) [C2] on mbs samples, so every sample costs
    at least, per layer, the least tp · (fwd + bwd)(mbs) / mbs over the profiled (GPU, tp, mbs) ([C2]
    is linear in mbs between profiled sizes and proportional outside them: the least per-sample time
    lies at a profiled size). The fallback for splits the time limit leaves without a cheap bound."""
    L = tables.num_layers
    per_sample = np.full(L, np.inf)
    lo, hi = np.arange(L), np.arange(1, L + 1)
    gpus = {c.gpu for c in instance.topology.clusters}
    for (gpu, tp), tab in tables.by_gpu_tp.items():
        if gpu not in gpus:
            continue
        for mbs in tab.mbs:
            t = stage_compute_v(tab, int(mbs), lo, hi)
            per_sample = np.minimum(per_sample, tp * t / float(mbs))
    total = float(per_sample.sum())
    if not math.isfinite(total):
        return 0.0
    return instance.job.global_batch * total / instance.topology.num_gpus()


def _cheap_until(instance: Instance, tables: CostTables, splits: list[BatchSplit], cheap: dict[BatchSplit, CheapBounds],
                 links: LinkPolicy, share: float, prog: object, meter: WorkMeter) -> None:
    """The cheap bounds [M0] of the splits of ``splits`` not in ``cheap`` yet, in their order, until ``share``
    of the work budget is spent (determinism: each is charged ``work.cheap_bound_work``), the watchdog's
    deadline passes or a stop."""
    for sp in splits:
        if sp in cheap:
            continue
        if not meter.within(share, "cheap bounds") or (prog is not None and prog.stop_requested()):  # type: ignore[attr-defined]
            return
        cheap[sp] = cheap_bounds(instance, tables, replicas=sp.k, microbatch=sp.microbatch,
                                 num_microbatches=sp.num_microbatches, links=links)
        meter.charge(cheap_bound_work(instance))


def _outside_space_note(instance: Instance, tables: CostTables, value: float, options: PlanOptions,
                        deadline: float, outside: OutsideCheck | None) -> list[str]:
    """A faster plan outside this plan space (``outside``, e.g. the heuristic's data parallelism across
    cluster groups [H9]) against the exact planner's plan: a note naming it (nothing otherwise)."""
    if outside is None or options.extra.get("outside_check", "on") == "off" or len(instance.topology.clusters) < 2:
        return []
    left = deadline - time.perf_counter()
    if left < OUTSIDE_MIN_S:
        return ["outside-space check skipped: the time limit ran out (data parallelism across cluster groups, "
                "outside this plan space, was not tried; `--planner heuristic` tries it)"]
    try:
        alt = outside(instance, tables, value, left)
    except ValueError as exc:  # the heuristic declines some instances
        log.info("outside-space check skipped: %s", exc)
        return []
    if alt is None:
        return []
    return [f"outside this plan space the heuristic found a faster plan: data parallelism across cluster groups, "
            f"{alt[0]:.4g} s by evaluate ({alt[1]}); `--planner heuristic` returns it"]


def _relaxation_bound(instance: Instance, tables: CostTables, sp: BatchSplit, cheap: CheapBounds, target: float,
                      deadline: float, links: LinkPolicy | None = None,
                      arcs: ArcTable | None = None) -> tuple[float, Callable[[float], float] | None]:
    """[R4] The subset-DP relaxation bound of a split (the cheap bound when there are too many
    clusters for it), and a function bounding the plans whose bottleneck is >= t (for [M0]).
    Hand-overs at the fastest precision ``links`` allows, so it bounds compressed plans too
    (``arcs``: the split's ``arc_table``, shared with its MILP)."""
    from hgopt.search.relax import relax_split, split_bound

    rs = relax_split(instance, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                     cheap=cheap, links=links, arcs=arcs)
    if rs is None:
        return cheap.value, None
    single = _best_single(instance, tables, sp, cheap, target)

    def above(t: float) -> float:
        return split_bound(rs, cheap, target=target, deadline=deadline, single=single, above=t)

    return split_bound(rs, cheap, target=target, deadline=deadline, single=single), above


def _best_single(instance: Instance, tables: CostTables, sp: BatchSplit, cheap: CheapBounds,
                 target: float = math.inf) -> float:
    """[R0] A lower bound on every plan of the split on one cluster: from the intra-cluster DP over all
    layers, D* <= (m − 1)·B + F + S for each such plan ([C3] with B its largest stage compute or
    send, F its fill, S its first stage's sync + optimizer [C7o]; no WAN). The exact timeline [C3x]
    is >= w·B' + F + S − offset ([C3b]: w = ``cheap.weight``, B' = B less at most the largest NIC
    latency λ). Under the closed form D* itself; under the replay (replay3 [R0s]) the plan's own stage
    count S sets the weight: ``single_bound.single_cluster_replay_bound`` (the intra DP per S with
    ``bound_weight(m, S, ρ)``, blended with the busy chain), where round 7 scaled D* by κ = w/(m − 1)
    with the split's most stages S̄ (on default's k=1 B=32 m=16: 2.27 s against D* = 5.60 s)."""
    from hgopt.search.intra import best_local_plan
    from hgopt.search.single_bound import single_cluster_replay_bound

    def closed_optimum(name: str) -> float:
        c = instance.topology.cluster(name)
        lp = best_local_plan(instance, tables, c.name, 0, instance.model.num_layers, microbatch=sp.microbatch,
                             num_microbatches=sp.num_microbatches, gpu_budget=c.num_gpus // sp.k, replicas=sp.k)
        return lp.objective(sp.num_microbatches) if lp is not None else math.inf

    if not _pipeline.replay_bounds():
        return min(closed_optimum(c.name) for c in instance.topology.clusters)  # [C3]: D* bounds the closed form

    return single_cluster_replay_bound(instance, tables, replicas=sp.k, microbatch=sp.microbatch,
                                       num_microbatches=sp.num_microbatches, tail_floor=cheap.s_lb, target=target)


def _warm_start(instance: Instance, tables: CostTables, options: PlanOptions, t_start: float,
                links: LinkPolicy | None, warm_start: WarmStart | None, meter: WorkMeter | None = None) -> SplitOutcome | None:
    """The injected warm start's plan (the heuristic's, under the same link precision settings) as the
    first incumbent (its objective — evaluate's time plus its link penalty — prunes splits and block
    options; a plan of the same space). ``extra['warm_start'] = 'none'`` turns it off."""
    if warm_start is None or options.extra.get("warm_start", "heuristic") != "heuristic":
        return None
    pol = links or LinkPolicy()
    total = options.time_limit_s if options.work_limit_s is None else options.work_limit_s
    budget = min(10.0, 0.2 * total)  # determinism: a fixed function of the limit (the work limit follows it)
    if meter is not None:
        meter.charge(WARM_START_CHARGE * budget)
    try:
        plan = warm_start(instance, tables, budget)
    except ValueError as exc:  # the heuristic declines some instances; the MILP still runs
        log.info("warm start skipped: %s", exc)
        return None
    if plan is None:
        return None
    ev = evaluate(plan, instance, tables)
    if not ev.feasible or not math.isfinite(ev.iteration_time_s):
        return None
    p0 = plan.pipelines[0]
    split = BatchSplit(k=len(plan.pipelines), microbatch=p0.microbatch, num_microbatches=p0.num_microbatches)
    pen = pol.plan_penalty(plan.pipelines)
    log.info("warm start: plan %.4g s (%s) after %.1f s", ev.iteration_time_s, split, time.perf_counter() - t_start)
    return SplitOutcome(split=split, plan=plan, value=ev.iteration_time_s + pen, lower_bound=-math.inf, penalty=pen)


def _polished(instance: Instance, tables: CostTables, out: SplitOutcome | None, links: LinkPolicy,
              options: PlanOptions, deadline: float) -> SplitOutcome | None:
    """gaps3: ``out`` with its plan improved by ``polish.polish`` (neighbours of the same batch split
    scored by evaluate + link penalty; a fixed number of evaluations); ``extra['polish'] = 'off'``
    turns it off. The split's bound is untouched (the plans stay in the split; one may leave the
    space, e.g. a cluster boundary inside the prefix, which only tightens the incumbent)."""
    if out is None or out.plan is None or options.extra.get("polish", "on") == "off":
        return out
    plan, value = polish(instance, tables, out.plan, penalty=links.plan_penalty, deadline=deadline,
                         stop=options.progress.stop_requested if options.progress is not None else None)
    if value >= out.value:
        return out
    return dataclasses.replace(out, plan=plan, value=value, penalty=links.plan_penalty(plan.pipelines))


def _global_lb(lbs: dict[BatchSplit, float], best: SplitOutcome | None) -> float:
    lb = min(lbs.values(), default=math.inf)
    return min(lb, best.value) if best else lb


def _result(instance: Instance, best: SplitOutcome | None, lbs: dict[BatchSplit, float], options: PlanOptions,
            solver: str, wall: float, links: LinkPolicy | None = None, extra_notes: tuple[str, ...] = ()) -> PlanResult:
    """The bound of the objective (time + link penalty) is turned into a bound on evaluate's time by
    subtracting the most penalty any plan can pay (nothing without penalties)."""
    pol = links or LinkPolicy()
    space = plan_space(pol)
    lb_obj = _global_lb(lbs, best)
    slack = pol.max_penalty(len(instance.topology.clusters) - 1)
    lb = max(lb_obj - slack, 0.0) if math.isfinite(lb_obj) else lb_obj
    if best is None or best.plan is None:
        status = "infeasible" if not math.isfinite(lb) else "error"
        if status == "infeasible":
            extra_notes = (f"no plan of this space fits: the bounds of all {len(lbs)} batch splits (k pipelines x "
                           "microbatch B) are infinite — for none of them do the block options (memory per GPU, GPUs "
                           "per pipeline, profiled tp and microbatch sizes) cover the model; the infeasibility lines "
                           "name the binding constraint with its numbers", *extra_notes)
            solver = solver or f"none ({options.solver} not needed: every batch split's bounds are infinite)"
        else:
            extra_notes = ("no plan found within the time limit (the bound still holds); a longer --time-limit "
                           "or the warm start finds one", *extra_notes)
            solver = solver or f"none ({options.solver} not run: the time limit ran out first)"
        return PlanResult(planner="milp", status=status, plan=None, lower_bound_s=lb if math.isfinite(lb) else None,
                          search_time_s=wall, solver=solver, plan_space=space, notes=extra_notes)
    time_s = best.value - best.penalty
    gap = (time_s - lb) / time_s
    status = "optimal" if gap <= options.gap + 1e-12 else "feasible"
    if not solver:  # no MILP was solved: say why, and claim a certificate only when there is one
        solver = (f"none ({options.solver} not needed: the cheap and relaxation bounds certified the result "
                  f"within the gap {options.gap:g})" if status == "optimal" else
                  f"none ({options.solver} not run: the time limit ran out first; the gap is that of the cheap "
                  "and relaxation bounds)")
    meta = (("solver", solver), ("lower_bound_s", repr(lb)), ("gap", f"{gap:.6f}"), ("status", status),
            ("split", str(best.split)), ("plan_space", space))
    notes = [_size_note(best, gap), *extra_notes]
    if slack > 0:
        obj_gap = (best.value - lb_obj) / best.value
        meta += (("objective_with_link_penalty_s", repr(best.value)), ("objective_lower_bound_s", repr(lb_obj)))
        notes.append(f"objective = iteration time + link penalty: {best.value:.6g} s (penalty {best.penalty:.6g} s), "
                     f"bound {lb_obj:.6g} s, gap {100 * obj_gap:.2f} %; the time bound is that bound minus the "
                     f"largest penalty a plan can pay ({slack:.6g} s)")
    plan = Plan(pipelines=best.plan.pipelines, planner="milp", instance=instance.name, meta=meta)
    return PlanResult(planner="milp", status=status, plan=plan, iteration_time_s=time_s, lower_bound_s=lb,
                      search_time_s=wall, solver=solver, plan_space=space, notes=tuple(notes))


def _size_note(best: SplitOutcome, gap: float) -> str:
    if not best.solves and best.unfinished:
        return f"best split {best.split}: the warm start's plan (the time limit ran out before its MILP was built)"
    if not best.solves:  # deadline3: the words claim no certificate; the overall gap says what is proven
        return (f"best split {best.split}: this split's bound came from the relaxations (no MILP solved for it); "
                f"overall gap {100 * gap:.1f} %")
    return f"best split {best.split}: {best.variables} variables, {best.rows} rows"
