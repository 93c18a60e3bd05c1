"""Running a planner from a command: heartbeat on stderr, and SIGINT/SIGTERM turned into an
``interrupted`` result that still carries the incumbent.

The planner runs in a worker thread while the main thread waits, so a signal is handled at once
even while the worker sits in a solver call. The handler sets the :class:`~hgopt.progress.Progress`
stop flag; the search loops check it and return their best plan. If the worker has not returned
``grace_s`` seconds later (a long MILP solve), the command takes the incumbent the search last
reported; a search stopped before it had any plan returns the ``uniform`` baseline's (found in a
fraction of a second) so that ``-o`` still gets a valid plan. A second signal ends the command at
once (exit 130/143, no plan written).

sigint: a worker the command gave up on is a daemon thread that may still be inside a solver's native
code when the command ends; :func:`exit_past_searches` then ends the process without the interpreter's
finalisation (see there)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hgopt.cost import evaluate
from hgopt.plan import Plan
from hgopt.progress import Progress
from hgopt.search import Planner, PlanOptions, PlanResult

__all__ = ["EXIT_CODES", "QUICK_PLANNER", "SEARCH_THREAD", "SearchInterrupted", "at_deadline", "exit_code",
           "exit_past_searches", "quick_plan", "run_planner", "searches_left", "stand_in",
           "stand_in_reserve_s"]

log = logging.getLogger(__name__)

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""128 + the signal number, as shells report a process ended by it."""


SEARCH_THREAD = "hgopt-search-"
"""sigint: the name prefix of :func:`run_planner`'s worker threads (:func:`searches_left` finds them)."""


def searches_left() -> list[threading.Thread]:
    """sigint: the search workers still running (ones a command stopped waiting for after a stop)."""
    return [t for t in threading.enumerate() if t.name.startswith(SEARCH_THREAD) and t.is_alive()]


def exit_past_searches(rc: int) -> None:
    """sigint: end the process now with ``rc`` when a search worker is still running; else return.

    Why: the worker is a daemon thread, and under CPython before 3.14 a daemon thread that takes the GIL
    back after the interpreter began finalising is ended with ``pthread_exit``. Its forced unwinding
    through a C++ frame that cannot unwind (a pybind11 call that released the GIL: HiGHS, OR-Tools,
    torch) calls ``std::terminate``: "terminate called without an active exception", SIGABRT, rc -6,
    after the plan was written. Waiting for the worker is no cure (a MILP solve may not return for
    minutes), so the process skips finalisation: logging and the standard streams are flushed (the plan
    file is already written and closed), then ``os._exit``. atexit handlers do not run (the planner
    registers none)."""
    left = searches_left()
    if not left:
        return
    log.debug("hgopt: %d search thread(s) still running at exit (%s): ending the process without finalisation",
              len(left), ", ".join(t.name for t in left))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can reach it
            pass
    os._exit(rc)


