"""``hgopt plan INSTANCE --objective cost | --budget USD_PER_HOUR | --pareto``: the time planner on
cluster subsets, priced, with the bound and gap of the chosen objective (``hgopt.search.by_cost``)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from hgopt.commands._deadline import DEADLINE_GRACE_S, Deadline, search_limit
from hgopt.cost import build_tables, evaluate
from hgopt.search import PlanOptions, get_planner
from hgopt.search.by_cost import CostSearch, pareto, plan_by_cost
from hgopt.spec import Instance
from hgopt.table import fmt_seconds, format_table

__all__ = ["add_arguments", "honest_status", "render", "run_cost", "stopped_words", "to_json", "wanted"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--objective", choices=("time", "cost"), default="time",
                   help="time: the fastest plan (default); cost: the cheapest $ per iteration (GPU-hours from "
                        "cost_per_gpu_hour plus WAN egress; the heuristic compares its candidates by it and searches "
                        "node counts), with a lower bound on $ valid for every plan")
    p.add_argument("--budget", type=float, default=None, metavar="USD_PER_HOUR",
                   help="only plans costing at most this many dollars per hour of training")
    p.add_argument("--pareto", action="store_true",
                   help="list the candidates' time vs cost, marking those no other is both faster and cheaper than")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the command asked for the cost search (else ``hgopt plan`` runs as before)."""
    return getattr(args, "objective", "time") != "time" or getattr(args, "budget", None) is not None \
        or bool(getattr(args, "pareto", False))


def run_cost(args: argparse.Namespace, inst: Instance, opts: PlanOptions, *, deadline: Deadline | None = None) -> int:
    """The cost search under the usual heartbeat and SIGINT/SIGTERM handling (``_search.run_planner``):
    a signal stops it after the running planner returns, keeping the candidates found so far.

    deadline2: ``--time-limit T`` bounds the whole command as for ``hgopt plan``
    (``hgopt.commands._deadline``): the search gets ``search_limit(T)``, the watchdog stops it near
    max(1.1 T, T + 2 s) and the candidates priced by then are the result (the subsets not searched
    are counted); when not even the whole instance's run has returned, the incumbent its planner last
    reported (or the uniform baseline's plan) is the one candidate. ``deadline``: tests' fake clock."""
    import dataclasses
    import signal
    import sys

    from hgopt.commands._search import EXIT_CODES, SearchInterrupted, at_deadline, exit_code, run_planner
    from hgopt.commands.plan import render_result, result_to_json
    from hgopt.explain import explain
    from hgopt.progress import Progress
    from hgopt.search import PlanResult
    from hgopt.search.by_cost import single_result_search

    dl = deadline or Deadline.for_command(args.time_limit, getattr(args, "started_at", None))
    tables = build_tables(inst)
    box: dict[str, CostSearch] = {}

    def search_all(instance: Instance, options: PlanOptions) -> PlanResult:
        box["search"] = s = plan_by_cost(instance, get_planner(args.planner), options, objective=args.objective,
                                         budget_usd_per_hour=args.budget, tables=tables,
                                         on_update=lambda part: box.__setitem__("partial", part))
        return s.best.result if s.best is not None else PlanResult(planner=args.planner, status="infeasible", plan=None)

    progress = Progress(args.planner)
    opts = dataclasses.replace(opts, time_limit_s=search_limit(args.time_limit))  # deadline2: the search's share
    try:
        res = run_planner(args.planner, search_all, inst, opts, progress, stop_at=dl.stop_at,
                          stop_grace_s=DEADLINE_GRACE_S, clock=dl.clock)
    except SearchInterrupted as exc:  # a second signal
        print(f"hgopt: aborted by {signal.Signals(exc.signum).name}; no plan written", file=sys.stderr)
        return EXIT_CODES.get(exc.signum, 130)  # type: ignore[call-overload, no-any-return]
    stopped = exit_code(progress)
    by_deadline = progress.stop_is_set() and progress.signal is None
    search = box.get("search") or box.get("partial")
    if search is not None and by_deadline and search.best is not None and search.best.stopped:
        # deadline2: the chosen plan's run was cut short by the deadline: its words say so
        cut = dataclasses.replace(search.best, result=at_deadline(search.best.result, progress, inst))
        search = dataclasses.replace(search, best=cut, candidates=tuple(cut if c is search.best else c
                                                                        for c in search.candidates))
    if search is None and res.plan is not None:
        # deadline2: stopped inside the whole instance's run: res is its last reported incumbent (or the
        # uniform baseline's plan), with the words of what stopped it
        search = single_result_search(inst, res, objective=args.objective, budget_usd_per_hour=args.budget,
                                      tables=tables)
    if search is None:  # stopped inside a planner that did not return within the grace time, no plan at all
        print("hgopt: interrupted before the cost search had priced any plan; no plan written", file=sys.stderr)
        return stopped or 1
    search = honest_status(search, args.gap)
    best = search.best
    if args.output and best is not None and best.result.plan is not None:
        with open(args.output, "w") as fh:
            fh.write(best.result.plan.to_json() + "\n")
    ev = evaluate(best.result.plan, inst, tables) if best is not None and best.result.plan is not None else None
    expl = explain(best.result.plan, inst, ev, tables) if ev is not None and best is not None and best.result.plan else None
    why_stopped = (f"interrupted by {signal.Signals(progress.signal).name}: {len(search.candidates)} cluster subset(s) "
                   "searched, the rest not" if stopped and progress.signal is not None else "")
    deadline_note = stopped_words(search, dl.elapsed()) if by_deadline or search.unsearched else ""
    if args.json:
        doc = to_json(search)
        doc["interrupted"] = why_stopped or None
        doc["stopped_by_deadline"] = deadline_note or None
        doc["chosen"] = result_to_json(best.result, ev, expl) if best is not None else None
        print(json.dumps(doc, indent=2))
    else:
        print(render(inst, search, pareto_only=bool(args.pareto)))
        if why_stopped:
            print(why_stopped)
        if deadline_note:
            print(deadline_note)
        if best is not None:
            print()
            print(render_result(inst, best.result, ev, expl))
            if args.output:
                print(f"plan written to {args.output}")
    if stopped:
        return stopped
    return 0 if best is not None else 1


