"""Timing one layer at a time: forward, backward and optimizer step, with warm-up and repeats.

On CUDA the clock is a pair of CUDA events around each phase (synchronised); on CPU it is the wall
clock (``time.perf_counter``) with torch's intra-op thread count fixed to ``threads``, or, with
``pace`` set, the thread's CPU time divided by ``pace``: the device time of a paced device
(:mod:`hgopt.profiler.paced`), which the machine's other load does not stretch. A paced device is
idle for (1/pace − 1) of every operation's time, and what else runs on the machine meanwhile evicts
its caches (measured here: +6-8 % CPU time per operation on a loaded 2-core host); the profiler
therefore idles the same way after every timed phase, so that layers are timed as the paced ranks
run them. Repeats are
interleaved over the layers (rep 1 of every layer, then rep 2, ...) so that a slow spell of a shared
machine spreads over all layers instead of landing on one; the reported figure is the median.

torch is imported lazily (planning must work without it).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hgopt.profiler.writer import LayerMeasurement, TimingMeasurement
from hgopt.spec import LayerKind

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["LayerCase", "TimingSettings", "measure_layers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCase:
    """One layer to time, built by itself."""

    name: str
    kind: LayerKind
    module: Any
    """A ``torch.nn.Module`` holding exactly this layer's parameters."""
    make_input: Callable[[int], tuple[Any, ...]]
    """``mbs -> inputs`` for ``module(*inputs)`` (float inputs get ``requires_grad`` here)."""
    loss: Callable[[Any], Any] | None = None
    """For the last layer: output -> scalar loss, so its backward starts where training's does."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimingSettings:
    gpu: str
    """Name written into the profile's timing entries (the topology's ``gpu`` field)."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:i]``."""
    threads: int = 1
    """torch intra-op threads on CPU (ignored on CUDA)."""
    warmup: int = 3
    repeat: int = 10
    tp: int = 1
    pace: float | None = None
    """CPU only: report thread CPU seconds / ``pace`` (a paced device of ``pace`` cores) instead of
    wall seconds."""
    tenants: int = 1
    """Paced only: time the layers while ``tenants - 1`` companion processes time them too
    (:mod:`hgopt.profiler.tenants`), as the ranks of a run of ``tenants`` paced ranks share the machine."""

    def check(self) -> None:
        if self.pace is not None and not 0 < self.pace <= 1:
            raise ValueError(f"pace must be in (0, 1], got {self.pace}")
        if self.pace is not None and (self.device != "cpu" or self.threads != 1):
            raise ValueError("pace applies to --device cpu with --threads 1 (the paced main thread)")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.tenants < 1:
            raise ValueError(f"tenants must be >= 1, got {self.tenants}")
        if self.tenants > 1 and (self.pace is None or self.tp != 1):
            raise ValueError("tenants apply to a paced profile (--pace) at tp 1")


