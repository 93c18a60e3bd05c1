"""hgopt.profiler.insitu: a layer profile rescaled to the device times a run's stages measured
(hand-computed cases; no torch, no timing)."""

from __future__ import annotations

import math

import pytest

from hgopt.profiler.insitu import StageDeviceTimes, calibrate_profile, stage_times_from_trace
from hgopt.spec import model_profile_from_dict


def _profile() -> dict:
    layers = [{"name": f"l{i}", "kind": k, "params": 10.0, "activation_bytes": 4.0, "act_mem_bytes": 4.0}
              for i, k in enumerate(("embedding", "block", "block", "head"))]
    timing = lambda mbs, f: {"gpu": "cpu", "tp": 1, "mbs": mbs, "fwd": [f * x for x in (1.0, 2.0, 2.0, 1.0)],  # noqa: E731
                                   "bwd": [f * x for x in (2.0, 4.0, 4.0, 2.0)], "update": [0.5, 1.0, 1.0, 0.5]}
    return {"version": 1, "name": "toy", "dtype": "fp32", "seq_len": 8, "source": "hand", "layers": layers,
            "timings": [timing(1, 0.5), timing(2, 1.0)]}


def test_each_stage_adds_up_to_its_measured_time_and_keeps_its_layer_proportions() -> None:
    prof = _profile()
    # stage [0, 2) at mbs 2: profiled fwd 1 + 2 = 3, bwd 6, update 1.5; measured 4.5 / 6 / 3 -> x1.5, x1, x2
    # stage [2, 4) at mbs 2: profiled fwd 3, bwd 6, update 1.5; measured 3 / 9 / 1.5 -> x1, x1.5, x1
    out = calibrate_profile(prof, [StageDeviceTimes(start=0, end=2, mbs=2, fwd_s=4.5, bwd_s=6.0, update_s=3.0),
                                   StageDeviceTimes(start=2, end=4, mbs=2, fwd_s=3.0, bwd_s=9.0, update_s=1.5)])
    t2 = next(t for t in out["timings"] if t["mbs"] == 2)
    assert t2["fwd"] == pytest.approx([1.5, 3.0, 2.0, 1.0])
    assert t2["bwd"] == pytest.approx([2.0, 4.0, 6.0, 3.0])
    assert t2["update"] == pytest.approx([1.0, 2.0, 1.0, 0.5])
    assert sum(t2["fwd"][0:2]) == pytest.approx(4.5) and sum(t2["bwd"][2:4]) == pytest.approx(9.0)
    # mbs 1 was not measured: forward and backward as profiled; the optimizer step does not depend on mbs
    t1 = next(t for t in out["timings"] if t["mbs"] == 1)
    assert t1["fwd"] == pytest.approx([0.5, 1.0, 1.0, 0.5]) and t1["bwd"] == pytest.approx([1.0, 2.0, 2.0, 1.0])
    assert t1["update"] == pytest.approx([1.0, 2.0, 1.0, 0.5])
    # the input is untouched and the result is still a valid model profile that says what was done
    assert prof["timings"][1]["fwd"] == [1.0, 2.0, 2.0, 1.0]
    assert "calibrated in situ" in out["source"]
    model_profile_from_dict(out)


def test_a_layer_held_by_several_stages_gets_the_median_ratio_and_unmeasured_layers_keep_theirs() -> None:
    prof = _profile()
    # three replicas of stage [1, 2) at mbs 1 (profiled fwd 1.0): measured 1.0, 3.0, 1.5 -> median x1.5
    reps = [StageDeviceTimes(start=1, end=2, mbs=1, fwd_s=f, bwd_s=2.0) for f in (1.0, 3.0, 1.5)]
    t1 = next(t for t in calibrate_profile(prof, reps)["timings"] if t["mbs"] == 1)
    assert t1["fwd"] == pytest.approx([0.5, 1.5, 1.0, 0.5])
    assert t1["bwd"] == pytest.approx([1.0, 2.0, 2.0, 1.0])  # measured = profiled
    assert t1["update"] == pytest.approx([0.5, 1.0, 1.0, 0.5])  # update_s None: not measured


