"""hetgap2: the faster [H11b] dual function (levels below the bottleneck's window compacted to the ones
whose GPUs change, one matrix product over the clusters) gives the plain definition's values, and the
search changes (warm start, polishing) only ever add price vectors (each a valid bound)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hgopt.cost import build_tables
from hgopt.cost.compute import forward_share_of
from hgopt.search import mixed_bound as mb
from hgopt.search.mixed import compute_floor
from tests.test_mixed_bound import _brute, _pool


def _duals(inst, B: int, m: int, target: float = math.inf):
    tables = build_tables(inst)
    lo, hi = mb._ranges(tables.num_layers)
    kinds = mb._kinds(inst, tables, lo, hi)
    floor = compute_floor(inst, tables)
    G = inst.job.global_batch
    args = (inst, tables, kinds, lo, hi, B, m, G // (B * m), floor, target, forward_share_of(tables, G),
            mb.MixedBoundOptions())
    return mb._setup(*args), mb._setup(*args, compact=False), mb._start(inst, floor, m, G // (B * m))


def _prices(lam0: np.ndarray, C: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    return np.vstack((lam0, lam0 * rng.uniform(0.0, 4.0, size=(6, C)), np.zeros((1, C))))


@pytest.mark.parametrize("a_gpus,b_gpus,b_speed", [(3, 1, 1.0), (2, 2, 2.5), (2, 1, 0.5)])
def test_compact_dual_equals_the_plain_one_on_tiny_pools(a_gpus, b_gpus, b_speed):
    inst = _pool(a_gpus, b_gpus, b_speed)
    G = inst.job.global_batch
    n = 0
    for B in (d for d in range(1, G + 1) if G % d == 0):
        for m in (d for d in range(1, G // B + 1) if (G // B) % d == 0):
            fast, plain, lam0 = _duals(inst, B, m)
            lam = _prices(lam0, 2)
            a, b = fast(lam), plain(lam)
            assert np.array_equal(np.isfinite(a), np.isfinite(b))
            ok = np.isfinite(a)
            np.testing.assert_allclose(a[ok], b[ok], rtol=1e-12, atol=0.0)
            n += int(ok.sum())
    assert n > 20


def test_compact_dual_equals_the_plain_one_on_a_sailor_pair():
    """sailor-het-16+16 at its bound-setting shape (B 8, m 128): 26 layers, most levels below the window."""
    from hgopt.instances import load_instance

    inst = load_instance("sailor-het-16+16")
    fast, plain, lam0 = _duals(inst, 8, 128, target=10.31)
    lam = _prices(lam0, 2)
    a, b = fast(lam), plain(lam)
    assert np.isfinite(b).sum() >= 6
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=0.0)


def test_search_steps_never_lower_a_pair_and_polishing_only_adds():
    """A pair's search value is the largest dual seen (monotone in the steps); polishing continues from
    the end state, so it is at least the unpolished value; both stay below the brute-force optimum."""
    inst = _pool(2, 2, 2.5)
    tables, best, _ = _brute(inst)
    fast, _, lam0 = _duals(inst, 4, 2)
    opts = mb.MixedBoundOptions()
    one = mb._Search(B=4, m=2, lam=lam0, value=float(fast(lam0)[0]))
    seen = [one.value]
    while not one.done:
        one.advance(fast, 2, opts)
        seen.append(one.value)
    assert all(b >= a for a, b in zip(seen, seen[1:]))
    plain = one.value
    one.step, one.done = 0, False
    fine = mb.MixedBoundOptions(factors=opts.polish_factors, rounds=opts.polish_rounds)
    while not one.done:
        one.advance(fast, 2, fine)
    assert plain <= one.value
    full = mb.mixed_bound(inst, tables).value
    plain_search = mb.mixed_bound(inst, tables, options=mb.MixedBoundOptions(warm_start=False, polish_rounds=0)).value
    assert compute_floor(inst, tables) <= plain_search <= best * (1 + 1e-9)
    assert compute_floor(inst, tables) <= full <= best * (1 + 1e-9)
