"""A rank that dies must not leave the others hanging. Every rank runs a heartbeat thread on its own
connection to the rendezvous store: it bumps a counter ``hb/<rank>`` and watches the others' counters.
A counter that stops moving for ``timeout_s`` (or never starts within 4 × that) names a dead rank;
the watcher records the reason under ``abort`` and exits the process with status 1, and every other
watcher that sees ``abort`` exits too, repeating the message. Counters (not clock times) are compared,
so the machines' clocks need not agree. The store is hosted outside the ranks (torchrun's agent or the
local launcher), so it outlives any of them."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

__all__ = ["Watchdog", "abort_reason", "connected_ranks"]

log = logging.getLogger(__name__)
_PREFIX = "hgopt/watchdog/"


class Watchdog:
    def __init__(self, host: str, port: int, rank: int, world: int, describe: Callable[[int], str],
                 timeout_s: float, interval_s: float = 0.5) -> None:
        self.rank, self.world, self.describe = rank, world, describe
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(30.0, timeout_s)),
                                   wait_for_workers=False)
        self._stop = threading.Event()
        self._dead: str | None = None
        self._thread = threading.Thread(target=self._loop, name="hgopt-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self.store.add(f"{_PREFIX}hb/{self.rank}", 1)
        self._thread.start()
        return self

    def done(self) -> None:
        """This rank finished cleanly: the others stop watching it."""
        self.store.set(f"{_PREFIX}done/{self.rank}", "1")
        self._stop.set()
        self._thread.join(timeout=5)

    def fail(self, error: str) -> None:
        """The main thread hit ``error``. If a peer died, that is the cause: wait for the heartbeat to
        say which one; else report this rank. Never returns."""
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
        while self._dead is None and time.monotonic() < deadline:
            time.sleep(self.interval_s)
        if self._dead is not None:
            self._exit(f"rank {self.rank}: stopping: {self._dead} (local error: {error})")
        msg = f"{self.describe(self.rank)} failed: {error}"
        self._abort(msg)
        self._exit(f"rank {self.rank}: {msg}")

    # ---- the thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        start = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"{_PREFIX}hb/{self.rank}", 1)
                if self.store.check([f"{_PREFIX}abort"]):
                    reason = self.store.get(f"{_PREFIX}abort").decode()
                    self._exit(f"rank {self.rank}: stopping because {reason}")
                dead = self._find_dead(seen, start)
            except Exception as exc:  # the store is gone: the launcher or torchrun agent died
                if self._stop.is_set():
                    return
                self._exit(f"rank {self.rank}: lost the rendezvous store ({exc}); stopping")
            if dead is not None:
                self._dead = dead
                self._abort(dead)
                if not self._stop.is_set():
                    self._exit(f"rank {self.rank}: stopping: {dead}")

    def _find_dead(self, seen: dict[int, tuple[int, float]], start: float) -> str | None:
        peers = [r for r in range(self.world) if r != self.rank]
        done = {r for r in peers if self.store.check([f"{_PREFIX}done/{r}"])}
        now = time.monotonic()
        for r in peers:
            if r in done:
                continue
            key = f"{_PREFIX}hb/{r}"
            count = int(self.store.get(key)) if self.store.check([key]) else 0
            if r not in seen or seen[r][0] != count:
                seen[r] = (count, now)
            quiet = now - seen[r][1]
            limit = self.timeout_s if count > 0 else 4 * self.timeout_s
            if quiet > limit or (count == 0 and now - start > limit):
                what = "stopped responding" if count > 0 else "never started"
                return f"{self.describe(r)} {what} (no heartbeat for {quiet:.1f} s)"
        return None

    def _abort(self, reason: str) -> None:
        try:
            self.store.compare_set(f"{_PREFIX}abort", "", reason)
        except Exception:  # best effort: the store may be gone too
            pass

    @staticmethod
    def _exit(message: str) -> None:
        log.error(message)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        os._exit(1)


def abort_reason(store: object) -> str | None:
    """What the first rank that gave up wrote into the store ("rank 2 (...) stopped responding ..."), or
    None when no watchdog aborted the run (or the store is gone)."""
    key = f"{_PREFIX}abort"
    try:
        if store.check([key]):  # type: ignore[attr-defined]
            return bytes(store.get(key)).decode() or None  # type: ignore[attr-defined]
    except Exception:  # the store may be gone
        return None
    return None


def connected_ranks(store: object, ranks: int) -> int:
    """Ranks among ``0 .. ranks-1`` whose watchdog has reached the store (its first heartbeat key is
    set); -1 when the store is gone. (The launcher's start-up progress lines.)"""
    try:
        return sum(1 for r in range(ranks) if store.check([f"{_PREFIX}hb/{r}"]))  # type: ignore[attr-defined]
    except Exception:  # a store that went away: no progress line, the exit codes tell the rest
        return -1
