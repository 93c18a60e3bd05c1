"""Runner overhead: hgopt's own 1F1B engine vs ``torch.distributed.pipelining.Schedule1F1B`` on the same
2-stage split, model, data and microbatches (CPU, gloo, one thread per rank).

Both sides build the stages with :func:`hgopt.runner.model.build_stage`, draw the same random tokens,
normalise the loss by the step's token count and step Adam; both time a step from its start (all
ranks just synchronised) to the end of the optimizer step and take the slowest rank. Runs alternate
(hgopt, torch, hgopt, torch, ...) so that load from other processes hits both alike; the figure is the
median over runs of each run's median step time (first steps dropped as warm-up). The losses of the
two are compared as a check that they computed the same thing.

    .venv/bin/python bench/runner_overhead.py [--runs 5] [--steps 12]

The machine this was written on has 2 cores shared with other jobs, so wall times are noisy; the CPU
time per step (summed over both ranks) is printed as well, as a load-insensitive measure of the same
work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hgopt.export import ExportOptions, build_runner_plan
from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner.data import Dataset
from hgopt.runner.engine import make_optimizer
from hgopt.runner.launch import run_forked
from hgopt.runner.model import build_stage
from hgopt.runner.summary import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.runner_plans import G, pipeline, runner_instance  # noqa: E402
from hgopt.plan import Plan  # noqa: E402

WARMUP = 2


def bench_plan(layers: int, microbatches: int, mbs: int, hidden: int, seq: int, steps: int) -> RunnerPlan:
    """Embedding, blocks, head split in two equal stages on two clusters; one replica each."""
    half = layers // 2
    plan = Plan(pipelines=(pipeline([((0, half), [G("a", mbs=mbs)]), ((half, layers), [G("b", mbs=mbs)])],
                                    m=microbatches),))
    inst = runner_instance(layers, microbatches * mbs, embed_head=True)
    return build_runner_plan(plan, inst, ExportOptions(hidden=hidden, heads=4, seq=seq, steps=steps, data="random"))


def run_hgopt(rp: RunnerPlan) -> tuple[list[float], list[float], list[float]]:
    """Per step: slowest rank's wall time, CPU seconds of all ranks, loss."""
    with tempfile.TemporaryDirectory() as d:
        codes = run_forked(rp, Path(d), threads=1, timeout_s=600)
        if any(codes.values()):
            raise RuntimeError(f"runner failed: {codes}")
        recs = read_metrics(d)
    return [r["time_s"] for r in recs], [r["cpu_s"] for r in recs], [r["loss"] for r in recs]


def _torch_rank(rank: int, port: int, rp: RunnerPlan, q: object) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("bench", store), rank=rank, world_size=2)
    pipe = rp.pipelines[0]
    st = pipe.stages[rank]
    model = build_stage(rp.model, st.start, st.end, seed=rp.train.seed, dtype=rp.train.dtype)
    opt = make_optimizer(rp, model)
    data = Dataset(rp.model, rp.train)
    stage = PipelineStage(model, rank, 2, torch.device("cpu"))
    tokens = [0]  # the step's token count (random data: every target counts, but computed like the runner does)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="sum") / tokens[0]

    sched = Schedule1F1B(stage, n_microbatches=pipe.num_microbatches, loss_fn=loss_fn, scale_grads=False)
    times: list[float] = []
    cpus: list[float] = []
    losses: list[float] = []
    for step in range(rp.train.steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        tokens[0] = data.global_tokens(step, rp.global_batch)
        opt.zero_grad(set_to_none=True)
        x, y = data.batch(step, range(rp.global_batch))
        part: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=part)
        opt.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        t = torch.tensor([wall, cpu, float(sum(float(v.detach()) for v in part))], dtype=torch.float64)
        dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(t[1:])
        times.append(float(t[0]))
        cpus.append(float(t[1]))
        losses.append(float(t[2]))
    if rank == 0:
        q.put((times, cpus, losses))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def run_torch(rp: RunnerPlan) -> tuple[list[float], list[float], list[float]]:
    import multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["hgopt.runner.worker"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_torch_rank, args=(r, store.port, rp, q)) for r in range(2)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=8, help="embedding + blocks + head")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    rp = bench_plan(args.layers, args.microbatches, args.mbs, args.hidden, args.seq, args.steps)
    wall: dict[str, list[float]] = {"hgopt": [], "torch": []}
    cpu: dict[str, list[float]] = {"hgopt": [], "torch": []}
    load0 = _load()
    for i in range(args.runs):
        losses = {}
        for name, fn in (("hgopt", run_hgopt), ("torch", run_torch)):
            t, c, losses[name] = fn(rp)
            wall[name].append(statistics.median(t[WARMUP:]))
            cpu[name].append(statistics.median(c[WARMUP:]))
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses["hgopt"], losses["torch"]))
        print(f"run {i + 1}: step wall / CPU (all ranks): hgopt {wall['hgopt'][-1] * 1e3:.1f} / {cpu['hgopt'][-1] * 1e3:.1f} ms, "
              f"torch Schedule1F1B {wall['torch'][-1] * 1e3:.1f} / {cpu['torch'][-1] * 1e3:.1f} ms; "
              f"losses agree to {worst:.1e} (relative)", flush=True)
    w = {k: statistics.median(v) for k, v in wall.items()}
    c = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}; 2 stages, {args.microbatches} "
          f"microbatches of {args.mbs}; {args.steps} steps per run ({WARMUP} warm-up), {args.runs} runs; "
          f"load average {load0:.1f} -> {_load():.1f} on {os.cpu_count()} cores")
    print(f"median step wall time: hgopt runner {w['hgopt'] * 1e3:.1f} ms, torch.distributed.pipelining "
          f"Schedule1F1B {w['torch'] * 1e3:.1f} ms, ratio {w['hgopt'] / w['torch']:.3f}")
    print(f"median step CPU time (sum over ranks): hgopt {c['hgopt'] * 1e3:.1f} ms, torch {c['torch'] * 1e3:.1f} ms, "
          f"ratio {c['hgopt'] / c['torch']:.3f}")
    return 0


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


if __name__ == "__main__":
    sys.exit(main())
