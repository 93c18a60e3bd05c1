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
``__main__`` (e.g. ``-m hgopt.runner --plan ... --rank 3``), pacing from the end of the first optimizer
step on (start-up and the first step, a warm-up, run unpaced); with ``$HGOPT_PACE_REPORT`` set to a
folder, each process writes its pacing figures there when it exits (``lag_s`` > 0: the machine was too
busy to hold the pace). ``$HGOPT_PACE_NICE`` (e.g. ``-10``, root) raises the process's CPU priority:
a paced rank uses at most ``speed`` of a core, but on a busy machine it should get that share, and get
it promptly after each wait (wake-up delays otherwise add milliseconds to every operation). The hooks wrap ``torch.distributed``'s
sends, receives and collectives (not ``irecv``: posting a receive does not wait for anything),
``Work.wait``, ``time.sleep`` and the optimizers' ``step``; they act only on the main thread.
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

__all__ = ["PacedClock", "install", "main", "realtime_from_env"]

_real_sleep = time.sleep


class PacedClock:
    """Device time of the main thread since the last interaction, and the wait that settles it."""

    def __init__(self, speed: float, armed: bool = True) -> None:
        if not 0 < speed <= 1:
            raise ValueError(f"pace speed must be in (0, 1], got {speed}")
        self.speed = speed
        self.main = threading.main_thread().ident
        self.paced_s = 0.0
        """Total seconds waited to pace the device (diagnostics)."""
        self.lag_s = 0.0
        """Total seconds by which compute took longer than its device time: the machine gave this
        thread less than ``speed`` of a core (diagnostics; pacing cannot make up for it)."""
        self.steps = 0
        self.armed = armed
        """Unarmed, the clock paces nothing (start-up: imports, model building, rendezvous)."""
        self.cpu_s = 0.0
        self.overshoot = 0.0
        self.host_s = 0.0
        """CPU seconds of the main thread outside device work since the clock was armed (diagnostics)."""
        self.regions = False
        """With device regions (:func:`install`), only CPU time inside them is device work; the rest of
        the main thread is host work that overlaps with it. Without, all of it is device work."""
        self._depth = 0
        self._region_t0 = 0.0
        self._region_cpu = 0.0
        self.reset()

    def reset(self) -> None:
        self.wall = time.perf_counter()
        self._take()

    def enter(self) -> None:
        """Device work begins (nested regions count once)."""
        if self._depth == 0:
            self._region_t0 = time.thread_time()
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._region_cpu += time.thread_time() - self._region_t0

    def _take(self) -> float:
        """Device CPU seconds since the last take (all CPU seconds without regions)."""
        now = time.thread_time()
        if not self.regions:
            cpu, self.cpu = now - getattr(self, "cpu", now), now
            return cpu
        cpu, self._region_cpu = self._region_cpu, 0.0
        if self._depth > 0:
            cpu += now - self._region_t0
            self._region_t0 = now
        if self.armed:
            self.host_s += max(0.0, now - getattr(self, "cpu", now) - cpu)
        self.cpu = now
        return cpu

    def settle(self) -> None:
        """Wait until the CPU work done since the last reset has taken its device time.

        The device clock advances to the target even when the sleep overshoots it (a sleeping thread
        wakes late on a busy machine): the next settle then waits that much less, so wake-up delays
        do not add up over the many settles of a step."""
        if not self.armed:
            self.reset()
            return
        cpu = self._take()
        target = self.wall + cpu / self.speed
        self.cpu_s += cpu
        wait = target - time.perf_counter()
        if wait > 0:
            _real_sleep(wait)
            self.paced_s += wait
            self.overshoot = max(0.0, time.perf_counter() - target)
            self.wall = target
            self._take()
        else:
            self.lag_s -= wait
            self.overshoot = 0.0
            self.reset()

    def resume(self, blocked_s: float) -> None:
        """Restart the clock after a blocking call. A call that returned at once found its data
        already there, so the device would have gone on at its own time: the last sleep's overshoot is
        credited. A call that really waited resumes the device now."""
        if blocked_s < 5e-4:
            self.wall = time.perf_counter() - self.overshoot
            self._take()
        else:
            self.reset()
        self.overshoot = 0.0

    def report(self) -> dict[str, float]:
        return {"speed": self.speed, "cpu_s": self.cpu_s, "device_s": self.cpu_s / self.speed,
                "paced_s": self.paced_s, "lag_s": self.lag_s, "host_s": self.host_s, "regions": self.regions}

    def on_main(self) -> bool:
        return threading.get_ident() == self.main


