"""Shared by the validation benchmarks: run one plan with the PyTorch runner on this machine, every
rank a paced device of fixed speed (``python -m hgopt.profiler.paced``, see its docstring), with links
emulated by the runner, and read back its per-step times and byte counters.

The runner is used as it is (``hgopt.runner.launch.launch_local``); two things are added from outside:
the ranks are started through ``hgopt.profiler.paced`` (LaunchOptions.python is a small wrapper
script), and in ``netns`` mode, once the ranks have started (pids.json appears), the token buckets of
the emulated links get a small burst (``burst_bytes``), so that a link serialises every message at its
rate like a WAN link does (a burst of B bytes lets a message of up to B bytes through at memory speed
after an idle spell; the runner first used 10 ms of traffic, now 1 ms)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hgopt.export import ExportOptions, build_runner_plan
from hgopt.export.runner_plan import RunnerPlan
from hgopt.plan import Plan
from hgopt.profiler.run import free_port, set_burst
from hgopt.spec import Instance

__all__ = ["ModelOpts", "RunResult", "load_average", "run_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelOpts:
    hidden: int = 128
    heads: int = 4
    vocab: int = 256
    seq: int = 128
    data: str = "random"
    lr: float = 1e-3
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    step_s: tuple[float, ...]
    median_s: float
    """Median of the steps after the warm-up ones."""
    losses: tuple[float, ...]
    bytes_last_step: dict[str, int]
    wall_s: float
    load_before: float
    load_after: float
    returncode: int
    lag_s: float = 0.0
    """Largest total lag of a paced rank (seconds its compute ran slower than its device time)."""
    device_s: float = 0.0
    """Largest paced device time of a rank over the run."""


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _adjust(rp: RunnerPlan, out: Path, port: int, mode: str, burst: int | None, errors: list[str]) -> None:
    """Wait for the ranks to start (then the namespaces exist), then shrink the links' bursts."""
    deadline = time.monotonic() + 60
    pids_file = out / "pids.json"
    while not pids_file.exists():
        if time.monotonic() > deadline:
            errors.append("ranks did not start within 60 s")
            return
        time.sleep(0.02)
    try:
        if mode == "netns" and burst:
            from hgopt.export import netns

            lay = netns.layout(rp, tag=str(port))
            for v in lay.veths:
                set_burst(lay.namespaces[v.ns], v.name, v.bytes_per_s, burst)
                set_burst(lay.namespaces[v.peer_ns], v.peer, v.peer_bytes_per_s, burst)
    except (OSError, subprocess.CalledProcessError) as exc:
        errors.append(f"could not adjust the run: {exc}")


def run_plan(plan: Plan, inst: Instance, out: Path, *, model: ModelOpts, steps: int, warmup_steps: int,
             mode: str, pace: float | None = None, nice: int = 0, burst_bytes: int | None = 3000,
             device_regions: bool = False, heartbeat_s: float | None = None, op_trace: bool = False) -> RunResult:
    """Export ``plan`` for the runner, run ``steps`` steps with every rank paced at ``pace`` cores (None:
    unpaced) and niceness ``nice``, read the metrics. ``device_regions``: only the ranks' model,
    autograd, loss, codec and optimizer work is paced device work, the engine's bookkeeping is host
    work (``python -m hgopt.profiler.paced --device-regions``). ``heartbeat_s``: the runner's heartbeat
    timeout (collectives get 4x), for a host whose other load can deschedule a rank for longer than
    the default 15 s. ``op_trace`` (paced only): every rank's operations timed from outside
    (hgopt/profiler/optrace.py), one ``out/trace/ops-<pid>.json`` per rank."""
    from hgopt.runner.launch import LaunchOptions, launch_local

    out.mkdir(parents=True, exist_ok=True)
    for f in ("metrics.jsonl", "pids.json", *(f"pace/{p.name}" for p in (out / "pace").glob("*.json")),
              *(f"trace/{p.name}" for p in (out / "trace").glob("ops-*.json"))):
        (out / f).unlink(missing_ok=True)
    port = free_port()
    rp = build_runner_plan(plan, inst, ExportOptions(
        hidden=model.hidden, heads=model.heads, vocab=model.vocab, seq=model.seq, steps=steps, lr=model.lr,
        seed=model.seed, data=model.data, local=True, emulate_links=mode, master_port=port))  # type: ignore[arg-type]
    if heartbeat_s is not None:
        rp = replace(rp, heartbeat_timeout_s=heartbeat_s, timeout_s=max(rp.timeout_s, 4 * heartbeat_s))
    plan_path = out / "plan.json"
    plan_path.write_text(rp.to_json())
    load0, t0 = load_average(), time.perf_counter()
    errors: list[str] = []
    watcher = threading.Thread(target=_adjust, args=(rp, out, port, mode, burst_bytes, errors), daemon=True)
    watcher.start()
    python = _paced_python(out, pace, nice, device_regions, op_trace) if pace else sys.executable
    code = launch_local(rp, plan_path, LaunchOptions(out_dir=out, threads=1, port=port, emulation=mode, python=python))
    watcher.join(timeout=5)
    if errors:
        raise RuntimeError("; ".join(errors))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = tuple(float(r["time_s"]) for r in recs)
    if code != 0 or len(times) < steps:
        raise RuntimeError(f"runner failed (exit {code}, {len(times)} of {steps} steps recorded) in {out}")
    paces = [json.loads(p.read_text()) for p in (out / "pace").glob("*.json")]
    return RunResult(step_s=times, median_s=statistics.median(times[warmup_steps:]),
                     lag_s=max((p["lag_s"] for p in paces), default=0.0),
                     device_s=max((p["device_s"] for p in paces), default=0.0),
                     losses=tuple(float(r["loss"]) for r in recs), bytes_last_step=dict(recs[-1]["bytes"]),
                     wall_s=time.perf_counter() - t0, load_before=load0, load_after=load_average(), returncode=code)


def _paced_python(out: Path, pace: float, nice: int, device_regions: bool = False, op_trace: bool = False) -> str:
    """An executable that the launcher can use as its python: starts the module paced (and traced)."""
    path = out / "paced-python"
    (out / "pace").mkdir(exist_ok=True)
    trace = ""
    if op_trace:
        (out / "trace").mkdir(exist_ok=True)
        trace = f"HGOPT_OP_TRACE={out / 'trace'} "
    path.write_text(f"#!/bin/sh\n{trace}HGOPT_PACE_REPORT={out / 'pace'} HGOPT_PACE_NICE={nice} "
                    f"exec {sys.executable} -m hgopt.profiler.paced {pace}"
                    + (" --device-regions" if device_regions else "") + (" -m hgopt.profiler.optrace" if op_trace else "")
                    + " \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def env_summary() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_average": load_average()}