def test_no_stages_leaves_the_profile_as_it_was() -> None:
    prof = _profile()
    assert calibrate_profile(prof, []) == prof


def test_stage_times_from_trace_takes_the_median_of_the_chosen_steps_in_device_seconds() -> None:
    def step(f: list[float], b: list[float], opt: float) -> dict:
        return {"ops": [{"kind": "F", "model_fwd": x, "backward": 0.0} for x in f]
                + [{"kind": "B", "model_fwd": 0.0, "backward": x} for x in b], "opt": opt}

    trace = [step([9.0], [9.0], 9.0),  # step 1 (unpaced warm-up): not chosen
             step([0.1, 0.3], [0.2], 0.05), step([0.2], [0.4, 0.6], 0.15), step([7.0], [7.0], 7.0)]
    st = stage_times_from_trace(trace, pace=0.5, use_steps=(2, 3), layers=(1, 3), mbs=2)
    assert (st.start, st.end, st.mbs) == (1, 3, 2)
    assert st.fwd_s == pytest.approx(0.2 / 0.5)  # median of 0.1, 0.3, 0.2
    assert st.bwd_s == pytest.approx(0.4 / 0.5)  # median of 0.2, 0.4, 0.6
    assert st.update_s is not None and math.isclose(st.update_s, 0.1 / 0.5)
    with pytest.raises(ValueError, match="no forward"):
        stage_times_from_trace(trace, pace=0.5, use_steps=(7,), layers=(0, 1), mbs=1)


def test_invalid_stage_times_are_rejected() -> None:
    with pytest.raises(ValueError):
        StageDeviceTimes(start=2, end=2, mbs=1, fwd_s=1.0, bwd_s=1.0)
    with pytest.raises(ValueError):
        StageDeviceTimes(start=0, end=1, mbs=1, fwd_s=-1.0, bwd_s=1.0)


def test_the_validation_bench_maps_each_ranks_trace_to_its_stages_layers_and_mbs(tmp_path) -> None:
    """bench/validate_cost_model.py's ``calibrated``: rank traces (pipeline, stage) -> the plan's layers."""
    import json

    bench = pytest.importorskip("bench.validate_cost_model")
    plan = next(p for name, _, p in bench.plans() if name == "w200 2st a|b mbs2 m8")  # [0,3) and [3,6), mbs 2
    prof = _profile()
    prof["layers"] = prof["layers"] + [dict(prof["layers"][1], name="l4"), dict(prof["layers"][1], name="l5")]
    for t in prof["timings"]:  # six layers: fwd 1, 2, 2, 1, 2, 2 (x0.5 at mbs 1), bwd twice that
        t["fwd"], t["bwd"], t["update"] = t["fwd"] + t["fwd"][1:3], t["bwd"] + t["bwd"][1:3], t["update"] + [1.0, 1.0]
    pace = 0.5

    def trace(stage: int, fwd_dev: float, bwd_dev: float) -> list[dict]:
        step = {"pipeline": 0, "stage": stage, "opt": 0.0,
                "ops": [{"kind": "F", "model_fwd": fwd_dev * pace, "backward": 0.0},
                        {"kind": "B", "model_fwd": 0.0, "backward": bwd_dev * pace}]}
        return [step, step, step]

    # stage 0 = layers 0-2 (profiled at mbs 2: fwd 5, bwd 10) measured 10 / 10; stage 1 = layers 3-5
    # (fwd 5, bwd 10) measured 5 / 20
    (tmp_path / "ops-1.json").write_text(json.dumps(trace(0, 10.0, 10.0)))
    (tmp_path / "ops-2.json").write_text(json.dumps(trace(1, 5.0, 20.0)))
    out = bench.calibrated(prof, plan, tmp_path, pace, [2, 3])
    t2 = next(t for t in out["timings"] if t["mbs"] == 2)
    assert t2["fwd"] == pytest.approx([2.0, 4.0, 4.0, 1.0, 2.0, 2.0])
    assert t2["bwd"] == pytest.approx([2.0, 4.0, 4.0, 4.0, 8.0, 8.0])
    assert t2["update"] == pytest.approx([0.5, 1.0, 1.0, 0.5, 1.0, 1.0])  # opt 0: not measured
