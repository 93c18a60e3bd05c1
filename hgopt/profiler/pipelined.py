"""A layer profile measured inside a short pipelined run: ``hgopt profile --pace SPEED --pipeline N``.

Why: on the paced CPU devices of the validation (:mod:`hgopt.profiler.paced`) a layer's device time
depends on its context. Inside an N-rank pipeline of the runner a one-block middle stage's forward and
backward took 13-26 % more device time than the same block timed layer by layer with N − 1 co-tenants
(``--tenants N``) a minute earlier, in autograd's C++ backward and the forward's torch calls, not in
hooks or host work (bench/RESULTS.md, "Cost-model validation: in-situ stage times (round 5)"; docs/
validation.md). No profiling condition tried in isolation (stage-only processes, microbatches in
flight, longer idles, loopback traffic, aligned bursts, page faults) reproduced it, so this profile
measures the stage times where they arise: in the runner itself.

How: the layers are first timed one by one (:mod:`hgopt.profiler.timing`, which gives each layer's
share of its stage). Then, for every microbatch size, the runner trains the model for ``steps`` steps as
one pipeline of ``stages`` stages of ``dp`` replicas each (contiguous layers balanced by their timed
forward + backward, one cluster of ``stages * dp`` paced ranks at ``pace``, device regions as in the validation, ``microbatches``
microbatches, 1F1B), each rank's operations timed from outside (:mod:`hgopt.profiler.optrace`); the
first step runs unpaced (warm-up) and steps 2.. are used. Each stage's layers are rescaled so that
they add up to the median device time of that stage's forwards, backwards and optimizer steps in the
run (:func:`hgopt.profiler.insitu.calibrate_profile`); with ``pool_blocks`` the transformer blocks then
get the blocks' median again (the profile's convention: identical blocks, one time). The split of the
profiling run is chosen from the layer times alone, not from any plan.

torch is imported only by the ranks (and by :mod:`hgopt.export` helpers it does not need).
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hgopt.export.runner_plan import ModelConfig
from hgopt.profiler.insitu import StageDeviceTimes, calibrate_profile, stage_times_from_trace

__all__ = ["PipelineSettings", "balanced_cuts", "pipelined_profile", "pool_blocks", "stage_times_of_run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSettings:
    stages: int
    """Stages of the profiling pipeline."""
    dp: int = 1
    """Data-parallel replicas of every stage (``stages * dp`` paced ranks; gradients synchronised among a
    stage's replicas over loopback, as the runner does)."""
    pace: float
    """Each rank is a paced device of ``pace`` cores (the profile's unit)."""
    microbatches: int = 4
    steps: int = 5
    """Steps of the run; step 1 runs unpaced (warm-up), steps 2..steps are used."""
    keep_dir: str = ""
    """Folder for the runs (plans, traces, pace reports); empty: a temporary one, removed afterwards."""
    max_lag: float = 0.1
    """A run whose ranks lagged more than this fraction of it (the machine was too busy to hold the
    pace) is run once more."""

    def check(self, num_layers: int) -> None:
        if not 1 <= self.stages <= num_layers:
            raise ValueError(f"--pipeline {self.stages}: needs 1 <= stages <= the model's {num_layers} layers")
        if self.dp < 1:
            raise ValueError(f"--pipeline-dp must be >= 1, got {self.dp}")
        if not 0 < self.pace <= 1:
            raise ValueError(f"--pipeline needs --pace in (0, 1], got {self.pace}")
        if self.microbatches < 1:
            raise ValueError(f"pipeline microbatches must be >= 1, got {self.microbatches}")
        if self.steps < 2:
            raise ValueError(f"pipeline steps must be >= 2 (step 1 is the warm-up), got {self.steps}")


def balanced_cuts(weights: Sequence[float], stages: int) -> tuple[int, ...]:
    """Cuts ``(0, c_1, ..., len(weights))`` of ``weights`` into ``stages`` non-empty contiguous runs
    whose largest sum is the smallest possible; among equally good splits the one with the earliest
    cuts (a deterministic choice). Dynamic programme over (layers, stages)."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][j]: smallest largest-stage-sum of layers [0, j) in k stages; arg[k][j]: the last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j] - 1e-15 * max(1.0, abs(v)):
                    best[k][j], arg[k][j] = v, i
    cuts = [n]
    for k in range(stages, 0, -1):
        cuts.append(arg[k][cuts[-1]])
    return tuple(reversed(cuts))


def pool_blocks(profile: Mapping[str, Any], kinds: Sequence[str]) -> dict[str, Any]:
    """A copy of ``profile`` whose tp-1 timings give every ``block`` layer the blocks' median forward,
    backward and optimizer step."""
    out = copy.deepcopy(dict(profile))
    idx = [i for i, k in enumerate(kinds) if k == "block"]
    if len(idx) < 2:
        return out
    for timing in out.get("timings", []):
        if timing.get("tp", 1) != 1:
            continue
        for key in ("fwd", "bwd", "update"):
            if key in timing:
                med = statistics.median(timing[key][i] for i in idx)
                timing[key] = [med if i in idx else v for i, v in enumerate(timing[key])]
    return out


def stage_times_of_run(traces: Sequence[Sequence[Mapping[str, Any]]], cuts: Sequence[int], mbs: int, *,
                       pace: float, use_steps: Sequence[int]) -> list[StageDeviceTimes]:
    """Every traced rank's stage device times (one pipeline, stage ``s`` = layers ``[cuts[s], cuts[s+1])``)."""
    out = []
    for trace in traces:
        if not trace:
            continue
        s = int(trace[0]["stage"])
        out.append(stage_times_from_trace(trace, pace=pace, use_steps=use_steps, layers=(cuts[s], cuts[s + 1]), mbs=mbs))
    return out


def _instance(profile: Mapping[str, Any], gpu: str, ranks: int, batch: int, seq: int) -> Any:
    """One cluster of ``ranks`` devices of type ``gpu`` running ``profile``'s model."""
    from hgopt.spec import instance_from_dict

    # one node of `ranks` paced devices; the run emulates no link inside a cluster, so these figures
    # only let the exporter build the plan (they are not measured and not used)
    local = {"gbyte_s": 1.0, "latency_ms": 0.1}
    cluster = {"name": "p", "region": "p", "gpu": gpu, "gpu_memory_gb": 64, "nodes": 1, "gpus_per_node": ranks,
               "intra_node": local, "inter_node": local}
    return instance_from_dict({"name": "pipelined-profile", "model": dict(profile),
                               "topology": {"clusters": [cluster], "links": {}},
                               "job": {"global_batch": batch, "seq_len": seq,
                                       "precision": str(profile.get("dtype", "fp32"))}})


def _paced_python(folder: Path, pace: float) -> str:
    """An executable the launcher uses as its python: the rank paced (device regions) and traced."""
    path = folder / "paced-python"
    path.write_text(f"#!/bin/sh\nHGOPT_OP_TRACE={folder / 'trace'} HGOPT_PACE_REPORT={folder / 'pace'} "
                    f"exec {sys.executable} -m hgopt.profiler.paced {pace:g} --device-regions "
                    "-m hgopt.profiler.optrace \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def _run_once(profile: Mapping[str, Any], cfg: ModelConfig, gpu: str, mbs: int, cuts: tuple[int, ...],
              s: PipelineSettings, folder: Path, seed: int, dtype: str) -> tuple[list[list[dict[str, Any]]], float]:
    """One profiling run; (every rank's trace, largest lag as a fraction of the run's device time)."""
    from hgopt.export import ExportOptions, build_runner_plan
    from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
    from hgopt.profiler.run import free_port
    from hgopt.runner.launch import LaunchOptions, launch_local

    for sub in ("trace", "pace"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        for f in (folder / sub).glob("*.json"):
            f.unlink()
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    stages = tuple(Stage(start=a, end=b, groups=(ReplicaGroup(cluster="p", dp=s.dp, mbs=mbs),))
                   for a, b in zip(cuts, cuts[1:]))
    plan = Plan(pipelines=(Pipeline(stages=stages, num_microbatches=s.microbatches),))
    inst = _instance(profile, gpu, s.stages * s.dp, mbs * s.dp * s.microbatches, cfg.seq)
    port = free_port()
    rp = build_runner_plan(plan, inst, ExportOptions(
        hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab, seq=cfg.seq, steps=s.steps, seed=seed,
        dtype=dtype, data="random", local=True, emulate_links="off", master_port=port,  # type: ignore[arg-type]
        heartbeat_timeout_s=60.0, timeout_s=240.0))
    plan_path = folder / "plan.json"
    plan_path.write_text(rp.to_json())
    code = launch_local(rp, plan_path, LaunchOptions(out_dir=folder, threads=1, port=port, emulation="off",
                                                     python=_paced_python(folder, s.pace)))
    traces = [json.loads(f.read_text()) for f in sorted((folder / "trace").glob("ops-*.json"))]
    if code != 0 or len(traces) != s.stages * s.dp or any(len(t) < s.steps for t in traces):
        raise RuntimeError(f"the pipelined profiling run failed (exit {code}; {len(traces)} of {s.stages * s.dp} rank "
                           f"traces) in {folder}")
    paces = [json.loads(f.read_text()) for f in (folder / "pace").glob("*.json")]
    lag = max((p["lag_s"] / max(p["device_s"], 1e-9) for p in paces), default=0.0)
    return traces, lag


def pipelined_profile(profile: Mapping[str, Any], cfg: ModelConfig, s: PipelineSettings, *, pool: bool = True,
                      seed: int = 0, dtype: str = "float32") -> dict[str, Any]:
    """``profile`` (the model-profile format, layer by layer, tp-1 timings for the sizes to measure)
    with every tp-1 timing's layers rescaled to their stage's device time in a pipelined run of
    ``cfg`` (module docstring); the runs' traces stay in ``s.keep_dir`` when given."""
    if cfg.hf_config or cfg.ffn_mult != 4:
        raise ValueError("--pipeline runs the runner's GPT as exported (ffn x4, no --hf-config)")
    s.check(cfg.num_layers)
    timings = [t for t in profile.get("timings", []) if t.get("tp", 1) == 1]
    if not timings:
        raise ValueError("--pipeline needs tp-1 timings to calibrate")
    use = list(range(2, s.steps + 1))
    with tempfile.TemporaryDirectory(prefix="hgopt-pipelined-") as tmp:
        root = Path(s.keep_dir or tmp)
        if s.keep_dir:
            root.mkdir(parents=True, exist_ok=True)
            (root / "profile-layers.json").write_text(json.dumps(profile, indent=1))
        measured: list[StageDeviceTimes] = []
        notes = []
        for t in timings:
            mbs = int(t["mbs"])
            cuts = balanced_cuts([f + b for f, b in zip(t["fwd"], t["bwd"])], s.stages)
            folder = root / f"mbs{mbs}"
            for attempt in range(2):
                traces, lag = _run_once(profile, cfg, str(t["gpu"]), mbs, cuts, s, folder, seed, dtype)
                if lag <= s.max_lag:
                    break
                log.warning("pipelined profile, mbs %d: the ranks lagged %.0f %% of their device time%s", mbs,
                            100 * lag, "; running it again" if attempt == 0 else "; keeping this run")
            measured += stage_times_of_run(traces, cuts, mbs, pace=s.pace, use_steps=use)
            notes.append(f"mbs {mbs}: cuts {','.join(map(str, cuts))}")
            log.info("pipelined profile, mbs %d, cuts %s: lag %.1f %%", mbs, cuts, 100 * lag)
    out = calibrate_profile(profile, measured, note=(
        f"a {s.stages}-stage pipelined run of the runner" + (f" with {s.dp} replicas per stage" if s.dp > 1 else "")
        + f", {s.microbatches} microbatches, {s.stages * s.dp} paced ranks "
        f"at {s.pace:g} core, steps {use[0]}-{use[-1]}; " + "; ".join(notes)))
    out["source"] = str(out["source"]).replace("calibrated in situ", "stage times measured in a pipelined run", 1)
    if pool:
        out = pool_blocks(out, cfg.layers)
        out["source"] += "; blocks pooled again (median)"
    return out
