"""Block options for the cluster-level MILP: what a cluster can do with n trunk layers.

The model must be *trunk-shaped*: leading layers (embedding), a run of identical layers (transformer
blocks, the trunk), trailing layers (head) — see ``model_shape``. A cluster
that hosts a contiguous block of one pipeline plays one of four roles [B0]:

- ``first``: the prefix layer (if any) and n trunk layers, pipeline stages follow it;
- ``middle``: n >= 1 trunk layers, stages before and after it;
- ``end``: n trunk layers and the suffix layer (if any), nothing after it;
- ``only``: the whole model.

For every role, n and local (tp, dp, s) this module computes with the intra-cluster closed form
(``hgopt.search.intra.solve_trunk``) the partition minimising the block's own objective at d
stages after it, for d on a ladder, and keeps the options not dominated in (bottleneck, fill,
sync_opt, local stages s, tolerated stages after) [B1]. Labels refer to formulations/cluster_milp.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from hgopt.cost.evaluate import boundary_cast_times
from hgopt.cost.links import handover_floor, handover_lower_bound, replicas_per_node
from hgopt.cost.compute import forward_share_of
from hgopt.cost.pipeline import (
    ROUND_TRIP_WINDOWS,
    occupancy_bounds,
    replay_bounds,
    round_trip_pace,
    search_offset,
    search_weight,
    search_windows,
    stage_fill,
    steady_weight,
    weighted_time,
)
from hgopt.cost.tables import CostTables, link_bytes_factor
from hgopt.plan import Boundary, Pipeline, ReplicaGroup, Stage
from hgopt.search.intra import (
    LocalConfig,
    StageModel,
    TrunkCosts,
    TrunkGeometry,
    TrunkSolution,
    layer_classes,
    local_configs,
    solve_trunk,
)
from hgopt.spec import Instance

__all__ = ["NATIVE_PAIR", "ArcPrecision", "ArcTable", "BlockOption", "HandoverKey", "LinkPolicy", "ModelShape",
           "OutOfTime", "Role", "arc_precisions", "arc_table", "block_options", "handover_times", "layout_floor",
           "model_shape"]

log = logging.getLogger(__name__)

Role = Literal["first", "middle", "end", "only"]
ROLES: tuple[Role, ...] = ("first", "middle", "end", "only")
INF = math.inf
D_STEPS = 12
"""At most this many exact steps of the stages-after ladder per (role, config, s); then one jump to
the cap (see formulations/cluster_milp.md, [B1])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """Layers [0, p) prefix, [p, p + trunk) identical trunk layers, [L − q, L) suffix. Prefix and
    suffix layers stay in the first and last local stage of the pipeline [B0]."""

    p: int
    q: int
    trunk: int
    num_layers: int

    def boundary_ok_after_prefix(self, act: np.ndarray) -> bool:
        """A first block made of the prefix alone sends act[p−1] bytes; allowed only when that equals
        the trunk's boundary bytes, so every WAN boundary carries the same bytes per sample."""
        return self.p == 0 or float(act[self.p - 1]) == float(act[self.p])


def model_shape(instance: Instance) -> ModelShape:
    """The trunk shape of the model: the longest run of identical layers is the trunk, the layers
    before it the prefix, after it the suffix; ValueError when there is no run to split."""
    classes = layer_classes(instance)
    L = len(classes)
    best = (0, 0)  # (length, start) of the longest run of one class
    i = 0
    while i < L:
        j = i
        while j < L and classes[j] == classes[i]:
            j += 1
        if j - i > best[0]:
            best = (j - i, i)
        i = j
    length, start = best
    if length < 2 and L > 1:
        _not_trunk(instance)
    return ModelShape(p=start, q=L - start - length, trunk=length, num_layers=L)


