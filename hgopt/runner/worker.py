"""One rank from start to finish: rendezvous, process groups, its stage's model, the training loop,
metrics, checkpoints, and a clear exit when anything (here or on another rank) fails."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hgopt.export.runner_plan import RunnerPlan
from hgopt.runner import checkpoint
from hgopt.runner.comm import Wire
from hgopt.runner.linkemu import LEDGER_FILE, FileLedger
from hgopt.runner.device import DeviceChoice, local_index, rank_device, resolve_device
from hgopt.runner.engine import StageWorker, StepStats, make_groups, make_optimizer
from hgopt.runner.model import build_stage
from hgopt.runner.outer import make_outer, restore as outer_restore, save as outer_save
from hgopt.runner.watchdog import Watchdog
from hgopt.runner.zero import make_zero_shards, optimizer_params

__all__ = ["RankOptions", "metric_keys", "run_rank"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankOptions:
    out_dir: Path
    """Metrics (rank 0) and checkpoints go here."""
    store_host: str
    store_port: int
    steps: int | None = None
    """Train until this many steps are done (default: the plan's)."""
    resume: bool = False
    emulation: str = "off"
    """Resolved link emulation: ``off``, ``delay`` or ``netns``."""
    threads: int = 1
    device: str = "cpu"
    """``cpu`` (gloo), ``cuda`` (nccl; GPU ``$LOCAL_RANK``, or the rank's number under the local
    launcher) or ``auto``."""


def metric_keys(rp: RunnerPlan) -> list[str]:
    return [f"{b}.{d}{w}" for b in rp.boundary_names() for d in ("fwd", "bwd") for w in ("", ".wan")]


def run_rank(rp: RunnerPlan, rank: int, opts: RankOptions) -> int:
    """Train; returns 0, or exits the process with status 1 and a message naming the failed rank."""
    torch.set_num_threads(opts.threads)
    timeout = timedelta(seconds=rp.timeout_s)
    choice = resolve_device(opts.device)  # a ValueError here is the caller's to report: no rank started yet
    device = rank_device(choice, local_index(rank))
    if opts.emulation == "netns" and choice.kind == "cuda":
        raise ValueError("link emulation netns shapes gloo's TCP sockets and is CPU-only; with --device cuda use delay")
    watchdog = Watchdog(opts.store_host, opts.store_port, rank, rp.world_size,
                        lambda r: rp.rank_info(r).describe(), rp.heartbeat_timeout_s).start()
    try:
        _train(rp, rank, opts, timeout, choice, device)
        dist.barrier()
        watchdog.done()
        dist.destroy_process_group()
        return 0
    except Exception as exc:  # report, name the rank, exit: never hang
        log.debug("rank %d failed", rank, exc_info=True)
        watchdog.fail(f"{type(exc).__name__}: {exc}")
        raise  # not reached: fail() exits


def _train(rp: RunnerPlan, rank: int, opts: RankOptions, timeout: timedelta, choice: DeviceChoice,
           device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore(opts.store_host, opts.store_port, is_master=False, timeout=timeout, wait_for_workers=False)
    dist.init_process_group(choice.backend, store=dist.PrefixStore("hgopt/pg", store), rank=rank,
                            world_size=rp.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    groups = make_groups(rp, rank, timeout)
    info = rp.rank_info(rank)
    stage = rp.pipelines[info.pipeline].stages[info.stage]
    model = build_stage(rp.model, stage.start, stage.end, groups.tp, seed=rp.train.seed, dtype=rp.train.dtype,
                        device=device, recompute=stage.recompute == "full")
    outer = make_outer(rp, rank, model, timeout, groups.tp)  # issue #15 (diloco): None without an outer sync
    zero = make_zero_shards(rp, rank, model, groups.sync)
    opt = make_optimizer(rp, model, optimizer_params(model, zero))
    if rank == 0 and not opts.resume:  # a fresh run: forget the previous run's metrics and checkpoint marker
        for stale in ("metrics.jsonl", "summary.json", "checkpoints/latest.json"):
            (opts.out_dir / stale).unlink(missing_ok=True)
    if rank == 0:  # emulate: every run (resumed ones too) starts with an empty link ledger
        (opts.out_dir / LEDGER_FILE).unlink(missing_ok=True)
    dist.barrier()
    done = checkpoint.restore(rp, rank, model, opt, groups.tp, opts.out_dir, zero) if opts.resume else 0
    if outer is not None and done:
        outer_restore(outer, checkpoint._dir(opts.out_dir, done))
    wire = Wire(plan=rp, cluster_of={r.rank: r.cluster for r in rp.ranks()}, mode=opts.emulation, device=device,
                backward_group=groups.backward, ledger=FileLedger(path=opts.out_dir / LEDGER_FILE))  # emulate
    worker = StageWorker(rp, rank, model, groups, wire, opt, device=device, zero=zero)
    steps = rp.train.steps if opts.steps is None else opts.steps
    if rank == 0:
        log.info("%d ranks, %d pipeline(s), global batch %d x %d tokens, steps %d..%d, links: %s, device %s (%s)",
                 rp.world_size, len(rp.pipelines), rp.global_batch, rp.model.seq, done + 1, steps, opts.emulation,
                 choice.kind, choice.backend)
    for z in zero:
        log.info("zero 1: layers [%d, %d): optimizer state for %d of %d elements in %d buckets (member %d of %d)",
                 z.sg.start, z.sg.end, z.shard.numel(), z.numel, len(z.buckets), z.member, z.members)
    every = rp.train.checkpoint_every
    for step in range(done, steps):
        st = worker.step(step)
        if outer is not None and outer.maybe_sync(step + 1):
            for z in zero:  # ZeRO-1 steps a flat copy of its slice: take the outer step's parameters
                z.refresh()
        _report(rp, rank, step, st, opts.out_dir, device)
        if (every and (step + 1) % every == 0) or step + 1 == steps:
            if outer is not None:
                outer_save(outer, checkpoint._dir(opts.out_dir, step + 1))
            checkpoint.save(rp, rank, model, opt, groups.tp, opts.out_dir, step + 1, zero)


def _report(rp: RunnerPlan, rank: int, step: int, st: StepStats, out: Path, device: torch.device) -> None:
    """Sum the loss parts, CPU times and byte counters, take the slowest rank's step time; rank 0 logs and appends
    a line to ``metrics.jsonl``. (Outside the timed part of the step.)"""
    keys = metric_keys(rp)
    vec = torch.tensor([st.loss, st.cpu_s] + [float(st.sent.get(k, 0)) for k in keys], dtype=torch.float64,
                       device=device)
    dist.all_reduce(vec)
    t = torch.tensor([st.time_s], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    info = rp.rank_info(rank)
    mine = {"rank": rank, "pipeline": info.pipeline, "stage": info.stage, "replica": info.replica,
            "tp_rank": info.tp_rank, "memory": st.memory, "grad_sync": st.grad_sync}
    per_rank: list[Any] = [None] * rp.world_size
    dist.all_gather_object(per_rank, mine)  # memory and bucket launches of every rank (overlap, memory.py)
    if rank != 0:
        return
    tokens = rp.global_batch * rp.model.seq
    rec = {"step": step + 1, "loss": float(vec[0]), "time_s": float(t[0]), "tokens_per_s": tokens / float(t[0]),
           "cpu_s": float(vec[1]), "samples": rp.global_batch,
           "bytes": {k: int(v) for k, v in zip(keys, vec[2:].tolist())},
           "wall": time.time(), "ranks": per_rank}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    sent = "  ".join(f"{b} {rec['bytes'][b + '.fwd'] / 1e3:.1f}/{rec['bytes'][b + '.bwd'] / 1e3:.1f} kB"
                     for b in rp.boundary_names())
    log.info("step %d  loss %.4f  %.3f s  %.0f tokens/s%s", step + 1, rec["loss"], rec["time_s"], rec["tokens_per_s"],
             f"  fwd/bwd {sent}" if sent else "")
