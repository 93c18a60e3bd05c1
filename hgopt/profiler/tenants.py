"""Co-tenants of a paced profile (``hgopt profile --pace SPEED --tenants N``): N − 1 companion
processes that time the same layers the same way, concurrently with the measuring process, so that
the layers are timed as N paced ranks of a run time them on this machine.

Why: a paced device (:mod:`hgopt.profiler.paced`) has a fixed *share* of a core, not fixed caches.
While it idles, the other ranks of the same run compute on the same cores and evict its working set;
the more ranks share the machine, the more CPU time the same layer takes. Measured on the 2-core
validation host (block of hidden 128, mbs 4, pace 0.15): forward/backward 0.0184/0.0295 s timed alone,
0.0222/0.0355 s with four copies timing at once, and 0.0222/0.0355 s inside a 4-rank runner step
(`bench/validate_cost_model.py`, "Cost-model validation" in bench/RESULTS.md). The companions' own
figures are discarded; the measuring process reports as before.

``python -m hgopt.profiler.tenants PAYLOAD`` is one companion: it builds the layers, prints ``ready``
and times them in a loop until it is terminated.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["companions", "main"]


@contextlib.contextmanager
def companions(payload: dict[str, Any], count: int) -> Iterator[list[int]]:
    """``count`` companion processes timing ``payload``'s layers (the fields of
    :func:`hgopt.profiler.run._measure_tp1`'s request) while the body runs; each has started
    timing before the body begins, and all are stopped (and reaped) when it ends. Yields their pids."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-m", "hgopt.profiler.tenants", json.dumps(payload)],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"profiling co-tenant failed to start (exit {p.poll()})")
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(argv: list[str]) -> int:
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.profiler.runner_model import runner_layer_cases
    from hgopt.profiler.timing import TimingSettings, measure_layers

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    payload = json.loads(argv[0])
    m = payload["model"]
    cfg = ModelConfig(**{**m, "layers": tuple(m["layers"])})
    cases = runner_layer_cases(cfg, names=payload["names"], seed=payload["seed"], dtype=payload["dtype"])
    settings = TimingSettings(**payload["timing"])
    print("ready", flush=True)
    while True:
        measure_layers(cases, payload["mbss"], settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
