"""``python -m hgopt.runner.store HOST PORT``: host the rendezvous store until killed (used by the local
launcher inside a network namespace). Prints ``ready`` once listening."""

from __future__ import annotations

import sys
import time

import torch.distributed as dist


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    print("ready", flush=True)
    while True:  # killed by the launcher
        time.sleep(3600)
        store.check(["keepalive"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
