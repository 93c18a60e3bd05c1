"""Run every rank of a (small) runner plan on this machine: host the rendezvous store, set up link
emulation, start one process per rank, watch them, clean up. The store lives in this process (or,
with network namespaces, in a helper process inside the first cluster's namespace), so it outlives
any rank and the ranks' watchdogs can name the one that died.

While the ranks start (interpreter and torch import, rendezvous: tens of seconds on a small machine)
the launcher logs ``rendezvous k/N ranks`` as ranks reach the store, in every link-emulation mode
(with namespaces the launcher has no route to the store: its helper reports the count). SIGTERM (and SIGINT) are
forwarded to every rank as SIGTERM; ranks still running ``STOP_GRACE_S`` later are killed; the
launcher then returns 143 (130 for SIGINT), without a traceback."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hgopt.export import netns
from hgopt.export.runner_plan import RunnerPlan

__all__ = ["EXIT_SLACK_S", "LaunchOptions", "STOP_GRACE_S", "launch_local", "local_device", "resolve_emulation",
           "run_forked"]

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""Seconds the ranks get to exit after the launcher forwarded SIGTERM, before they are killed."""
EXIT_SLACK_S = 10.0
"""Default exit grace after a rank failed: the plan's heartbeat timeout (the survivors' watchdogs need that
long to notice a dead rank) plus this much for them to log and exit (see ``LaunchOptions.exit_grace_s``)."""
_SIGNAL_EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
_PROGRESS_S = 2.0
"""At most this long between two start-up progress lines while ranks are still connecting."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchOptions:
    out_dir: Path
    steps: int | None = None
    resume: bool = False
    threads: int | None = None
    """Torch threads per rank (default: cores / ranks, at least 1)."""
    emulation: str | None = None
    """Override the plan's ``emulate_links``."""
    port: int | None = None
    """Rendezvous port (default: the plan's; 0 picks a free one)."""
    python: str = sys.executable
    device: str | None = None
    """``auto``, ``cpu`` or ``cuda``; None: the plan's."""
    exit_grace_s: float | None = None
    """Seconds the other ranks get, after the first rank exited with an error, to notice and exit on their
    own; ranks still running then (a stopped or hung one) are killed. None: the plan's
    ``heartbeat_timeout_s`` + ``EXIT_SLACK_S``. A grace shorter than the heartbeat timeout kills
    survivors before their watchdogs can name the dead rank."""

    def __post_init__(self) -> None:
        if self.exit_grace_s is not None and not (self.exit_grace_s >= 0.0 and self.exit_grace_s < float("inf")):
            raise ValueError(f"exit_grace_s must be a finite number of seconds >= 0, got {self.exit_grace_s}")


def resolve_emulation(mode: str, rp: RunnerPlan, device: str = "cpu") -> str:
    """``off``, ``delay`` or ``netns`` for ``mode``. Namespaces shape the TCP sockets gloo uses; nccl on
    GPUs does not go through them, so with ``device`` cuda ``auto`` means delay and netns is refused."""
    if mode == "off":
        return "off"
    if len(rp.clusters) < 2:  # emulate: one cluster on several nodes: only delay emulates node NICs
        return "delay" if mode == "delay" and rp.nics and len(rp.nodes) > 1 else "off"
    if device == "cuda":
        if mode == "netns":
            raise ValueError("--emulate-links netns is CPU/gloo-only (namespaces shape gloo's TCP sockets, not nccl's "
                             "transports); with --device cuda use --emulate-links delay")
        if mode == "auto":
            log.info("link emulation: delay (netns would shape gloo's sockets only; this run uses cuda and nccl)")
            return "delay"
        return mode
    if mode == "auto":
        return "netns" if netns.available() else "delay"
    if mode == "netns" and not netns.available():
        raise ValueError("--emulate-links netns needs root and the `ip`/`tc` tools; use delay instead")
    return mode


