"""The heuristic's records: its options, the cluster-level skeleton it searches over, and its result
(``formulations/hierarchical.md``)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from hgopt.plan import Plan
from hgopt.progress import Progress


INF = math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class HeuristicOptions:
    time_limit_s: float | None = 10.0
    """Wall-clock cap; the fixed search usually ends far earlier (the refinement stops at it)."""
    work_limit: int | None = None
    """Cap on the work done, counted in cluster subsets split [H4] and skeletons realised or
    re-scored [H5]/[H6] (None: no cap). Checked wherever the time limit is: when it, not the clock,
    ends a phase, the same input and limits give the same plan on any machine and load."""
    neighbours: int = 8
    """Candidate-list length of the steps that would cost O(clusters³) above ``neighbours`` + 1
    clusters (cluster order 2-opt, layer-split moves, cluster adding/dropping, reordering); at or
    below it they are the full searches."""
    finalists: int = 6
    """Skeletons realised with the exact intra-cluster DP [H5]."""
    refine_rounds: int = 3
    """Rounds of single-layer moves with exact local plans [H6]."""
    max_pipelines: int = 1024
    polish_extra: int = 1
    """Realised skeletons besides the best that also get their local plans polished [H6]."""
    screen: int = 32
    """Leading estimated skeletons re-ranked by an exact but DP-free realisation [H5]."""
    reorder: int = 2
    """Leading estimated skeletons whose cluster order is improved by 2-opt on the estimate [H3]."""
    link_precision: str = "native"
    """Inter-cluster boundaries: 'native'/'fp32' (no compression), 'bf16', 'fp16' or 'fp8' (every
    such boundary compressed), or 'auto' (per boundary the fastest of native, bf16 and fp8) [H7]."""
    max_compressed_links: int | None = None
    """At most this many compressed inter-cluster boundaries per pipeline (None: no limit)."""
    link_penalty: tuple[tuple[str, float], ...] = ()
    """Seconds added to a boundary's cost when compressed to a precision (``link_penalty``) [H7]."""
    patience: int = 2
    """Per pipeline count, stop raising the microbatch after this many that did not improve."""
    kb_leaders: int = 3
    """(k, B) of the best coarse skeletons whose cluster sets are grown and pruned greedily [H4]."""
    repartition: bool = True
    """Re-partition the layers over all stages of the realised plans at once [H8]."""
    repartition_extra: int = 2
    """Realised skeletons besides the best whose stages are re-partitioned globally [H8]."""
    cross_cluster_dp: bool = True
    """Also try data parallelism across cluster groups [H9] (plans outside the exact planner's space)."""
    mixed_stages: bool = True
    """[H11] Also try one pipeline whose stages mix replica groups of clusters joined by fast links
    (``hgopt.search.mixed``; outside the exact planner's space). Only where ``cross_cluster_dp`` is on,
    under the time objective (mixed)."""
    require_clusters: tuple[str, ...] = ()
    """Only skeletons whose pipelines use every one of these clusters (the CLI's why-not lines:
    the best plan that uses an idle cluster); implies no [H9] groups. (cli-explain)"""
    progress: Progress | None = field(default=None, compare=False)
    """Heartbeat state and cooperative stop (SIGINT), checked wherever the time limit is. (cli-explain)"""
    objective: str = "time"
    """[H10] 'time' (iteration time) or 'cost' ($ per iteration, ``hgopt.cost.money``): how candidates compare."""
    budget_usd_per_hour: float | None = None
    """[H10] Plans over this many $/hour rank behind every plan within it and are never returned."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Skeleton:
    """A cluster-level decision: k identical pipelines of microbatch B crossing ``order`` with
    ``layers[i]`` layers on cluster ``order[i]``."""

    pipelines: int
    microbatch: int
    order: tuple[str, ...]
    layers: tuple[int, ...]
    weights: tuple[int, ...] = ()
    """Per cluster, the microbatch count the intra-cluster DP weighs its local bottleneck with
    (empty: the real m everywhere) [H6]."""
    links: tuple[str, ...] = ()
    """Precision of each inter-cluster boundary, forward and backward (empty: native) [H7]."""

    def ranges(self) -> list[tuple[int, int]]:
        cuts = list(itertools.accumulate(self.layers, initial=0))
        return list(zip(cuts, cuts[1:]))


@dataclass(frozen=True, kw_only=True, slots=True)
class HeuristicResult:
    plan: Plan | None
    skeleton: Skeleton | None
    iteration_time_s: float = INF
    """``evaluate(plan).iteration_time_s``."""
    search_time_s: float = 0.0
    realized: int = 0
    """Skeletons realised with exact local plans."""
    work: int = 0
    """Work done (the unit of ``HeuristicOptions.work_limit``)."""
    stopped: str = ""
    """What ended the search early: 'work limit', 'time limit' or 'stop request'; '' when it completed
    (with 'work limit' alone, the plan depends only on the input and the options)."""
    groups: tuple[tuple[str, ...], ...] = ()
    """[H9] When the plan trains on cluster groups in data parallel: the groups (``skeleton`` is
    then None); empty for a single family of identical pipelines."""
    candidates: tuple[tuple[Plan, float], ...] = ()
    """[H10] Every realised plan the search scored, with its ``evaluate`` time (``--pareto``)."""
    note: str = ""
    """Why there is no plan, when that is not 'nothing fits' (e.g. none within the budget)."""


class Estimated(NamedTuple):
    """A skeleton and its estimated iteration time [H2]/[H4]."""

    estimate_s: float
    skeleton: Skeleton


class Realised(NamedTuple):
    """A skeleton realised with exact local pipelines [H5]: its plan and the plan's iteration time
    (``evaluate``'s)."""

    time_s: float
    skeleton: Skeleton
    plan: Plan
