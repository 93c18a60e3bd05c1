"""The hierarchical heuristic (``--planner heuristic``): a fast search in the cluster-level plan
space — k identical pipelines, each crossing an ordered subset of clusters, every cluster hosting one
contiguous layer range as a local pipeline chosen by the intra-cluster DP. The design and its labels
[H1]..[H9] are in ``formulations/hierarchical.md``; one module per step:

1. [H1] for each number of identical pipelines k and per-pipeline microbatch B (k·B·m = global batch)
   (``skeletons``);
2. [H3] order the clusters along the pipeline over the WAN matrix (bottleneck path, then total)
   (``order``, boundary times and precisions [H7] in ``links``);
3. [H4] split the layers between the clusters by greedy marginal allocation on fast per-cluster
   estimates ([H2], ``estimates`` over ``hier_tables``), then pairwise layer moves; drop clusters
   while that helps (``split``, ``skeletons``);
4. [H5] realise the best few skeletons with ``best_local_plan`` (exact local pipelines) and score
   them with ``evaluate`` (``realise``); [H6] refine the best by moving single layers across cluster
   boundaries with exact local plans while the time budget lasts (``refine``);
5. [H8] re-partition the layers over the realised stages globally (``refine``, via ``repartition``);
6. [H9] try data parallelism across cluster groups (``groups``), outside the exact planner's space.

``search`` runs the steps in that order; ``run`` holds the entry points for others
(``heuristic_incumbent``: the exact planner's warm start; ``run_heuristic``: the registry's).
"""

from hgopt.search.hierarchical.links import LINK_PRECISIONS, allowed_link_precisions
from hgopt.search.hierarchical.realise import realize
from hgopt.search.hierarchical.records import HeuristicOptions, HeuristicResult, Skeleton
from hgopt.search.hierarchical.run import heuristic_incumbent, run_heuristic
from hgopt.search.hierarchical.search import grouped_alternative, plan_heuristic

__all__ = [
    "LINK_PRECISIONS",
    "HeuristicOptions",
    "HeuristicResult",
    "Skeleton",
    "grouped_alternative",
    "heuristic_incumbent",
    "allowed_link_precisions",
    "plan_heuristic",
    "realize",
    "run_heuristic",
]
