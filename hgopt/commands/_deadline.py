"""One deadline for a whole command (issue #11 item 4: ``--time-limit T`` returns within
max(1.1 T, T + 2 s)), measured from the start of the process: the interpreter's start-up, the
imports and loading the instance count against it.

Every phase of ``hgopt plan`` takes its share of it:

- the search gets ``search_limit(T)`` (``T - STARTUP_RESERVE_S``, at least half of T) as its
  nominal ``--time-limit``: a fixed function of T, so that the same input and T give the same
  warm start and plan whatever the machine's load (the work-limited phases scale with it);
- a watchdog asks the search to stop at ``stop_at`` (the hard end less ``POST_RESERVE_S`` and the
  grace the search gets to return its incumbent), so an overshooting search still leaves the
  post-search phases their time;
- post-search phases that are optional (the why-not lines, the timeline drawing) run only in what
  is left; a skipped one is named in the output (``skipped``).

``clock`` is injectable (tests pass a fake one: no wall-clock verdicts)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["DEADLINE_GRACE_S", "Deadline", "MAX_SLOWDOWN", "POST_RESERVE_S", "STARTUP_RESERVE_S", "hard_limit",
           "process_elapsed_s", "search_limit", "slowdown"]

STARTUP_RESERVE_S = 1.0
"""Seconds of T kept from the search for the process start-up (Python, imports, instance load:
0.8-1.6 s with warm .pyc files on the 2-core development machine at load 12-17)."""

POST_RESERVE_S = 0.5
"""Seconds kept after the search for what always runs: evaluate, explain, the JSON / text output."""

DEADLINE_GRACE_S = 1.0
"""Seconds the search gets, once asked to stop at the deadline, to return its incumbent before the
command takes the incumbent it last reported (``_search.run_planner``'s grace)."""


MAX_SLOWDOWN = 4.0
"""deadline2: the most ``slowdown`` stretches ``POST_RESERVE_S`` (so a loaded machine still leaves the
search part of T: at T = 5 the watchdog then fires 3 s, not 1.5 s, before the hard end)."""


def slowdown(wall_s: float, cpu_s: float) -> float:
    """deadline2: how much slower than its CPU work this process runs on this machine now: its wall
    seconds since the start over its CPU seconds (the start-up is single-threaded work), in
    [1, ``MAX_SLOWDOWN``]; 1 where either is unknown. On the 2-core development machine at load
    13-15 under ``nice``: about 4 (1.4 CPU s in 5.5 s of wall); idle: about 1.1. The post-search
    phases (evaluate, explain, the output, a stand-in plan) are CPU work, so their reserve scales with it."""
    if not (wall_s > 0 and cpu_s > 0):
        return 1.0
    return min(max(wall_s / cpu_s, 1.0), MAX_SLOWDOWN)


def hard_limit(time_limit_s: float) -> float:
    """The contract's end: max(1.1 T, T + 2 s) from the process start."""
    return max(1.1 * time_limit_s, time_limit_s + 2.0)


def search_limit(time_limit_s: float) -> float:
    """The search's nominal time limit for a command ``--time-limit`` of ``time_limit_s``."""
    return max(time_limit_s - STARTUP_RESERVE_S, 0.5 * time_limit_s)


def process_elapsed_s(clock: Callable[[], float] = time.monotonic) -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time against
    /proc/uptime); 0.0 where that cannot be read (the deadline is then measured from the command's
    start)."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rpartition(")")[2].split()[19])  # field 22: starttime
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass(frozen=True, slots=True)
class Deadline:
    """``time_limit_s`` measured from ``start`` (a ``clock()`` reading)."""

    time_limit_s: float
    start: float
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)
    slowdown: float = 1.0
    """deadline2: ``slowdown()`` of this process when the command started: ``POST_RESERVE_S`` is kept
    that many times (a loaded machine needs longer for the same post-search work)."""

    @classmethod
    def from_process_start(cls, time_limit_s: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        return cls(time_limit_s, clock() - process_elapsed_s(), clock)

    @classmethod
    def for_command(cls, time_limit_s: float, started: float | None) -> Deadline:
        """deadline2: the deadline of a command started at ``started`` (``hgopt.cli.main``'s
        ``args.started_at``, a ``time.monotonic`` reading; None: now), with the process's slowdown
        measured now (its wall and CPU seconds so far)."""
        now = time.monotonic()
        return cls(time_limit_s, started if started is not None else now,
                   slowdown=slowdown(process_elapsed_s(), time.process_time()))

    @property
    def soft(self) -> float:
        """The clock reading at which ``--time-limit`` is used up."""
        return self.start + self.time_limit_s

    @property
    def hard(self) -> float:
        """The clock reading by which the command must have returned."""
        return self.start + hard_limit(self.time_limit_s)

    @property
    def stop_at(self) -> float:
        """When the watchdog asks the search to stop (the post-search reserve stretched by ``slowdown``)."""
        return self.hard - POST_RESERVE_S * self.slowdown - DEADLINE_GRACE_S

    def left(self) -> float:
        """Seconds left of ``--time-limit`` (negative once past it)."""
        return self.soft - self.clock()

    def hard_left(self) -> float:
        return self.hard - self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.start