def local_device(rp: RunnerPlan, requested: str) -> str:
    """``cpu`` or ``cuda`` for running every rank of ``rp`` on this machine: nccl needs one GPU per rank,
    so ``auto`` takes the CPU when there are fewer GPUs than ranks (and says so); ``cuda`` is then an
    error."""
    import torch

    from hgopt.runner.device import resolve_device

    choice = resolve_device(requested)
    if choice.kind == "cuda" and torch.cuda.device_count() < rp.world_size:
        what = f"{rp.world_size} ranks but {torch.cuda.device_count()} GPU(s) here; nccl needs one GPU per rank"
        if requested == "cuda":
            raise ValueError(f"--device cuda: {what} (use --device cpu, or run the per-node torchrun scripts)")
        log.info("device: cpu (%s)", what)
        return "cpu"
    return choice.kind


def launch_local(rp: RunnerPlan, plan_path: Path, opts: LaunchOptions, outcome: dict[str, Any] | None = None) -> int:
    """Start every rank, wait for all of them, clean up; 0 when every rank succeeded. ``outcome`` (elastic
    mode, :mod:`hgopt.runner.elastic`): filled with every rank's exit code and the watchdogs' abort reason."""
    device = local_device(rp, opts.device or rp.device)
    mode = resolve_emulation(opts.emulation or rp.emulate_links, rp, device)
    port = rp.master_port if opts.port is None else opts.port
    threads = opts.threads or max(1, (os.cpu_count() or 1) // rp.world_size)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    keep: list[Any] = []  # the store (or its helper process) and the namespaces, released in `finally`
    try:
        host, port, lay = _rendezvous(rp, mode, port, opts.python, keep)
        log.info("launching %d ranks (store %s:%d, links: %s, device: %s, %d thread(s) each)", rp.world_size, host,
                 port, mode, device, threads)
        for r in range(rp.world_size):
            procs[r] = _start_rank(rp, r, plan_path, opts, mode, host, port, threads, lay, device)
        (opts.out_dir / "pids.json").write_text(json.dumps({str(r): p.pid for r, p in procs.items()}))
        grace = rp.heartbeat_timeout_s + EXIT_SLACK_S if opts.exit_grace_s is None else opts.exit_grace_s
        return _watch(rp, procs, _view(keep), outcome, exit_grace_s=grace)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for k in reversed(keep):
            if isinstance(k, subprocess.Popen):
                k.kill()
                k.wait()
            elif isinstance(k, netns.NetnsLayout):
                netns.teardown(k)


def _rendezvous(rp: RunnerPlan, mode: str, port: int, python: str, keep: list[Any]) -> tuple[str, int, netns.NetnsLayout | None]:
    """Host the store: here, or (netns) in a helper process inside rank 0's namespace."""
    import socket

    try:
        with socket.socket() as s:  # fails early, with a clear message, when the port is taken
            s.bind(("127.0.0.1", port))
            port = s.getsockname()[1]
    except OSError as exc:
        raise ValueError(f"rendezvous port {port} is not free ({exc.strerror}); pass --port 0 for any free port") from None
    if mode != "netns":
        import torch.distributed as dist

        keep.append(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))
        return "127.0.0.1", port, None
    lay = netns.layout(rp, tag=str(port))
    keep.append(lay)
    netns.setup(rp, lay)
    host = lay.addr_of(rp, rp.rank_info(0).cluster)
    keep.append(_store_helper(python, lay.namespace_of(rp, rp.rank_info(0).cluster), host, port, rp.world_size))
    return host, port, lay


FORKSERVER_PRELOAD = ("hgopt.runner.worker", "hgopt.runner.hf", "transformers.models.auto.configuration_auto",
                      "transformers.models.llama.modeling_llama")
"""What ``run_forked``'s fork server imports once for every rank it forks (in this process the server starts
once, at the first call): the runner and, where transformers is installed (the server skips a module it
cannot import), the config and Llama modeling an HF rank would otherwise import itself (~2 CPU s a rank)."""


