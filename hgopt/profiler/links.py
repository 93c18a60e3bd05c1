"""Measuring links between ranks: point-to-point ping-pong between every pair of ranks and a ring
all-reduce among all of them, fitted to the cost model's (bandwidth, latency) ([C1], [C5]).

Each rank is a separate process (``python -m hgopt.profiler.links``), so ranks can be started inside
network namespaces whose veth links are shaped (``tc tbf``): :class:`RankLaunch` carries the command
prefix (``ip netns exec NS``) and the environment (``GLOO_SOCKET_IFNAME``) per rank. On loopback the
prefix is empty. torch is imported only inside the worker.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hgopt.profiler.fit import LinkFit, fit_allreduce, fit_point_to_point

__all__ = ["LinkReport", "LinkSettings", "PairReport", "RankLaunch", "measure_links"]

log = logging.getLogger(__name__)

DEFAULT_SIZES = tuple(2**k for k in range(12, 23, 2))  # 4 KiB .. 4 MiB


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSettings:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Message sizes in bytes (multiples of 4: float32 tensors)."""
    warmup: int = 2
    repeat: int = 5
    max_seconds_per_size: float = 3.0
    """Stop repeating a size once its transfers have taken this long (slow links, big messages)."""
    threads: int = 1

    def check(self) -> None:
        if len(set(self.sizes)) < 2:
            raise ValueError(f"sizes must hold at least two distinct message sizes, got {self.sizes}")
        if min(self.sizes) < 4 or any(s % 4 for s in self.sizes):
            raise ValueError(f"sizes must be positive multiples of 4 bytes, got {self.sizes}")
        if self.repeat < 1 or self.warmup < 0:
            raise ValueError(f"repeat must be >= 1 and warmup >= 0, got {self.repeat}, {self.warmup}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLaunch:
    """How to start one rank: a command prefix (e.g. ``("ip", "netns", "exec", "ns1")``) and extra
    environment variables (e.g. ``{"GLOO_SOCKET_IFNAME": "veth1"}``)."""

    prefix: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class PairReport:
    src: int
    dst: int
    sizes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    """Fastest round trip of a message of that size, halved."""
    fit: LinkFit


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkReport:
    world: int
    pairs: tuple[PairReport, ...]
    allreduce_sizes: tuple[int, ...] = ()
    allreduce_s: tuple[float, ...] = ()
    allreduce_fit: LinkFit | None = None
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True, slots=True)
class _Raw:
    pairs: dict[str, dict[str, float]] = field(default_factory=dict)
    allreduce: dict[str, float] = field(default_factory=dict)


def measure_links(
    launches: list[RankLaunch],
    settings: LinkSettings,
    *,
    master_addr: str = "127.0.0.1",
    port: int = 29533,
    timeout_s: float = 300.0,
) -> LinkReport:
    """Start one worker per entry of ``launches`` (rank = index), gather rank 0's timings, fit."""
    settings.check()
    world = len(launches)
    if world < 2:
        raise ValueError(f"link measurement needs >= 2 ranks, got {world}")
    t0 = time.perf_counter()
    procs = [_start(r, world, launch, settings, master_addr, port) for r, launch in enumerate(launches)]
    outs = [_wait(p, timeout_s, procs) for p in procs]
    raw = json.loads(outs[0].strip().splitlines()[-1])
    return _report(world, raw, time.perf_counter() - t0)


def _start(rank: int, world: int, launch: RankLaunch, s: LinkSettings, addr: str, port: int) -> subprocess.Popen[str]:
    cmd = [*launch.prefix, sys.executable, "-m", "hgopt.profiler.links", "--rank", str(rank), "--world", str(world),
           "--init", f"tcp://{addr}:{port}", "--settings", json.dumps(asdict(s))]
    env = {**os.environ, **dict(launch.env), "OMP_NUM_THREADS": str(s.threads)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(p: subprocess.Popen[str], timeout_s: float, everyone: list[subprocess.Popen[str]]) -> str:
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for q in everyone:
            q.kill()
            q.wait()
        raise RuntimeError(f"link measurement did not finish within {timeout_s:.0f} s") from None
    if p.returncode != 0:
        for q in everyone:
            if q.poll() is None:
                q.kill()
                q.wait()
        raise RuntimeError(f"link worker failed (exit {p.returncode}): {err.strip()[-2000:]}")
    return out


def _report(world: int, raw: dict[str, Any], wall: float) -> LinkReport:
    pairs = []
    for key, by_size in sorted(raw["pairs"].items()):
        a, b = (int(x) for x in key.split("-"))
        sizes = tuple(sorted(int(k) for k in by_size))
        times = tuple(by_size[str(k)] for k in sizes)
        pairs.append(PairReport(src=a, dst=b, sizes=sizes, one_way_s=times, fit=fit_point_to_point(list(sizes), list(times))))
    ar_sizes = tuple(sorted(int(k) for k in raw["allreduce"]))
    ar_times = tuple(raw["allreduce"][str(k)] for k in ar_sizes)
    ar_fit = fit_allreduce(list(ar_sizes), list(ar_times), world) if len(ar_sizes) >= 2 else None
    return LinkReport(world=world, pairs=tuple(pairs), allreduce_sizes=ar_sizes, allreduce_s=ar_times,
                      allreduce_fit=ar_fit, wall_s=wall)


# ---- the worker (runs in its own process, imports torch) ----------------------------------------
def _timed_repeats(fn: Any, s: LinkSettings) -> float:
    """The fastest of the repeats: other load on the machine only ever adds time to a transfer."""
    for _ in range(s.warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    for _ in range(s.repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        spent += times[-1]
        if spent > s.max_seconds_per_size:
            break
    return min(times)


def _ping_pong(dist: Any, buf: Any, rank: int, a: int, b: int) -> None:
    if rank == a:
        dist.send(buf, b)
        dist.recv(buf, b)
    else:
        dist.recv(buf, a)
        dist.send(buf, a)


def _worker(rank: int, world: int, init: str, s: LinkSettings) -> _Raw:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(s.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    raw = _Raw()
    for a in range(world):
        for b in range(a + 1, world):
            for size in s.sizes:
                buf = torch.zeros(size // 4, dtype=torch.float32)
                if rank in (a, b):
                    rtt = _timed_repeats(lambda: _ping_pong(dist, buf, rank, a, b), s)
                    if rank == a:
                        raw.pairs.setdefault(f"{a}-{b}", {})[str(size)] = rtt / 2.0
                dist.barrier()
    for size in s.sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        t = _timed_repeats(lambda: (dist.barrier(), dist.all_reduce(buf)), s)
        raw.allreduce[str(size)] = t
    everyone: list[Any] = [None] * world  # each pair was timed by its lower rank: collect them all
    dist.all_gather_object(everyone, raw.pairs)
    for pairs in everyone:
        raw.pairs.update(pairs)
    dist.barrier()  # no rank tears its gloo pairs down while a peer is still in a collective
    dist.destroy_process_group()
    return raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hgopt.profiler.links")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--settings", required=True)
    args = ap.parse_args(argv)
    d = json.loads(args.settings)
    s = LinkSettings(**{**d, "sizes": tuple(d["sizes"])})
    raw = _worker(args.rank, args.world, args.init, s)
    if args.rank == 0:
        print(json.dumps({"pairs": raw.pairs, "allreduce": raw.allreduce}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