class SearchInterrupted(KeyboardInterrupt):
    """A second signal: stop now."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def exit_code(progress: Progress) -> int | None:
    """130 / 143 when a signal stopped the search, else None."""
    return EXIT_CODES.get(progress.signal) if progress.signal is not None else None  # type: ignore[call-overload]


def run_planner(name: str, planner: Planner, instance: Any, options: PlanOptions, progress: Progress,
                *, grace_s: float = 5.0, stop_at: float | None = None, stop_grace_s: float = 1.0,
                clock: Callable[[], float] = time.monotonic, fallback: bool = True,
                give_up_at: float | None = None, stand_in_s: float = 0.0) -> PlanResult:
    """``planner(instance, options with progress)`` under ``progress`` (heartbeat + stop flag).
    deadline: at ``stop_at`` (a ``clock()`` reading) the search is asked to stop as a signal would, and
    given ``stop_grace_s`` to return before its last reported incumbent is taken; the result keeps
    its plan and bound, status ``feasible`` / ``heuristic`` (not ``interrupted``), with a note.
    ``fallback``: a search stopped by the deadline before any plan returns the uniform baseline's
    (:func:`quick_plan`); False (deadline2: ``compare``, whose uniform row is there anyway): no plan.
    ``give_up_at`` (deadline2, a ``clock()`` reading): after a deadline stop, wait for the search until
    then instead of ``stop_grace_s`` (compare: a planner stopped at the end of its slot may finish
    in the time of the later ones, up to the command's own stop). ``stand_in_s`` (deadline4): when the
    search has reported no plan ``stand_in_s`` before ``stop_at`` (:func:`stand_in_reserve_s`), the
    stand-in is made then, beside the search (which keeps running and may still report one), so that
    after the stop only the command's own phases are left."""
    opts = dataclasses.replace(options, progress=progress)
    box: dict[str, Any] = {}
    by_deadline = False

    def work() -> None:
        try:
            box["result"] = planner(instance, opts)
        except BaseException as exc:  # handed to the main thread
            box["error"] = exc

    def on_signal(signum: int, frame: object) -> None:
        if progress.stop_is_set():
            raise SearchInterrupted(signum)
        log.warning("hgopt: %s received: stopping the search, keeping the best plan so far (again to abort)",
                    signal.Signals(signum).name)
        progress.request_stop(signum)

    ready: list[tuple[Plan | None, tuple[str, ...], float]] = []  # deadline4: the stand-in, made before the stop
    worker = threading.Thread(target=work, name=f"{SEARCH_THREAD}{name}", daemon=True)
    saved = _install(on_signal)
    try:
        with progress:
            worker.start()
            waited_after_stop = 0.0
            while worker.is_alive():
                worker.join(0.1)
                if (stand_in_s and fallback and stop_at is not None and not ready and not progress.stop_is_set()
                        and clock() >= stop_at - stand_in_s and progress.state().plan is None):
                    ready.append(stand_in(instance))  # deadline4: no incumbent yet: the stand-in now, beside the search
                if stop_at is not None and not progress.stop_is_set() and clock() >= stop_at:  # deadline
                    log.warning("hgopt: the command's deadline is near: stopping the search, keeping its best plan")
                    progress.request_stop()
                    by_deadline = True
                if progress.stop_is_set():
                    waited_after_stop += 0.1
                    grace = stop_grace_s if by_deadline and progress.signal is None else grace_s
                    if by_deadline and progress.signal is None and give_up_at is not None:
                        grace = max(give_up_at - stop_at, 0.0) if stop_at is not None else grace
                        over = clock() >= give_up_at
                    else:
                        over = waited_after_stop >= grace
                    if over:
                        log.warning("hgopt: the search did not return within %.1f s of the stop; using the "
                                    "incumbent it last reported", grace)
                        progress.park(worker)  # deadline2: it stops competing for the interpreter
                        deadline_stop = by_deadline and progress.signal is None
                        snap = _from_snapshot(name, instance, progress, fallback or not deadline_stop,
                                              pre=ready[0] if ready else None)
                        return at_deadline(snap, progress, instance, fallback) if deadline_stop else snap
    finally:
        _restore(saved)
    if "error" in box:
        raise box["error"]
    res: PlanResult = box["result"]
    if by_deadline and progress.signal is None:  # deadline3: one that never saw the stop finished on its own
        return at_deadline(res, progress, instance, fallback, pre=ready[0] if ready else None) \
            if progress.stop_seen() else res
    if progress.stop_is_set():
        sig = signal.Signals(progress.signal).name if progress.signal else "a stop request"
        plan = res.plan
        quick: tuple[str, ...] = ()
        t_quick = math.inf
        if plan is not None:
            plan = dataclasses.replace(plan, meta=(*((k, v) for k, v in plan.meta if k != "status"),
                                                   ("status", "interrupted")))
        else:
            plan, quick, t_quick = ready[0] if ready else stand_in(instance)
        solver = res.solver
        if "certified" in solver:  # the milp's words for "no MILP needed": untrue when it was stopped first
            solver = "none (stopped before any MILP was solved)"
        res = dataclasses.replace(res, status="interrupted", plan=plan, solver=solver, notes=(
            f"interrupted by {sig} after {progress.elapsed_s():.1f} s: the best plan found so far"
            + ("; the lower bound still holds" if res.lower_bound_s is not None else ""),
            *(n.replace("time limit reached before", "the search stopped before")
               .replace("the time limit ran out before", "the search stopped before") for n in res.notes), *quick),
            iteration_time_s=res.iteration_time_s if res.plan is not None or plan is None else t_quick)
    return res


def at_deadline(res: PlanResult, progress: Progress, instance: Any, fallback: bool = True, *,
                pre: tuple[Plan | None, tuple[str, ...], float] | None = None) -> PlanResult:
    """deadline: a result the command's deadline stopped: its plan and bound stand (a stop only
    ends the search early); ``optimal`` stays when proven, else ``feasible`` with a bound,
    ``heuristic`` without; the solver words that claim a certificate are dropped. ``pre`` (deadline4):
    :func:`stand_in`'s answer when it was made before the stop."""
    quick: tuple[str, ...] = ()
    if fallback and res.plan is None and res.status != "infeasible":  # stopped before any plan: the uniform baseline's
        plan0, quick, t0 = pre or stand_in(instance)
        if plan0 is not None:
            res = dataclasses.replace(res, plan=plan0, iteration_time_s=t0)
    status = res.status
    if res.plan is not None and status not in ("optimal",):
        status = "feasible" if res.lower_bound_s is not None else "heuristic"
    meta = res.plan.meta if res.plan is not None else ()
    plan = res.plan and dataclasses.replace(res.plan, meta=(*((k, v) for k, v in meta if k != "status"),
                                                             ("status", status)))
    solver = res.solver
    if "certified" in solver and status != "optimal":
        solver = "none (stopped by the deadline before any MILP was solved)"
    note = (f"stopped by the command's deadline after {progress.elapsed_s():.1f} s of search: the best plan found "
            "so far" + ("; the lower bound still holds" if res.lower_bound_s is not None else ""))
    notes = tuple(n.replace("interrupted by a stop request", "stopped by the deadline") for n in res.notes)
    return dataclasses.replace(res, status=status, plan=plan, solver=solver, notes=(note, *notes, *quick))


def _from_snapshot(name: str, instance: Any, progress: Progress, fallback: bool = True, *,
                   pre: tuple[Plan | None, tuple[str, ...], float] | None = None) -> PlanResult:
    st = progress.state()
    plan = st.plan if isinstance(st.plan, Plan) else None
    notes: tuple[str, ...] = ()
    t = math.inf
    if plan is not None:
        plan = dataclasses.replace(plan, planner=name.partition(":")[0], instance=instance.name,
                                   meta=(*plan.meta, ("status", "interrupted")))
        t = evaluate(plan, instance).iteration_time_s
    elif fallback:
        plan, notes, t = pre or stand_in(instance)  # deadline4: evaluated once, there
    sig = signal.Signals(progress.signal).name if progress.signal else "a stop request"
    bound = st.bound_s if st.bound_s is not None and math.isfinite(st.bound_s) else None
    return PlanResult(planner=name.partition(":")[0], status="interrupted", plan=plan,
                      iteration_time_s=t, lower_bound_s=bound, search_time_s=progress.elapsed_s(),
                      notes=(f"interrupted by {sig} during phase '{st.phase}': the incumbent last reported"
                             + ("" if st.plan is not None else " (none yet)"), *notes))


QUICK_PLANNER = "uniform"
"""The planner whose plan an interrupted search returns when it had no incumbent yet (a fraction of
a CPU second even on 1024 GPUs: every cluster's GPUs as equal pipeline stages)."""


STAND_IN_CPU_S = (0.1, 2.0e-5)
"""deadline4: CPU seconds :func:`stand_in` takes, fixed + per GPU of the instance (measured after
deadline4's changes, unloaded, 2-core development machine: scale-64r's 16384 GPUs 0.42 s,
scale-16r's 4096 0.12 s, default 0.08 s, sailor-geo-5x128 0.04 s: ``bench/stand_in_cost.py``)."""


def stand_in_reserve_s(instance: Any, slowdown: float = 1.0) -> float:
    """deadline4: wall seconds to keep for :func:`stand_in` on ``instance`` at ``slowdown``
    (``Deadline.slowdown``): ``STAND_IN_CPU_S`` stretched by it."""
    fixed, per_gpu = STAND_IN_CPU_S
    return (fixed + per_gpu * sum(c.num_gpus for c in instance.topology.clusters)) * slowdown


QUICK_PLAN_S = 0.05
"""deadline2: the uniform baseline's time limit in :func:`quick_plan`: it keeps the first feasible grid
of the largest ones once this is spent (sailor-geo-5x80: 0.03 CPU s instead of 1.0 s for all 48
grids, which took 5 s of wall at load 15 and pushed ``--time-limit 5`` past its end)."""


def quick_plan(instance: Any) -> tuple[Plan | None, tuple[str, ...]]:
    """A valid plan at once, for a search stopped before it had one (the ``-o`` file still gets a
    plan): the ``uniform`` baseline's, with ``status`` interrupted in its meta; (None, why) if it
    has none either."""
    plan, notes, _ = stand_in(instance)
    return plan, notes


def stand_in(instance: Any) -> tuple[Plan | None, tuple[str, ...], float]:
    """deadline4: :func:`quick_plan` and the stand-in's iteration time by ``evaluate`` (inf without
    one), evaluated once: the callers no longer evaluate it again. The plan is the uniform grid
    search's own (``plan_uniform`` under ``QUICK_PLAN_S``: one ``evaluate`` of one finalist, reused here), without
    the registry's [C7o] bucket choice and its two more ``evaluate`` runs (the grid's 25 MiB default
    buckets stand): on scale-64r's 16384 GPUs one ``evaluate`` is ~0.2 CPU s, and at a fifth of a core
    each cost a second of the deadline's wall time."""
    from hgopt.search.baselines.uniform import plan_uniform

    scores: dict[Plan, Any] = {}
    try:
        plan = plan_uniform(instance, time_limit_s=QUICK_PLAN_S, scores=scores)
    except Exception as exc:  # noqa: BLE001 - a fallback: its failure must not hide the interruption
        return None, (f"no incumbent yet, and the {QUICK_PLANNER} baseline failed: {exc}",), math.inf
    ev = (scores.get(plan) or evaluate(plan, instance)) if plan is not None else None
    if plan is None or ev is None or not ev.feasible:
        return None, (f"no incumbent yet, and the {QUICK_PLANNER} baseline has no feasible plan either",), math.inf
    plan = dataclasses.replace(plan, meta=(*plan.meta, ("status", "interrupted")))
    return plan, (f"no incumbent yet: the plan is the {QUICK_PLANNER} baseline's (valid, found at once, far from "
                  f"the best), {ev.iteration_time_s:.4g} s per iteration",), ev.iteration_time_s


def _install(handler: Any) -> dict[int, Any] | None:
    if threading.current_thread() is not threading.main_thread():
        return None  # signals are only delivered to the main thread: nothing to install
    saved = {}
    for sig in EXIT_CODES:
        saved[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)
    return saved


def _restore(saved: dict[int, Any] | None) -> None:
    for sig, h in (saved or {}).items():
        signal.signal(sig, h)
