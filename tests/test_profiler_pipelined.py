"""hgopt.profiler.pipelined: stage times measured inside a short pipelined run of the runner.

The split and the block pooling against brute force / hand computation (no torch); one real run of a
tiny model (2 paced ranks), whose profile is compared with quantities measured in the same run: every
stage's layers add up to the median device time of that stage's operations in the run's trace, and
keep the proportions the layer-by-layer timing gave them (no machine-speed verdict)."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hgopt.profiler.pipelined import PipelineSettings, balanced_cuts, pool_blocks, stage_times_of_run


def _brute(weights: list[float], stages: int) -> float:
    n = len(weights)
    best = float("inf")
    for inner in itertools.combinations(range(1, n), stages - 1):
        cuts = (0, *inner, n)
        best = min(best, max(sum(weights[a:b]) for a, b in zip(cuts, cuts[1:])))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=1, max_size=7), st.integers(1, 7))
def test_balanced_cuts_minimise_the_largest_stage_as_brute_force_does(weights: list[float], stages: int) -> None:
    stages = min(stages, len(weights))
    cuts = balanced_cuts(weights, stages)
    assert cuts[0] == 0 and cuts[-1] == len(weights) and len(cuts) == stages + 1
    assert all(a < b for a, b in zip(cuts, cuts[1:]))  # non-empty stages
    got = max(sum(weights[a:b]) for a, b in zip(cuts, cuts[1:]))
    assert got == pytest.approx(_brute(weights, stages), rel=1e-9, abs=1e-12)


def test_balanced_cuts_hand_cases() -> None:
    # embedding 1, four blocks 3, head 2: 4 stages -> [emb+block | block | block | block+head] (max 5)
    assert balanced_cuts([1, 3, 3, 3, 3, 2], 4) == (0, 2, 3, 4, 6)
    assert balanced_cuts([1, 3, 3, 3, 3, 2], 2) == (0, 3, 6)
    assert balanced_cuts([5.0], 1) == (0, 1)
    with pytest.raises(ValueError):
        balanced_cuts([1.0, 2.0], 3)


def test_pool_blocks_gives_every_block_the_median_and_leaves_the_rest() -> None:
    prof = {"timings": [{"tp": 1, "mbs": 1, "fwd": [1.0, 2.0, 6.0, 3.0, 9.0], "bwd": [1.0, 1.0, 1.0, 4.0, 1.0],
                         "update": [0.5, 1.0, 2.0, 3.0, 0.5]},
                        {"tp": 2, "mbs": 1, "fwd": [1.0, 2.0, 6.0, 3.0, 9.0], "bwd": [1.0] * 5, "update": [1.0] * 5}]}
    out = pool_blocks(prof, ("embedding", "block", "block", "block", "head"))
    assert out["timings"][0]["fwd"] == [1.0, 3.0, 3.0, 3.0, 9.0]
    assert out["timings"][0]["bwd"] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert out["timings"][0]["update"] == [0.5, 2.0, 2.0, 2.0, 0.5]
    assert out["timings"][1]["fwd"] == [1.0, 2.0, 6.0, 3.0, 9.0]  # tp > 1 untouched
    assert prof["timings"][0]["fwd"] == [1.0, 2.0, 6.0, 3.0, 9.0]  # input untouched


def test_stage_times_of_run_maps_each_trace_to_its_stage_layers() -> None:
    def step(fwd: float, bwd: float, opt: float, stage: int) -> dict:
        return {"rank": stage, "pipeline": 0, "stage": stage, "opt": opt,
                "ops": [{"kind": "F", "model_fwd": fwd, "backward": 0.0}, {"kind": "B", "model_fwd": 0.0, "backward": bwd}]}

    traces = [[step(9, 9, 9, 1), step(0.2, 0.4, 0.1, 1), step(0.4, 0.6, 0.3, 1)],
              [step(9, 9, 9, 0), step(0.1, 0.2, 0.05, 0), step(0.1, 0.2, 0.05, 0)]]
    out = sorted(stage_times_of_run(traces, (0, 2, 5), 4, pace=0.5, use_steps=[2, 3]), key=lambda s: s.start)
    assert [(s.start, s.end, s.mbs) for s in out] == [(0, 2, 4), (2, 5, 4)]
    assert out[0].fwd_s == pytest.approx(0.2) and out[0].bwd_s == pytest.approx(0.4) and out[0].update_s == pytest.approx(0.1)
    assert out[1].fwd_s == pytest.approx(0.6) and out[1].bwd_s == pytest.approx(1.0) and out[1].update_s == pytest.approx(0.4)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="stages"):
        PipelineSettings(stages=5, pace=0.5).check(4)
    with pytest.raises(ValueError, match="pace"):
        PipelineSettings(stages=2, pace=1.5).check(4)
    with pytest.raises(ValueError, match="steps"):
        PipelineSettings(stages=2, pace=0.5, steps=1).check(4)


def test_a_pipelined_profile_adds_up_to_the_run_it_measured(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.profiler.pipelined import pipelined_profile
    from hgopt.profiler.run import ModelRequest, profile_model
    from hgopt.profiler.timing import TimingSettings
    from hgopt.spec import model_profile_to_dict

    cfg = ModelConfig(layers=("embedding", "block", "block", "head"), hidden=32, heads=2, vocab=64, seq=16)
    names = ("embedding", "block1", "block2", "head")
    timing = TimingSettings(gpu="cpu", warmup=1, repeat=3, pace=0.5)
    layered = model_profile_to_dict(profile_model(ModelRequest(model=cfg, names=names, mbss=(2,), timing=timing,
                                                               pool_blocks=False)))
    s = PipelineSettings(stages=2, pace=0.5, microbatches=2, steps=3, keep_dir=str(tmp_path), max_lag=float("inf"))
    out = pipelined_profile(layered, cfg, s, pool=False)
    before, after = layered["timings"][0], out["timings"][0]
    cuts = balanced_cuts([f + b for f, b in zip(before["fwd"], before["bwd"])], 2)
    assert f"cuts {','.join(map(str, cuts))}" in out["source"]
    traces = [json.loads(f.read_text()) for f in sorted((tmp_path / "mbs2" / "trace").glob("ops-*.json"))]
    assert len(traces) == 2
    for trace in traces:
        stage = trace[0]["stage"]
        a, b = cuts[stage], cuts[stage + 1]
        ops = [o for step in trace[1:3] for o in step["ops"]]  # steps 2-3: step 1 is the unpaced warm-up
        fwd = statistics.median(o["model_fwd"] for o in ops if o["kind"] == "F") / 0.5
        bwd = statistics.median(o["backward"] for o in ops if o["kind"] == "B") / 0.5
        opt = statistics.median(step["opt"] for step in trace[1:3]) / 0.5
        assert sum(after["fwd"][a:b]) == pytest.approx(fwd, rel=1e-9)
        assert sum(after["bwd"][a:b]) == pytest.approx(bwd, rel=1e-9)
        assert sum(after["update"][a:b]) == pytest.approx(opt, rel=1e-9)
        for key in ("fwd", "bwd"):  # the layer-by-layer timing's shares inside the stage are kept
            ratios = [x / y for x, y in zip(after[key][a:b], before[key][a:b])]
            assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)


def test_the_cli_refuses_a_pipelined_profile_it_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from hgopt.cli import main

    out = str(tmp_path / "p.json")
    assert main(["profile", "--blocks", "1", "--pipeline", "2", "-o", out]) == 2  # no --pace
    assert "--pipeline needs --pace" in capsys.readouterr().err
    assert main(["profile", "--blocks", "1", "--pace", "0.5", "--pipeline", "4", "-o", out]) == 2  # 3 layers
    assert "--pipeline 4" in capsys.readouterr().err
    assert main(["profile", "--blocks", "1", "--pace", "0.5", "--pipeline", "2", "--tp", "1,2", "-o", out]) == 2
    assert not Path(out).exists()
