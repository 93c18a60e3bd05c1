"""``hgopt compare INSTANCE``: run several planners on one instance and compare their plans, all
scored by the one cost model (``evaluate``).

Columns: planner, status, iteration time and throughput by ``evaluate``, $ per million tokens
(GPU-hours from ``cost_per_gpu_hour`` + WAN egress, as ``hgopt.explain`` prices; "-" without prices),
throughput relative to the
best plan, the row's own gap ((T − its own lower bound) / T, for planners with a bound), the gap to
the least bound of the milp rows (``milp``, ``milp:auto``; the column header names the row whose bound
it is; it holds for their plan spaces, so a plan outside them — a Metis stage mixing GPU types — can
beat it: the gap is then negative), search time and GPUs used. Every planner's heartbeat on stderr is
prefixed with its name. Exit status 0 when at least one planner found a plan; 130 / 143 after
SIGINT / SIGTERM (the running planner's incumbent is kept, the planners after it are not run).

deadline2: ``--time-limit T`` bounds the whole command (``hgopt.commands._deadline``): it returns
within max(1.1 T, T + 2 s) of the process start. Each of the n planners gets ``search_limit(T) / n``
as its nominal limit (a fixed function of T: the same input and T give the same rows whatever the
load) and a watchdog at the end of its slot (the time up to the search's stop, split in n equal
slots, at least ``MIN_SLOT_S`` from its start), which asks it to stop: a search that checks the flag
returns its best plan and bound (status ``feasible`` / ``heuristic``, note "stopped by the command's
deadline"); one that does not (the baselines) may finish in the later planners' time, up to the
command's own stop plus ``DEADLINE_GRACE_S``, when its last reported incumbent is taken (none: status
``NOT_FOUND``, no stand-in plan under its name); a planner that would start
after the search's stop is not run (status ``not run``, note saying so); ``--plot`` / ``--timeline``
are skipped, naming themselves, with under ``TIMELINE_MIN_S`` left."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass

from hgopt.commands._deadline import DEADLINE_GRACE_S, STARTUP_RESERVE_S, Deadline, search_limit
from hgopt.commands._search import EXIT_CODES, SearchInterrupted, run_planner
from hgopt.commands.plan import TIMELINE_MIN_S, check_outputs
from hgopt.cost import build_tables, evaluate
from hgopt.instances import load_instance
from hgopt.plan import Plan
from hgopt.progress import Progress
from hgopt.search import PlanOptions, PlanResult, get_planner, link_penalties, planner_names
from hgopt.spec import Instance
from hgopt.table import format_table

__all__ = ["CompareRow", "compare", "register"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class CompareRow:
    planner: str
    status: str
    iteration_time_s: float
    throughput_samples_per_s: float
    vs_best: float
    """Throughput / the best throughput of the comparison (1.0 for the best plan)."""
    gap_to_bound: float | None
    """(T − the least lower bound of the milp rows) / T (the row ``bound_from``); None without one."""
    lower_bound_s: float | None
    search_time_s: float
    gpus: int
    plan: Plan | None
    note: str = ""
    own_gap: float | None = None
    """(T − this row's own lower bound) / T; None for planners without a bound."""
    bound_from: str | None = None
    """The row whose lower bound ``gap_to_bound`` is measured against."""
    signal: int | None = None
    """The signal (SIGINT/SIGTERM) that interrupted this planner, if one did."""
    usd_per_million_tokens: float | None = None
    """$ per million tokens (``hgopt.explain``: GPU-hours + WAN egress); None without prices."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="run several planners on one instance and compare their plans")
    p.add_argument("instance", help="instance name (see `hgopt instances`) or path")
    p.add_argument("--planners", nargs="+", default=None, metavar="NAME",
                   help="planners to run, space- or comma-separated; NAME:VARIANT runs a variant (milp:auto, "
                        "heuristic:auto, heuristic:fp8 = link precision; metis:slowest-link = what Metis is told) "
                        f"(default: {', '.join(_default_planners())})")
    p.add_argument("--link-precision", choices=("native", "fp32", "bf16", "fp16", "fp8", "auto"), default=None,
                   help="inter-cluster boundary precision for planners without a variant (default: native)")
    p.add_argument("--max-compressed-links", type=int, default=None, metavar="N",
                   help="at most N compressed inter-cluster boundaries per pipeline")
    p.add_argument("--link-penalty", default=None, metavar="P=S[,P=S]",
                   help="seconds added to the objective per boundary compressed to precision P (default 0)")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="seconds the whole command may take, from the process start (default 60): the n planners get "
                        "(S - 1 s) / n each, a planner still running at the end of its slot is stopped with its best "
                        "plan and bound, and --plot/--timeline are skipped, saying so, when no time is left")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of the throughputs")
    p.add_argument("--timeline", metavar="FILE.png", help="1F1B timeline picture of the best plan")
    p.set_defaults(func=run)


_VARIANT_KEY = {"metis": "bandwidth"}
"""Which PlanOptions.extra key a NAME:VARIANT sets (default: link_precision)."""


def _default_planners() -> list[str]:
    """Every registered planner, plus the exact planner and the heuristic with compressed links
    (auto precision)."""
    names = list(planner_names())
    return names + [f"{n}:auto" for n in ("milp", "heuristic") if n in names]


def _planner_list(arg: list[str] | None) -> list[str]:
    if not arg:
        return _default_planners()
    names = [n for a in arg for n in a.split(",") if n]
    known = planner_names()
    for n in names:
        if n.partition(":")[0] not in known:
            raise ValueError(f"--planners: unknown planner {n!r} (choices: {', '.join(known)}, optionally NAME:VARIANT)")
    return list(dict.fromkeys(names))


def _options(name: str, time_limit_s: float, extra: dict[str, str]) -> tuple[str, PlanOptions]:
    base, _, variant = name.partition(":")
    ex = dict(extra)
    if variant:
        ex[_VARIANT_KEY.get(base, "link_precision")] = variant
    return base, PlanOptions(time_limit_s=time_limit_s, extra=ex)


MIN_SLOT_S = 0.5
"""deadline2: the least time a planner that is started gets before its watchdog (a planner whose
slot earlier ones used up still gets this much, if the search's stop is not reached)."""

NOT_RUN_DEADLINE = "not run: no time left of --time-limit"

NOT_FOUND = "no plan in its slot"
"""deadline2: the row status of a planner its slot's watchdog stopped before it had any plan (compare
gives it no stand-in plan: the uniform row is there)."""


def planner_slots(deadline: Deadline, n: int) -> tuple[float, tuple[float, ...]]:
    """deadline2: (each planner's nominal time limit, the clock readings at which the n slots end):
    ``search_limit(T) / n``, and the time from the start-up reserve to the deadline's ``stop_at``
    in n equal slots."""
    first = deadline.start + STARTUP_RESERVE_S
    width = max(deadline.stop_at - first, 0.0) / max(n, 1)
    return search_limit(deadline.time_limit_s) / max(n, 1), tuple(first + (i + 1) * width for i in range(n))


def compare(
    instance: Instance, planners: list[str], time_limit_s: float, extra: dict[str, str] | None = None,
    *, heartbeat: bool = True, deadline: Deadline | None = None,
) -> list[CompareRow]:
    """Run ``planners`` (registry names, optionally NAME:VARIANT) and score every plan with
    ``evaluate``. ``extra``: PlanOptions.extra for every planner (a variant overrides its key).
    ``heartbeat``: progress lines on stderr, prefixed with the planner's name. After SIGINT/SIGTERM
    the running planner returns its incumbent and the later ones are reported as not run.
    ``time_limit_s``: each planner's limit; with ``deadline`` (the command's, whose ``time_limit_s``
    is the whole command's) the planners share it (``planner_slots``; the module text)."""
    if time_limit_s <= 0:
        raise ValueError(f"--time-limit: must be > 0 seconds, got {time_limit_s}")
    tables = build_tables(instance)
    results: list[tuple[str, PlanResult | None, str, float]] = []
    stopped_by: int | None = None
    share, ends = planner_slots(deadline, len(planners)) if deadline is not None else (time_limit_s, ())
    for i, name in enumerate(planners):
        if stopped_by is not None:
            results.append((name, None, "not run: interrupted", 0.0))
            continue
        stop_at = None
        if deadline is not None:
            now = deadline.clock()
            if now >= deadline.stop_at:
                results.append((name, None, NOT_RUN_DEADLINE, 0.0))
                continue
            stop_at = min(deadline.stop_at, max(ends[i], now + MIN_SLOT_S))
        t0 = time.perf_counter()
        base, opts = _options(name, share, extra or {})
        progress = Progress(name, heartbeat=heartbeat)
        try:
            if deadline is not None:
                res: PlanResult | None = run_planner(name, get_planner(base), instance, opts, progress, stop_at=stop_at,
                                                     clock=deadline.clock, fallback=False,
                                                     give_up_at=deadline.stop_at + DEADLINE_GRACE_S)
                if res.plan is None and res.notes and "deadline" in res.notes[0]:  # stopped before it had a plan
                    res = dataclasses.replace(res, status=NOT_FOUND)  # type: ignore[arg-type]
            else:
                res = run_planner(name, get_planner(base), instance, opts, progress)
            note = ""
        except ValueError as exc:  # a planner that cannot handle this instance says why
            res, note = None, str(exc)
        stopped_by = progress.signal
        results.append((name, res, note, time.perf_counter() - t0))
    # the least bound of the milp rows (milp, milp:auto, ...) holds for every plan of their spaces
    milp_bounds = [(r.lower_bound_s, n) for n, r, _, _ in results
                   if n.partition(":")[0] == "milp" and r and r.lower_bound_s]
    bound, bound_from = min(milp_bounds) if milp_bounds else (None, None)
    scored = []
    for name, res, note, wall in results:
        plan = res.plan if res else None
        ev = evaluate(plan, instance, tables) if plan is not None else None
        t = ev.iteration_time_s if ev is not None and ev.feasible else math.inf
        usd = None
        if plan is not None and ev is not None and ev.feasible:  # issue #14 (cli): $/Mtoken beside throughput
            from hgopt.explain import explain

            usd = explain(plan, instance, ev, tables).money.usd_per_million_tokens
        scored.append((name, res, note, wall, plan, t, ev.gpus_used if ev else 0, usd))
    best = min((x[5] for x in scored), default=math.inf)
    rows = []
    for name, res, note, wall, plan, t, gpus, usd in scored:
        own = None
        if res is not None and res.lower_bound_s is not None and math.isfinite(t):
            own = (t - res.lower_bound_s) / t
        rows.append(CompareRow(
            own_gap=own,
            bound_from=bound_from if bound is not None and math.isfinite(t) else None,
            signal=stopped_by if res is not None and res.status == "interrupted" else None,
            planner=name,
            status=res.status if res else ("not run" if note in ("not run: interrupted", NOT_RUN_DEADLINE) else "error"),
            iteration_time_s=t,
            throughput_samples_per_s=instance.job.global_batch / t if math.isfinite(t) else 0.0,
            vs_best=best / t if math.isfinite(t) else 0.0,
            gap_to_bound=(t - bound) / t if bound is not None and math.isfinite(t) else None,
            lower_bound_s=res.lower_bound_s if res else None,
            search_time_s=res.search_time_s if res and res.search_time_s else wall,
            gpus=gpus,
            plan=plan,
            note=note or (("; ".join(res.notes[:1])) if res and res.notes else ""),
            usd_per_million_tokens=usd,
        ))
    return rows


def run(args: argparse.Namespace, *, deadline: Deadline | None = None) -> int:
    # deadline2: --time-limit bounds the whole command (from the process start when run as `hgopt`);
    # ``deadline``: tests' fake clock
    dl = deadline or Deadline.for_command(args.time_limit, getattr(args, "started_at", None))
    inst = load_instance(args.instance)
    check_outputs(args, "--plot", "--timeline")
    extra = {}
    if args.link_precision:
        extra["link_precision"] = args.link_precision
    if args.max_compressed_links is not None:
        if args.max_compressed_links < 0:
            raise ValueError(f"--max-compressed-links: must be >= 0, got {args.max_compressed_links}")
        extra["max_compressed_links"] = str(args.max_compressed_links)
    if args.link_penalty:
        link_penalties({"link_penalty": args.link_penalty})  # bad input fails here, naming the option
        extra["link_penalty"] = args.link_penalty
    try:
        rows = compare(inst, _planner_list(args.planners), args.time_limit, extra, deadline=dl)
    except SearchInterrupted as exc:  # a second signal: abort without a table
        print(f"hgopt: aborted by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return EXIT_CODES.get(exc.signum, 130)  # type: ignore[call-overload, no-any-return]
    sig = next((r.signal for r in rows if r.signal is not None), None)
    found = [r for r in rows if r.plan is not None and math.isfinite(r.iteration_time_s)]
    skipped = []  # deadline2: drawings left out for want of time, named (stderr too: the JSON is the row list)
    for opt in ("plot", "timeline"):
        path = getattr(args, opt)
        if path and (opt == "plot" or found) and dl.hard_left() < TIMELINE_MIN_S:
            setattr(args, opt, None)
            skipped.append(f"--{opt} {path} (under {TIMELINE_MIN_S:g} s left before the deadline)")
    if args.json:
        print(json.dumps([_row_dict(r) for r in rows], indent=2))
    else:
        print(render(inst, rows))
        for what in skipped:
            print(f"skipped: {what}")
    for what in skipped:
        log.warning("hgopt: skipped %s", what)
    if args.plot:
        from hgopt.report import plot_comparison

        plot_comparison(inst.name, [(r.planner, r.throughput_samples_per_s) for r in rows], args.plot)
        log.info("bar chart written to %s", args.plot)
    if args.timeline and found:
        from hgopt.report import plot_timeline

        from hgopt.commands.plan import _timeline_kwargs

        top = min(found, key=lambda r: r.iteration_time_s)
        plot_timeline(top.plan, inst, args.timeline, **_timeline_kwargs(top.planner))  # type: ignore[arg-type]
    if sig is not None:
        return EXIT_CODES.get(sig, 130)  # type: ignore[call-overload, no-any-return]
    return 0 if found else 1


def render(inst: Instance, rows: list[CompareRow]) -> str:
    src = next((r.bound_from for r in rows if r.bound_from), None)
    table = format_table(
        ["planner", "status", "iteration", "samples/s", "$/Mtoken", "vs best", "own gap",
         f"gap to {src} bound" if src else "gap to milp bound", "search", "GPUs"],
        [[r.planner, r.status, _secs(r.iteration_time_s), _num(r.throughput_samples_per_s),
          "-" if r.usd_per_million_tokens is None else f"${r.usd_per_million_tokens:.4g}", _ratio(r.vs_best),
          _gap(r.own_gap), _gap(r.gap_to_bound), f"{r.search_time_s:.2f} s", r.gpus]
         for r in rows])
    lines = [f"{inst.name}: {inst.topology.num_gpus()} GPUs in {len(inst.topology.clusters)} clusters, "
             f"global batch {inst.job.global_batch}; every plan scored by evaluate", "", table,
             "own gap: (iteration - the row's own lower bound) / iteration; "
             + (f"gap to {src} bound: (iteration - the {src} row's bound, the least of the milp rows) / iteration "
                "(valid for the milp plan spaces; a plan outside them can be negative)" if src else
                "gap to milp bound: no milp row with a bound")]
    notes = [f"  {r.planner}: {r.note}" for r in rows if r.note]
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


def _gap(g: float | None) -> str:
    return "-" if g is None else f"{100 * g:.2f} %"


def _secs(t: float) -> str:
    return f"{t:.4f} s" if math.isfinite(t) else "-"


def _num(v: float) -> str:
    return f"{v:.2f}" if v else "-"


def _ratio(v: float) -> str:
    return f"{v:.3f}x" if v else "-"


def _row_dict(r: CompareRow) -> dict[str, object]:
    fin = lambda v: v if isinstance(v, (int, float)) and math.isfinite(v) else None  # noqa: E731
    return {
        "planner": r.planner, "status": r.status, "iteration_time_s": fin(r.iteration_time_s),
        "throughput_samples_per_s": r.throughput_samples_per_s, "usd_per_million_tokens": r.usd_per_million_tokens,
        "vs_best": r.vs_best,
        "gap_to_bound": r.gap_to_bound, "gap_to_bound_of": r.bound_from, "own_gap": r.own_gap,
        "lower_bound_s": r.lower_bound_s, "search_time_s": r.search_time_s,
        "gpus": r.gpus, "note": r.note, "plan": r.plan.to_dict() if r.plan else None,
    }