def run_forked(rp: RunnerPlan, out_dir: Path, *, steps: int | None = None, resume: bool = False,
               emulation: str = "off", threads: int = 1, timeout_s: float = 300.0, device: str = "cpu") -> dict[int, int]:
    """Every rank as a child of a fork server that has imported the runner once (no interpreter and
    torch start-up per rank: for tests and benchmarks). Forking from a clean single-threaded server, not
    from this process, avoids inheriting locks held by this process's threads. Returns each rank's exit
    code (-9: killed after ``timeout_s``). ``device`` is cpu unless asked (tests must not pick up a GPU)."""
    import multiprocessing as mp

    import torch.distributed as dist

    kind = local_device(rp, device)
    mode = resolve_emulation(emulation, rp, kind)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    procs = {r: ctx.Process(target=_forked_rank, args=(rp, r, out_dir, store.port, steps, resume, mode, threads, kind))
             for r in range(rp.world_size)}
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    return {r: int(p.exitcode if p.exitcode is not None else -9) for r, p in procs.items()}


def _forked_rank(rp: RunnerPlan, rank: int, out_dir: Path, port: int, steps: int | None, resume: bool, mode: str,
                 threads: int, device: str) -> None:
    from hgopt.runner.worker import RankOptions, run_rank

    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stderr, force=True)
    code = run_rank(rp, rank, RankOptions(out_dir=out_dir, store_host="127.0.0.1", store_port=port, steps=steps,
                                          resume=resume, emulation=mode, threads=threads, device=device))
    sys.stderr.flush()
    os._exit(code)