def realtime_from_env() -> None:
    """``$HGOPT_PACE_RT=PRIO`` (root): put every thread of this process under ``SCHED_RR`` at PRIO.

    A paced rank computes in short bursts and idles in between; on a host whose other load keeps
    both cores busy (load average 20-35 measured while the validation ran), a waking rank at nice −10
    still waited for its share (pace lag 20-30 % of a run). Under ``SCHED_RR`` it runs as soon as it
    wakes; its pacing keeps it to ``speed`` of a core, and the kernel's real-time throttling
    (``sched_rt_runtime_us``) bounds it anyway. Set once pacing starts (start-up runs at normal
    priority, so that importing torch does not hold a core)."""
    prio = os.environ.get("HGOPT_PACE_RT")
    if not prio:
        return
    param = os.sched_param(int(prio))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_RR, param)
        except (PermissionError, ProcessLookupError):
            pass


def _blocking(clock: PacedClock, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Settle before ``fn`` (the work so far is done) and restart the clock after it returns (the time
    spent blocked is not compute)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not clock.on_main():
            return fn(*args, **kwargs)
        clock.settle()
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.resume(time.perf_counter() - t)

    return wrapper


def _after(clock: PacedClock, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` (compute) and settle right after it, e.g. an optimizer step that ends a timed step."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if clock.on_main():
            clock.settle()
            clock.steps += 1
            if not clock.armed:
                realtime_from_env()
            clock.armed = True
        return out

    return wrapper


def _region(clock: PacedClock, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` is device work (on the main thread)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not clock.on_main():
            return fn(*args, **kwargs)
        clock.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.exit()

    return wrapper


DEVICE_WORK = ("torch.nn.Module.__call__", "torch.autograd.backward", "torch.nn.functional.cross_entropy",
               "torch.optim.Adam.step", "torch.optim.AdamW.step", "torch.optim.SGD.step",
               "hgopt.runner.codec.encode", "hgopt.runner.codec.decode")
"""What runs on the device with ``regions``: a module's forward (the outermost call), autograd's
backward, the runner's loss, optimizer steps, and the boundary codec's casts. Everything else on the
main thread (the engine's bookkeeping, posting sends and receives, building batches, gradient
buffers' flattening) is host work."""


def install(speed: float, from_first_step: bool = False, regions: bool = False) -> PacedClock:
    """Pace this process's main thread at ``speed`` cores (call once per process). With
    ``from_first_step`` pacing starts once the first optimizer step is done: start-up and the first
    (warm-up) step run at the machine's speed. With ``regions``, only the main thread's CPU time inside
    :data:`DEVICE_WORK` is device work, paced at ``speed``; the rest is host work, which runs at the
    machine's speed and overlaps with the device's (as a host enqueues work for an accelerator)."""
    import importlib

    import torch
    import torch.distributed as dist

    clock = PacedClock(speed, armed=not from_first_step)
    clock.regions = regions
    if regions:
        for path in DEVICE_WORK:
            mod_name, _, attr = path.rpartition(".")
            owner: Any
            try:
                owner = importlib.import_module(mod_name)
            except ModuleNotFoundError:  # a class: module.Class
                m, _, cls = mod_name.rpartition(".")
                owner = getattr(importlib.import_module(m), cls)
            setattr(owner, attr, _region(clock, getattr(owner, attr)))
    for name in ("isend", "send", "recv", "all_reduce", "broadcast", "barrier", "all_gather_object",
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
    regions = len(argv) > 1 and argv[1] == "--device-regions"
    if regions:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[1] != "-m":
        print("usage: python -m hgopt.profiler.paced SPEED [--device-regions] -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    if nice := os.environ.get("HGOPT_PACE_NICE"):
        os.setpriority(os.PRIO_PROCESS, 0, int(nice))
    clock = install(float(argv[0]), from_first_step=True, regions=regions)
    if report := os.environ.get("HGOPT_PACE_REPORT"):
        atexit.register(lambda: Path(report, f"pace-{os.getpid()}.json").write_text(json.dumps(clock.report())))
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
