"""[H6] refinement and polishing with exact local plans and [H8] the global re-partition of the
realised finalists, every result scored by ``evaluate``."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from hgopt.plan import Plan
from hgopt.search.hier_tables import MOST_STAGES
from hgopt.search.hierarchical.context import Ctx, evaluated, out_of_time
from hgopt.search.hierarchical.estimates import local_weights
from hgopt.search.hierarchical.realise import (assemble, decomposed, dp_local, local_plans, realize_and_score,
                                              table_local)
from hgopt.search.hierarchical.records import HeuristicOptions, Realised, Skeleton
from hgopt.search.intra import LocalPlan
from hgopt.search.repartition import repartition


log = logging.getLogger(__name__)


def refine(ctx: Ctx, best: Realised, options: HeuristicOptions) -> Realised:
    """Move one layer across each cluster boundary (both ways) while that lowers ``evaluate``."""
    for _ in range(options.refine_rounds):
        improved = False
        sk = best.skeleton
        for i in range(len(sk.order) - 1):
            for step in (1, -1):
                layers = list(best.skeleton.layers)
                layers[i] += step
                layers[i + 1] -= step
                if min(layers) < 1:
                    continue
                cand = Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch, order=sk.order, layers=tuple(layers),
                                weights=sk.weights, links=sk.links)
                got = realize_and_score(ctx, cand)
                if got is not None and got.time_s < best.time_s - 1e-12:
                    best, improved = got, True
                if out_of_time(ctx, options):
                    return best
        if not improved:
            break
    return best


def polish(ctx: Ctx, got: Realised, options: HeuristicOptions) -> Realised:
    """[H6] Per cluster, the local pipelines the DP finds when it weighs its bottleneck differently
    and the estimates' alternatives made exact; coordinate descent over the combination on the
    exact decomposition (a plan out of memory scores inf), kept if ``evaluate`` confirms it; stops
    at the time limit with what it has."""
    if out_of_time(ctx, options):
        return got
    sk = got.skeleton
    base = local_plans(ctx, sk)
    if base is None:
        return got
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    ranges = sk.ranges()
    alts: list[list[LocalPlan]] = []
    after = 0
    for i in reversed(range(len(sk.order))):
        opts = [base[i]]
        for w in sorted((set(local_weights(m)) | {max(1, m // 4)}) - {m}):
            for lp in (dp_local(ctx, sk, i, *ranges[i], after, w) if w != MOST_STAGES else None,
                       table_local(ctx, sk, i, *ranges[i], after, w)):
                if lp is not None and all(lp.stages != o.stages for o in opts):
                    opts.append(lp)
        dp_m = dp_local(ctx, sk, i, *ranges[i], after, m)
        if dp_m is not None and all(dp_m.stages != o.stages for o in opts):
            opts.append(dp_m)
        alts.append(opts)
        after += len(base[i].stages)
    alts.reverse()
    pick = list(base)
    cur = decomposed(ctx, sk, pick)
    improved = True
    while improved and not out_of_time(ctx, options):
        improved = False
        for i, opts in enumerate(alts):
            for lp in opts:
                trial = pick[:i] + [lp] + pick[i + 1 :]
                t = decomposed(ctx, sk, trial)
                if t < cur - 1e-12:
                    pick, cur, improved = trial, t, True
    if pick == base:
        return got
    plan = assemble(ctx, sk, pick)
    ev = evaluated(ctx, plan)
    if ev.feasible and ev.iteration_time_s < got.time_s:
        return Realised(ev.iteration_time_s, sk, plan)
    return got


def checked(ctx: Ctx, got: Realised) -> Realised | None:
    """The realised plan scored by ``evaluate`` (None when it is infeasible there)."""
    ev = evaluated(ctx, got.plan)
    if not ev.feasible:
        log.warning("heuristic: realised plan infeasible by evaluate: %s", "; ".join(ev.violations[:2]))
        return None
    if abs(ev.iteration_time_s - got.time_s) > 1e-9 * max(1.0, ev.iteration_time_s):
        log.debug("heuristic: decomposition %.9g s, evaluate %.9g s", got.time_s, ev.iteration_time_s)
    return Realised(ev.iteration_time_s, got.skeleton, got.plan)


def repartitioned(
    ctx: Ctx, best: Realised, others: Sequence[Realised]
) -> Realised:
    """[H8] The best plan and the other realised finalists with every stage's layer range re-chosen
    at once (stage hardware kept), scored by ``evaluate``; the best of all."""
    for _, sk, plan in [best, *others]:
        got = repartition(plan, ctx.instance, ctx.tables)
        if got is not None and got.iteration_time_s < best.time_s - 1e-12:
            best = Realised(got.iteration_time_s, _skeleton_of(sk, got.plan), got.plan)
    return best


def _skeleton_of(sk: Skeleton, plan: Plan) -> Skeleton:
    """``sk`` with its per-cluster layer counts read from ``plan``'s (first) pipeline."""
    count: dict[str, int] = {}
    for st in plan.pipelines[0].stages:
        c = st.groups[0].cluster
        count[c] = count.get(c, 0) + st.num_layers
    return dataclasses.replace(sk, layers=tuple(count[c] for c in sk.order))