def _not_trunk(instance: Instance) -> ModelShape:
    raise ValueError(
        f"--planner milp: model {instance.model.name!r} has no run of identical layers (transformer blocks) to split "
        "between clusters; the exact planner needs one"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockOption:
    """One way cluster ``cluster`` hosts its block (one pipeline's copy)."""

    cluster: str
    role: Role
    n: int
    """Trunk layers in the block."""
    cfg: LocalConfig
    bounds: tuple[int, ...]
    """Layer boundaries of the local stages (absolute layer indices)."""
    bottleneck: float
    fill: float
    sync_opt: float
    dmax: float
    """Most pipeline stages after the block for which every local stage fits (inf: any)."""
    suffix_fill: tuple[float, ...] = ()
    """suffix_fill[r-1]: fill (fwd+bwd and intra-cluster sends) of the block's last r local stages,
    for the 1F1B round trip [C3]; suffix_fill[-1] == fill."""
    prefix_trip: tuple[float, ...] = ()
    """prefix_trip[r-1]: round trip of the window of the block's first r local stages (their fwd+bwd
    and the sends between them, not the r-th stage's send out), for windows that enter the block
    from an earlier one [C3]; prefix_trip[-1] == fill."""

    @property
    def s(self) -> int:
        return len(self.bounds) - 1

    @property
    def gpus(self) -> int:
        return self.s * self.cfg.gpus


def role_geometry(shape: ModelShape, role: Role) -> tuple[TrunkGeometry, range]:
    """The block geometry of ``role`` and its trunk counts n [B0]."""
    p, q, T, L = shape.p, shape.q, shape.trunk, shape.num_layers
    if role == "first":
        return TrunkGeometry(p=p, q=0, first=0, t0=p, last_end=L, trunk=T), range(0 if p else 1, T + (q > 0))
    if role == "middle":
        return TrunkGeometry(p=0, q=0, first=p, t0=p, last_end=L, trunk=T, pipeline_first=False), \
            range(1, T - 1 + (p > 0) + (q > 0))
    if role == "end":
        return TrunkGeometry(p=0, q=q, first=p, t0=p, last_end=L, trunk=T, anchor="end", pipeline_first=False), \
            range(0 if q else 1, T + (p > 0))
    return TrunkGeometry(p=p, q=q, first=0, t0=p, last_end=L, trunk=T), range(T, T + 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Window:
    """Bounds that prune block options without losing an optimum [B2]: every plan of the space has
    bottleneck >= t_lb and tail >= s_lb; options with bottleneck > t_cap are left out (the caller
    accounts for plans above the cap in its lower bound)."""

    t_lb: float = 0.0
    s_lb: float = 0.0
    t_cap: float = INF
    weight: float = 1.0
    """m − 1, the weight of the bottleneck in the objective."""
    mbs_matters: bool = False
    """Inter-cluster boundaries may be compressed: their (de)quantisation time grows with the
    replicas' microbatch size [C4q], so an option must also have no larger mbs to dominate [B3]."""
    per_stage: float = 0.0
    """[C3b] What the objective charges per stage a plan has fewer (``pipeline.Composition.per_stage``;
    0 under the closed form): an option with fewer stages dominates only if it makes up for them [B3],
    and [B2] stops adding stages only while a stage's fill is worth more than this."""
    gpus_matter: bool = False
    """costmilp: the objective prices GPUs (``--objective cost``, ``--budget``; hgopt.search.milp_cost):
    an option must also use no more GPUs to dominate [B3]."""
    # costmilp: $ pruning while options are generated ([C4], formulations/cluster_milp.md §10)
    gpu_usd_per_s: tuple[tuple[str, float], ...] = ()
    """costmilp: $ per GPU-second per cluster (empty: no $ pruning)."""
    usd_cap: float = INF
    """costmilp: leave out options whose own GPUs' $ over ``time_floor(bottleneck)`` is >= this."""
    gpu_usd_s_cap: float = INF
    """costmilp: leave out options whose own GPUs cost more than this many $ per second (a budget)."""
    time_floor: Callable[[float], float] | None = None
    """costmilp: a nondecreasing lower bound on every plan's time given its bottleneck >= t
    (``CheapBounds.lb_above``); required with ``usd_cap``."""
    layer_usd: tuple[float, ...] = ()
    """costmilp: per layer, the least $ any plan pays for its compute (``money.layer_work_usd``;
    empty: 0): the layers outside an option are paid by other GPUs."""


class OutOfTime(Exception):
    """Raised by :func:`block_options` when its ``deadline`` passes before the options are complete."""


def block_options(
    instance: Instance,
    tables: CostTables,
    *,
    replicas: int,
    microbatch: int,
    num_microbatches: int,
    d_cap: int,
    window: Window | None = None,
    roles: tuple[Role, ...] = ROLES,
    deadline: float = math.inf,
) -> dict[tuple[str, Role, int], list[BlockOption]]:
    """[B1] Non-dominated block options per (cluster, role, n) for ``replicas`` identical pipelines
    with this microbatch and m. ``d_cap``: the most stages that can follow a block. Raises
    :class:`OutOfTime` once ``time.perf_counter()`` passes ``deadline`` (checked per configuration):
    an incomplete option set would make a MILP whose bound is not valid."""
    shape = model_shape(instance)
    win = window or Window(weight=steady_weight(num_microbatches))
    out: dict[tuple[str, Role, int], list[BlockOption]] = {}
    for c in instance.topology.clusters:
        budget = c.num_gpus // replicas
        for role in roles:
            cands = _cluster_role_candidates(instance, tables, c.name, role, shape, replicas, microbatch,
                                             num_microbatches, budget, d_cap, win, deadline)
            for n, opts in cands.items():
                kept = _dominance_filter(opts, role, win)
                if kept:
                    out[(c.name, role, n)] = kept
    return out


def _cluster_role_candidates(
    instance: Instance, tables: CostTables, cluster: str, role: Role, shape: ModelShape, replicas: int,
    microbatch: int, m: int, budget: int, d_cap: int, win: Window, deadline: float = math.inf,
) -> dict[int, list[BlockOption]]:
    geo, n_range = role_geometry(shape, role)
    if role == "first" and not shape.boundary_ok_after_prefix(tables.activation_bytes):
        n_range = range(max(1, n_range.start), n_range.stop)
    if len(n_range) == 0:
        return {}
    c = instance.topology.cluster(cluster)
    d_lo = 1 if role in ("first", "middle") else 0
    cands: dict[int, list[BlockOption]] = {}
    for cfg in local_configs(instance, cluster, microbatch, tables):  # with recomputation where memory binds [I3r]
        if cfg.gpus > budget:
            continue
        if time.perf_counter() > deadline:
            raise OutOfTime(f"block options of {cluster} ({role}) not complete by the deadline")
        if cfg.recompute and geo.t0 == 0:
            continue  # [I3r] a recomputing layer 0 keeps token ids: trunk stages would not cost alike (no options)
        sm = StageModel(instance, tables, c, cfg, replicas)
        t1 = float(sm.compute(np.array([geo.t0]), np.array([geo.t0 + 1]))[0])
        per_stage = int(win.t_cap // t1) if t1 > 0 and math.isfinite(win.t_cap) else 10**9
        n_hi = min(n_range.stop - 1, (budget // cfg.gpus) * per_stage)
        if n_hi < n_range.start:  # gaps2: a cap below one trunk layer still leaves n = 0 (prefix / suffix only)
            continue
        s_usd = _usd_stage_cap(win, cluster, replicas * cfg.gpus)  # costmilp: $ pruning [C4]
        if s_usd < 1:
            continue
        ns = np.arange(n_range.start, n_hi + 1)
        tc = TrunkCosts(sm, geo, int(ns.max()))
        s_first = max(1, -(-int(ns.min()) // max(per_stage, 1)) - 1)
        s_top = min(budget // cfg.gpus, geo.p + geo.q + int(ns.max()), s_usd)
        stop_at = np.full(len(ns), s_top)
        min_send = 2.0 * min(tc.t_send, float(tc.f_send.min()) if geo.p else INF) * 0.999
        for s in range(s_first, s_top + 1):
            if s > stop_at.max():
                break
            if time.perf_counter() > deadline:  # also per stage count: one configuration can take seconds
                raise OutOfTime(f"block options of {cluster} ({role}) not complete by the deadline")
            if math.isfinite(win.usd_cap) and _usd_hopeless(win, replicas * s * cfg.gpus, cluster, ns, s, t1, geo):
                continue  # costmilp [C4]: no option of s stages of this config is under the $ cap
            for front in ((False, True) if s >= 3 else (False,)):
                for sol, new, dm in _ladder(tc, s, d_lo, d_cap if d_lo else 0, m, ns, front=front, weight=win.weight):
                    new = new & (sol.bottleneck <= win.t_cap) & (s <= stop_at)
                    if math.isfinite(win.usd_cap) and win.time_floor is not None:  # costmilp: $ pruning [C4]
                        new &= _usd_useful(win, sol, replicas * s * cfg.gpus, cluster, new)
                    _collect(cands, sol, new, cluster, role, cfg, tc, m, dm)
                    if not front:
                        stop_at = _stop_rule(stop_at, sol, dm, s, d_cap if d_lo else 0, win, min_send - win.per_stage)
    return cands


def _usd_useful(win: Window, sol: TrunkSolution, gpus: int, cluster: str, new: np.ndarray) -> np.ndarray:
    """costmilp [C4]: per new option of ``sol`` (``gpus`` GPUs over all replicas), whether its $
    floor is below ``win.usd_cap``. Floor: a plan P using the option rents its GPUs for P's whole
    time T >= time_floor(option's bottleneck) (P's bottleneck is >= the option's; time_floor is
    nondecreasing), and every layer outside the option's range runs on P's other GPUs, whose rent
    is >= that layer's ``layer_usd`` (each GPU-second of compute is rented; disjoint layers, disjoint
    GPU time); egress >= 0. So $(P) >= gpus·price·time_floor(b) + Σ_{l outside} layer_usd[l], and an
    option at or above the incumbent's $ is in no cheaper plan."""
    rate = dict(win.gpu_usd_per_s).get(cluster, 0.0)
    out = np.ones(len(sol.ns), dtype=bool)
    assert win.time_floor is not None
    prefix = np.concatenate(([0.0], np.cumsum(win.layer_usd))) if win.layer_usd else None
    for i in np.flatnonzero(new):
        rest = 0.0
        if prefix is not None:
            b = sol.bounds(int(i))
            rest = max(float(prefix[-1] - (prefix[b[-1]] - prefix[b[0]])), 0.0)
        out[i] = gpus * rate * win.time_floor(float(sol.bottleneck[i])) + rest < win.usd_cap
    return out


def _usd_hopeless(win: Window, gpus: int, cluster: str, ns: np.ndarray, s: int, t1: float,
                  geo: TrunkGeometry) -> bool:
    """costmilp [C4]: whether every option with s local stages (``gpus`` GPUs over all replicas) and
    n in ``ns`` trunk layers is at or above ``win.usd_cap`` before it is computed: some stage holds
    >= ceil(n / s) trunk layers, each costing >= t1 (the per-stage layer count rule of [B2] that
    ``per_stage`` uses), so the bottleneck is >= ceil(n / s)·t1; the trunk - n trunk layers outside
    the block cost >= their least ``layer_usd`` each; then ``_usd_useful``'s floor applies."""
    if win.time_floor is None:
        return False
    rate = dict(win.gpu_usd_per_s).get(cluster, 0.0)
    trunk = win.layer_usd[geo.t0: geo.t0 + geo.trunk] if win.layer_usd else ()
    w = min(trunk) if trunk else 0.0
    for n in ns:
        b = math.ceil(int(n) / s) * t1 * (1 - 1e-12)
        if gpus * rate * win.time_floor(b) + max(geo.trunk - int(n), 0) * w < win.usd_cap:
            return False
    return True


def _usd_stage_cap(win: Window, cluster: str, gpus_per_stage: int) -> int:
    """costmilp [C4]: the most local stages (of ``gpus_per_stage`` GPUs over all replicas) an option
    of ``cluster`` may have. Proof: a plan using an option with s stages rents those s·gpus_per_stage
    GPUs for its whole iteration time T, so its $ per iteration is >= s·gpus_per_stage·price·T
    (``money``: GPU part = Σ GPUs·price·T, egress >= 0) with T >= time_floor(t_lb) (every plan's
    bottleneck is >= t_lb and time_floor is nondecreasing), and its GPU $ per second is >=
    s·gpus_per_stage·price. Options at or above ``usd_cap`` cannot be in a plan cheaper than the
    incumbent, and options above ``gpu_usd_s_cap`` in no plan within the budget; per option the same
    floor at its own bottleneck (plans containing it have a bottleneck >= its) drops it in the loop."""
    rate = dict(win.gpu_usd_per_s).get(cluster, 0.0)
    if rate <= 0 or gpus_per_stage <= 0:
        return 10**9
    cap = 10**9
    if math.isfinite(win.gpu_usd_s_cap):
        cap = min(cap, int(win.gpu_usd_s_cap * (1 + 1e-12) // (gpus_per_stage * rate)))
    if math.isfinite(win.usd_cap) and win.time_floor is not None:
        t = win.time_floor(win.t_lb)
        if t > 0 and math.isfinite(t):
            per_stage = gpus_per_stage * rate * t
            cap = min(cap, math.ceil(win.usd_cap / per_stage) - 1)  # s·per_stage < usd_cap
    return cap


def _stop_rule(stop_at: np.ndarray, sol: TrunkSolution, dm: np.ndarray, s: int, d_need: int, win: Window,
               min_send: float) -> np.ndarray:
    """[B2] Once an option has bottleneck <= t_lb and fits for every d, a partition with more stages
    of the same config only adds fill (one more boundary: >= min_send) and can lower the tail by at
    most sync_opt − s_lb, so stage counts beyond s + (sync_opt − s_lb) / min_send are dominated."""
    done = sol.feasible & (sol.bottleneck <= win.t_lb) & (dm >= d_need)
    if min_send <= 0:
        extra = np.where(done, 10**9, 0)
    else:
        extra = np.ceil(np.maximum(sol.sync_opt - win.s_lb, 0.0) / min_send)
    return np.where(done, np.minimum(stop_at, s + extra), stop_at).astype(np.int64)


def _ladder(tc: TrunkCosts, s: int, d_lo: int, d_cap: int, m: int, ns: np.ndarray, *,
            front: bool = False, weight: float | None = None) -> list[tuple[TrunkSolution, np.ndarray, np.ndarray]]:
    """Solutions at d = d_lo, then at the next d where some n's best partition stops fitting, up to
    D_STEPS steps, then at d_cap [B1]. Returns (solution, mask of n whose option is new). ``weight``:
    the objective's weight of the bottleneck (the window's; m − 1 when omitted), so that each
    partition is the best one for the objective the options enter [C3b]. relaxspeed: each with its
    ``_dmax`` (computed once)."""
    out: list[tuple[TrunkSolution, np.ndarray, np.ndarray]] = []
    d = d_lo
    covered = np.full(len(ns), -1.0)  # largest d already covered per n
    for step in range(D_STEPS + 2):
        sol = solve_trunk(tc, s, d, m, ns, front=front, weight=weight)
        if sol is None:
            break
        new = sol.feasible & (covered < d)
        if not new.any() and not (sol.feasible & (covered < d_cap)).any():
            break
        dm = _dmax(tc, sol, m)
        out.append((sol, new, dm))
        covered = np.where(new, np.minimum(dm, d_cap), covered)
        todo = sol.feasible & (covered < d_cap)
        if not todo.any() or d >= d_cap:
            break
        nxt = int(covered[todo].min()) + 1
        d = nxt if step < D_STEPS else d_cap
        d = min(max(d, d_lo), d_cap)
    return out


def _dmax(tc: TrunkCosts, sol: TrunkSolution, m: int) -> np.ndarray:
    """Per n: the most stages after the block for which the chosen partition fits [C6]: a stage with
    r stages from it to the block's end keeps min(r + d, m) microbatches, so it needs
    d <= kmax − r unless kmax >= m."""
    s, geo = sol.s, tc.geo
    parts: list[tuple[np.ndarray, int]] = []
    if s == 1:
        lo = np.array([geo.whole(int(n))[0] for n in sol.ns])
        hi = np.array([geo.whole(int(n))[1] for n in sol.ns])
        parts.append((tc.sm.max_in_flight_v(lo, hi), 1))
    else:
        if geo.p:
            parts.append((tc.kmax("f")[sol.x0], s))
        if geo.q:
            parts.append((tc.kmax("l")[sol.xl], 1))
    dm = np.full(len(sol.ns), INF)
    for km, r in parts:
        dm = np.minimum(dm, np.where(km < m, km - r, INF))
    if s > 1 and sol.counts:  # relaxspeed: the trunk stages at once (stage j at distance s − int(p > 0) − j)
        km = tc.kmax("t")[np.stack(sol.counts)]
        r = (s - int(bool(geo.p)) - np.arange(len(sol.counts)))[:, None]
        dm = np.minimum(dm, np.where(km < m, km - r, INF).min(axis=0))
    return dm


def _collect(cands: dict[int, list[BlockOption]], sol: TrunkSolution, new: np.ndarray, cluster: str, role: Role,
             cfg: LocalConfig, tc: TrunkCosts, m: int, dm: np.ndarray) -> None:
    """The options of ``sol`` marked ``new`` into ``cands`` (``dm``: ``_dmax`` of ``sol``, from ``_ladder``)."""
    for i in np.flatnonzero(new):
        n = int(sol.ns[i])
        bounds = sol.bounds(int(i))
        suffix, prefix, inner = _trips(tc.sm, bounds, m)
        cands.setdefault(n, []).append(BlockOption(
            cluster=cluster, role=role, n=n, cfg=cfg, bounds=bounds,
            bottleneck=max(float(sol.bottleneck[i]), inner), fill=suffix[-1], sync_opt=float(sol.sync_opt[i]),
            dmax=float(dm[i]), suffix_fill=suffix, prefix_trip=prefix,
        ))


def _trips(sm: StageModel, bounds: tuple[int, ...], m: int) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(fill of the last r local stages, round trip of the first r local stages, r = 1..s; the
    round-trip pace of the windows inside the block [C3], ``pipeline.round_trip_pace``). A stage's
    fill is its fwd+bwd plus its send forward and backward to the next local stage."""
    lo, hi = np.array(bounds[:-1]), np.array(bounds[1:])
    t = sm.compute(lo, hi)
    sends = np.zeros(len(t))
    if len(hi) > 1:
        sends[:-1] = sm.send(hi[:-1])
    e = stage_fill(t, sends, sends)
    suffix = tuple(float(x) for x in np.cumsum(e[::-1]))
    prefix = tuple(float(x) for x in np.cumsum(e) - stage_fill(0.0, sends, sends))
    windows = ROUND_TRIP_WINDOWS == "all" and search_windows()  # [C3b] not under the replay
    inner = round_trip_pace(t.tolist(), sends.tolist(), sends.tolist(), m) if windows else 0.0
    return suffix, prefix, inner


def _dominance_filter(opts: list[BlockOption], role: Role, win: Window) -> list[BlockOption]:
    """[B3] Drop options some other option of the same (cluster, role, n) beats in every plan:
    o beats o' when swapping o' for o cannot raise the objective,
    w·(T_o − T_o')⁺ + (F_o − F_o') + (S_o − S_o')⁺ <= 0 with T, S clamped below at t_lb, s_lb
    (every plan's bottleneck and tail are at least that), when stages come before the block the
    same local stage count (memory of earlier stages; their 1F1B round trip), when stages follow it
    dmax_o >= dmax_o', and the fill of every suffix of local stages no larger (round trip); with
    compressed links also mbs_o <= mbs_o' (the cast time of a compressed boundary [M19])."""
    if not opts:
        return []
    use_s = role in ("middle", "end")
    use_d = role in ("first", "middle")
    T = np.array([max(o.bottleneck, win.t_lb) for o in opts])
    F = np.array([o.fill for o in opts])
    S = np.array([max(o.sync_opt, win.s_lb) for o in opts])
    st = np.array([o.s for o in opts])
    dm = np.array([o.dmax if use_d else 0.0 for o in opts])
    mb = np.array([o.cfg.mbs if win.mbs_matters and role != "only" else 0 for o in opts])
    gp = np.array([o.gpus if win.gpus_matter else 0 for o in opts])  # costmilp: cost dominance
    width = int(st.max())
    prof = np.full((len(opts), width), INF)
    pre = np.full((len(opts), width), INF)
    for i, o in enumerate(opts):
        prof[i, : o.s] = o.suffix_fill
        pre[i, : o.s] = o.prefix_trip
    order = np.lexsort((st, S, F, T))
    kept: list[int] = []
    tol = 1e-12
    for i in order:
        if kept:
            k = np.array(kept)
            worse = weighted_time(win.weight, np.maximum(T[k] - T[i], 0.0), F[k] - F[i]) + np.maximum(S[k] - S[i], 0.0)
            if win.per_stage > 0:  # [C3b] the objective's stage term: fewer stages may cost more
                worse = worse + win.per_stage * np.maximum(st[i] - st[k], 0)
            same_s = (st[k] == st[i]) if use_s else (st[k] <= st[i])
            rt = np.all(np.where(np.isfinite(prof[k]), prof[k] <= prof[i] + tol * (abs(F[i]) + 1.0), True), axis=1)
            if use_s and ROUND_TRIP_WINDOWS == "all":  # windows entering the block from an earlier one
                rt &= np.all(np.where(np.isfinite(pre[k]), pre[k] <= pre[i] + tol * (abs(F[i]) + 1.0), True), axis=1)
            beats = (worse <= tol * (abs(F[i]) + 1.0)) & same_s & (dm[k] >= dm[i]) & rt & (mb[k] <= mb[i]) & (gp[k] <= gp[i])
            if beats.any():
                continue
        kept.append(int(i))
    return [opts[i] for i in kept]


# --------------------------------------------------------------------------------------------
# Cheap bounds of a batch split [B4]
# --------------------------------------------------------------------------------------------
GRID_RATIO = 1.01
"""Spacing of the bottleneck grid on which the cheap bound is evaluated."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheapBounds:
    """Valid lower bounds for every plan of one batch split (k pipelines, microbatch, m) [B4]."""

    t_lb: float
    """Bottleneck: a cluster hosting n trunk layers in s stages of one config has a stage with
    >= ceil(n / s) layers, and all layers must be hosted (fluid over clusters)."""
    s_lb: float
    """Tail [C7o]: the iteration ends at least the first stage's sync + optimizer after the pipeline
    (``LocalPlan.sync_opt_s``), and the first stage holds at least layers [0, max(p, 1)): the least
    ``StageModel.first_tail`` of that range over the configs."""
    weight: float
    """``pipeline.search_weight``: m − 1 under the closed form, [C3b]'s ``bound_weight`` (valid for the
    exact timeline [C3x]) under the replay."""
    grid: tuple[float, ...]
    """Bottleneck values tau_0 = t_lb < tau_1 < ...; bound on plans with bottleneck in
    [tau_i, tau_{i+1}): weight·tau_i + fill_lb(tau_{i+1}) + s_lb."""
    fill_at: tuple[float, ...]
    """fill_lb(tau_i): least fill of any plan whose bottleneck is at most tau_i (inf: none)."""
    f_lb: float
    """Least fill of any plan at all (fill_at of the largest grid point)."""
    offset: float = 0.0
    """[C3b] ``pipeline.bound_offset``: subtracted once (w̄·E, the forward seconds beyond ρ·t)."""
    busy: float = 0.0
    """[C3b] m under the replay (``pipeline.replay_bounds``): every plan also costs >= m·B + s_lb (a
    stage's m microbatches back to back, T ≥ A_s + B_s + m·t_s; a boundary's T ≥ R_0 + (m − 1)·o ≥ m·o);
    0 under the closed form (where m·B ≤ (m − 1)·B + fill adds nothing)."""
    max_stages: int = 1
    """Most stages a plan of the split can have (its GPUs over the fewest per stage; its layers)."""
    fwd_share: tuple[float, float] = (1.0, 0.0)
    """(ρ, E) of ``compute.forward_share_of`` at the split's microbatch."""

    @property
    def value(self) -> float:
        return self.lb_above(self.t_lb)

    def reweighted(self, num_microbatches: int) -> "CheapBounds":
        """The same structure for another m (weight and offset of [C3b]; grid and fills do not depend
        on m), for callers that re-use one (k, B) structure over several shares (``master``)."""
        rho, e = self.fwd_share
        return dataclasses.replace(self, weight=search_weight(num_microbatches, self.max_stages, rho),
                                   offset=search_offset(num_microbatches, self.max_stages, e),
                                   busy=float(num_microbatches) if replay_bounds() else 0.0)

    def lb_above(self, t: float) -> float:
        """Lower bound on every plan whose bottleneck is >= t."""
        best = math.inf
        for i, tau in enumerate(self.grid):
            hi = self.grid[i + 1] if i + 1 < len(self.grid) else math.inf
            if hi <= t:
                continue
            f = self.fill_at[i + 1] if i + 1 < len(self.grid) else self.f_lb
            x = max(tau, t)
            best = min(best, max(weighted_time(self.weight, x, f) - self.offset, self.busy * x) + self.s_lb)
        return best


@dataclass(frozen=True, kw_only=True, slots=True)
class _Cfg:
    stages: int
    gpus: int
    t1: float
    jmax: int


def cheap_bounds(instance: Instance, tables: CostTables, *, replicas: int, microbatch: int,
                 num_microbatches: int, links: LinkPolicy | None = None) -> CheapBounds:
    """[B4] Bounds of the split from per-layer costs only (no partition search). WAN hand-overs are
    costed at the fastest precision ``links`` allows, with a one-sample cast (a lower bound)."""
    shape = model_shape(instance)
    t0, L = shape.p, shape.num_layers
    special = list(range(shape.p)) + list(range(L - shape.q, L))
    rows: dict[str, list[_Cfg]] = {}
    f_min = {l: INF for l in [t0, *special]}
    s_first = INF
    head = (np.array([0]), np.array([max(shape.p, 1)]))  # [C7o] layers the pipeline's first stage always holds
    for c in instance.topology.clusters:
        budget = c.num_gpus // replicas
        rows[c.name] = []
        for cfg in local_configs(instance, c.name, microbatch, tables):  # every layout a plan may use [I3r]
            if cfg.gpus > budget:
                continue
            sm = StageModel(instance, tables, c, cfg, replicas)
            for l in f_min:
                one = (np.array([l]), np.array([l + 1]))
                f_min[l] = min(f_min[l], float(sm.compute(*one)[0]))
            s_first = min(s_first, float(sm.first_tail(*head, monotone=True)[0]))  # zero1ov: bounds longer first stages
            j = np.arange(1, shape.trunk + 1)
            fits = sm.max_in_flight_v(np.full_like(j, t0), t0 + j) >= 1
            jmax = int(np.argmin(fits)) if not fits.all() else shape.trunk
            if jmax >= 1:
                t1 = float(sm.compute(np.array([t0]), np.array([t0 + 1]))[0])
                rows[c.name].append(_Cfg(stages=budget // cfg.gpus, gpus=cfg.gpus, t1=t1, jmax=jmax))
    t_lb = _fluid(rows, shape.trunk)
    wan = (INF, INF)
    if len(instance.topology.clusters) > 1:  # no layout floor here: every split gets this bound first
        # (gaps2: with the analytic floor [M8f] no cheap bound of sailor-geo-5x32 moved, least 1.492796 s
        # both ways, for 30 % more CPU: the least pace and fill over all arcs are the intra-region ones)
        arcs = [(e.bound_pace(1.0), e.fill(1.0))  # [C3b] under the replay a hand-over's term is its occupancy
                for a in instance.topology.clusters for b in instance.topology.clusters if a.name != b.name
                for e in arc_precisions(instance, tables, a.name, b.name, microbatch, replicas, links, shape)]
        wan = (min(x for x, _ in arcs), min(y for _, y in arcs))
    extra = sum(f_min[l] for l in special)
    max_stages = min(sum(max((r.stages for r in rs), default=0) for rs in rows.values()), L)
    rho, excess = forward_share_of(tables, microbatch)
    budgets = {c.name: c.num_gpus // replicas for c in instance.topology.clusters}
    full = _grid(t_lb, rows)
    # [C3b] the weight and offset valid for the exact timeline (not [C3]'s m − 1)
    s_lb, w = s_first, search_weight(num_microbatches, max_stages, rho)
    off = search_offset(num_microbatches, max_stages, excess)
    # the least fill of any plan: at the grid's top every stage may hold its most layers; plans
    # across clusters need a bottleneck >= the fastest hand-over's pace, which may lie above it
    top = max(full[-1], wan[0]) if full and math.isfinite(wan[0]) else (full[-1] if full else INF)
    parts: dict[tuple[int, bytes], tuple[float, np.ndarray | None]] = {}  # relaxspeed: _fill_lb's per-cluster parts
    floor = _fill_lb(rows, budgets, shape.trunk, top, wan, extra, parts) if full else INF
    grid: list[float] = []
    fill: list[float] = []
    best = INF
    for tau in full:  # stop once w·tau alone makes every later interval worse than the best one
        if weighted_time(w, tau, floor) + s_lb - off >= best:
            break
        grid.append(tau)
        fill.append(_fill_lb(rows, budgets, shape.trunk, tau, wan, extra, parts))
        if len(fill) >= 2:
            best = min(best, weighted_time(w, grid[-2], fill[-1]) + s_lb - off)
    return CheapBounds(t_lb=t_lb, s_lb=s_lb, weight=w, grid=tuple(grid), fill_at=tuple(fill), f_lb=floor,
                       offset=off, max_stages=max_stages, fwd_share=(rho, excess),
                       busy=float(num_microbatches) if replay_bounds() else 0.0)


def _grid(t_lb: float, rows: dict[str, list[_Cfg]]) -> tuple[float, ...]:
    """Geometric grid from t_lb to the largest bottleneck any single stage can have."""
    if not math.isfinite(t_lb):
        return ()
    top = max((r.t1 * r.jmax for rs in rows.values() for r in rs), default=t_lb)
    out, tau = [t_lb], t_lb
    while tau < top:
        tau *= GRID_RATIO
        out.append(tau)
    return tuple(out)


def _fill_lb(rows: dict[str, list[_Cfg]], budgets: dict[str, int], trunk: int, tau: float,
             wan: tuple[float, float], extra: float,
             parts: dict[tuple[int, bytes], tuple[float, np.ndarray | None]] | None = None) -> float:
    """[B4] Least fill of the trunk when every stage's compute is <= tau: a cluster spends a fraction
    of its GPUs on each config; config i holds min(floor(tau/t1), jmax) layers per stage of g GPUs
    at t1 fill per layer (a fractional, convex relaxation solved greedily over marginal costs).
    A plan on one cluster needs no WAN; a plan on several pays at least the cheapest hand-over's
    fill (``wan`` = (least pace, least fill) over the links) and has bottleneck >= the least pace, so
    below that only single-cluster plans count."""
    marginals = []
    single = INF
    for name, rs in rows.items():
        # relaxspeed: a cluster's part depends on tau only through the layers per stage of each config, so
        # it is computed once per such vector (``parts``, one cheap_bounds call) and per cluster
        per_stage = [min(int(tau / r.t1 + 1e-9), r.jmax) for r in rs]
        key = (id(rs), budgets[name], np.array(per_stage, dtype=np.int64).tobytes())
        if parts is None or key not in parts:
            part = _cluster_fill(rs, per_stage, budgets[name], trunk)
            if parts is not None:
                parts[key] = part
        else:
            part = parts[key]
        one, marg = part
        single = min(single, one)
        if marg is not None:
            marginals.append(marg)
    multi = INF
    if marginals and tau >= wan[0]:
        allm = np.sort(np.concatenate(marginals))
        if len(allm) >= trunk and np.isfinite(allm[trunk - 1]):
            multi = float(allm[:trunk].sum()) + wan[1]
    return min(single, multi) + extra


def _cluster_fill(rs: list[_Cfg], per_stage: list[int], budget: int, trunk: int) -> tuple[float, np.ndarray | None]:
    """[B4] One cluster's part of ``_fill_lb`` with ``per_stage[i]`` layers per stage of config i: the
    least fill of the whole trunk on it (inf: it cannot host it) and its marginal fill per layer hosted
    (None: no config holds a layer)."""
    pts = [(r.gpus / j, r.t1) for r, j in zip(rs, per_stage) if j >= 1]
    if not pts:
        return INF, None
    rho, cost = _lower_hull(pts)
    n = np.arange(1, trunk + 1)
    per = budget / n  # GPUs per layer available when hosting n layers
    ok = per >= rho[0] * (1 - 1e-12)
    h = np.interp(per, rho, cost)  # cost per layer at that resource per layer (convex, decreasing)
    g = np.where(ok, n * h, INF)
    single = float(g[-1]) if ok[-1] else INF
    with np.errstate(invalid="ignore"):
        marg = np.diff(np.concatenate(([0.0], g)))
    return single, np.where(ok, marg, INF)


def _lower_hull(pts: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Lower convex envelope of (resource per layer, cost per layer) points, as arrays sorted by
    resource, keeping only the part where cost decreases with resource."""
    pts = sorted(set(pts))
    hull: list[tuple[float, float]] = []
    for p in pts:
        if hull and p[1] >= hull[-1][1]:
            continue  # more resource for no lower cost
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    return np.array([p[0] for p in hull]), np.array([p[1] for p in hull])


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _fluid(rows: dict[str, list[_Cfg]], trunk: int) -> float:
    """Smallest t at which the clusters together can host ``trunk`` layers (inf: never)."""
    points = sorted({j * r.t1 for rs in rows.values() for r in rs for j in range(1, min(r.jmax, trunk) + 1)})

    def enough(t: float) -> bool:
        return sum(min(trunk, max((r.stages * min(int(t / r.t1 + 1e-9), r.jmax) for r in rs), default=0))
                   for rs in rows.values()) >= trunk

    if not points or not enough(points[-1]):
        return INF
    lo, hi = 0, len(points) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if enough(points[mid]):
            hi = mid
        else:
            lo = mid + 1
    return points[lo]


def arc_times(instance: Instance, per_sample: float, a: str, b: str, microbatch: int, pipelines: int) -> tuple[float, float]:
    """(pace, fill) of a hand-over from cluster a to cluster b [C4, C4w]: the activations of all k
    pipelines' microbatches share link a→b and their gradients share link b→a; pace is the slower
    direction, fill the sum of both."""
    load = pipelines * (microbatch * per_sample * 1.0)
    fwd = _handover(instance, a, b, microbatch, microbatch * per_sample, load, pipelines)
    bwd = _handover(instance, b, a, microbatch, microbatch * per_sample, load, pipelines)
    return max(fwd, bwd), fwd + bwd


def _handover(instance: Instance, a: str, b: str, microbatch: int, nbytes: float, load: float, copies: int) -> float:
    """links: lower bound of evaluate's hand-over a -> b of ``copies`` identical pipelines (per-flow
    link, aggregate cap, node NICs; hgopt/cost/links.py): each side has at most its cluster's nodes."""
    t = instance.topology
    ca, cb = t.cluster(a), t.cluster(b)
    return handover_lower_bound(t.link_spec(a, b), ca.inter_node, cb.inter_node, nbytes, load, microbatch,
                                ca.nodes, cb.nodes, copies)


# --------------------------------------------------------------------------------------------
# Link precision of inter-cluster boundaries [M17]-[M19]
# --------------------------------------------------------------------------------------------
NATIVE_PAIR: tuple[str, str] = ("native", "native")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkPolicy:
    """What an inter-cluster boundary of the exact planner may carry (formulations/cluster_milp.md §7).
    Boundaries inside a cluster stay native."""

    pairs: tuple[tuple[str, str], ...] = (NATIVE_PAIR,)
    """Allowed (forward activations, backward gradients) precisions of an inter-cluster boundary."""
    max_compressed: int | None = None
    """At most this many boundaries per pipeline with a compressed direction (None: no limit) [M18]."""
    penalty_s: tuple[tuple[str, float], ...] = ()
    """Seconds added to the objective per boundary compressed to a precision (half per direction)."""

    @property
    def compresses(self) -> bool:
        return any(p != NATIVE_PAIR for p in self.pairs)

    def pair_penalty(self, pair: tuple[str, str]) -> float:
        pen = dict(self.penalty_s)
        return sum(0.5 * pen.get(p, 0.0) for p in pair if p != "native")

    def plan_penalty(self, pipelines: tuple[Pipeline, ...]) -> float:
        """The penalty a plan pays: its costliest pipeline's sum over its boundaries."""
        if not self.penalty_s:
            return 0.0
        return max((sum(self.pair_penalty((b.fwd, b.bwd)) for b in p.boundaries) for p in pipelines), default=0.0)

    def max_penalty(self, boundaries: int) -> float:
        """The most penalty any plan with at most ``boundaries`` inter-cluster boundaries pays."""
        worst = max((self.pair_penalty(p) for p in self.pairs), default=0.0)
        n = boundaries if self.max_compressed is None else min(boundaries, self.max_compressed)
        return worst * max(n, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ArcPrecision:
    """A hand-over a→b at one (forward, backward) precision pair [C4, C4q, C4w]: transfer seconds of
    all k pipelines' bytes per microbatch on link a→b (activations) and b→a (gradients), plus the
    cast time per sample of the largest block one replica sends to one replica (× min(mbs_a, mbs_b)
    in a plan, [M19])."""

    pair: tuple[str, str]
    fwd: float
    bwd: float
    q_fwd: float = 0.0
    q_bwd: float = 0.0
    penalty: float = 0.0
    lat_fwd: float = 0.0
    lat_bwd: float = 0.0
    """[C3b] The latency parts of ``fwd`` / ``bwd`` (``evaluate.boundary_latency`` of a hand-over a→b):
    a message occupies its boundary only for the rest, so the exact timeline's boundary term is
    (m − 1)·occupancy, not (m − 1)·pace."""

    @property
    def compressed(self) -> bool:
        return self.pair != NATIVE_PAIR

    def pace(self, mu: float) -> float:
        """Seconds per microbatch of the slower direction with blocks of ``mu`` samples."""
        return max(self.fwd + mu * self.q_fwd, self.bwd + mu * self.q_bwd)

    def fill(self, mu: float) -> float:
        return self.fwd + self.bwd + mu * (self.q_fwd + self.q_bwd)

    def occupancy(self, mu: float) -> float:
        """[C3b] Seconds per microbatch the slower direction occupies the boundary at least (transfer less
        latency): what a lower bound of the exact timeline may weigh with ``pipeline.bound_weight``. The
        casts are left out (``mu`` is unused): [C3n] counts them in a message's delay, not its occupancy
        (``evaluate._shared_nic_inputs``), so only the transfer is a lower bound for both replays."""
        del mu
        return max(self.fwd - self.lat_fwd, self.bwd - self.lat_bwd)

    def bound_pace(self, mu: float) -> float:
        """The pace the bounds weigh: :meth:`occupancy` under the replay, :meth:`pace` under the
        closed form (``pipeline.replay_bounds``)."""
        return self.occupancy(mu) if occupancy_bounds() else self.pace(mu)  # [C3c] closed8


HandoverKey = tuple[int, int, int]
"""(tp, dp, mbs) of a block's local stages: all a hand-over's time depends on at each end [C4]."""


def _probe(a: str, b: str, ka: HandoverKey, kb: HandoverKey, pair: tuple[str, str], shape: ModelShape) -> Pipeline:
    """A two-stage pipeline whose one boundary is a hand-over a→b between blocks of layouts ka, kb
    at a trunk boundary (every one carries the same bytes per sample)."""
    cut, L = shape.p + 1, shape.num_layers
    ga = ReplicaGroup(cluster=a, tp=ka[0], dp=ka[1], mbs=ka[2])
    gb = ReplicaGroup(cluster=b, tp=kb[0], dp=kb[1], mbs=kb[2])
    native = pair == NATIVE_PAIR
    return Pipeline(stages=(Stage(start=0, end=cut, groups=(ga,), zero=1), Stage(start=cut, end=L, groups=(gb,), zero=1)),
                    num_microbatches=1, boundaries=() if native else (Boundary(fwd=pair[0], bwd=pair[1]),))  # type: ignore[arg-type]


def handover_times(instance: Instance, tables: CostTables, a: str, b: str, ka: HandoverKey, kb: HandoverKey,
                   pipelines: int, pair: tuple[str, str] = NATIVE_PAIR,
                   shape: ModelShape | None = None) -> tuple[float, float]:
    """[M8f] The exact (forward, backward) seconds of a hand-over from a block of layout ``ka`` in
    cluster a to a block of layout ``kb`` in cluster b, for ``pipelines`` identical pipelines, at
    precision ``pair``: ``evaluate``'s own ``stage_boundary_time`` on a two-stage probe cut at a trunk
    boundary. Exact for every plan of the MILP's space, not only a bound: a hand-over a→b is between
    a's last local stage and b's first (each one ReplicaGroup of that layout), at a trunk boundary
    (every one carries the same bytes per sample; a prefix-only first block is allowed only when its
    output is that size, ``ModelShape.boundary_ok_after_prefix``); each cluster appears once per chain,
    so link a→b carries only this boundary's activations and b→a only its gradients, which is what the
    probe's own loads are (``stage_boundary_time`` without ``wan_loads``: this pipeline's, times
    ``pipelines`` copies sharing nodes as ``evaluate`` places them)."""
    from hgopt.cost.evaluate import stage_boundary_time  # the kernel's own hand-over [C4]

    probe = _probe(a, b, ka, kb, pair, shape or model_shape(instance))
    return stage_boundary_time(instance, tables, probe, 0, copies=pipelines)


FLOOR_MAX_CLUSTERS = 8
"""Above this many clusters the arcs keep the layout-free ``handover_lower_bound`` only (the layout
floor [M8f] is |layouts|² arithmetic per arc and split: about 0.15 ms per arc on sailor-geo-5x32)."""


def _layouts(instance: Instance, tables: CostTables, cluster: str, microbatch: int, pipelines: int) -> list[HandoverKey]:
    """One (tp, dp, mbs) per distinct placement of a block's stage of ``cluster`` within the split's
    GPU budget: ``evaluate`` places a group by replicas per node (``replicas_per_node(gpus_per_node,
    tp)``), dp and mbs, so layouts equal in those three move the same flows (their casts, which also
    depend only on mbs, are not part of the floor)."""
    c = instance.topology.cluster(cluster)
    budget = c.num_gpus // pipelines
    seen: dict[tuple[int, int, int], HandoverKey] = {}
    for cfg in local_configs(instance, cluster, microbatch, tables):
        if cfg.gpus <= budget:
            seen.setdefault((replicas_per_node(c.gpus_per_node, cfg.tp), cfg.dp, cfg.mbs), (cfg.tp, cfg.dp, cfg.mbs))
    return list(seen.values())


def layout_floor(instance: Instance, tables: CostTables, a: str, b: str, microbatch: int, pipelines: int,
                 pair: tuple[str, str], shape: ModelShape) -> tuple[float, float]:
    """[M8f] The least transfer seconds (forward, backward; casts excluded) of a hand-over a→b over
    every pair of layouts the split allows at its two ends (``_layouts``): ``links.handover_floor``
    from each layout's node tiling (gaps2: analytic, at most ``stage_boundary_time`` less its
    ``boundary_cast_times`` for every such pair; on the shipped five-zone instances equal to the
    least of those over the pairs). Every plan of the split hands over between two such layouts, so
    this bounds its transfer from below; it is tighter than ``handover_lower_bound`` (which lets the
    microbatch spread over nodes_a + nodes_b − 1 node-pair flows, where a block's node tiles leave its
    largest flow at the first nodes' overlap: 3× on sailor-geo-5x32's WAN links). (inf, inf) when
    either side has no layout."""
    topo = instance.topology
    ca, cb = topo.cluster(a), topo.cluster(b)
    tiles = {c.name: [(replicas_per_node(c.gpus_per_node, tp), dp, mbs)
                      for tp, dp, mbs in _layouts(instance, tables, c.name, microbatch, pipelines)] for c in (ca, cb)}
    per_sample = float(tables.activation_bytes[shape.p])
    ff, fb = (link_bytes_factor(instance.model.dtype, x) for x in pair)
    fwd = handover_floor(topo.link_spec(a, b), ca.inter_node, cb.inter_node, per_sample * ff, microbatch,
                         tiles[a], tiles[b], pipelines)
    bwd = handover_floor(topo.link_spec(b, a), cb.inter_node, ca.inter_node, per_sample * fb, microbatch,
                         tiles[b], tiles[a], pipelines)
    return fwd, bwd


ArcTable = dict[tuple[str, str], tuple["ArcPrecision", ...]]


def arc_table(instance: Instance, tables: CostTables, microbatch: int, pipelines: int,
              links: LinkPolicy | None = None, shape: ModelShape | None = None) -> ArcTable:
    """``arc_precisions`` of every ordered cluster pair of a split, with the layout floor [M8f] when
    the instance has at most FLOOR_MAX_CLUSTERS clusters (computed once per split for its relaxation
    and its MILP; the cheap bound [B4], which every split gets first, does without)."""
    shape = shape or model_shape(instance)
    names = [c.name for c in instance.topology.clusters]
    use_floor = 1 < len(names) <= FLOOR_MAX_CLUSTERS
    return {(a, b): arc_precisions(instance, tables, a, b, microbatch, pipelines, links, shape, floor=use_floor)
            for a in names for b in names if a != b}


def arc_precisions(instance: Instance, tables: CostTables, a: str, b: str, microbatch: int, pipelines: int,
                   links: LinkPolicy | None = None, shape: ModelShape | None = None,
                   floor: bool = False) -> tuple[ArcPrecision, ...]:
    """Every allowed precision pair of a hand-over a→b at the trunk's boundary size. Transfer times as
    ``arc_times`` with the byte factor (with ``floor``, at least the least transfer over the split's
    layout pairs, ``layout_floor`` [M8f]); the cast time per sample from ``evaluate``'s own boundary
    time (``boundary_cast_times`` of a one-sample probe)."""
    from hgopt.cost.evaluate import boundary_latency  # the kernel's latency part of a send [C3x]

    pol = links or LinkPolicy()
    shape = shape or model_shape(instance)
    per_sample = float(tables.activation_bytes[shape.p])
    load = pipelines * (microbatch * per_sample * 1.0)
    cut, L = shape.p + 1, shape.num_layers
    lat = boundary_latency(instance, Pipeline(stages=(Stage(start=0, end=cut, groups=(ReplicaGroup(cluster=a),)),
                                                      Stage(start=cut, end=L, groups=(ReplicaGroup(cluster=b),))),
                                              num_microbatches=1), 0)
    out = []
    for pf, pb in pol.pairs:
        ff, fb = (link_bytes_factor(instance.model.dtype, p) for p in (pf, pb))
        fwd = _handover(instance, a, b, microbatch, microbatch * per_sample * ff, load * ff, pipelines)  # links
        bwd = _handover(instance, b, a, microbatch, microbatch * per_sample * fb, load * fb, pipelines)  # links
        if floor:  # [M8f] no layout pair of the split moves it faster
            f_lo, b_lo = layout_floor(instance, tables, a, b, microbatch, pipelines, (pf, pb), shape)
            fwd, bwd = max(fwd, f_lo), max(bwd, b_lo)
        qf = qb = 0.0
        if (pf, pb) != NATIVE_PAIR:
            probe = Pipeline(stages=(Stage(start=0, end=cut, groups=(ReplicaGroup(cluster=a),)),
                                     Stage(start=cut, end=L, groups=(ReplicaGroup(cluster=b),))),
                             num_microbatches=1, boundaries=(Boundary(fwd=pf, bwd=pb),))  # type: ignore[arg-type]
            qf, qb = boundary_cast_times(instance, tables, probe, 0)  # links: the cast alone
        out.append(ArcPrecision(pair=(pf, pb), fwd=fwd, bwd=bwd, q_fwd=qf, q_bwd=qb, penalty=pol.pair_penalty((pf, pb)),
                                lat_fwd=min(lat[0], fwd), lat_bwd=min(lat[1], bwd)))
    return tuple(out)
