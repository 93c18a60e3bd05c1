"""The measurement runs behind ``hgopt profile``: the runner's model layer by layer (tp 1 in this
process, tp > 1 in one worker process per tensor-parallel rank), and links between ranks on loopback
or over emulated links (network namespaces + ``tc tbf`` from :mod:`hgopt.export.netns`).

torch is imported only inside the functions that measure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from typing import Iterator

from hgopt.export.runner_plan import ModelConfig
from hgopt.profiler.links import LinkReport, LinkSettings, RankLaunch, measure_links
from hgopt.profiler.pipelined import PipelineSettings
from hgopt.profiler.timing import TimingSettings
from hgopt.profiler.writer import LayerMeasurement, TimingMeasurement
from hgopt.spec import ModelProfile, TpMemory, model_profile_from_dict, model_profile_to_dict

__all__ = ["ModelRequest", "emulated_pair", "free_port", "profile_model", "profile_links_loopback", "profile_links_emulated", "pool_layers", "set_burst"]

log = logging.getLogger(__name__)


_PROFILE_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
"""Runner compute dtype -> the profile's training precision (bfloat16: the runner's mixed precision)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRequest:
    model: ModelConfig
    names: tuple[str, ...]
    mbss: tuple[int, ...]
    tps: tuple[int, ...] = (1,)
    timing: TimingSettings
    seed: int = 0
    dtype: str = "float32"
    profile_name: str = "runner-gpt"
    pool_blocks: bool = True
    """Give every transformer block the median of the blocks' timings: the runner's blocks are identical,
    so their differences are measurement noise (and planners look for runs of identical blocks)."""
    pipeline: PipelineSettings | None = None
    """Paced tp-1 profiles: then rescale each stage's layers to the device time they took in a short
    pipelined run of the runner (:mod:`hgopt.profiler.pipelined`); None: the layers as timed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def profile_model(req: ModelRequest) -> ModelProfile:
    """Timings for every (tp, mbs) asked for; sizes from tp 1 (and per-tp shard sizes as tp_memory)."""
    if req.dtype not in _PROFILE_DTYPE:
        raise ValueError(f"--dtype {req.dtype}: the runner computes in float32 or bfloat16 (mixed precision)")
    if max(req.tps) > 1 and req.timing.device != "cpu":
        raise ValueError("--tp > 1 is measured with one CPU process per rank (the runner's gloo tensor "
                         "parallelism); use --device cpu")
    if req.timing.tenants > 1 and max(req.tps) > 1:
        raise ValueError("--tenants applies to tp 1 only")
    if req.pipeline is not None:
        if req.timing.pace is None or req.timing.pace != req.pipeline.pace:
            raise ValueError("--pipeline applies to a paced profile (--pace)")
        if max(req.tps) > 1:
            raise ValueError("--pipeline applies to tp 1 only")
        req.pipeline.check(req.model.num_layers)
    for tp in req.tps:
        if (problem := req.model.tp_problem(tp)) is not None:
            raise ValueError(f"--tp {tp}: {problem}")
    per_tp: dict[int, tuple[list[LayerMeasurement], list[TimingMeasurement]]] = {}
    for tp in sorted(set(req.tps) | {1}):
        per_tp[tp] = _measure_tp1(req) if tp == 1 else _measure_tp_workers(req, tp)
    layers = per_tp[1][0]
    timings = [t for tp in sorted(req.tps) for t in per_tp[tp][1]]
    if req.pool_blocks:
        blocks = [i for i, kind in enumerate(req.model.layers) if kind == "block"]
        timings = [pool_layers(t, blocks) for t in timings]
    tp_memory = [TpMemory(tp=tp, params=tuple(m.params for m in per_tp[tp][0]),
                          act_mem_bytes=tuple(m.act_mem_bytes for m in per_tp[tp][0]))
                 for tp in sorted(req.tps) if tp > 1]
    prof = _assemble(req, layers, timings, tp_memory)
    if req.pipeline is None:
        return prof
    from hgopt.profiler.pipelined import pipelined_profile

    data = pipelined_profile(model_profile_to_dict(prof), req.model, req.pipeline, pool=req.pool_blocks,
                             seed=req.seed, dtype=req.dtype)
    return model_profile_from_dict(data, source="<pipelined profile>")


def _assemble(req: ModelRequest, layers: list[LayerMeasurement], timings: list[TimingMeasurement],
              tp_memory: list[TpMemory]) -> ModelProfile:
    from hgopt.profiler.writer import build_model_profile

    m = req.model
    what = (f"Hugging Face {json.loads(m.hf_config).get('model_type')} (transformers' modules) hidden {m.hidden}, "
            f"heads {m.heads}, vocab {m.vocab}, seq {m.seq}" if m.hf_config else
            f"runner GPT hidden {m.hidden}, heads {m.heads}, vocab {m.vocab}, seq {m.seq}, ffn x{m.ffn_mult}")
    source = (f"hgopt profile: {what}, {req.dtype}; device {req.timing.device}"
              + (f", {req.timing.threads} thread(s)" if req.timing.device == "cpu" else "")
              + (f", paced device of {req.timing.pace:g} core (thread CPU time / {req.timing.pace:g})"
                 if req.timing.pace else "")
              + (f", timed with {req.timing.tenants - 1} paced co-tenant(s)" if req.timing.tenants > 1 else "")
              + f"; median of {req.timing.repeat} after {req.timing.warmup} warm-up"
              + ("; blocks pooled (median over the identical blocks)" if req.pool_blocks else ""))
    prof = build_model_profile(name=req.profile_name, dtype=_PROFILE_DTYPE[req.dtype],  # type: ignore[arg-type]
                               seq_len=m.seq, layers=layers, timings=timings, source=source)
    prof = replace(prof, hf_config=m.hf_config)
    if not tp_memory:
        return prof
    data = model_profile_to_dict(replace(prof, tp_memory=tuple(tp_memory)))
    return model_profile_from_dict(data, source="<profiler>")


def _measure_tp1(req: ModelRequest) -> tuple[list[LayerMeasurement], list[TimingMeasurement]]:
    from hgopt.profiler.runner_model import runner_layer_cases
    from hgopt.profiler.timing import measure_layers

    cases = runner_layer_cases(req.model, names=list(req.names), seed=req.seed, dtype=req.dtype)
    timing = replace(req.timing, tp=1)
    if timing.tenants == 1:
        return measure_layers(cases, list(req.mbss), timing)
    from hgopt.profiler.tenants import companions

    payload = {"model": asdict(req.model), "names": list(req.names), "mbss": list(req.mbss),
               "timing": asdict(replace(timing, tenants=1)), "seed": req.seed, "dtype": req.dtype}
    with companions(payload, timing.tenants - 1):
        return measure_layers(cases, list(req.mbss), timing)


def _measure_tp_workers(req: ModelRequest, tp: int) -> tuple[list[LayerMeasurement], list[TimingMeasurement]]:
    """One process per tp rank (gloo); rank 0's timings are reported (the ranks move in lock step)."""
    payload = json.dumps({"model": asdict(req.model), "names": list(req.names), "mbss": list(req.mbss),
                          "timing": asdict(replace(req.timing, tp=tp)), "seed": req.seed, "dtype": req.dtype})
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for r in range(tp):
        cmd = [sys.executable, "-m", "hgopt.profiler.tpworker", str(r), str(tp), init, payload]
        env = {**os.environ, "OMP_NUM_THREADS": str(req.timing.threads)}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"tp profiling worker failed (exit {p.returncode}): {err.strip()[-2000:]}")
    data = json.loads(outs[0][0].strip().splitlines()[-1])
    sizes = [LayerMeasurement(**d) for d in data["sizes"]]
    timings = [TimingMeasurement(**{**d, "fwd": tuple(d["fwd"]), "bwd": tuple(d["bwd"]), "update": tuple(d["update"])})
               for d in data["timings"]]
    return sizes, timings


