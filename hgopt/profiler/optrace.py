"""A rank's stage operations timed from outside the runner (no runner file changes):
``python -m hgopt.profiler.paced SPEED -m hgopt.profiler.optrace -m hgopt.runner ARGS...`` runs the
runner's rank and records per step and per op the main thread's CPU seconds spent in the stage model's
forward, in ``Tensor.backward``, in the whole op (receive/decode, send, hooks, bookkeeping) and in the
optimizer step (``model_fwd`` includes the last stage's loss), written to
``$HGOPT_OP_TRACE/ops-<pid>.json`` at exit. CPU seconds / pace = device seconds, the unit of the paced
profile. Used by the pipelined profile (:mod:`hgopt.profiler.pipelined`), the in-situ calibration of the
validation bench (:mod:`hgopt.profiler.insitu`) and its diagnostics (``bench/_op_trace.py`` is this
module under its old name)."""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "-m":
        print("usage: python -m hgopt.profiler.optrace -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    import torch

    from hgopt.runner import engine

    steps: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}
    acc = {"model_fwd": 0.0, "backward": 0.0, "flt": 0}

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    def timed(fn: Any, key: str) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t, f = time.thread_time(), faults()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.thread_time() - t
                acc["flt"] += faults() - f
        return wrapper

    real_fwd, real_bwd, real_step = engine.StageWorker._forward, engine.StageWorker._backward, engine.StageWorker.step
    torch.Tensor.backward = timed(torch.Tensor.backward, "backward")  # type: ignore[method-assign]
    # the last stage's loss is device work of its forward (paced.DEVICE_WORK, and the profile's head)
    engine.vocab_parallel_cross_entropy = timed(engine.vocab_parallel_cross_entropy, "model_fwd")

    def op(kind: str, real: Any) -> Any:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            if not getattr(self.model, "_traced", False):
                self.model.forward = timed(self.model.forward, "model_fwd")
                self.model._traced = True
            acc["model_fwd"] = acc["backward"] = 0.0
            acc["flt"] = 0
            acc["recv"] = 0.0
            t, w0 = time.thread_time(), time.perf_counter()
            out = real(self, *a, **k)
            cur.setdefault("ops", []).append({"kind": kind, "w0": w0, "w1": time.perf_counter(), "recv_wait": acc["recv"],
                                              "mb": a[-1] if kind == "B" else a[1],
                                              "cpu": time.thread_time() - t, "model_fwd": acc["model_fwd"],
                                              "backward": acc["backward"], "faults": acc["flt"]})
            return out
        return wrapper

    prof = None
    if os.environ.get("HGOPT_OP_PROFILE"):
        import cProfile

        prof = cProfile.Profile(time.thread_time)

    def step(self: Any, *a: Any, **k: Any) -> Any:
        cur.clear()
        t, w = time.thread_time(), time.perf_counter()
        if prof is not None and len(steps) >= 3:
            prof.enable()
        st = real_step(self, *a, **k)
        if prof is not None:
            prof.disable()
        steps.append({"rank": self.rank, "pipeline": self.pi, "stage": self.si, "cpu": time.thread_time() - t,
                      "wall": time.perf_counter() - w, "ops": list(cur.get("ops", [])),
                      "opt": cur.get("opt", 0.0), "finish": cur.get("finish", 0.0)})
        return st

    def sub(obj: Any, name: str, key: str) -> None:
        real = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return real(*a, **k)
            finally:
                cur[key] = cur.get(key, 0.0) + time.thread_time() - t
        setattr(obj, name, wrapper)

    from hgopt.runner import comm

    real_wait = comm.Pending.wait

    def pending_wait(self: Any) -> Any:
        w = time.perf_counter()
        try:
            return real_wait(self)
        finally:
            acc["recv"] = acc.get("recv", 0.0) + time.perf_counter() - w
            acc["recv_done"] = time.perf_counter()

    comm.Pending.wait = pending_wait  # type: ignore[method-assign]
    engine.StageWorker._forward = op("F", real_fwd)  # type: ignore[method-assign]
    engine.StageWorker._backward = op("B", real_bwd)  # type: ignore[method-assign]
    engine.StageWorker.step = step  # type: ignore[method-assign]
    for cls in (torch.optim.Adam, torch.optim.SGD):
        sub(cls, "step", "opt")
    sub(engine.GradSync, "finish", "finish")
    if folder := os.environ.get("HGOPT_OP_TRACE"):
        atexit.register(lambda: Path(folder, f"ops-{os.getpid()}.json").write_text(json.dumps(steps)))
        if prof is not None:
            atexit.register(lambda: prof.dump_stats(str(Path(folder, f"prof-{os.getpid()}.pstats"))))
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
