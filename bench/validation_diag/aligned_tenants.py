"""Diagnostics: one transformer block (hidden 128, 4 heads, seq 128, mbs 4) timed as a paced device (thread
CPU seconds / PACE, idling (1/PACE - 1) of each phase) by N processes at once, either unaligned (each loops
on its own, as ``hgopt profile --tenants N``) or aligned (every process starts each forward at the same
wall instants, as the stages of a pipeline in steady state do), optionally with the output gradient scaled
like a real one. Prints per condition the median forward / backward device seconds of process 0 and its
minor page faults per step.
  sudo env HGOPT_PACE_RT=1 PYTHONPATH=$PWD /work/main/.venv/bin/python bench/validation_diag/aligned_tenants.py
"""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import time

PACE = 0.15
REPS = 40


def worker(rank: int, n: int, aligned: bool, t0: float, period: float, gscale: float, q) -> None:
    import torch
    torch.set_num_threads(1)
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.profiler.paced import realtime_from_env
    from hgopt.profiler.runner_model import runner_layer_cases
    cfg = ModelConfig(hidden=128, heads=4, seq=128, vocab=256, layers=("embedding", "block", "block", "head"))
    c = runner_layer_cases(cfg)[1]
    x = c.make_input(4)[0].detach().requires_grad_(True)
    with torch.no_grad():
        g = torch.randn_like(c.module(x)) * gscale
    realtime_from_env()
    fw, bw, flt = [], [], []
    for k in range(REPS):
        if aligned:
            target = t0 + k * period
            while time.time() < target:
                time.sleep(max(0.0, min(0.002, target - time.time())))
        r0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        x.grad = None
        c.module.zero_grad(set_to_none=True)
        a = time.thread_time(); out = c.module(x); f = (time.thread_time() - a) / PACE
        time.sleep(f * (1 - PACE))
        a = time.thread_time(); out.backward(g); b = (time.thread_time() - a) / PACE
        time.sleep(b * (1 - PACE))
        flt.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - r0)
        if k >= 5:
            fw.append(f); bw.append(b)
    q.put((rank, statistics.median(fw), statistics.median(bw), statistics.median(flt)))


def cond(n: int, aligned: bool, gscale: float = 1.0) -> str:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.time() + 8.0
    ps = [ctx.Process(target=worker, args=(r, n, aligned, t0, 0.1, gscale, q)) for r in range(n)]
    for p in ps: p.start()
    res = sorted(q.get() for _ in ps)
    for p in ps: p.join()
    f = statistics.median(r[1] for r in res); b = statistics.median(r[2] for r in res)
    return (f"n={n} aligned={aligned} gscale={gscale:g}: fwd {f:.4f} bwd {b:.4f} (per proc "
            + ", ".join(f"{r[1]:.4f}/{r[2]:.4f}" for r in res) + f") minflt/step {res[0][3]}")


if __name__ == "__main__":
    conds = [(1, False), (1, False, 1e-5), (2, False), (2, True), (4, False), (4, True)]
    for c in conds * int(os.environ.get("ROUNDS", "1")):
        print(f"load {os.getloadavg()[0]:.2f}", cond(*c), flush=True)
