"""determinism (issue #11 item 5): the exact planner's phases limited by counted work, not by the wall clock.

Where a phase's end changes the result (the cheap bounds of the opening, the relaxation phase, each split's
MILP), it ends when its share of a **work budget** is spent. Work is counted in *nominal seconds*: each step
is charged a fixed estimate of its CPU seconds on the development machine (a function of the instance's size
and, for a MILP, of its nonzeros and the branch-and-bound nodes the solver reports), divided by
``CORE_SHARE`` — so on a machine that gives the planner at least that share of a core, nominal and wall
seconds agree and the work budget, not the clock, ends every phase: the same input, limit and seed then give
the same plan and bound, whatever the load. The wall-clock deadline stays as the watchdog: when it ends a
phase first, the meter records it (``WorkMeter.cut``) and the result says "stopped by the time limit".

The charges (CPU seconds, measured on the 2-core development machine, round 8, ``/tmp`` probes quoted in
bench/RESULTS.md "Determinism, round 8"): a split's cheap bound 0.0033·C^1.5 (C clusters: default 0.017 s,
sailor-geo-5x32 0.025 s, geo-8r 0.061 s, scale-16r 0.22 s a split); a split's relaxation 0.015·C^1.5
(default 0.01-0.12 s, sailor-geo-5x32 0.05-0.24 s, geo-8r 0.1-1.5 s); a MILP's root 1.2e-7·nnz^1.5
(sailor-het-16+16: 3.3 k nonzeros 0.04 s, 8.6 k 0.09 s, 19 k 0.26 s; 207 k nonzeros did not leave HiGHS's
presolve in 16 CPU s) and each further node a tenth of it; a split's block options 1.5 ms each (sailor-het-16+16:
599-1,007 options in 1.3-7.2 s of wall at about a quarter of a core). They need not be accurate: any fixed function
gives determinism; accuracy only decides how often the watchdog, not the budget, ends a phase.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from hgopt.spec import Instance

__all__ = ["CORE_SHARE", "GROUPED_QUERY_S", "MAX_NODES", "MIXED_PAIR_S", "PHASE_SLACK", "mixed_pair_work", "WorkMeter", "block_options_work",
           "cheap_bound_work", "counted_stop", "milp_root_work", "milp_work",
           "node_limit", "relaxation_work"]

log = logging.getLogger(__name__)

CORE_SHARE = 0.5
"""The share of one core the nominal second assumes (``exact.WARM_START_WORK_PER_S`` makes the same
assumption for the warm start's heuristic)."""
CHEAP_S = 0.0033
RELAX_S = 0.015
ROOT_S_PER_NNZ15 = 1.2e-7
BLOCK_S_PER_OPTION = 0.0015
NODE_SHARE = 0.1
"""A branch-and-bound node after the root costs this share of the root."""
MIXED_PAIR_S = 0.1
"""CPU seconds charged for each (B, m) pair ``mixed_bound`` bounds (it asks its stop once per pair) at the reference
size ``MIXED_PAIR_REF`` (``mixed_pair_work`` scales it). Determinism measured 0.2-0.7 s a pair on round 7's code
(sailor-het-16+16 66 pairs in 14.4 CPU s, default 55 in 39.2 s, sailor-het-80+240 66 in 13.3 s) and charged 0.4;
hetgap2's rewrite is 2-3.5x cheaper (lead, round 8, quiet machine: `bench/mixed_bound_gap.py` sailor-het-32+96 66
pairs in 3.5 CPU s, sailor-het-16+16 in 4.8 s, i.e. 0.05-0.07 s a pair), and at 0.4 a 60 s limit's [H11b] share
(15 nominal s) allowed 15 / (0.4 / CORE_SHARE) = 18 of sailor-het-32+96's 66 pairs: its certificate stayed at the
compute floor."""
MIXED_PAIR_REF = 26 * 27 // 2 * 2
"""Layer ranges × clusters of the instances ``MIXED_PAIR_S`` was measured on (sailor-het-*: 26 layers, 2 clusters)."""


def mixed_pair_work(layers: int, clusters: int) -> float:
    """CPU seconds charged for one (B, m) pair of ``mixed_bound`` on a model of ``layers`` layers over
    ``clusters`` clusters: ``MIXED_PAIR_S`` scaled with layer ranges L(L + 1)/2 × clusters (a pair's
    Lagrangian layer DP runs over (level, layer range) entries per cluster). Without the scaling a tiny
    instance's ten pairs, microseconds each, spent a 20 s limit's [H11b] share after six and fell back to the compute floor (lead, round 8,
    tests/test_mixed.py)."""
    return MIXED_PAIR_S * (layers * (layers + 1) // 2 * clusters / MIXED_PAIR_REF)


GROUPED_QUERY_S = 0.01
"""CPU seconds charged for each query of ``master.grouped_bound``'s stop (once per partition and once per
share-table structure, a ``cheap_bounds`` of a cluster group: ~3-60 ms)."""
PHASE_SLACK = 1.0
"""The per-phase watchdog: a phase whose work share is ``s`` of the budget is cut (and the cut recorded) once
``PHASE_SLACK`` × ``s`` of the wall-clock limit has passed since the search began, so that on a machine slower
than the nominal one (under about CORE_SHARE / PHASE_SLACK of a core) the later phases — the warm start, the
MILPs — still get their turn before the deadline: there the phases end where round 7's clock ended them (0.2 /
0.4 / 0.75 of the limit), and the result says so. 2.0 was tried: at T = 5 under load 23-26 the warm start then
began too late for the command's watchdog (sailor-geo-5x128: 7.38 s plan after 8.4 s wall, round 7's code 1.01 s
after 5.4 s; bench/RESULTS.md "Determinism, round 8")."""
MAX_NODES = 100_000
"""The most nodes one MILP solve gets (a cap, so that tiny models do not get absurd limits)."""


def _clusters(instance: Instance) -> int:
    return len(instance.topology.clusters)


def cheap_bound_work(instance: Instance) -> float:
    """Nominal seconds charged for one split's cheap bound (``blocks.cheap_bounds``)."""
    return CHEAP_S * _clusters(instance) ** 1.5 / CORE_SHARE


def relaxation_work(instance: Instance) -> float:
    """Nominal seconds charged for one split's relaxation bound (``relax.relax_split`` + ``split_bound``)."""
    return RELAX_S * _clusters(instance) ** 1.5 / CORE_SHARE


def block_options_work(options: int) -> float:
    """Nominal seconds charged for generating ``options`` block options of a split (``blocks.block_options``)."""
    return BLOCK_S_PER_OPTION * options / CORE_SHARE


def milp_root_work(nonzeros: int) -> float:
    """Nominal seconds charged for building a MILP of ``nonzeros`` and solving its root."""
    return ROOT_S_PER_NNZ15 * max(nonzeros, 1) ** 1.5 / CORE_SHARE


def milp_work(nonzeros: int, nodes: int, node_limit_given: int) -> float:
    """Nominal seconds charged for a solve that explored ``nodes`` nodes (the limit it was given when the
    backend does not say: ``nodes`` < 0)."""
    n = node_limit_given if nodes < 0 else nodes
    return milp_root_work(nonzeros) * (1.0 + NODE_SHARE * max(n - 1, 0))


def node_limit(nonzeros: int, work_left: float) -> int:
    """The node limit a solve gets from ``work_left`` nominal seconds (at least 1: the root)."""
    root = milp_root_work(nonzeros)
    if not math.isfinite(work_left) or work_left <= root:
        return 1 if math.isfinite(work_left) else MAX_NODES
    return int(min(MAX_NODES, 1 + (work_left / root - 1.0) / NODE_SHARE))


def counted_stop(budget_s: float, query_s: float, stop: Callable[[], bool] | None = None) -> Callable[[], bool]:
    """A stop for a routine that asks it once per unit of its work (``mixed_bound``: per (B, m) pair;
    ``grouped_bound``: per partition and structure): True once ``budget_s`` nominal seconds are spent at
    ``query_s`` CPU seconds a query, or when ``stop`` (the search's stop flag) says so — a work limit."""
    spent = [0.0]

    def ask() -> bool:
        if stop is not None and stop():
            return True
        if spent[0] >= budget_s:
            return True
        spent[0] += query_s / CORE_SHARE
        return False

    return ask


class WorkMeter:
    """The work one search has spent (nominal seconds) against its budget, and whether the wall-clock
    watchdog cut a phase. One per search (no module state); not thread-safe (a search is one thread)."""

    def __init__(self, budget_s: float, deadline: float, clock: Callable[[], float] | None = None) -> None:
        self.budget_s = budget_s
        self.deadline = deadline
        """The wall-clock watchdog (``clock()`` time)."""
        self.clock = clock if clock is not None else time.perf_counter
        self.start = self.clock()
        self.spent_s = 0.0
        self.cut: str = ""
        """The first phase the watchdog ended before its work share was spent ("" while none)."""

    def charge(self, seconds: float) -> None:
        self.spent_s += max(seconds, 0.0)

    def left(self, share: float = 1.0) -> float:
        """Nominal seconds left of ``share`` of the budget."""
        return share * self.budget_s - self.spent_s

    def within(self, share: float = 1.0, phase: str = "") -> bool:
        """True while ``share`` of the budget is not spent and neither the deadline nor the phase's own
        watchdog (``PHASE_SLACK`` × ``share`` of the wall-clock limit since the start) has passed (then the
        meter records ``phase`` as cut)."""
        if self.spent_s >= share * self.budget_s:
            return False
        now = self.clock()
        if now >= self.deadline or now >= self.start + PHASE_SLACK * share * (self.deadline - self.start):
            self.note_cut(phase)
            return False
        return True

    def past_deadline(self, phase: str = "") -> bool:
        """True (recording ``phase`` as cut) once the watchdog's deadline has passed."""
        if self.clock() >= self.deadline:
            self.note_cut(phase)
            return True
        return False

    def note_cut(self, phase: str) -> None:
        if not self.cut:
            self.cut = phase or "search"
            log.info("the time limit ended the %s before its work share was spent (%.3g of %.3g nominal s)",
                     self.cut, self.spent_s, self.budget_s)
