"""relaxspeed: the relaxation's tables, the one-cluster bound [R0], the cheap bound [B4] and the block
options [B1] are bit-identical to what the code before the speed-up (commit 696958f) computed (the snapshot was first written on 696958f; re-written by the lead on 76dc932, the integration tree
just before relaxspeed's merge, i.e. with closed8's, replay3's and gaps4's changes of round 8 and without the
speed-up).

The reference values in ``tests/relax_speed_snapshot.json`` were written by the OLD code path, with
this file copied into a ``git archive 696958f`` tree:

    git archive 76dc932 | tar -x -C /tmp/old && cp tests/test_relax_speed.py /tmp/old/tests/
    cd /tmp/old && PYTHONPATH=$PWD .venv/bin/python -m tests.test_relax_speed --write SNAPSHOT.json

Floats are stored as ``repr`` (exact), block options as a SHA-256 of their canonical repr (every field,
every option, keys sorted) and their count. The memo (``CostTables.memo``) is shared across splits as in one
``plan_milp`` call, and one split is recomputed on fresh tables, so a value that depended on the order
splits are visited in would fail here too.

The snapshot pins the values of 696958f: a later change that alters a bound, a row or an option ON PURPOSE
(round 8: closed8, replay3, gaps4) makes ``test_bit_identical_to_the_old_code`` fail by design; then
re-write the snapshot from the tree just before that change (same command, that commit instead of
696958f). The other tests here (memo on = memo off, the vectorised helpers against the old loops) hold
whatever the maths.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from hgopt.cost import build_tables
from hgopt.cost.pipeline import stages_that_matter
from hgopt.instances import load_instance
from hgopt.search.blocks import Window, arc_table, block_options, cheap_bounds, model_shape
from hgopt.search.milp import WIDEN, _best_single, batch_splits, link_policy, milp_composition
from hgopt.search.relax import relax_split, split_bound

COMMAND = ("git archive 76dc932 | tar -x -C /tmp/old && cp tests/test_relax_speed.py /tmp/old/tests/ && cd /tmp/old && "
           "PYTHONPATH=$PWD .venv/bin/python -m tests.test_relax_speed --write SNAPSHOT.json")
SNAPSHOT = Path(__file__).with_name("relax_speed_snapshot.json")
CASES = {  # instance: (split indices in batch_splits order, indices whose block options are checked)
    "sailor-geo-5x32": ((0, 7, 13, 21, 30, 44, 59), (13, 30)),
    "sailor-het-32+96": ((0, 9, 20, 33, 47, 59), (20,)),
    "geo-4r-llama7b": ((0, 5, 11), (5,)),
}


def _arr(a: np.ndarray) -> str:
    """Exact digest of an array (dtype, shape, bytes)."""
    a = np.ascontiguousarray(a)
    return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()[:16]


def _relaxed_digest(rs: object) -> dict[str, str]:
    out = {}
    for f in rs.__slots__:  # type: ignore[attr-defined]
        v = getattr(rs, f)
        if isinstance(v, np.ndarray):
            out[f] = _arr(v)
        elif isinstance(v, tuple) and v and isinstance(v[0], np.ndarray):
            out[f] = ",".join(_arr(x) for x in v)
        else:
            out[f] = repr(v)
    return out


def _options_digest(opts: dict) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    for key in sorted(opts, key=repr):
        for o in opts[key]:
            h.update(repr((key, o)).encode())
            n += 1
    return n, h.hexdigest()


def split_values(name: str, indices: tuple[int, ...], with_options: tuple[int, ...]) -> dict[str, object]:
    """Per chosen split: the cheap bound's fields, the relaxation's tables (digests), [R0], the split
    bound without a target, and (for ``with_options``) the first cap's block options."""
    inst = load_instance(name)
    tables = build_tables(inst)
    links = link_policy(inst, {})
    shape = model_shape(inst)
    splits = batch_splits(inst)
    out: dict[str, object] = {}
    for i in indices:
        sp = splits[i]
        cb = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                          links=links)
        arcs = arc_table(inst, tables, sp.microbatch, sp.k, links, shape)
        rs = relax_split(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                         cheap=cb, links=links, arcs=arcs)
        single = _best_single(inst, tables, sp, cb)
        row: dict[str, object] = {
            "cheap": [repr(cb.t_lb), repr(cb.s_lb), repr(cb.weight), repr(cb.f_lb), repr(cb.value),
                      _arr(np.array(cb.grid)), _arr(np.array(cb.fill_at))],
            "single": repr(single),
            "relaxed": _relaxed_digest(rs) if rs is not None else None,
            "bound": repr(split_bound(rs, cb, target=math.inf, single=single)) if rs is not None else None,
        }
        if i in with_options:
            t_cap = cb.t_lb * WIDEN if cb.weight > 0 else math.inf
            win = Window(t_lb=cb.t_lb, s_lb=cb.s_lb, t_cap=t_cap, weight=cb.weight, mbs_matters=links.compresses,
                         per_stage=milp_composition(inst, sp, cb).per_stage)
            row["options"] = list(_options_digest(block_options(
                inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                d_cap=stages_that_matter(sp.num_microbatches), window=win)))
        out[str(sp)] = row
    return out


