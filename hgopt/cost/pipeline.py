"""Pipeline composition [C3]: how per-stage times and boundary times make one pipeline's time.

The one definition of the steady-state weight (m − 1), the pipeline time (m − 1)·bottleneck + fill,
the in-flight depth of a stage, the 1F1B round-trip pace over every contiguous window of stages, the
GPipe variant, and the end of each stage's last backward (for the overlapped gradient sync [C7o]).
Every function takes plain floats or numpy arrays (elementwise) unless it says otherwise; the search
and ``evaluate`` both call these. Equations: ``formulations/cost_model.md``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence, TypeVar

import numpy as np

__all__ = [
    "EVALUATE_1F1B",
    "ROUND_TRIP_WINDOWS",
    "BUSY_SHARES",
    "bound_offset",
    "bound_weight",
    "busy_blend_bound",
    "busy_blend_weight",
    "stage_line",
    "Composition",
    "replay_bounds",
    "search_composition",
    "search_offset",
    "search_weight",
    "search_windows",
    "forward_share",
    "replay_floor",
    "warmup_cap",
    "window_cycles",
    "window_weight",
    "fill_time",
    "in_flight",
    "last_backward_ends",
    "pipeline_bottleneck",
    "path_time",
    "pipeline_time",
    "replay_shared_nics",
    "replay_stage_ends",
    "reweighted_bound",
    "round_trip_pace",
    "stage_pace",
    "stages_that_matter",
    "stage_fill",
    "steady_weight",
    "weighted_time",
    "trip_depth",
    "window_trip",
]

Num = TypeVar("Num", float, np.ndarray)


def steady_weight(num_microbatches: int) -> float:
    """The steady-state weight m − 1: the microbatches after the first one [C3]."""
    return float(num_microbatches - 1)


def weighted_time(weight: float, bottleneck: Num, fill: Num) -> Num:
    """[C3] weight·bottleneck + fill: the pipeline time with the steady-state weight given (the
    search's objectives and bounds take the weight once per batch split)."""
    return weight * bottleneck + fill  # type: ignore[return-value]


def pipeline_time(num_microbatches: int, bottleneck: Num, fill: Num) -> Num:
    """[C3] (m − 1)·bottleneck + fill (one microbatch's trip through and back, R_0)."""
    return weighted_time(steady_weight(num_microbatches), bottleneck, fill)


def stage_fill(t: Num, send_f: Num, send_b: Num) -> Num:
    """[C3] One stage's share of the fill: fwd + bwd + its send forward + its send backward."""
    return t + send_f + send_b  # type: ignore[return-value]


def in_flight(num_stages: Num | int, stage: Num | int, num_microbatches: Num | int, schedule: str = "1f1b") -> Num:
    """[C6] Microbatches stage ``stage`` (0-based) of ``num_stages`` holds between forward and backward:
    1F1B runs S − s − 1 warm-up forwards and one more before its first backward, so min(S − s, m);
    GPipe holds all m. Elementwise on numpy arrays."""
    if schedule == "gpipe":
        return num_microbatches  # type: ignore[return-value]
    if _is_array(num_stages, stage, num_microbatches):
        return np.minimum(np.asarray(num_stages) - stage, num_microbatches)
    return min(num_stages - stage, num_microbatches)  # type: ignore[operator,return-value]


def _is_array(*xs: object) -> bool:
    return any(isinstance(x, np.ndarray) for x in xs)


def stage_pace(t: Num, send_f: Num, send_b: Num) -> Num:
    """[C3] 1F1B steady term of one stage: max(f + b, c^f, c^b) (links are full duplex)."""
    return np.maximum(t, np.maximum(send_f, send_b)) if _is_array(t, send_f, send_b) else max(t, send_f, send_b)  # type: ignore[return-value]


def fill_time(t: Sequence[float], send_f: Sequence[float], send_b: Sequence[float]) -> float:
    """[C3] R_0 = Σ_s (t_s + c^f_s + c^b_s): one microbatch's trip through the pipeline and back."""
    return float(sum(stage_fill(a, b, c) for a, b, c in zip(t, send_f, send_b)))


def stages_that_matter(num_microbatches: int) -> int:
    """[C6] Stages after a stage beyond which its in-flight depth min(S − s, m) no longer grows: m − 1."""
    return max(num_microbatches - 1, 0)


def trip_depth(window_stages: int, num_microbatches: int) -> int:
    """[C3] Microbatches one round trip of a window of n stages advances: min(n, m)."""
    return window_stages if window_stages < num_microbatches else num_microbatches


def window_trip(t: Sequence[float], send_f: Sequence[float], send_b: Sequence[float], s: int, j: int) -> float:
    """[C3] Round trip of the window of stages s..j: Σ_{i=s..j} t_i + Σ_{i=s..j−1} (c^f_i + c^b_i)
    (the links between the window's stages; the link leaving stage j is not on the cycle)."""
    return float(sum(t[s : j + 1]) + sum(send_f[s:j]) + sum(send_b[s:j]))


ROUND_TRIP_WINDOWS: Literal["suffix", "all"] = "all"
"""Windows [C3] prices (a constant, not a setting): ``"all"`` is what the runner's 1F1B order does
(checked against the exact replay, ``tests/test_cost_kernel.py``); ``"suffix"`` (only windows ending
at the last stage) is the model before the fix. ``evaluate``, the MILP rows [M15w] and the
re-partition DP [H8] all read this constant, so the three stay one model."""


EVALUATE_1F1B: Literal["closed", "replay"] = "closed"
"""What ``evaluate`` takes as a 1F1B pipeline's time (a constant, not a setting): ``"closed"`` is
max([C3], [C3p], [C3n] where NIC sharing can matter), the model every bound of the MILP [M15]/[M15w]
is still built on; ``"replay"`` is the exact timeline ([C3n] where NIC sharing can matter, else
[C3x]) with each stage's last backward from it. The bound sites read it too (:func:`replay_bounds`):
under ``"replay"`` the cheap bounds, the relaxation and the grouped bound take [C3b]'s forms and the
MILP's own dual bound (a bound of [C3] only) is not reported, so the two flip together
(``formulations/cost_model.md`` [C3b]; bench/RESULTS.md says what the bounds lose)."""


def round_trip_pace(t: Sequence[float], send_f: Sequence[float], send_b: Sequence[float], num_microbatches: int,
                    windows: Literal["suffix", "all"] = ROUND_TRIP_WINDOWS) -> float:
    """[C3] The least 1F1B pace that every contiguous window of stages s..j allows (``windows="all"``;
    ``"suffix"``: only the windows ending at the last stage).

    In the strict 1F1B order (``hgopt.cost.schedule.stage_ops``) stage s runs its forward of
    microbatch k + (j − s + 1) + w_j only after its backward of k, which comes back from stage j
    after the trip of ``window_trip`` (w_j: stage j's warm-up). The cycle advances j − s + 1
    microbatches (at most m), so the pace is at least trip / min(j − s + 1, m). O(S²)."""
    S, m = len(t), num_microbatches
    best = 0.0
    if windows == "suffix":
        trip = 0.0
        for s in range(S - 1, -1, -1):
            trip += t[s] + send_f[s] + send_b[s] if s < S - 1 else t[s]
            best = max(best, trip / trip_depth(S - s, m))
        return best
    for s in range(S):
        trip = 0.0
        for j in range(s, S):
            trip += t[j] + (send_f[j - 1] + send_b[j - 1] if j > s else 0.0)
            best = max(best, trip / trip_depth(j - s + 1, m))
    return best


def pipeline_bottleneck(
    schedule: str,
    fwd: Sequence[float],
    bwd: Sequence[float],
    send_f: Sequence[float],
    send_b: Sequence[float],
    num_microbatches: int,
    windows: Literal["suffix", "all"] = ROUND_TRIP_WINDOWS,
) -> float:
    """[C3] Steady-state seconds per microbatch. GPipe: max_s max(f_s, c^f_s) + max_s max(b_s, c^b_s);
    1F1B: max(max_s stage_pace, round_trip_pace)."""
    if schedule == "gpipe":
        return max(max(f, c) for f, c in zip(fwd, send_f)) + max(max(b, c) for b, c in zip(bwd, send_b))
    t = [f + b for f, b in zip(fwd, bwd)]
    steady = max(stage_pace(a, c, d) for a, c, d in zip(t, send_f, send_b))
    return max(steady, round_trip_pace(t, send_f, send_b, num_microbatches, windows))


def last_backward_ends(time_s: float, bwd: Sequence[float], send_b: Sequence[float]) -> list[float]:
    """[C7o] When each stage's backward of the last microbatch ends, in the closed form: stage 0 at
    the pipeline time, stage s earlier by the backward path Σ_{i<s} (b_i + c^b_i) from it to stage 0."""
    out, ahead = [], 0.0
    for b, c in zip(bwd, send_b):
        out.append(time_s - ahead)
        ahead += b + c
    return out


StageOps = Callable[[str, int, int, int], Sequence[object]]


def replay_stage_ends(
    stage_ops: StageOps,
    schedule: str,
    fwd: Sequence[float],
    bwd: Sequence[float],
    send_f: Sequence[float],
    send_b: Sequence[float],
    num_microbatches: int,
    latency_f: Sequence[float] | None = None,
    latency_b: Sequence[float] | None = None,
) -> list[float]:
    """[C3x] The exact timeline of one pipeline of single-replica stages with the given times: when each
    stage's last operation ends. Stage s runs ``stage_ops(schedule, s, S, m)`` (pass the runner's
    order, ``hgopt.cost.schedule.stage_ops``: the kernel does not import the runner) one operation
    at a time; F(s, i) waits for F(s − 1, i) to arrive, B(s, i) for B(s + 1, i). Each direction of each boundary carries one message at a time in
    order: a message starts when its operation ends and the previous one has left, occupies the boundary
    for ``send − latency`` and arrives ``send`` after its start (``latency_*`` default 0: the whole
    send time occupies the boundary). No contention between boundaries, directions or pipelines (a
    node's NIC carrying both directions, shared caps): ``hgopt.simulate`` replays those.

    The longest path of the schedule's dependency graph: the reference [C3]'s closed form
    ``(m − 1)·pace + R_0`` approximates (``bench/cost_fidelity.py`` compares them). O(S·m) operations;
    ``evaluate``'s pipeline time under ``EVALUATE_1F1B = "replay"`` (not the default)."""
    S, m = len(fwd), num_microbatches
    lf = latency_f if latency_f is not None else [0.0] * S
    lb = latency_b if latency_b is not None else [0.0] * S
    seq = _op_sequence(stage_ops, schedule, S, m)
    if seq is not None:
        return _replay_by_position(seq, fwd, bwd, send_f, send_b, m, lf, lb)
    orders = [[(str(getattr(op, "kind")), int(getattr(op, "microbatch"))) for op in stage_ops(schedule, s, S, m)]
              for s in range(S)]
    arrive: dict[tuple[str, int, int], float] = {}
    free_f, free_b = [0.0] * S, [0.0] * S  # boundary s (between s and s + 1), each direction
    ptr, clock = [0] * S, [0.0] * S
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for s in range(S):
            order = orders[s]
            while ptr[s] < len(order):
                kind, i = order[ptr[s]]
                first = (kind == "F" and s == 0) or (kind == "B" and s == S - 1)
                ready = 0.0 if first else arrive.get((kind, s, i))
                if ready is None:
                    break
                end = max(clock[s], ready) + (fwd[s] if kind == "F" else bwd[s])
                clock[s], ptr[s], left, progressed = end, ptr[s] + 1, left - 1, True
                if kind == "F" and s + 1 < S:
                    t0 = max(end, free_f[s])
                    free_f[s] = t0 + send_f[s] - lf[s]
                    arrive[("F", s + 1, i)] = t0 + send_f[s]
                elif kind == "B" and s > 0:
                    t0 = max(end, free_b[s - 1])
                    free_b[s - 1] = t0 + send_b[s - 1] - lb[s - 1]
                    arrive[("B", s - 1, i)] = t0 + send_b[s - 1]
        if not progressed:
            raise ValueError("the schedule deadlocks")
    return clock


@functools.lru_cache(maxsize=256)
def _op_sequence(stage_ops: StageOps, schedule: str, num_stages: int,
                 num_microbatches: int) -> tuple[tuple[int, int, bool], ...] | None:
    """Every operation (stage, microbatch, is forward) of the stages' orders in one sequence that meets
    each operation after its input, or None when the orders allow none of this form. In 1F1B (and GPipe)
    F(s, i) sits at a position of stage s's order no earlier than F(s − 1, i) on stage s − 1, and B(s, i)
    no earlier than B(s + 1, i); so visiting positions in turn, each position's forwards by stage
    ascending, then its backwards by stage descending, is such a sequence (checked here, not assumed),
    and each stage's and each boundary's operations keep their order. A memo of a pure function of its
    arguments (``stage_ops`` is a module function); the replay then needs no readiness test."""
    S, m = num_stages, num_microbatches
    orders = [[(str(getattr(op, "kind")) == "F", int(getattr(op, "microbatch"))) for op in stage_ops(schedule, s, S, m)]
              for s in range(S)]
    width = max((len(o) for o in orders), default=0)
    seen_f: set[tuple[int, int]] = set()
    seen_b: set[tuple[int, int]] = set()
    seq: list[tuple[int, int, bool]] = []
    for p in range(width):
        for forward, stages in ((True, range(S)), (False, range(S - 1, -1, -1))):
            for s in stages:
                if p >= len(orders[s]) or orders[s][p][0] != forward:
                    continue
                i = orders[s][p][1]
                if forward and s > 0 and (s - 1, i) not in seen_f:
                    return None
                if not forward and s < S - 1 and (s + 1, i) not in seen_b:
                    return None
                (seen_f if forward else seen_b).add((s, i))
                seq.append((s, i, forward))
    return tuple(seq)


def _replay_by_position(seq: tuple[tuple[int, int, bool], ...], fwd: Sequence[float], bwd: Sequence[float],
                        send_f: Sequence[float], send_b: Sequence[float], m: int,
                        lf: Sequence[float], lb: Sequence[float]) -> list[float]:
    """:func:`replay_stage_ends`'s timeline along :func:`_op_sequence` (same semantics as its event loop)."""
    S = len(fwd)
    arr_f = [[0.0] * m for _ in range(S)]  # arrival of F(s, i)'s input (stage 0: at 0)
    arr_b = [[0.0] * m for _ in range(S)]
    free_f, free_b = [0.0] * S, [0.0] * S
    clock = [0.0] * S
    for s, i, forward in seq:
        if forward:
            ready = arr_f[s][i]
            end = (clock[s] if clock[s] > ready else ready) + fwd[s]
            clock[s] = end
            if s + 1 < S:
                t0 = end if end > free_f[s] else free_f[s]
                free_f[s] = t0 + send_f[s] - lf[s]
                arr_f[s + 1][i] = t0 + send_f[s]
        else:
            ready = arr_b[s][i]
            end = (clock[s] if clock[s] > ready else ready) + bwd[s]
            clock[s] = end
            if s > 0:
                t0 = end if end > free_b[s - 1] else free_b[s - 1]
                free_b[s - 1] = t0 + send_b[s - 1] - lb[s - 1]
                arr_b[s - 1][i] = t0 + send_b[s - 1]
    return clock


def _chain(fwd: Sequence[float], bwd: Sequence[float], send_f: Sequence[float], send_b: Sequence[float],
           latency_f: Sequence[float] | None, latency_b: Sequence[float] | None
           ) -> tuple[list[float], list[float], list[float], list[float], list[float], float]:
    """One pipeline's per-stage inputs as [C3p] and [C3b] read them: latencies (0 by default), sends
    with a 0 after the last stage, t = f + b, and R_0."""
    S = len(fwd)
    lf = list(latency_f) if latency_f is not None else [0.0] * S
    lb = list(latency_b) if latency_b is not None else [0.0] * S
    cf, cb = list(send_f[: S - 1]) + [0.0], list(send_b[: S - 1]) + [0.0]
    t = [x + y for x, y in zip(fwd, bwd)]
    return lf, lb, cf, cb, t, sum(t) + sum(cf) + sum(cb)


def path_time(
    fwd: Sequence[float],
    bwd: Sequence[float],
    send_f: Sequence[float],
    send_b: Sequence[float],
    num_microbatches: int,
    latency_f: Sequence[float] | None = None,
    latency_b: Sequence[float] | None = None,
) -> float:
    """[C3p] The longest of a family of dependency paths through one 1F1B pipeline (the runner's order,
    ``formulations/cost_model.md``): a lower bound of the exact timeline [C3x]
    (:func:`replay_stage_ends`), equal to it when one of these paths is the critical one.

    With A_s = Σ_{i<s} (f_i + c^f_i) (microbatch 0 reaching stage s), B_s = Σ_{i<s} (c^b_i + b_i) (the
    way back from s), D_s microbatch 0's trip below s and back (Σ_{i>s} t_i + Σ_{i≥s} (c^f_i + c^b_i)),
    w_s = min(S − s − 1, m) warm-up forwards and o = c − λ the part of a send that occupies its
    boundary, for every window s..j (d = j − s + 1 stages, round trip W(s, j) of [C3]):

    - head, stage s's first backward ends at least at A_s + b_s + max(f_s + D_s, min(w_s + 1, m)·f_s)
      and, for j > s, after the first w_j + 1 forwards have queued through boundary s
      (max(f_s + w_j·o^f_s, (w_j + 1)·f_s) + c^f_s + the forwards of s+1..j + b_j + the way back to s);
    - q cycles around the window, each W(s, j) long and d microbatches further (q ≤ ⌊(m − 2 − w_s)/d⌋ + 1:
      stage s's backward of k is followed by its forward of k + w_s + 1);
    - tail from stage s's backward of k = d·q: its remaining backwards and forwards back to back, or
      the remaining backward messages queued through boundary s ((m − 1 − k)·o^b_s), or its next
      forward's trip below s and back followed by its remaining backwards;
    - then B_s back to stage 0.

    And each boundary's messages in one direction back to back: R_0 + (m − 1)·o. Every piece follows
    edges of the dependency graph, so the result never exceeds [C3x]. O(S²)."""
    S, m = len(fwd), num_microbatches
    f, b = list(fwd), list(bwd)
    lf, lb, cf, cb, t, fill = _chain(fwd, bwd, send_f, send_b, latency_f, latency_b)
    of = [c - x for c, x in zip(cf, lf)]
    ob = [c - x for c, x in zip(cb, lb)]
    ahead, back, below = [0.0] * S, [0.0] * S, [0.0] * S
    for s in range(1, S):
        ahead[s] = ahead[s - 1] + f[s - 1] + cf[s - 1]
        back[s] = back[s - 1] + cb[s - 1] + b[s - 1]
    for s in range(S - 2, -1, -1):
        below[s] = below[s + 1] + t[s + 1] + cf[s] + cb[s]
    best = max([fill + steady_weight(m) * max(of[i], ob[i]) for i in range(S - 1)], default=0.0)
    for s in range(S):
        w = min(S - s - 1, m)
        head0 = max(f[s] + below[s], min(w + 1, m) * f[s]) + b[s]
        trip, into, way_back = t[s], 0.0, 0.0
        for j in range(s, S):
            head = head0
            if j > s:
                trip += t[j] + cf[j - 1] + cb[j - 1]
                into += f[j] + (cf[j - 1] if j - 1 > s else 0.0)
                way_back += cb[j - 1] + b[j - 1]
                wj = min(S - j - 1, m - 1)
                queued = max(f[s] + wj * of[s], (wj + 1) * f[s])
                head = max(head, queued + cf[s] + into + b[j] + way_back)
            d = j - s + 1
            q_max = (m - 2 - w) // d + 1 if m - 2 - w >= 0 else 0
            for q in {q_max, max(q_max - 1, 0)}:
                k = d * q
                rest = m - 1 - k
                tail = rest * b[s] + max(0, rest - w) * f[s]
                if j > s:
                    tail = max(tail, rest * ob[s])
                if k + w + 1 <= m - 1:
                    tail = max(tail, f[s] + below[s] + b[s] + (m - 2 - k - w) * b[s])
                best = max(best, ahead[s] + back[s] + head + q * trip + tail)
    return best


# ---- [C3b] linear lower bounds of the exact timeline [C3x] (what every search bound is built on) ---------
def warmup_cap(max_stages: int, num_microbatches: int) -> int:
    """[C3b] An upper bound of the warm-up forwards w_s = min(S − s − 1, m − 1) that a stage's own
    form may hide under microbatch 0's trip, when the pipeline has at most ``max_stages`` stages:
    min(S̄ − 1, m − 1) (0 for a single stage or microbatch)."""
    return max(min(max_stages - 1, num_microbatches - 1), 0)


def bound_weight(num_microbatches: int, max_stages: int, fwd_share: float = 1.0) -> float:
    """[C3b] A steady weight valid for the exact timeline: for every stage s of a 1F1B pipeline of at
    most ``max_stages`` stages whose forward is f_s ≤ ``fwd_share``·t_s + E (``forward_share``),
    T ≥ R_0 + (m − 1)·t_s − w_s·f_s ≥ R_0 + this·t_s − ``bound_offset``: microbatch 0 reaches s, goes
    down and back (R_0 in all), then s runs its m − 1 other backwards and m − 1 − w_s other forwards
    (its w_s warm-up forwards ran while microbatch 0 was below it). A boundary whose messages occupy
    it o = send − latency each gives T ≥ R_0 + (m − 1)·o, above this·o. Replaces
    :func:`steady_weight` (m − 1) in every lower bound; equal to it for one stage."""
    return float(num_microbatches - 1) - fwd_share * warmup_cap(max_stages, num_microbatches)


def bound_offset(num_microbatches: int, max_stages: int, fwd_excess: float) -> float:
    """[C3b] What a lower bound subtracts from its fill with :func:`bound_weight`: w̄·E, E the forward
    seconds a stage may have beyond ``fwd_share``·t (``forward_share``)."""
    return warmup_cap(max_stages, num_microbatches) * fwd_excess


def forward_share(fwd: Sequence[float], bwd: Sequence[float], skip: int = 1) -> tuple[float, float]:
    """[C3b] (ρ, E) with f ≤ ρ·(f + b) + E for every contiguous run of the per-layer (forward,
    backward) seconds given: ρ the largest f / (f + b) of the layers but the first and last ``skip``
    (embedding and head, whose forward dominates but is short), E the sum over all layers of the
    excess (f_l − ρ·(f_l + b_l))⁺. Sums, nonnegative combinations (the microbatch interpolation) and
    the max over a stage's replica groups keep the inequality (scaled E for scaled times)."""
    n = len(fwd)
    core = range(skip, n - skip) if n > 2 * skip else range(n)
    rho = max((fwd[i] / (fwd[i] + bwd[i]) for i in core if fwd[i] + bwd[i] > 0), default=0.0)
    excess = sum(max(f - rho * (f + b), 0.0) for f, b in zip(fwd, bwd))
    return rho, excess


BUSY_SHARES: tuple[float, ...] = (1.0, 0.75, 0.5, 0.3, 0.15)
"""[C3b] The shares σ at which :func:`busy_blend_weight` blends the busy chain into a stage-count bound
(σ = 1: the warm-up form alone)."""


def busy_blend_weight(weight: float, num_microbatches: int, share: float) -> float:
    """[C3b] w' = w + (1 − σ)/σ·m: a plan whose every microbatch-weighted form is known by its largest
    piece B' (stage f + b or boundary occupancy), its fill R_0 and its first stage's tail U has
    T ≥ w·B' + R_0 + U − offset (the warm-up form) and T ≥ m·B' + U (the busy chain A_s + B_s + m·t_s,
    or R_0 + (m − 1)·o ≥ m·o for a boundary); their σ-combination is σ·(w'·B' + R_0 + U) − σ·offset +
    (1 − σ)·U, so the least of w'·B + R_0 + U over a plan family bounds the family by
    :func:`busy_blend_bound`. ``share`` in (0, 1]."""
    return weight + (1.0 - share) / share * num_microbatches


def busy_blend_bound(value: float, share: float, blend_weight: float, latency: float, offset: float,
                     tail_floor: float) -> float:
    """[C3b] σ·(V − w'·λ − offset) + (1 − σ)·U_lb: the lower bound of every plan of a family whose least
    w'·B + R_0 + U is ``value`` (w' = :func:`busy_blend_weight`, B counting sends by pace, so B' ≥ B − λ
    with λ = ``latency`` the largest latency of the family's sends), ``offset`` the warm-up form's
    :func:`bound_offset` and ``tail_floor`` ≤ every plan's tail U."""
    return share * (value - blend_weight * latency - offset) + (1.0 - share) * tail_floor


def stage_line(num_microbatches: int, fwd_share: float, fwd_excess: float) -> tuple[float, float, float]:
    """[C3b] (m − 1 + ρ, ρ, E): for a plan of S stages whose pieces are at least a, the warm-up form's
    w(S)·a − offset(S) = (m − 1 − ρ·min(S − 1, m − 1))·a − min(S − 1, m − 1)·E is at least the line
    (m − 1 + ρ)·a + E − (ρ·a + E)·S in S (its supporting line for S ≤ m; above it beyond), so a
    relaxation that knows S only through a per-stage term may charge −(ρ·a + E) per stage on top of
    (m − 1 + ρ)·a + E (replay3 [R4s]; ``bound_weight``/``bound_offset`` at the split's S̄ is the other
    supporting line, flat from S = m on)."""
    return float(num_microbatches - 1) + fwd_share, fwd_share, fwd_excess


def replay_bounds() -> bool:
    """[C3b] Whether the search's bounds must hold for the exact timeline: ``EVALUATE_1F1B == "replay"``
    (read at call time). With ``"closed"`` they keep [C3]'s weight m − 1 (valid for the closed form,
    which is ≥ [C3]); the bound sites call this, :func:`search_weight` and :func:`search_offset`, so
    the switch flips evaluate and every bound together."""
    return EVALUATE_1F1B == "replay"


def search_weight(num_microbatches: int, max_stages: int, fwd_share: float = 1.0) -> float:
    """[C3b] The steady weight of the search's lower bounds: :func:`bound_weight` under the replay,
    :func:`steady_weight` (m − 1) under the closed form."""
    return bound_weight(num_microbatches, max_stages, fwd_share) if replay_bounds() else steady_weight(num_microbatches)


def reweighted_bound(closed: float, weight: float, num_microbatches: int, floor: float) -> float:
    """[C3b] A lower bound ``closed`` ≤ (m − 1)·B + F of the closed form restated for a steady weight
    ``weight`` ≤ m − 1: with κ = weight / (m − 1), κ·closed + (1 − κ)·floor ≤ weight·B + F whenever
    F ≥ ``floor`` (every plan's fill-and-tail is at least the floor)."""
    kappa = weight / steady_weight(num_microbatches) if num_microbatches > 1 else 1.0
    return kappa * closed + (1.0 - kappa) * floor


def search_offset(num_microbatches: int, max_stages: int, fwd_excess: float) -> float:
    """[C3b] :func:`bound_offset` under the replay, 0 under the closed form."""
    return bound_offset(num_microbatches, max_stages, fwd_excess) if replay_bounds() else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Composition:
    """[C3b] The MILP's composition (``search.milp``'s objective): every 1F1B pipeline of S ≤ S̄ stages
    costs at least ``weight``·T + ``per_stage``·max(``warmup`` − (S − 1), 0) + R_0 − ``constant``, for any T
    ≤ max(largest stage f + b, largest intra-cluster send pace, largest inter-cluster occupancy), when its
    largest stage f + b is at least the ``t_floor`` given to :func:`search_composition`."""

    weight: float
    constant: float = 0.0
    per_stage: float = 0.0
    """What each stage fewer than ``warmup`` + 1 is worth: the warm-up forwards w_s ≤ min(S − 1, m − 1)
    the plan's own S allows, against the split's bound min(S̄ − 1, m − 1) that ``weight`` assumes."""
    warmup: int = 0
    """``warmup_cap(S̄, m)``."""

    def stage_bonus(self, num_stages: int) -> float:
        """per_stage·max(warmup − (S − 1), 0): what a plan of S stages adds to weight·T + R_0 − constant."""
        return self.per_stage * max(self.warmup - (num_stages - 1), 0)


def search_composition(num_microbatches: int, max_stages: int, fwd_share: float, fwd_excess: float,
                       latency: float, t_floor: float = 0.0) -> Composition:
    """[C3b] :class:`Composition` for a split (``search.milp``'s objective and rows [M7]/[M8]): pipelines of
    at most ``max_stages`` stages whose every layer has f ≤ ρ·(f + b) + E (``fwd_share``, ``fwd_excess``),
    whose intra-cluster sends carry a latency of at most ``latency`` and whose largest stage f + b is at
    least ``t_floor`` (the split's bottleneck bound ``CheapBounds.t_lb``).

    Under the replay: weight w = :func:`bound_weight`, constant K = :func:`bound_offset` + w·``latency``,
    warmup w̄ = :func:`warmup_cap`, per_stage β = ρ·``t_floor`` + E. Proof, x the piece of T that is
    largest: if x is a stage's t_s, T_replay ≥ R_0 + (m − 1)·t_s − w_s·f_s with w_s ≤ min(S − 1, m − 1) =
    w̄ − q (q = max(w̄ − (S − 1), 0)), so ≥ R_0 + (m − 1 − ρ·w̄)·t_s + q·(ρ·t_s + E) − w̄·E ≥ R_0 + w·x +
    β·q − offset (t_s ≥ t_floor); if x is an occupancy o > max t (or a send pace c, o = c − λ > max t),
    R_0 + (m − 1)·o ≥ R_0 + w·o + ρ·w̄·o with ρ·w̄·o ≥ β·q − w̄·E as o ≥ t_floor. Under the closed form:
    (m − 1, 0, 0) ([C3] itself, with T also over the window paces of [M15]/[M15w]).
    ``tests/test_cost_kernel.py`` holds it against :func:`replay_stage_ends`."""
    if not replay_bounds():
        return Composition(weight=steady_weight(num_microbatches))
    w = bound_weight(num_microbatches, max_stages, fwd_share)
    return Composition(weight=w, constant=bound_offset(num_microbatches, max_stages, fwd_excess) + w * latency,
                       per_stage=max(fwd_share * t_floor + fwd_excess, 0.0),
                       warmup=warmup_cap(max_stages, num_microbatches))


def search_windows() -> bool:
    """[C3b] Whether the search's rows may price [C3]'s round-trip windows with the steady weight
    (the MILP's [M12]-[M16]/[M15w], the options' inner window pace): under the closed form only. Under the
    replay a window of d stages starting at stage s completes only ``window_cycles`` round trips
    (none once S − s − 1 ≥ m − 1), so it may not carry :func:`bound_weight`; the rows are left out (a
    weaker, still valid, relaxation)."""
    return not replay_bounds()


def window_cycles(num_microbatches: int, window_stages: int, warmup: int) -> int:
    """[C3b] Complete round trips q of a window of d stages s..j a dependency path can take in the
    runner's 1F1B order when stage s has ``warmup`` (w_s, or an upper bound of it) warm-up forwards:
    stage s's backward of k is followed by its forward of k + w_s + 1, so q = ⌊(m − 2 − w_s)/d⌋ + 1
    (0 when m − 2 − w_s < 0). [C3]'s closed form counts (m − 1)/d instead."""
    left = num_microbatches - 2 - warmup
    return left // window_stages + 1 if left >= 0 else 0


def window_weight(num_microbatches: int, window_stages: int, warmup: int) -> int:
    """[C3b] d·q (``window_cycles``): T ≥ R_0 + d·q·(W(s, j)/d), the weight a window's pace W/d may
    carry in a lower bound (≥ m − 1 − w_s whenever m − 2 − w_s ≥ 0; [C3] gives it m − 1)."""
    return window_stages * window_cycles(num_microbatches, window_stages, warmup)


def replay_floor(
    fwd: Sequence[float],
    bwd: Sequence[float],
    send_f: Sequence[float],
    send_b: Sequence[float],
    num_microbatches: int,
    latency_f: Sequence[float] | None = None,
    latency_b: Sequence[float] | None = None,
) -> float:
    """[C3b] The largest of the linear forms the search's bounds instantiate, on one pipeline with
    its exact stage positions (each ≤ :func:`replay_stage_ends`, ``tests/test_simulate.py``):
    busy chain A_s + B_s + m·t_s; stage with its warm-up once R_0 + (m − 1)·t_s − w_s·f_s; boundary
    R_0 + (m − 1)·o; window R_0 + q·W(s, j) (``window_cycles``). O(S²)."""
    S, m = len(fwd), num_microbatches
    lf, lb, cf, cb, t, fill = _chain(fwd, bwd, send_f, send_b, latency_f, latency_b)
    best = fill
    ahead = back = 0.0
    for s in range(S):
        w = min(S - s - 1, m - 1)
        best = max(best, ahead + back + m * t[s], fill + (m - 1) * t[s] - w * fwd[s])
        if s + 1 < S:
            best = max(best, fill + (m - 1) * max(cf[s] - lf[s], cb[s] - lb[s]))
        trip = 0.0
        for j in range(s, S):
            trip += t[j] + (cf[j - 1] + cb[j - 1] if j > s else 0.0)
            best = max(best, fill + window_cycles(m, j - s + 1, min(S - s - 1, m)) * trip)
        ahead += fwd[s] + cf[s]
        back += cb[s] + bwd[s]
    return best


def replay_shared_nics(
    stage_ops: StageOps,
    schedule: str,
    fwd: Sequence[float],
    bwd: Sequence[float],
    send_f: Sequence[float],
    send_b: Sequence[float],
    num_microbatches: int,
    delay_f: Sequence[float],
    delay_b: Sequence[float],
    nic_f: Sequence[tuple[float, ...]],
    nic_b: Sequence[tuple[float, ...]],
) -> list[float]:
    """[C3n] The exact timeline of one pipeline of single-replica stages (as :func:`replay_stage_ends`,
    the runner's order) when each stage's node NIC is shared, per direction, by the messages of both
    its boundaries: stage s's outbound NIC carries its activations to s + 1 AND its gradients to s − 1,
    its inbound NIC the activations from s − 1 AND the gradients from s + 1 (NICs are full duplex: in
    and out do not compete; ``formulations/cost_model.md`` [C3n]).

    A message of boundary i occupies its boundary direction (one message at a time, in order, as in
    [C3x]) for ``send − delay`` seconds when alone; ``nic_f[i]`` = (seconds the forward message needs
    of stage i's outbound NIC alone, of stage i + 1's inbound NIC alone), ``nic_b[i]`` = (of stage
    i + 1's outbound, of stage i's inbound). Concurrent messages on one NIC direction share it equally
    per flow (processor sharing, as ``hgopt.simulate``'s NIC resources): an entry may carry two more
    numbers, the flows (replica pairs) the message is on that NIC (default 1 each), and a message of n
    flows among N on a NIC gets n / N of it. A message progresses at the smallest of 1 / occupancy
    and, per NIC it crosses, (n / N) / its NIC seconds. It arrives
    ``delay`` (latency and (de)quantisation) after its last byte leaves. Returns each stage's last
    operation end; with no NIC seconds (or none concurrent) it equals :func:`replay_stage_ends` with
    ``latency = delay``. O(events · S)."""
    S, m = len(fwd), num_microbatches
    orders = [[(str(getattr(op, "kind")), int(getattr(op, "microbatch"))) for op in stage_ops(schedule, s, S, m)]
              for s in range(S)]
    ptr, clock = [0] * S, [0.0] * S
    running: list[float | None] = [None] * S  # end of the running operation
    got: set[tuple[str, int, int]] = set()  # (kind, stage, microbatch) whose input has arrived
    queues: dict[tuple[str, int], list[int]] = {}  # (direction, boundary) -> messages waiting, in order
    # message: [direction, boundary, microbatch, remaining fraction, occupancy, delay, ((nic, seconds), ...)]
    msgs: list[list[object]] = []
    active: list[int] = []
    arrivals: list[tuple[float, str, int, int]] = []
    now = 0.0

    def resources(kind: str, i: int) -> tuple[tuple[tuple[str, int], float, float], ...]:
        out_s, in_s, e = (i, i + 1, nic_f[i]) if kind == "F" else (i + 1, i, nic_b[i])
        n_out, n_in = (e[2], e[3]) if len(e) > 2 else (1.0, 1.0)
        return tuple((r, w, n) for r, w, n in ((("out", out_s), e[0], n_out), (("in", in_s), e[1], n_in)) if w > 0)

    def start_next(ch: tuple[str, int]) -> None:
        q = queues.get(ch)
        if q:
            active.append(q[0])

    def rate(k: int, users: dict[tuple[str, int], float]) -> float:
        msg = msgs[k]
        occ = float(msg[4])  # type: ignore[arg-type]
        r = 1.0 / occ
        for res, w, n in msg[6]:  # type: ignore[attr-defined]
            r = min(r, n / (users[res] * w))
        return r

    left = sum(len(o) for o in orders)
    while left or active or arrivals:
        for s in range(S):  # start every operation whose input is there
            if running[s] is None and ptr[s] < len(orders[s]):
                kind, i = orders[s][ptr[s]]
                first = (kind == "F" and s == 0) or (kind == "B" and s == S - 1)
                if first or (kind, s, i) in got:
                    running[s] = max(clock[s], now) + (fwd[s] if kind == "F" else bwd[s])
        users: dict[tuple[str, int], float] = {}
        for k in active:
            for res, _, n in msgs[k][6]:  # type: ignore[attr-defined]
                users[res] = users.get(res, 0.0) + n
        rates = {k: rate(k, users) for k in active}
        t_next = min([e for e in running if e is not None] + [now + float(msgs[k][3]) / rates[k] for k in active]  # type: ignore[arg-type]
                     + [a[0] for a in arrivals], default=math.inf)
        if math.isinf(t_next):
            raise ValueError("the schedule deadlocks")
        dt = t_next - now
        done = [k for k in active if now + float(msgs[k][3]) / rates[k] <= t_next]  # type: ignore[arg-type]
        for k in active:
            msgs[k][3] = 0.0 if k in done else float(msgs[k][3]) - rates[k] * dt  # type: ignore[arg-type]
        now = t_next
        for k in done:
            kind, i, mb = str(msgs[k][0]), int(msgs[k][1]), int(msgs[k][2])  # type: ignore[call-overload]
            active.remove(k)
            arrivals.append((now + float(msgs[k][5]), kind, i, mb))  # type: ignore[arg-type]
            ch = (kind, i)
            queues[ch].pop(0)
            start_next(ch)
        for a in [a for a in arrivals if a[0] <= now]:
            arrivals.remove(a)
            _, kind, i, mb = a
            got.add((kind, i + 1 if kind == "F" else i, mb))
        for s in range(S):
            end = running[s]
            if end is None or end > now:
                continue
            kind, i = orders[s][ptr[s]]
            clock[s], running[s], ptr[s], left = end, None, ptr[s] + 1, left - 1
            if (kind == "F" and s + 1 < S) or (kind == "B" and s > 0):
                bnd = s if kind == "F" else s - 1
                occ = (send_f[bnd] - delay_f[bnd]) if kind == "F" else (send_b[bnd] - delay_b[bnd])
                dl = delay_f[bnd] if kind == "F" else delay_b[bnd]
                if occ <= 0:
                    arrivals.append((now + dl, kind, bnd, i))
                    continue
                msgs.append([kind, bnd, i, 1.0, occ, dl, resources(kind, bnd)])
                ch = (kind, bnd)
                q = queues.setdefault(ch, [])
                q.append(len(msgs) - 1)
                if len(q) == 1:
                    start_next(ch)
    return clock
