"""[H1]-[H4] Candidate skeletons, best estimate first: every (k, B) on all usable clusters and on each
alone, greedy cluster adding and dropping for the leading (k, B), subsets crossed with the other
(k, B), and order / split improvement of the leaders."""

from __future__ import annotations

import itertools
import logging
import math

from hgopt.cost.pipeline import pipeline_time
from hgopt.search.hier_tables import role_of
from hgopt.search.hierarchical.context import Ctx, out_of_time
from hgopt.search.hierarchical.estimates import Cell, alt_tables, cell, choose_weights, combine, round_up
from hgopt.search.hierarchical.links import wan_times
from hgopt.search.hierarchical.order import cheapest_reversals
from hgopt.search.hierarchical.records import INF, Estimated, HeuristicOptions, Skeleton
from hgopt.search.hierarchical.split import best_for_subset, split_order
from hgopt.spec import Instance

log = logging.getLogger(__name__)


def skeleton_candidates(ctx: Ctx, options: HeuristicOptions) -> list[Estimated]:
    """[H1]-[H4] estimated skeletons, best first. Coarse pass: every (k, B) on all usable clusters
    (both directions of the path) and on each cluster alone. For the (k, B) of the best coarse
    skeletons: greedy cluster adding and dropping, the best subsets tried with the other (k, B),
    and order improvement of the leaders."""
    inst = ctx.instance
    coarse: list[Estimated] = []
    counts = _pipeline_counts(inst, options)
    for i, k in enumerate(counts):
        if options.progress:  # progress (cli-explain): pipeline counts estimated so far
            options.progress.report("estimating skeletons", done=i, total=len(counts),
                                    incumbent_s=min((e for e, _ in coarse), default=None))
        if coarse and out_of_time(ctx, options):
            log.debug("heuristic: time limit after %d of %d pipeline counts (%.1f s)", i, len(counts), ctx.elapsed())
            break  # the time limit: the (k, B) estimated so far
        names = tuple(c.name for c in inst.topology.clusters if c.num_gpus // k >= 1)
        best_k, worse = math.inf, 0
        for B in _microbatches(inst, k):
            if coarse and out_of_time(ctx, options):
                break
            here = [got for sub in [names] + ([(n,) for n in names] if len(names) > 1 else [])
                    if (got := best_for_subset(ctx, k, B, sub, passes=1)) is not None]
            coarse.extend(here)
            top = min((e for e, _ in here), default=math.inf)
            # larger microbatches only get worse once two in a row did not improve (early stop)
            worse = 0 if top < best_k else worse + 1
            best_k = min(best_k, top)
            if worse >= options.patience:
                break
        log.debug("heuristic: k=%d: %d coarse skeletons so far, best estimate %.4g s (%.1f s)", k, len(coarse),
                 min((e for e, _ in coarse), default=math.inf), ctx.elapsed())
    coarse.sort(key=lambda x: x.estimate_s)
    out = list(coarse)
    kbs = list(dict.fromkeys((sk.pipelines, sk.microbatch) for _, sk in coarse))[: options.kb_leaders]
    for k, B in kbs:
        if out_of_time(ctx, options):
            break
        names = tuple(c.name for c in inst.topology.clusters if c.num_gpus // k >= 1)
        if len(names) > 1:
            out.extend(_add_clusters(ctx, k, B, names))
        got = best_for_subset(ctx, k, B, names)
        if got is not None:
            out.append(got)
            out.extend(_drop_clusters(ctx, got.skeleton, got.estimate_s))
    log.debug("heuristic: cluster subsets grown and pruned for %d (k, B): %d skeletons (%.1f s)", len(kbs), len(out),
             ctx.elapsed())
    if not out_of_time(ctx, options):
        out.extend(_cross(ctx, out, options))
    out.sort(key=lambda x: x.estimate_s)
    unique: dict[Skeleton, float] = {}
    for est, sk in out:
        unique.setdefault(sk, est)
    ranked = [Estimated(e, s) for s, e in unique.items()]
    reorder = 0 if out_of_time(ctx, options) else options.reorder
    for e, sk in [_improve_order(ctx, e, s) for e, s in ranked[:reorder]]:
        unique.setdefault(sk, e)
    ranked = sorted((Estimated(e, s) for s, e in unique.items()), key=lambda x: x.estimate_s)
    leaders = list(dict.fromkeys((s.pipelines, s.microbatch, s.order) for _, s in ranked))[: 2 * options.finalists]
    if out_of_time(ctx, options):
        leaders = []
    for e, sk in [_improve_split(ctx, e, s) for e, s in ranked if (s.pipelines, s.microbatch, s.order) in leaders]:
        unique.setdefault(sk, e)
    return sorted((Estimated(e, s) for s, e in unique.items()), key=lambda x: x.estimate_s)


def _pipeline_counts(instance: Instance, options: HeuristicOptions) -> list[int]:
    """Powers of two k dividing the global batch with at least one cluster giving each pipeline a GPU."""
    G = instance.job.global_batch
    most = max(c.num_gpus for c in instance.topology.clusters)
    out, k = [], 1
    while k <= min(most, options.max_pipelines, G):
        if G % k == 0:
            out.append(k)
        k *= 2
    return out


def _microbatches(instance: Instance, k: int) -> list[int]:
    """Divisors B of the samples per pipeline, from 1 up to what the biggest cluster's share of GPUs
    can hold at the largest profiled microbatch size per replica."""
    per_pipe = instance.job.global_batch // k
    top = max((c.num_gpus // k) * max(max(instance.model.mbss(c.gpu, t)) for t in instance.model.tps(c.gpu))
              for c in instance.topology.clusters)
    return [b for b in range(1, min(per_pipe, max(top, 1)) + 1) if per_pipe % b == 0]


def _add_clusters(ctx: Ctx, k: int, B: int, names: tuple[str, ...]) -> list[Estimated]:
    """[H4] From the best single cluster, add the cluster that lowers the estimate most, while one does."""
    singles = [got for n in names if (got := best_for_subset(ctx, k, B, (n,), passes=1)) is not None]
    if not singles:
        return []
    out = list(singles)
    est, sk = min(singles, key=lambda x: x.estimate_s)
    # above ctx.neighbours + 1 clusters, each round tries the ctx.neighbours best single clusters
    # not yet in (O(neighbours) splits a round instead of O(clusters))
    by_single = [n for _, s in sorted(singles, key=lambda x: (x.estimate_s, x.skeleton.order)) for n in s.order]
    large = len(names) > ctx.neighbours + 1
    while len(sk.order) < len(names):
        pool = [n for n in names if n not in sk.order]
        if large:
            keep = set([n for n in by_single if n not in sk.order][: ctx.neighbours])
            pool = [n for n in pool if n in keep]
        trials = [got for n in pool
                  if (got := best_for_subset(ctx, k, B, (*sk.order, n), passes=1)) is not None]
        if not trials:
            break
        best = min(trials, key=lambda x: x.estimate_s)
        if best.estimate_s >= est:
            break
        out.append(best)
        est, sk = best
    return out


def _drop_clusters(ctx: Ctx, sk: Skeleton, est: float) -> list[Estimated]:
    """[H4] Remove clusters one at a time while the estimate improves."""
    out: list[Estimated] = []
    names = sk.order
    layers = dict(zip(sk.order, sk.layers))
    while len(names) > 1:
        trials = []
        drops: list[tuple[str, ...]] = [(n,) for n in names]
        if len(names) > ctx.neighbours + 1:
            # large instances: drop one of the ctx.neighbours clusters holding the fewest layers, or the
            # fewest-layer half at once (O(neighbours) splits a round, O(log clusters) rounds to shrink)
            few = sorted(names, key=lambda n: (layers.get(n, 0), n))
            drops = [(n,) for n in sorted(few[: ctx.neighbours])] + [tuple(few[: len(names) // 2])]
        for drop in drops:
            got = best_for_subset(ctx, sk.pipelines, sk.microbatch, tuple(n for n in names if n not in drop),
                                  passes=1)
            if got is not None:
                trials.append(got)
        if not trials:
            break
        best = best_for_subset(ctx, sk.pipelines, sk.microbatch, min(trials, key=lambda x: x.estimate_s).skeleton.order)
        if best is None:
            break
        out.append(best)
        if best.estimate_s >= est:
            break
        est, names = best.estimate_s, best.skeleton.order
        layers = dict(zip(best.skeleton.order, best.skeleton.layers))
    return out


def _cross(ctx: Ctx, found: list[Estimated], options: HeuristicOptions) -> list[Estimated]:
    """[H4] The best cluster subsets found for some (k, B), tried with every other (k, B)."""
    found = sorted(found, key=lambda x: x.estimate_s)
    subsets = list(dict.fromkeys(frozenset(sk.order) for _, sk in found))[: options.finalists]
    kbs = list(dict.fromkeys((sk.pipelines, sk.microbatch) for _, sk in found))
    out = []
    for sub in subsets:
        for k, B in kbs:
            names = tuple(c.name for c in ctx.instance.topology.clusters if c.name in sub)
            if any(ctx.instance.topology.cluster(n).num_gpus // k < 1 for n in names):
                continue
            got = best_for_subset(ctx, k, B, names, passes=1)
            if got is not None:
                out.append(got)
    return out


def _improve_split(ctx: Ctx, est: float, sk: Skeleton, max_moves: int = 48) -> Estimated:
    """[H4] Single-layer moves between any two clusters, each judged with the two clusters' local
    alternatives ([H6]) re-chosen: the split was found with the default alternatives only, and some
    gains (a cluster relaying a few layers over several local stages, which lowers the 1F1B
    round-trip pace) appear only with the others. An accepted move is re-costed with every cluster's
    alternative re-chosen and the stages after each cluster it implies (memory in flight)."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    C = len(sk.order)
    if C < 2:
        return Estimated(est, sk)
    wan = wan_times(ctx, sk.order, sk.pipelines * sk.microbatch, sk.links)  # [C4w]: k pipelines share the WAN
    after = [round_up(C - 1 - i) for i in range(C)]
    best = Estimated(est, sk)
    ws = list(sk.weights) if sk.weights else [m] * C
    for _ in range(max_moves):
        tabs = [alt_tables(ctx, n, role_of(i, C), sk.pipelines, sk.microbatch, m, after[i])
                for i, n in enumerate(sk.order)]
        layers = best.skeleton.layers
        vals = [{w: cell(t, c) for w, t in tb.items()} for tb, c in zip(tabs, layers)]
        top: tuple[float, int, int, int, int] | None = None
        for i, j in _move_pairs(vals, ws, layers, m, max(2, ctx.neighbours // 2) if C > ctx.neighbours + 1 else None):
            if layers[i] <= 1:
                continue
            vi = {w: cell(t, layers[i] - 1) for w, t in tabs[i].items()}
            vj = {w: cell(t, layers[j] + 1) if layers[j] + 1 < len(t.fill) else Cell(INF, INF, INF, 0)
                  for w, t in tabs[j].items()}
            base = [v[w] for v, w in zip(vals, ws)]
            for wi, a in vi.items():
                for wj, b in vj.items():
                    base[i], base[j] = a, b
                    e = combine(base, m, wan)
                    if top is None or e < top[0]:
                        top = (e, i, j, wi, wj)
        if top is None or top[0] >= best.estimate_s - 1e-12:
            break
        cand = list(layers)
        cand[top[1]] -= 1
        cand[top[2]] += 1
        stages = [int(t[w].stages[c]) for t, w, c in zip(tabs, ws, cand)]
        after = [round_up(sum(stages[i + 1 :])) for i in range(C)]
        tabs = [alt_tables(ctx, n, role_of(i, C), sk.pipelines, sk.microbatch, m, after[i])
                for i, n in enumerate(sk.order)]
        e, chosen = choose_weights(ctx, sk.order, tabs, cand, sk.pipelines * sk.microbatch, m, sk.links)
        if e >= best.estimate_s - 1e-12:
            break
        ws = list(chosen)
        best = Estimated(e, Skeleton(pipelines=sk.pipelines, microbatch=sk.microbatch, order=sk.order,
                                     layers=tuple(cand), weights=() if all(w == m for w in ws) else tuple(ws),
                                     links=sk.links))
    return best


def _move_pairs(
    vals: list[dict[int, Cell]], ws: list[int], layers: tuple[int, ...], m: int, near: int | None
) -> list[tuple[int, int]]:
    """[H4] The (from, to) cluster pairs of one split-improvement move: every pair, or (``near``,
    large instances) the ``near`` most loaded clusters ((m − 1)·bottleneck + fill + sync of the chosen
    alternative) to the ``near`` least loaded, in index order."""
    C = len(layers)
    if near is None:
        return list(itertools.permutations(range(C), 2))
    load = [pipeline_time(m, c.bottleneck, c.fill) + c.sync_opt for c in (v[w] for v, w in zip(vals, ws))]
    donors = set(sorted(range(C), key=lambda i: (-load[i], i))[:near])
    takers = set(sorted(range(C), key=lambda j: (load[j], j))[:near])
    return [(i, j) for i in sorted(donors) for j in sorted(takers) if i != j]


def _improve_order(ctx: Ctx, est: float, sk: Skeleton, rounds: int = 2) -> Estimated:
    """[H3] Reorder by 2-opt moves (reverse a run of clusters) judged by the full
    split estimate, not the WAN path cost alone (a cluster's position also decides what it holds
    and how many stages follow it)."""
    m = ctx.instance.job.global_batch // (sk.pipelines * sk.microbatch)
    best = Estimated(est, sk)
    C = len(sk.order)
    for _ in range(rounds):
        order = best.skeleton.order
        if C > ctx.neighbours + 1:  # large: the reversals cheapest by WAN path cost only
            moves = set(cheapest_reversals(ctx, order, sk.pipelines * sk.microbatch, m, ctx.neighbours))
        else:
            moves = {order[:i] + order[i:j][::-1] + order[j:] for i in range(C - 1) for j in range(i + 2, C + 1)}
        moves.discard(order)
        moves.discard(order[::-1])  # the split already tries both directions
        improved = False
        for cand in sorted(moves):
            got = split_order(ctx, sk.pipelines, sk.microbatch, m, cand, passes=1)
            if got is not None and got.estimate_s < best.estimate_s - 1e-12:
                full = split_order(ctx, sk.pipelines, sk.microbatch, m, cand, passes=2)
                if full is not None and full.estimate_s < best.estimate_s - 1e-12:
                    best, improved = full, True
        if not improved:
            break
    return best


def requiring(ctx: Ctx, raw: list[Estimated], need: tuple[str, ...]) -> list[Estimated]:
    """(cli-explain) The estimated skeletons that use every cluster of ``need``; when none does, the
    clusters of the best few skeletons of each (k, B) plus ``need``, and ``need`` alone, split anew."""
    names = [c.name for c in ctx.instance.topology.clusters]
    for n in need:
        if n not in names:
            raise ValueError(f"require_clusters: unknown cluster {n!r} (clusters: {', '.join(names)})")
    keep = [x for x in raw if set(need) <= set(x.skeleton.order)]
    if keep:
        return keep
    out = []
    for e, sk in raw[:12]:
        for sub in (set(sk.order) | set(need), set(need)):
            got = best_for_subset(ctx, sk.pipelines, sk.microbatch, tuple(n for n in names if n in sub))
            if got is not None and set(need) <= set(got.skeleton.order):
                out.append(got)
    return sorted(dict.fromkeys(out), key=lambda x: x.estimate_s)