# ---- links ----------------------------------------------------------------------------------------
def profile_links_loopback(ranks: int, settings: LinkSettings) -> LinkReport:
    """``ranks`` processes on this host (one cluster's ranks talking over loopback)."""
    return measure_links([RankLaunch() for _ in range(ranks)], settings, port=free_port())


def pool_layers(t: TimingMeasurement, idx: list[int]) -> TimingMeasurement:
    """``t`` with the layers ``idx`` all set to their median forward, backward and update seconds."""
    if len(idx) < 2:
        return t

    def pooled(values: tuple[float, ...]) -> tuple[float, ...]:
        med = statistics.median(values[i] for i in idx)
        return tuple(med if i in idx else v for i, v in enumerate(values))

    return replace(t, fwd=pooled(t.fwd), bwd=pooled(t.bwd), update=pooled(t.update))


@contextlib.contextmanager
def emulated_pair(gbit_s: float, tag: str, burst_bytes: int | None = None) -> Iterator[tuple[list[str], list[str], str]]:
    """Two namespaces joined by one veth pair shaped to ``gbit_s`` each way (the runner's own link
    emulation, :mod:`hgopt.export.netns`); yields (namespaces, interface names, rank 0's address)."""
    from hgopt.export import netns
    from hgopt.export.runner_plan import LinkSpec, NodeSpec, ReplicaSpec, RunnerPipeline, RunnerPlan, RunnerStage, TrainConfig

    if not netns.available():
        raise ValueError("--emulate needs root and the `ip`/`tc` tools (network namespaces)")
    bps = gbit_s * 1e9 / 8
    stages = tuple(RunnerStage(start=i, end=i + 1, replicas=(ReplicaSpec(ranks=(i,), cluster=c, mbs=1, offset=0, group=0),))
                   for i, c in enumerate(("a", "b")))
    from hgopt.export.runner_plan import BoundarySpec

    rp = RunnerPlan(model=ModelConfig(layers=("block", "block")), train=TrainConfig(),
                    pipelines=(RunnerPipeline(stages=stages, num_microbatches=1, boundaries=(BoundarySpec(),)),),
                    nodes=(NodeSpec(index=0, cluster="a", cluster_node=0, ranks=(0,)),
                           NodeSpec(index=1, cluster="b", cluster_node=0, ranks=(1,))),
                    clusters=("a", "b"),
                    links=(LinkSpec(src="a", dst="b", bytes_per_s=bps, latency_s=0.0),
                           LinkSpec(src="b", dst="a", bytes_per_s=bps, latency_s=0.0)))
    lay = netns.layout(rp, tag=tag)
    netns.setup(rp, lay)
    try:
        if burst_bytes is not None:
            for ns, dev in ((lay.namespaces[0], lay.veths[0].name), (lay.namespaces[1], lay.veths[0].peer)):
                set_burst(ns, dev, bps, burst_bytes)
        yield list(lay.namespaces), list(lay.primary_ifname), lay.primary_addr[0]
    finally:
        netns.teardown(lay)