def honest_status(search: CostSearch, gap: float) -> CostSearch:
    """deadline2 (issue #11 item 5): the chosen plan's status is the cost search's, not the status its
    planner gave it on its cluster subset (``optimal`` there is optimal for that subset only):
    ``optimal`` only when the search's own gap against its bound (valid for every plan) is within
    ``gap``, else ``feasible`` with a bound, ``heuristic`` without; a changed status is named in a note.
    ``interrupted`` stays."""
    best = search.best
    if best is None or best.result.plan is None or best.result.status == "interrupted":
        return search
    status = ("optimal" if search.gap is not None and search.gap <= gap + 1e-12 else
              "feasible" if search.lower_bound is not None else "heuristic")
    if status == best.result.status:
        return search
    import dataclasses

    res = best.result
    plan = res.plan
    assert plan is not None
    where = "+".join(best.clusters) + ("" if best.nodes is None else f" on {best.nodes} nodes")
    gap_words = "no bound" if search.gap is None else f"its gap {100 * search.gap:.2f} %"
    note = (f"status {status}: the {search.objective} search's, {gap_words} against the bound that holds for "
            f"every plan (the planner said {res.status} for its run on {where})")
    plan = dataclasses.replace(plan, meta=(*((k, v) for k, v in plan.meta if k != "status"), ("status", status)))
    cut = dataclasses.replace(best, result=dataclasses.replace(res, status=status, plan=plan, notes=(note, *res.notes)))
    return dataclasses.replace(search, best=cut, candidates=tuple(cut if c is best else c for c in search.candidates))


def stopped_words(search: CostSearch, elapsed_s: float) -> str:
    """deadline2: what the time limit left out of the cost search, in words."""
    left = (f"{search.unsearched} cluster subset(s) not searched" if search.unsearched
            else "every cluster subset searched")
    return (f"time limit: {left} ({len(search.candidates)} candidate(s) priced after {elapsed_s:.1f} s); "
            "the best of those is chosen and the lower bound still holds for every plan")


def _usd(v: float | None) -> str:
    return "-" if v is None else f"${v:.4g}"


def render(inst: Instance, s: CostSearch, *, pareto_only: bool = False) -> str:
    front = set(id(c) for c in pareto(s.candidates))
    rows = []
    for c in s.candidates:
        if pareto_only and id(c) not in front:
            continue
        t = c.iteration_time_s
        where = "+".join(c.clusters) + ("" if c.nodes is None else
                                         f" ({c.nodes} of {inst.topology.cluster(c.clusters[0]).nodes} nodes)")
        gpus = ", ".join(f"{n}:{k}" for n, k in c.result.plan.gpus_by_cluster().items()) if c.result.plan else "-"
        rows.append([where + (" (searched)" if c.source == "searched" else ""), gpus, c.result.status,
                     fmt_seconds(t) if math.isfinite(t) else "-",
                     _usd(c.usd_per_iteration), _usd(c.usd_per_hour), _usd(c.usd_per_million_tokens),
                     "*" if id(c) in front else "", "<" if c is s.best else ""])
    what = "Pareto front (time vs $) of" if pareto_only else "candidates:"
    out = [f"{inst.name}: objective {s.objective}"
           + (f", budget ${s.budget_usd_per_hour:g}/hour" if s.budget_usd_per_hour is not None else "")
           + f"; {what} the planner's plans (on cluster subsets, and those it scored on the way: searched), "
           "priced (* Pareto, < chosen)",
           format_table(["clusters", "GPUs used", "status", "iteration", "$/iteration", "$/hour", "$/Mtoken", "pareto", "chosen"],
                        rows)]
    if s.best is None:
        out.append(s.note or ("no plan" + (" within the budget" if s.budget_usd_per_hour is not None else "")))
    unit = (lambda v: f"${v:.4g} per iteration") if s.objective == "cost" else fmt_seconds
    if s.lower_bound is not None:
        out.append(f"lower bound on the {s.objective}: {unit(s.lower_bound)} ({s.bound_note})"
                   + ("" if s.gap is None else f"; gap {100 * s.gap:.2f} %"))
    else:
        out.append(f"no lower bound on the {s.objective} ({s.bound_note})")
    return "\n".join(out)


def to_json(s: CostSearch) -> dict[str, Any]:
    def num(x: float | None) -> float | None:
        return None if x is None or not math.isfinite(x) else x

    front = set(id(c) for c in pareto(s.candidates))
    return {
        "objective": s.objective, "budget_usd_per_hour": s.budget_usd_per_hour,
        "lower_bound": num(s.lower_bound), "gap": s.gap, "bound_note": s.bound_note, "note": s.note or None,
        "unsearched_subsets": s.unsearched,
        "candidates": [{"clusters": list(c.clusters), "nodes": c.nodes, "source": c.source, "status": c.result.status,
                        "iteration_time_s": num(c.iteration_time_s), "usd_per_iteration": c.usd_per_iteration,
                        "usd_per_hour": c.usd_per_hour, "usd_per_million_tokens": c.usd_per_million_tokens,
                        "pareto": id(c) in front, "chosen": c is s.best,
                        "plan": c.result.plan.to_dict() if c.result.plan else None} for c in s.candidates],
    }
