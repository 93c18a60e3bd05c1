"""gaps4 (issue #11 item 3): the relaxation's prefix/suffix rows at their own config [R1c], and the round
trip per stage count with the windows without the first or last stage [R6s]/[R6w]
(``hgopt/search/relax_count.py``; formulations/cluster_milp.md §5). Each bound is checked against the
brute-force best plan of every batch split (every plan of the MILP's space scored by ``evaluate``), and
each change must raise some split's bound (teeth)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hgopt.cost import build_tables
from hgopt.search import relax, relax_count
from tests.test_milp_handover import _relaxed, _special_instance, _split_optima, _tail_instance

CASES = [("special", s) for s in range(3)] + [("tail", s) for s in (0, 2)]
"""Instances with a prefix and a suffix (light embedding, heavy head; heavy embedding gradients)."""
_RAISED: dict[tuple[str, int], tuple[int, int]] = {}


def _instance(kind: str, seed: int) -> object:
    return _special_instance(seed) if kind == "special" else _tail_instance(seed)


def _bound(inst: object, tables: object, sp: object, opt: float) -> float:
    from hgopt.search.milp import _best_single
    from hgopt.search.relax import split_bound

    cb, rs = _relaxed(inst, tables, sp)  # type: ignore[arg-type]
    assert rs is not None and rs.TB and rs.TE and rs.num_microbatches == sp.num_microbatches  # type: ignore[attr-defined]
    return split_bound(rs, cb, target=2 * opt, single=_best_single(inst, tables, sp, cb))  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_bounds_with_special_rows_at_config_and_stage_counts_below_each_split_optimum(
        kind: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per batch split: the relaxation bound with [R1c] (default), and with [R6s]/[R6w] on top, is at
    most the brute-force optimum of the split; neither is below the bound without it (each only adds
    rows' costs or takes a max with the old bound); counted for the teeth test."""
    inst = _instance(kind, seed)
    tables = build_tables(inst)  # type: ignore[arg-type]
    optima = _split_optima(inst)  # type: ignore[arg-type]
    assert optima
    raised_cfg = raised_count = 0
    for sp, opt in optima.items():
        monkeypatch.setattr(relax, "SPECIAL_AT_CONFIG", False)
        before = _bound(inst, tables, sp, opt)
        monkeypatch.setattr(relax, "SPECIAL_AT_CONFIG", True)
        at_cfg = _bound(inst, tables, sp, opt)
        monkeypatch.setattr(relax, "COUNT_ROWS", True)
        counted = _bound(inst, tables, sp, opt)
        monkeypatch.setattr(relax, "COUNT_ROWS", False)
        assert at_cfg <= opt * (1 + 1e-9), (sp, at_cfg, opt)
        assert counted <= opt * (1 + 1e-9), (sp, counted, opt)
        assert before <= at_cfg * (1 + 1e-12) and at_cfg <= counted * (1 + 1e-12), (sp, before, at_cfg, counted)
        raised_cfg += at_cfg > before * (1 + 1e-4)
        raised_count += counted > at_cfg * (1 + 1e-4)
    _RAISED[(kind, seed)] = (raised_cfg, raised_count)


def test_special_rows_at_config_raise_some_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cross-check above has teeth: on some instance [R1c] raises a split's bound."""
    for case in CASES:
        if case not in _RAISED:
            test_bounds_with_special_rows_at_config_and_stage_counts_below_each_split_optimum(*case, monkeypatch)
    assert sum(c for c, _ in _RAISED.values()) >= 1


def test_count_bound_matches_a_brute_force_over_block_choices() -> None:
    """``relax_count._count_values`` on the whole window with lambda = 0 (no tails) equals, per stage
    count, the least relaxed fill found by enumerating every path of two or three clusters and every
    choice of its first, middle and last blocks (row, trunk count) on a 3-cluster instance, or is below
    it by no more than the path's untied start allows (and equal on some count)."""
    import itertools

    inst = _tail_instance(3)  # 3 clusters
    tables = build_tables(inst)
    optima = _split_optima(inst)
    sp = min(optima, key=lambda s: optima[s])
    _, rs = _relaxed(inst, tables, sp)
    assert rs is not None and len(rs.names) == 3
    N, C = rs.trunk, len(rs.names)
    K = min(relax_count.STAGE_CAP, rs.num_microbatches)
    checked = exact = 0
    for tau in sorted({float(t) for t in np.concatenate([x.ravel() for x in rs.T + rs.TB + rs.TE]) if np.isfinite(t)})[::3]:
        tau = max(tau, float(rs.wan.min()))
        got = relax_count._count_values(rs, tau, 1.0, 0.0, [None] * C, N, K)
        arcs = np.where(rs.wan <= tau, rs.wan_fill, math.inf).min(axis=0)

        def opts(T: np.ndarray, F: np.ndarray, S: np.ndarray, n0: int) -> list[tuple[int, int, float]]:
            return [(int(S[r]), n + n0, float(F[r, n])) for r in range(len(T)) for n in range(T.shape[1])
                    if T[r, n] <= tau]

        want = np.full(K + 1, math.inf)
        for order in itertools.permutations(range(C)):
            for size in range(2, C + 1):
                path = order[:size]
                link = sum(arcs[a, b] for a, b in zip(path, path[1:]))
                if not math.isfinite(link):
                    continue
                first, last, mids = path[0], path[-1], path[1:-1]
                choices = [opts(rs.TB[first], rs.FB[first], rs.stages_first[first], 0)]
                choices += [opts(rs.T[c], rs.F[c], rs.stages[c], 1) for c in mids]
                choices.append(opts(rs.TE[last], rs.FE[last], rs.stages_end[last], 0))
                for pick in itertools.product(*choices):
                    if sum(n for _, n, _ in pick) == N:
                        s = min(sum(x for x, _, _ in pick), K)
                        want[s] = min(want[s], link + sum(f for _, _, f in pick) + rs.extra_fill)
        finite = np.isfinite(want)
        # the DP does not tie the first block to the path's start (a relaxation: only lower), and it
        # loses no more than that: the same counts are feasible and each within a hand-over of the least
        assert np.all(got <= want * (1 + 1e-12)), (tau, got, want)
        assert np.array_equal(np.isfinite(got), finite), (tau, got, want)
        assert np.all(got[finite] >= 0.9 * want[finite]), (tau, got, want)
        exact += int(np.isclose(got[finite], want[finite], rtol=1e-12, atol=0.0).sum())
        checked += int(finite.sum())
    assert checked >= 3 and exact >= 1