def _snapshot() -> dict[str, object]:
    return json.loads(SNAPSHOT.read_text())["values"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_bit_identical_to_the_old_code(name: str) -> None:
    indices, with_options = CASES[name]
    got = split_values(name, indices, with_options)
    want = _snapshot()[name]
    assert set(got) == set(want)
    for sp in want:
        assert got[sp] == want[sp], (name, sp)


def test_fresh_tables_give_the_same_split() -> None:
    """A split computed on fresh tables (empty memo) equals the one computed after other splits filled it."""
    name = "sailor-geo-5x32"
    indices, _ = CASES[name]
    got = split_values(name, (indices[3],), ())
    want = _snapshot()[name]
    sp = next(iter(got))
    assert got[sp] == {k: v for k, v in want[sp].items() if k != "options"}


def test_snapshot_can_fail() -> None:
    """The comparison sees a change in the last bit of one float (a guard against a vacuous digest)."""
    want = _snapshot()["sailor-het-32+96"]
    sp = next(iter(want))
    x = float(want[sp]["single"])  # type: ignore[index]
    assert repr(float(np.nextafter(x, math.inf))) != want[sp]["single"]  # type: ignore[index]


@pytest.mark.parametrize("name", ["sailor-het-32+96", "geo-4r-llama7b"])
def test_memo_changes_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the maths of the day: every value with the memo on (tables shared by the splits, visited
    in a scrambled order) equals the value with the memo off (``MEMO_MAX_ENTRIES = 0``)."""
    import hgopt.cost.tables as ct

    indices, with_options = CASES[name]
    shared = split_values(name, tuple(reversed(indices)), with_options)
    monkeypatch.setattr(ct, "MEMO_MAX_ENTRIES", 0)
    off = split_values(name, indices, with_options)
    assert shared == off


# ---- the vectorised helpers against the loops they replaced (kept here as reference functions) --------
def _old_trunk_counts(caps: list[int], mid: np.ndarray, xm: np.ndarray, *, front: bool = False) -> tuple[np.ndarray, ...]:
    """``intra._trunk_counts`` before relaxspeed (one stage after the other)."""
    kt = len(caps)
    counts = [np.ones_like(mid) for _ in range(kt)]
    left = mid - kt
    for i in (range(kt) if front else reversed(range(kt))):
        add = np.clip(np.minimum(caps[i], xm) - 1, 0, None)
        add = np.minimum(add, np.clip(left, 0, None))
        counts[i] = counts[i] + add
        left = left - add
    return tuple(counts)


def _old_dmax(tc: object, sol: object, m: int) -> np.ndarray:
    """``blocks._dmax`` before relaxspeed (one trunk stage after the other)."""
    s, geo = sol.s, tc.geo  # type: ignore[attr-defined]
    parts = []
    if s == 1:
        lo = np.array([geo.whole(int(n))[0] for n in sol.ns])  # type: ignore[attr-defined]
        hi = np.array([geo.whole(int(n))[1] for n in sol.ns])  # type: ignore[attr-defined]
        parts.append((tc.sm.max_in_flight_v(lo, hi), 1))  # type: ignore[attr-defined]
    else:
        i = 0
        if geo.p:
            parts.append((tc.kmax("f")[sol.x0], s))  # type: ignore[attr-defined]
            i = 1
        for j, cnt in enumerate(sol.counts):  # type: ignore[attr-defined]
            parts.append((tc.kmax("t")[cnt], s - i - j))  # type: ignore[attr-defined]
        if geo.q:
            parts.append((tc.kmax("l")[sol.xl], 1))  # type: ignore[attr-defined]
    dm = np.full(len(sol.ns), math.inf)  # type: ignore[attr-defined]
    for km, r in parts:
        dm = np.minimum(dm, np.where(km < m, km - r, math.inf))
    return dm


def _old_trunk_rows(tc: object, s_max: int, m: int, latency: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``relax._trunk_rows`` before relaxspeed (696958f)."""
    from hgopt.cost.pipeline import in_flight, stage_fill

    INF = math.inf
    N = tc.xmax  # type: ignore[attr-defined]
    km = tc.kmax("t")  # type: ignore[attr-defined]
    xs = np.arange(N + 1)
    caps = []
    for r in range(1, s_max + 1):
        ok = km[1:] >= in_flight(r, 0, m)
        bad = np.flatnonzero(~ok)
        caps.append(int(bad[0]) if bad.size else N)
    caps_a = np.array(caps)
    G = np.cumsum(np.minimum(caps_a[:, None], xs[None, :]), axis=0)
    n = np.arange(1, N + 1)
    T = np.full((s_max, N), INF)
    F = np.full((s_max, N), INF)
    for si in range(s_max):
        s = si + 1
        if caps_a[si] < 1:
            break
        xm = np.searchsorted(G[si], n, side="left")
        ok = (xm <= N) & (n >= s)
        xm = np.minimum(xm, N)
        t = tc.t_comp[xm]  # type: ignore[attr-defined]
        if s >= 2:
            t = np.maximum(t, max(tc.t_send - latency, 0.0))  # type: ignore[attr-defined]
        T[si] = np.where(ok, t, INF)
        F[si] = np.where(ok, stage_fill(tc.t_comp[n], (s - 1) * tc.t_send, (s - 1) * tc.t_send), INF)  # type: ignore[attr-defined]
    return T, F


def _old_end_rows(tc: object, comp: np.ndarray, kmax: np.ndarray, s_max: int, m: int, shift: int,
                  latency: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``relax._end_rows`` before relaxspeed (696958f)."""
    from hgopt.cost.pipeline import in_flight, stage_fill

    INF = math.inf
    N = tc.xmax  # type: ignore[attr-defined]
    km = tc.kmax("t")  # type: ignore[attr-defined]
    xs = np.arange(N + 1)
    caps = []
    for r in range(1, s_max + 1):
        bad = np.flatnonzero(~(km[1:] >= in_flight(r, 0, m)))
        caps.append(int(bad[0]) if bad.size else N)
    head = np.where(kmax >= in_flight(1, 0, m), comp, INF)
    idx = xs[:, None] - xs[None, :]
    T = np.full((s_max, N + 1), INF)
    F = np.full((s_max, N + 1), INF)
    G = np.zeros(N + 1)
    for si in range(s_max):
        s = si + 1
        if s == 1:
            rest = np.where(xs == 0, 0.0, INF)
        else:
            G = G + np.minimum(caps[s - 2 + shift], xs)
            xm = np.searchsorted(G, xs, side="left")
            rest = np.where((xm <= N) & (xs >= s - 1), tc.t_comp[np.minimum(xm, N)], INF)  # type: ignore[attr-defined]
        both = np.where(idx >= 0, np.maximum(head[None, :], rest[np.clip(idx, 0, N)]), INF)
        t = both.min(axis=1)
        if s >= 2:
            t = np.maximum(t, max(tc.t_send - latency, 0.0))  # type: ignore[attr-defined]
        T[si] = t
        F[si] = np.where(np.isfinite(t), stage_fill(tc.t_comp[xs], (s - 1) * tc.t_send, (s - 1) * tc.t_send), INF)  # type: ignore[attr-defined]
    return T, F


@pytest.mark.parametrize("name", ["sailor-geo-5x32", "geo-4r-llama7b"])
def test_rows_as_the_loops(name: str) -> None:
    """relax's [R1] and [R1e] rows (vectorised, memoised) against the loops of 696958f, bit for bit."""
    from hgopt.search.blocks import role_geometry
    from hgopt.search.intra import StageModel, TrunkCosts, local_configs
    from hgopt.search.relax import _end_rows, _trunk_rows

    inst = load_instance(name)
    tables = build_tables(inst)
    shape = model_shape(inst)
    geo, _ = role_geometry(shape, "middle")
    N, L = shape.trunk, shape.num_layers
    xs = np.arange(N + 1)
    checked = 0
    for c in inst.topology.clusters[:2]:
        for k, mb, m in ((1, 8, 3), (2, 4, 64), (1, 2, 1)):
            for cfg in local_configs(inst, c.name, mb, tables):
                sm = StageModel(inst, tables, c, cfg, k)
                tc = TrunkCosts(sm, geo, N)
                s_max = min(c.num_gpus // k // cfg.gpus, N)
                if s_max < 1:
                    continue
                for lat in (0.0, 1e-4):
                    got, want = _trunk_rows(tc, s_max, m, lat), _old_trunk_rows(tc, s_max, m, lat)
                    assert all(np.array_equal(g, w) for g, w in zip(got, want))
                    for shift, (lo, hi) in ((1, (L - shape.q - xs, np.full_like(xs, L))),
                                            (0, (np.zeros_like(xs), shape.p + xs))):
                        args = (sm.compute(lo, hi), sm.max_in_flight_v(lo, hi), min(s_max + 1, N + 1), m, shift, lat)
                        got, want = _end_rows(tc, *args), _old_end_rows(tc, *args)
                        assert all(np.array_equal(g, w) for g, w in zip(got, want))
                        checked += 1
    assert checked > 20


def _old_shift_matrix(f: np.ndarray, N: int) -> np.ndarray:
    idx = np.arange(N + 1)[:, None] - np.arange(N + 1)[None, :]
    return np.where(idx >= 0, f[np.clip(idx, 0, N)], math.inf)


def _old_paths_to(arcs: np.ndarray, C: int) -> np.ndarray:
    """``relax._paths_to`` before relaxspeed (696958f)."""
    full = 1 << C
    H = np.full((full, C), math.inf)
    for c in range(C):
        H[1 << c, c] = 0.0
    for X in range(1, full):
        row = H[X]
        if not np.isfinite(row).any():
            continue
        for u in range(C):
            if X >> u & 1:
                continue
            best = np.min(row + arcs[:, u])
            Y = X | (1 << u)
            if best < H[Y, u]:
                H[Y, u] = best
    return H


def _old_subset_dp(fills: np.ndarray, arcs: np.ndarray, N: int, ends: np.ndarray | None = None,
                   firsts: np.ndarray | None = None) -> float:
    """``relax._subset_dp`` before relaxspeed (696958f)."""
    INF = math.inf
    C = fills.shape[0]
    full = 1 << C
    A = np.full((full, N + 1), INF)
    A[0, 0] = 0.0
    f1 = np.concatenate([np.full((C, 1), INF), fills], axis=1)
    shifts = [_old_shift_matrix(f1[c], N) for c in range(C)]
    for X in range(1, full):
        c = (X & -X).bit_length() - 1
        prev = A[X ^ (1 << c)]
        if not np.isfinite(prev).any():
            continue
        A[X] = np.min(prev[None, :] + shifts[c], axis=1)
    if firsts is not None:
        A1 = np.full((full, N + 1), INF)
        fshift = [_old_shift_matrix(firsts[c], N) for c in range(C)]
        for X in range(1, full):
            c = (X & -X).bit_length() - 1
            Y = X ^ (1 << c)
            A1[X] = np.minimum(np.min(A1[Y][None, :] + shifts[c], axis=1), np.min(A[Y][None, :] + fshift[c], axis=1))
        A = A1
    if ends is not None:
        H = _old_paths_to(arcs, C)
        xs, es = np.nonzero((np.arange(full)[:, None] >> np.arange(C)[None, :]) & 1)
        per = H[xs, es] + np.min(A[xs ^ (1 << es)][:, ::-1] + ends[es], axis=1)
        vals = np.full(full, INF)
        np.minimum.at(vals, xs, per)
        vals[[0, *[1 << c for c in range(C)]]] = INF
        return float(vals.min())
    P = _old_paths_to(arcs, C).min(axis=1)
    vals = P + A[:, N]
    vals[[0, *[1 << c for c in range(C)]]] = INF
    return float(vals.min())


def test_subset_dp_as_the_loops() -> None:
    """[R3]'s subset DP and Held-Karp paths (by subset size) against the loops of 696958f, on random
    tables with infinite entries (missing rows, arcs slower than tau), every combination of ends/firsts."""
    from hgopt.search.relax import _paths_to, _subset_dp

    rng = np.random.default_rng(11)
    for trial in range(60):
        C, N = int(rng.integers(1, 7)), int(rng.integers(1, 9))
        inf_share = rng.choice([0.0, 0.3, 0.8])

        def table(shape: tuple[int, ...]) -> np.ndarray:
            a = rng.random(shape) * rng.choice([1e-3, 1.0, 1e3])
            a[rng.random(shape) < inf_share] = math.inf
            return a

        fills, arcs = table((C, N)), table((C, C))
        assert np.array_equal(_paths_to(arcs, C), _old_paths_to(arcs, C))
        for ends in (None, table((C, N + 1))):
            for firsts in (None, table((C, N + 1))):
                got, want = _subset_dp(fills, arcs, N, ends, firsts), _old_subset_dp(fills, arcs, N, ends, firsts)
                assert got == want or (math.isinf(got) and math.isinf(want)), (trial, got, want)


def test_trunk_counts_as_the_loop() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hgopt.search.intra import _trunk_counts

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(caps=st.lists(st.integers(0, 9), min_size=0, max_size=6), front=st.booleans(),
           mid=st.lists(st.integers(-3, 40), min_size=6, max_size=6), xm=st.lists(st.integers(0, 12), min_size=6, max_size=6))
    def check(caps: list[int], front: bool, mid: list[int], xm: list[int]) -> None:
        a, b = np.array(mid, dtype=np.int64).reshape(2, 3), np.array(xm, dtype=np.int64).reshape(2, 3)
        got, want = _trunk_counts(caps, a, b, front=front), _old_trunk_counts(caps, a, b, front=front)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and (g == w).all()

    check()


@pytest.mark.parametrize("name", ["sailor-geo-5x32", "geo-4r-llama7b"])
def test_dmax_as_the_loop(name: str) -> None:
    from hgopt.search.blocks import ROLES, _dmax, role_geometry
    from hgopt.search.intra import StageModel, TrunkCosts, local_configs, solve_trunk

    inst = load_instance(name)
    tables = build_tables(inst)
    shape = model_shape(inst)
    c = inst.topology.clusters[0]
    checked = 0
    for m, mb in ((4, 4), (64, 2)):
        for cfg in local_configs(inst, c.name, mb, tables)[:6]:
            sm = StageModel(inst, tables, c, cfg, 1)
            for role in ROLES:
                geo, ns = role_geometry(shape, role)
                ns_a = np.arange(max(ns.start, 0), ns.stop)
                if not len(ns_a):
                    continue
                tc = TrunkCosts(sm, geo, int(ns_a.max()))
                for s in (1, 2, 3, 5):
                    for d in (0, 1, 3):
                        sol = solve_trunk(tc, s, d, m, ns_a, front=s >= 3)
                        if sol is None:
                            continue
                        got, want = _dmax(tc, sol, m), _old_dmax(tc, sol, m)
                        assert got.shape == want.shape and np.array_equal(got, want)
                        checked += 1
    assert checked > 50


def test_fill_lb_parts_change_nothing() -> None:
    """[B4] ``_fill_lb`` with its per-cluster parts shared across bottlenecks equals it without (every grid
    point of a 16-config cluster set, several trunk counts and hand-over floors)."""
    from hgopt.search.blocks import _Cfg, _fill_lb

    rng = np.random.default_rng(5)
    for trial in range(20):
        rows = {f"c{i}": [_Cfg(stages=int(rng.integers(1, 9)), gpus=int(rng.choice([1, 2, 4, 8])),
                               t1=float(rng.random() * 0.1 + 1e-3), jmax=int(rng.integers(1, 30)))
                          for _ in range(int(rng.integers(1, 6)))] for i in range(int(rng.integers(1, 5)))}
        budgets = {n: int(rng.integers(1, 64)) for n in rows}
        trunk, wan, extra = int(rng.integers(1, 40)), (float(rng.random() * 0.05), float(rng.random())), 0.25
        parts: dict = {}
        for tau in np.geomspace(1e-3, 5.0, 80):
            assert _fill_lb(rows, budgets, trunk, float(tau), wan, extra, parts) == \
                _fill_lb(rows, budgets, trunk, float(tau), wan, extra)
        assert parts


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--write":
        print("usage: python -m tests.test_relax_speed --write FILE", file=sys.stderr)
        return 2
    values = {name: split_values(name, *CASES[name]) for name in sorted(CASES)}
    Path(argv[1]).write_text(json.dumps({"command": COMMAND, "values": values}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
