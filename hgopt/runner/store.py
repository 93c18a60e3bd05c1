"""``python -m hgopt.runner.store HOST PORT [RANKS]``: host the rendezvous store until killed (used by
the local launcher inside a network namespace, where the launcher cannot reach the store itself).
Prints ``ready`` once listening; with ``RANKS``, then one JSON line whenever what the launcher shows
changes: ``{"connected": k, "abort": reason or null}`` (ranks whose watchdog has reached the store,
and the abort reason the first watchdog that gave up wrote there)."""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

POLL_S = 0.5


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    ranks = int(argv[2]) if len(argv) > 2 else 0
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    print("ready", flush=True)
    if not ranks:
        while True:  # killed by the launcher
            time.sleep(3600)
            store.check(["keepalive"])
    from hgopt.runner.watchdog import abort_reason, connected_ranks

    last: tuple[int, str | None] | None = None
    while True:  # killed by the launcher
        now = (connected_ranks(store, ranks), abort_reason(store))
        if now != last:
            print(json.dumps({"connected": now[0], "abort": now[1]}), flush=True)
            last = now
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
