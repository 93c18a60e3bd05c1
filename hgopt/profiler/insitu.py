"""A layer profile calibrated *in situ*: the per-layer times of a model profile rescaled so that every
stage of a run adds up to the device time its operations actually took in that run.

Why: on the validation's paced CPU devices (:mod:`hgopt.profiler.paced`) a layer's time depends on
its context, which the cost model (a stage's time = the sum of its layers' profiled times) does not
see. Measured in the 4-stage validation plans (bench/RESULTS.md, "Cost-model validation: in-situ stage times (round 5)"):
a one-block middle stage's forward and backward took 13-26 % more device time inside the run than
the same block in ``hgopt profile --tenants 4`` timed a minute earlier, the last stage's backward
about the same, and a one-stage run's layers 14-15 % *less* (its layers run back to back without an
idle spell between them); the same profile repeated drifted by up to ±5 % over minutes on the shared
host. Composing the run's own per-operation device times with the cost model's schedule reproduced
the measured step (bench/validation_diag/sim1f1b.py). Calibrating the profile on a run's warm-up
steps therefore separates what the validation is after — the cost model's composition of stage
times, transfers, round trips, gradient sync and optimizer — from the emulated device's
context-dependent speed. (On a GPU a kernel's time barely depends on what ran before; this is a
property of the CPU emulation.)

The input is the per-operation trace written by :mod:`hgopt.profiler.optrace` (one list of steps per rank:
``{"rank", "stage", "pipeline", "ops": [{"kind": "F"|"B", "model_fwd", "backward", ...}], "opt"}``,
CPU seconds of the rank's main thread); device seconds = CPU seconds / pace. Pure Python, no torch.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StageDeviceTimes", "calibrate_profile", "stage_times_from_trace"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageDeviceTimes:
    """Device seconds of one rank's stage in a run: per microbatch forward (model and loss) and
    backward (autograd), and its optimizer step; ``update_s`` None: not measured."""

    start: int
    end: int
    """The stage's layers ``[start, end)``."""
    mbs: int
    fwd_s: float
    bwd_s: float
    update_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"a stage needs layers [start, end) with 0 <= start < end, got [{self.start}, {self.end})")
        if self.mbs < 1:
            raise ValueError(f"mbs must be >= 1, got {self.mbs}")
        if min(self.fwd_s, self.bwd_s, self.update_s or 0.0) < 0:
            raise ValueError("device times must be >= 0")


def stage_times_from_trace(steps: Sequence[Mapping[str, Any]], *, pace: float, use_steps: Sequence[int],
                           layers: tuple[int, int], mbs: int) -> StageDeviceTimes:
    """The median device time per forward, per backward and of the optimizer step of one rank over
    the steps ``use_steps`` (1-based step numbers of the run) of its trace ``steps``."""
    if pace <= 0:
        raise ValueError(f"pace must be > 0, got {pace}")
    chosen = [steps[i - 1] for i in use_steps if 1 <= i <= len(steps)]
    fwd = [o["model_fwd"] for s in chosen for o in s["ops"] if o["kind"] == "F"]
    bwd = [o["backward"] for s in chosen for o in s["ops"] if o["kind"] == "B"]
    if not fwd or not bwd:
        raise ValueError(f"no forward/backward operations in steps {list(use_steps)} of the trace")
    opt = [s["opt"] for s in chosen if s.get("opt")]
    return StageDeviceTimes(start=layers[0], end=layers[1], mbs=mbs, fwd_s=statistics.median(fwd) / pace,
                            bwd_s=statistics.median(bwd) / pace,
                            update_s=statistics.median(opt) / pace if opt else None)


def _factors(stages: Sequence[StageDeviceTimes], timing: Mapping[str, Any], key: str) -> dict[int, list[float]]:
    """Per layer: measured / profiled of every stage that holds it (and has a positive profiled sum)."""
    out: dict[int, list[float]] = {}
    for st in stages:
        measured = {"fwd": st.fwd_s, "bwd": st.bwd_s, "update": st.update_s}[key]
        if measured is None or (key != "update" and st.mbs != timing["mbs"]):
            continue
        profiled = sum(timing[key][st.start:st.end])
        if st.end > len(timing[key]) or profiled <= 0:
            continue
        for i in range(st.start, st.end):
            out.setdefault(i, []).append(measured / profiled)
    return out


def calibrate_profile(profile: Mapping[str, Any], stages: Sequence[StageDeviceTimes],
                      note: str = "") -> dict[str, Any]:
    """A copy of ``profile`` (the model-profile format, ``hgopt.spec.model_profile_from_dict``) whose
    tp-1 timing entries have each layer's forward and backward (at the stage's mbs) and optimizer
    step (every mbs) multiplied by measured / profiled of the stage that holds the layer, so that
    each measured stage's layers add up to its measured time. A layer that several stages hold (data
    parallel replicas, several pipelines) gets the median of their ratios; layers and microbatch
    sizes that no stage measured keep their profiled times."""
    out = copy.deepcopy(dict(profile))
    for timing in out.get("timings", []):
        if timing.get("tp", 1) != 1:
            continue
        for key in ("fwd", "bwd", "update"):
            if key not in timing:
                continue
            factors = _factors(stages, timing, key)
            timing[key] = [v * statistics.median(factors[i]) if i in factors else v
                           for i, v in enumerate(timing[key])]
    if stages:
        out["source"] = (str(out.get("source", "")) + "; calibrated in situ"
                         + (f" ({note})" if note else "") + f": {len(stages)} stage(s) rescaled to their measured device time")
    return out
