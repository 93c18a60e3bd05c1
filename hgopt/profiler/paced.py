"""A paced device: a process's main thread that executes its CPU work at ``speed`` times the speed of
one core of this machine, whatever else the machine is doing.

Why: an emulated run puts several ranks (stages, replicas) on a machine with few cores, shared with
other work. Wall-clock speed then depends on who else runs, and a layer profiled alone is not what a
rank sees. Pacing makes each rank a device of fixed speed again: the main thread's CPU time (the
thread CPU clock, unaffected by waiting or being descheduled) is converted into device time
``cpu / speed``, and before every point where the rank interacts with others — sending, waiting for a
receive, a collective, a sleep — it waits until that much wall time has passed since the previous
interaction. As long as the machine gives each rank at least ``speed`` of a core, a rank's compute
takes exactly its device time; communication threads (gloo's) are not paced, like a NIC.
``hgopt profile --pace SPEED`` measures layers in the same unit (thread CPU seconds / speed).

``python -m hgopt.profiler.paced SPEED -m MODULE ARGS...`` installs the pacing and runs MODULE as
``__main__`` (e.g. ``-m hgopt.runner --plan ... --rank 3``); with ``$HGOPT_PACE_REPORT`` set to a
folder, each process writes its pacing figures there when it exits (``lag_s`` > 0: the machine was too
busy to hold the pace). The hooks wrap ``torch.distributed``'s
point-to-point and collective calls, ``Work.wait``, ``time.sleep`` and the optimizers' ``step``; they
act only on the main thread.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["PacedClock", "install", "main"]

_real_sleep = time.sleep


class PacedClock:
    """Device time of the main thread since the last interaction, and the wait that settles it."""

    def __init__(self, speed: float) -> None:
        if not 0 < speed <= 1:
            raise ValueError(f"pace speed must be in (0, 1], got {speed}")
        self.speed = speed
        self.main = threading.main_thread().ident
        self.paced_s = 0.0
        """Total seconds waited to pace the device (diagnostics)."""
        self.lag_s = 0.0
        """Total seconds by which compute took longer than its device time: the machine gave this
        thread less than ``speed`` of a core (diagnostics; pacing cannot make up for it)."""
        self.cpu_s = 0.0
        self.reset()

    def reset(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.thread_time()

    def settle(self) -> None:
        """Wait until the CPU work done since the last reset has taken its device time."""
        cpu = time.thread_time() - self.cpu
        wait = self.wall + cpu / self.speed - time.perf_counter()
        self.cpu_s += cpu
        if wait > 0:
            _real_sleep(wait)
            self.paced_s += wait
        else:
            self.lag_s -= wait
        self.reset()

    def report(self) -> dict[str, float]:
        return {"speed": self.speed, "cpu_s": self.cpu_s, "device_s": self.cpu_s / self.speed,
                "paced_s": self.paced_s, "lag_s": self.lag_s}

    def on_main(self) -> bool:
        return threading.get_ident() == self.main


def _blocking(clock: PacedClock, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Settle before ``fn`` (the work so far is done) and restart the clock after it returns (the time
    spent blocked is not compute)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not clock.on_main():
            return fn(*args, **kwargs)
        clock.settle()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.reset()

    return wrapper


def _after(clock: PacedClock, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` (compute) and settle right after it, e.g. an optimizer step that ends a timed step."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if clock.on_main():
            clock.settle()
        return out

    return wrapper


def install(speed: float) -> PacedClock:
    """Pace this process's main thread at ``speed`` cores (idempotent per process: call once)."""
    import torch
    import torch.distributed as dist

    clock = PacedClock(speed)
    for name in ("isend", "irecv", "send", "recv", "all_reduce", "broadcast", "barrier", "all_gather_object",
                 "all_gather", "reduce_scatter", "gather", "scatter"):
        if hasattr(dist, name):
            setattr(dist, name, _blocking(clock, getattr(dist, name)))
    work = torch._C._distributed_c10d.Work
    work.wait = _blocking(clock, work.wait)
    time.sleep = _blocking(clock, _real_sleep)
    for opt in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        opt.step = _after(clock, opt.step)
    torch.set_num_threads(1)
    return clock


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "-m":
        print("usage: python -m hgopt.profiler.paced SPEED -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    clock = install(float(argv[0]))
    if report := os.environ.get("HGOPT_PACE_REPORT"):
        atexit.register(lambda: Path(report, f"pace-{os.getpid()}.json").write_text(json.dumps(clock.report())))
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
