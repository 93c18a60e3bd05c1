"""Progress of a long search: the planners ``report(...)`` their state at phase points (phase,
splits done/total, incumbent, bound, the incumbent plan) to a :class:`Progress` passed in
``PlanOptions.progress``; a background ticker logs one heartbeat line with the latest state every
``interval_s`` seconds (logger ``hgopt.progress`` at INFO, so ``-q`` silences it). The same object
carries a cooperative stop flag: a command's SIGINT/SIGTERM handler calls :meth:`Progress.request_stop`
and the search loops, which check :meth:`Progress.stop_requested`, return their incumbent."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

__all__ = ["Progress", "ProgressState", "format_state"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgressState:
    """The latest state a search reported."""

    phase: str = "starting"
    done: int | None = None
    total: int | None = None
    incumbent_s: float | None = None
    """Objective of the best plan found so far (seconds)."""
    bound_s: float | None = None
    """Proven lower bound so far (seconds)."""
    plan: Any = None
    """The incumbent plan (a ``hgopt.plan.Plan``), so an interrupted command can still write it."""


def format_state(state: ProgressState, elapsed_s: float, name: str = "") -> str:
    """One heartbeat line: ``[milp] splits 3/12, incumbent 5.623 s, bound 5.210 s, 12.0 s elapsed``."""
    if state.done is not None:
        head = f"{state.phase} {state.done}" + (f"/{state.total}" if state.total is not None else "")
    else:
        head = state.phase + (f" (of {state.total})" if state.total is not None else "")
    parts = [head]
    if state.incumbent_s is not None and math.isfinite(state.incumbent_s):
        parts.append(f"incumbent {state.incumbent_s:.4g} s")
    if state.bound_s is not None and math.isfinite(state.bound_s):
        parts.append(f"bound {state.bound_s:.4g} s")
    parts.append(f"{elapsed_s:.1f} s elapsed")
    return (f"[{name}] " if name else "") + ", ".join(parts)


class Progress:
    """Thread-safe latest search state, a heartbeat ticker and a stop flag.

    Use as a context manager (``with Progress("milp") as p: planner(inst, PlanOptions(progress=p))``):
    entering starts the ticker thread (when ``heartbeat``), leaving stops it. ``interval_s`` is the
    ticker period (the issue asks for a line at least every 2 s; default 1 s)."""

    def __init__(self, name: str = "", *, interval_s: float = 1.0, heartbeat: bool = True) -> None:
        if not interval_s > 0:
            raise ValueError(f"progress interval must be > 0 seconds, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self.heartbeat = heartbeat
        self._lock = threading.Lock()
        self._state = ProgressState()
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._signal: int | None = None
        self._t0 = time.monotonic()
        self._thread: threading.Thread | None = None
        self._parked: threading.Thread | None = None  # deadline2: see park()
        self._never = threading.Event()
        self._seen = threading.Event()  # deadline3: see stop_seen

    # ---- the search side -------------------------------------------------------------------
    def report(self, phase: str | None = None, *, done: int | None = None, total: int | None = None,
               incumbent_s: float | None = None, bound_s: float | None = None, plan: Any = None) -> None:
        """Update the state; arguments left None keep their previous value (a new phase resets
        done/total)."""
        self._park_here()
        with self._lock:
            s = self._state
            if phase is not None and phase != s.phase:
                s = replace(s, phase=phase, done=None, total=None)
            changes: dict[str, Any] = {k: v for k, v in (("done", done), ("total", total), ("incumbent_s", incumbent_s),
                                                         ("bound_s", bound_s), ("plan", plan)) if v is not None}
            self._state = replace(s, **changes)

    def stop_requested(self) -> bool:
        """True once :meth:`request_stop` was called: the search should return its incumbent."""
        self._park_here()
        if self._stop.is_set():
            self._seen.set()  # deadline3: the search saw the stop (see stop_seen)
            return True
        return False

    def stop_is_set(self) -> bool:
        """deadline3: the command side's query of the flag (it does not count as the search seeing it)."""
        return self._stop.is_set()

    def stop_seen(self) -> bool:
        """deadline3: True once :meth:`stop_requested` answered True: the search was told to stop (a
        search that returns after a stop it never saw finished on its own: its result is complete)."""
        return self._seen.is_set()

    def _park_here(self) -> None:
        if self._parked is not None and threading.current_thread() is self._parked:
            self._never.wait()  # deadline2: a search the command gave up on waits here until the process ends

    # ---- the command side --------------------------------------------------------------------
    def request_stop(self, signum: int | None = None) -> None:
        """Ask the search to stop (from a signal handler: records the signal number)."""
        if signum is not None and self._signal is None:
            self._signal = signum
        self._stop.set()

    def park(self, thread: threading.Thread) -> None:
        """deadline2: the command gave up waiting for ``thread`` (a search that did not return within
        its grace after a stop): from now on that thread blocks at its next :meth:`report` or
        :meth:`stop_requested` (never while holding this object's lock), so it no longer takes the
        interpreter from the command's remaining phases (a daemon thread: it ends with the process)."""
        self._parked = thread

    def stop_only(self) -> Progress:
        """sigint: a view for a sub-search whose state is not this search's (the exact planner's
        warm-start heuristic, its native-link pre-search, its grouped-plan check): it sees this object's
        stop flag (and parks with it, see :meth:`park`), its reports are dropped, it has no heartbeat."""
        return _StopView(self)

    @property
    def signal(self) -> int | None:
        """The signal that requested the stop, if one did."""
        return self._signal

    def state(self) -> ProgressState:
        with self._lock:
            return self._state

    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    def line(self) -> str:
        return format_state(self.state(), self.elapsed_s(), self.name)

    def __enter__(self) -> Progress:
        self._t0 = time.monotonic()
        if self.heartbeat and self._thread is None:
            self._thread = threading.Thread(target=self._tick, name=f"hgopt-progress-{self.name}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)
            self._thread = None

    def _tick(self) -> None:
        while not self._closed.wait(self.interval_s):
            log.info("%s", self.line())


class _StopView(Progress):
    """sigint: :meth:`Progress.stop_only`'s view: stop flag and parking of ``parent``, reports dropped."""

    def __init__(self, parent: Progress) -> None:
        super().__init__(parent.name, heartbeat=False)
        self._parent = parent

    def report(self, phase: str | None = None, *, done: int | None = None, total: int | None = None,
               incumbent_s: float | None = None, bound_s: float | None = None, plan: Any = None) -> None:
        self._parent._park_here()

    def stop_requested(self) -> bool:
        return self._parent.stop_requested()

    def stop_is_set(self) -> bool:
        return self._parent.stop_is_set()

    def request_stop(self, signum: int | None = None) -> None:
        self._parent.request_stop(signum)

    def park(self, thread: threading.Thread) -> None:
        self._parent.park(thread)

    @property
    def signal(self) -> int | None:
        return self._parent.signal