class _Clock:
    """Seconds between ``start()`` and ``stop()``: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, pace: float | None = None) -> None:
        import torch

        self.pace = pace
        self.cuda = device.type == "cuda"
        self.torch = torch
        if self.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.a.record()
        elif self.pace is not None:
            self.t0 = time.thread_time()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.torch.cuda.synchronize()
            return self.a.elapsed_time(self.b) / 1e3
        if self.pace is not None:
            device = (time.thread_time() - self.t0) / self.pace
            time.sleep(device - device * self.pace)  # idle like the paced device (co-tenants run meanwhile)
            return device
        return time.perf_counter() - self.t0


@dataclass(kw_only=True, slots=True)
class _Samples:
    fwd: list[float]
    bwd: list[float]


def measure_layers(
    cases: list[LayerCase], mbss: list[int], settings: TimingSettings
) -> tuple[list[LayerMeasurement], list[TimingMeasurement]]:
    """Sizes of every layer and one timing entry per microbatch size in ``mbss``."""
    import torch

    settings.check()
    if not cases:
        raise ValueError("nothing to profile: the model has no layers")
    if not mbss or min(mbss) < 1:
        raise ValueError(f"mbs must list microbatch sizes >= 1, got {mbss}")
    device = torch.device(settings.device)
    if device.type == "cpu":
        torch.set_num_threads(settings.threads)
    if settings.pace is not None:
        from hgopt.profiler.paced import realtime_from_env

        realtime_from_env()  # as the paced ranks run ($HGOPT_PACE_RT)
    for c in cases:
        c.module.to(device).train()
    clock = _Clock(device, settings.pace)
    update = tuple(_update_seconds(c.module, settings, clock) for c in cases)
    timings: list[TimingMeasurement] = []
    sizes: list[LayerMeasurement] = []
    for mbs in sorted(set(mbss)):
        samples, sizes = _time_all(cases, mbs, settings, clock, device)
        timings.append(_summarise(samples, mbs, update, settings))
        log.info("mbs %d: fwd+bwd %.4f s over %d layers", mbs, sum(timings[-1].fwd) + sum(timings[-1].bwd), len(cases))
    return sizes, timings


def _summarise(samples: list[_Samples], mbs: int, update: tuple[float, ...], s: TimingSettings) -> TimingMeasurement:
    spread = 0.0
    for smp in samples:
        tot = sorted(f + b for f, b in zip(smp.fwd, smp.bwd))
        if len(tot) >= 3:
            lo, hi = tot[len(tot) // 10], tot[-1 - len(tot) // 10]
            spread = max(spread, (hi - lo) / statistics.median(tot))
    return TimingMeasurement(
        gpu=s.gpu,
        tp=s.tp,
        mbs=mbs,
        fwd=tuple(statistics.median(smp.fwd) for smp in samples),
        bwd=tuple(statistics.median(smp.bwd) for smp in samples),
        update=update,
        spread=spread,
    )


def _time_all(
    cases: list[LayerCase], mbs: int, s: TimingSettings, clock: _Clock, device: torch.device
) -> tuple[list[_Samples], list[LayerMeasurement]]:
    prepared = [_prepare(c, mbs, device) for c in cases]
    samples = [_Samples(fwd=[], bwd=[]) for _ in cases]
    sizes = [_sizes(c, inputs, mbs, device) for c, (inputs, _) in zip(cases, prepared)]
    for rep in range(s.warmup + s.repeat):
        for c, (inputs, grad_out), smp in zip(cases, prepared, samples):
            f, b = _one_step(c, inputs, grad_out, clock)
            if rep >= s.warmup:
                smp.fwd.append(f)
                smp.bwd.append(b)
    return samples, sizes


def _prepare(c: LayerCase, mbs: int, device: torch.device) -> tuple[tuple[Any, ...], Any]:
    """Inputs on the device (float ones as grad-requiring leaves) and the output gradient."""
    import torch

    inputs = tuple(
        x.to(device).detach().requires_grad_(True) if x.is_floating_point() else x.to(device)
        for x in c.make_input(mbs)
    )
    if c.loss is not None:
        return inputs, None
    with torch.no_grad():
        out = c.module(*inputs)
    return inputs, torch.randn_like(out)


def _one_step(c: LayerCase, inputs: tuple[Any, ...], grad_out: Any, clock: _Clock) -> tuple[float, float]:
    for x in inputs:
        x.grad = None
    c.module.zero_grad(set_to_none=True)
    clock.start()
    out = c.module(*inputs)
    if c.loss is not None:
        out = c.loss(out)
    f = clock.stop()
    clock.start()
    if grad_out is None:
        out.backward()
    else:
        out.backward(grad_out)
    return f, clock.stop()


def _sizes(c: LayerCase, inputs: tuple[Any, ...], mbs: int, device: torch.device) -> LayerMeasurement:
    """Parameters, output bytes and bytes saved for backward, per sample."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in c.module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = c.module(*inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
    del out
    sent = _output_bytes(c, inputs)
    return LayerMeasurement(
        name=c.name,
        kind=c.kind,
        params=float(sum(p.numel() for p in c.module.parameters())),
        activation_bytes=sent / mbs,
        act_mem_bytes=max(sum(saved.values()), peak) / mbs,
    )


def _output_bytes(c: LayerCase, inputs: tuple[Any, ...]) -> float:
    import torch

    with torch.no_grad():
        out = c.module(*inputs)
    return float(out.numel() * out.element_size())


def _update_seconds(module: Any, s: TimingSettings, clock: _Clock) -> float:
    """Median Adam step over the layer's parameters (gradients filled with noise); 0 without any."""
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return 0.0
    opt = torch.optim.Adam(params, lr=1e-6)
    times = []
    for rep in range(s.warmup + s.repeat):
        for p in params:
            p.grad = torch.randn_like(p)
        clock.start()
        opt.step()
        t = clock.stop()
        if rep >= s.warmup:
            times.append(t)
    module.zero_grad(set_to_none=True)
    return statistics.median(times)