def _store_helper(python: str, ns: str, host: str, port: int, ranks: int) -> subprocess.Popen[str]:
    """The store inside namespace ``ns``; after ``ready`` it reports ranks connected and the abort
    reason on its stdout (``hgopt.runner.store``), read by :class:`_HelperView`."""
    p = subprocess.Popen(["ip", "netns", "exec", ns, python, "-m", "hgopt.runner.store", host, str(port), str(ranks)],
                         stdout=subprocess.PIPE, text=True, env={"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ})
    assert p.stdout is not None
    line = p.stdout.readline()
    if "ready" not in line:
        p.kill()
        raise RuntimeError(f"the rendezvous store in namespace {ns} did not start ({line.strip()!r})")
    return p


class _StoreView:
    """What the launcher reads from a store it hosts itself: ranks connected, the abort reason."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def connected(self, ranks: int) -> int:
        from hgopt.runner.watchdog import connected_ranks

        return connected_ranks(self.store, ranks)

    def abort_reason(self) -> str | None:
        from hgopt.runner.watchdog import abort_reason

        return abort_reason(self.store)


class _HelperView:
    """The same, from the JSON lines of the store helper inside a namespace (the launcher has no route
    into the namespaces), read by a daemon thread; -1 connected until the first line."""

    def __init__(self, helper: subprocess.Popen[str]) -> None:
        import threading

        self._state: dict[str, Any] = {"connected": -1, "abort": None}
        self._thread = threading.Thread(target=self._read, args=(helper,), daemon=True)
        self._thread.start()

    def _read(self, helper: subprocess.Popen[str]) -> None:
        assert helper.stdout is not None
        for line in helper.stdout:
            try:
                got = json.loads(line)
            except ValueError:
                continue
            if isinstance(got, dict):
                self._state = {"connected": int(got.get("connected", -1)), "abort": got.get("abort")}

    def connected(self, ranks: int) -> int:
        return int(self._state["connected"])

    def abort_reason(self) -> str | None:
        self._thread.join(timeout=2 * _HELPER_POLL_S)  # the helper's last line, if it is still being read
        reason = self._state["abort"]
        return str(reason) if reason else None


_HELPER_POLL_S = 0.5
"""hgopt.runner.store's POLL_S (not imported: that module imports torch)."""


def _view(keep: list[Any]) -> _StoreView | _HelperView | None:
    """The launcher's view of the store in ``keep``: in-process, or the netns helper's reports."""
    for k in keep:
        if isinstance(k, subprocess.Popen):
            return _HelperView(k)
        if not isinstance(k, netns.NetnsLayout):
            return _StoreView(k)
    return None


def _start_rank(rp: RunnerPlan, rank: int, plan_path: Path, opts: LaunchOptions, mode: str, host: str, port: int,
                threads: int, lay: netns.NetnsLayout | None, device: str) -> subprocess.Popen[bytes]:
    cmd = [opts.python, "-m", "hgopt.runner", "--plan", str(plan_path), "--rank", str(rank), "--out", str(opts.out_dir),
           "--emulation", mode, "--threads", str(threads), "--store", f"{host}:{port}", "--device", device]
    if opts.steps is not None:
        cmd += ["--steps", str(opts.steps)]
    if opts.resume:
        cmd.append("--resume")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # namespaces have no reverse DNS: c10d warns on every connect
    if lay is not None:
        cluster = rp.rank_info(rank).cluster
        cmd = ["ip", "netns", "exec", lay.namespace_of(rp, cluster), *cmd]
        env["GLOO_SOCKET_IFNAME"] = lay.ifname_of(rp, cluster)
    return subprocess.Popen(cmd, env=env)


def _watch(rp: RunnerPlan, procs: dict[int, subprocess.Popen[bytes]], store: _StoreView | _HelperView | None = None,
           outcome: dict[str, Any] | None = None, *, exit_grace_s: float) -> int:
    """Wait for every rank, logging start-up progress from ``store``. After the first failure the
    others get ``exit_grace_s`` to notice and exit on their own; whoever is left then is killed.
    SIGTERM/SIGINT: forward SIGTERM to the ranks, wait ``STOP_GRACE_S``, kill the rest."""
    first: tuple[int, int] | None = None
    deadline = float("inf")
    stop: list[int] = []
    t0 = time.monotonic()
    shown, last_line = 0, t0
    n = len(procs)

    def on_signal(signum: int, frame: object) -> None:
        if not stop:
            stop.append(signum)

    prev = {sig: signal.signal(sig, on_signal) for sig in _SIGNAL_EXIT}
    try:
        while True:
            if stop and stop[0] > 0:
                signum = stop[0]
                stop[0] = -signum  # handled once
                log.warning("%s: stopping %d rank(s) (SIGTERM forwarded; killed after %.0f s)",
                            signal.Signals(signum).name, sum(p.poll() is None for p in procs.values()), STOP_GRACE_S)
                for p in procs.values():
                    if p.poll() is None:
                        p.terminate()
                deadline = time.monotonic() + STOP_GRACE_S
            if store is not None and shown < n and not stop:
                k = store.connected(n)
                now = time.monotonic()
                if k >= 0 and (k != shown or now - last_line >= _PROGRESS_S):
                    log.info("rendezvous %d/%d ranks (%.0f s)", k, n, now - t0)
                    shown, last_line = k, now
            codes = {r: p.poll() for r, p in procs.items()}
            if first is None and not stop:
                bad = [(r, c) for r, c in codes.items() if c not in (None, 0)]
                if bad:
                    first = bad[0]
                    deadline = time.monotonic() + exit_grace_s
                    log.error("%s exited with status %d; waiting for the others to stop",
                              rp.rank_info(first[0]).describe(), first[1])
            if all(c is not None for c in codes.values()):
                break
            if time.monotonic() > deadline:
                left = [r for r, c in codes.items() if c is None]
                log.error("ranks %s still running %.0f s after the first failure: killing them", left, exit_grace_s)
                for r in left:
                    procs[r].kill()
                deadline = float("inf")
            time.sleep(0.1)
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)
    if stop:
        return _SIGNAL_EXIT[signal.Signals(-stop[0])]
    if first is None:
        return 0
    reason = store.abort_reason() if store is not None else None
    if outcome is not None:  # elastic mode: who died, for the re-plan
        outcome.update(codes={r: p.returncode for r, p in procs.items()}, first=first, reason=reason)
    if reason:  # the rank that exited first is often a healthy one that noticed the dead one
        log.error("run failed: %s; %s exited first (status %d)", reason, rp.rank_info(first[0]).describe(), first[1])
    else:
        log.error("run failed: %s exited first (status %d)", rp.rank_info(first[0]).describe(), first[1])
    return 1