def profile_links_emulated(gbit_s: float, settings: LinkSettings, burst_bytes: int | None = None) -> LinkReport:
    """Rank 0 and rank 1 in two namespaces joined by a link shaped to ``gbit_s`` (token bucket burst
    ``burst_bytes``; None: the runner's default)."""
    port = free_port()
    with emulated_pair(gbit_s, tag=str(port), burst_bytes=burst_bytes) as (spaces, ifnames, addr):
        launches = [RankLaunch(prefix=("ip", "netns", "exec", spaces[r]),
                               env=(("GLOO_SOCKET_IFNAME", ifnames[r]),)) for r in range(2)]
        return measure_links(launches, settings, master_addr=addr, port=port)


def set_burst(namespace: str, dev: str, bytes_per_s: float, burst_bytes: int) -> None:
    """Re-parameterise an emulated link's tbf with burst ``burst_bytes`` (the runner's rate and queue
    limit kept). A burst of a few packets makes the link serialise every message at its rate."""
    if burst_bytes < 1600:
        raise ValueError(f"--burst must be >= 1600 bytes (one full packet), got {burst_bytes}")
    bits = max(int(bytes_per_s * 8), 8000)
    limit = max(int(bytes_per_s * 2), 4 * 1024 * 1024)
    subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "change", "dev", dev, "root", "tbf", "rate",
                    f"{bits}bit", "burst", str(burst_bytes), "limit", str(limit)], check=True, capture_output=True)
