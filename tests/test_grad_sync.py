"""Bucketed gradient all-reduce overlapped with the last microbatch's backward (hgopt/runner/grad_sync.py)
and the runner's memory accounting (hgopt/runner/memory.py).

End to end on CPU/gloo, float64, Adam, 3 steps, buckets of 0.1 MiB (every layer of the tiny model is its
own bucket): parameters equal single-process training and the non-overlapped run (1e-10) on plans with
unequal dp, several sync groups, mixed tp ('full' sync), cross-cluster groups, bf16 gradient sync and
ZeRO-1 on and off. The launch records show the buckets starting inside the last backward: a bucket of
layers >= L starts while exactly the stage's parameters of layers < L still wait for their gradient
(autograd runs a later layer's nodes and AccumulateGrads before any node of an earlier one)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hgopt.errors import PlanError
from hgopt.plan import Plan

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.export.runner_plan import RunnerPlan  # noqa: E402
from hgopt.runner.checkpoint import load_full_state  # noqa: E402
from hgopt.runner.grad_sync import pack_buckets  # noqa: E402
from hgopt.runner.launch import run_forked  # noqa: E402
from hgopt.runner.model import build_stage, layer_of  # noqa: E402
from hgopt.runner.reference import train_reference  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from hgopt.runner.tp import TpGroup  # noqa: E402
from hgopt.runner.zero import shard_bounds  # noqa: E402
from tests.runner_plans import plan_dp_tp, plan_two_pipelines, plan_zero_dp_tp, runner_instance, with_zero  # noqa: E402

SMALL = 0.1
"""MiB: below one layer's gradient (about 0.4 MB in float64), so every layer is a bucket."""
PLANS: dict[str, Plan] = {
    "two-pipelines": plan_two_pipelines(),
    "dp-unequal": plan_dp_tp(),
    "zero1-two-pipelines": with_zero(plan_two_pipelines()),
    "zero1-dp-tp": plan_zero_dp_tp(),
    "two-pipelines-bf16": replace(plan_two_pipelines(), grad_sync_precision="bf16"),
}
RUNS = [(name, overlap) for name in PLANS for overlap in (True, False)
        if overlap or name in ("two-pipelines", "zero1-two-pipelines", "two-pipelines-bf16")]
ONE_BUCKET = 1e6
"""MiB: every ZeRO-1 group one bucket (the reduce-scatter of the whole flat gradient after the backward)."""


def _rp(name: str, overlap: bool, bucket_mb: float = SMALL) -> RunnerPlan:
    plan = replace(PLANS[name], overlap_grad_sync=overlap, grad_bucket_mb=bucket_mb)
    return build_runner_plan(plan, runner_instance(), ExportOptions(dtype="float64"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], tuple[RunnerPlan, Path]]:
    out = {}
    for name, overlap in RUNS:
        rp = _rp(name, overlap)
        d = tmp_path_factory.mktemp(f"{name}-{'on' if overlap else 'off'}")
        codes = run_forked(rp, d, timeout_s=120)
        assert codes == {r: 0 for r in range(rp.world_size)}, f"{name}: rank exit codes {codes}"
        out[(name, overlap)] = (rp, d)
    return out


def _worst(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in a)


# ---- pure parts ------------------------------------------------------------------------------------
def test_pack_buckets_by_hand() -> None:
    sizes = [(0, 3), (1, 4), (2, 2), (3, 9), (4, 1)]
    assert pack_buckets(sizes, 5) == [(4,), (3,), (2,), (1,), (0,)]  # 1+9 > 5, 9 alone, 2+4 > 5, 4+3 > 5
    assert pack_buckets(sizes, 10) == [(4, 3), (2, 1, 0)]
    assert pack_buckets(sizes, 100) == [(4, 3, 2, 1, 0)]
    assert pack_buckets(sizes, 6) == [(4,), (3,), (2, 1), (0,)]
    assert pack_buckets([], 5) == []


def test_plan_fields_default_round_trip_and_errors() -> None:
    old = {"version": 1, "pipelines": [{"num_microbatches": 1, "stages": [
        {"layers": [0, 4], "groups": [{"cluster": "a"}]}]}]}
    plan = Plan.from_dict(old)
    assert (plan.overlap_grad_sync, plan.grad_bucket_mb) == (True, 25.0)
    again = Plan.from_json(replace(plan, overlap_grad_sync=False, grad_bucket_mb=0.5).to_json())
    assert (again.overlap_grad_sync, again.grad_bucket_mb) == (False, 0.5)
    with pytest.raises(PlanError, match="overlap_grad_sync"):
        Plan.from_dict({**old, "overlap_grad_sync": "yes"})
    for bad in (0, -1, "25", True):
        with pytest.raises(PlanError, match="grad_bucket_mb"):
            Plan.from_dict({**old, "grad_bucket_mb": bad})


def test_runner_plan_carries_the_fields() -> None:
    rp = _rp("two-pipelines", False)
    assert (rp.train.overlap_grad_sync, rp.train.grad_bucket_mb) == (False, SMALL)
    back = RunnerPlan.from_dict(json.loads(rp.to_json()))
    assert back.train == rp.train
    data = json.loads(rp.to_json())
    del data["train"]["overlap_grad_sync"], data["train"]["grad_bucket_mb"]  # a runner plan from before
    assert (RunnerPlan.from_dict(data).train.overlap_grad_sync, RunnerPlan.from_dict(data).train.grad_bucket_mb) == (True, 25.0)
    data["train"]["grad_bucket_mb"] = 0
    with pytest.raises(ValueError, match="train.grad_bucket_mb"):
        RunnerPlan.from_dict(data)


# ---- end to end ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in PLANS if not n.endswith("bf16")])
def test_overlapped_sync_equals_single_process_training(runs: dict[tuple[str, bool], tuple[RunnerPlan, Path]],
                                                        name: str) -> None:
    rp, out = runs[(name, True)]
    ref, losses = train_reference(rp, 3)
    worst = _worst(load_full_state(out), {n: p.detach() for n, p in ref.named_parameters()})
    assert worst <= 1e-10, f"{name}: worst relative difference {worst:.2e}"
    assert [r["loss"] for r in read_metrics(out)] == pytest.approx(losses, rel=1e-10)


@pytest.mark.parametrize("name", ["two-pipelines", "zero1-two-pipelines", "two-pipelines-bf16"])
def test_overlap_on_equals_overlap_off(runs: dict[tuple[str, bool], tuple[RunnerPlan, Path]], name: str) -> None:
    """Same buckets, same sums: the order of launches does not change the numbers (bf16 included)."""
    worst = _worst(load_full_state(runs[(name, True)][1]), load_full_state(runs[(name, False)][1]))
    assert worst <= 1e-10, f"{name}: overlap on vs off differ by {worst:.2e}"


@pytest.mark.parametrize("name", ["zero1-two-pipelines", "zero1-dp-tp"])
def test_bucketed_overlapped_zero1_is_bit_identical_to_one_reduce_scatter_after_the_backward(
        runs: dict[tuple[str, bool], tuple[RunnerPlan, Path]], name: str, tmp_path: Path) -> None:
    """ZeRO-1 reduce-scattered per 0.1 MiB bucket (one layer each) from the hooks of the last backward,
    slices laid out per bucket, against the whole flat gradient reduce-scattered in one piece after it
    (overlap off, one bucket: the path before the buckets): float64, gloo, the same parameters to the
    bit and the same losses. (Sums of two members are exact whatever the order; the slices are
    elementwise Adam on the same elements.)"""
    rp = _rp(name, False, ONE_BUCKET)
    assert [len(sg.ranks) for sg in rp.sync_groups if sg.zero] and all(len(sg.ranks) == 2 for sg in rp.sync_groups if sg.zero)
    assert run_forked(rp, tmp_path, timeout_s=120) == {r: 0 for r in range(rp.world_size)}
    launches = [x for rk in read_metrics(tmp_path)[-1]["ranks"] for x in rk["grad_sync"]["launches"]]
    assert launches and not any(x["during_backward"] for x in launches)
    bucketed = runs[(name, True)][1]
    assert any(x["during_backward"] and x["pending_params"] > 0
               for rk in read_metrics(bucketed)[-1]["ranks"] for x in rk["grad_sync"]["launches"])
    a, b = load_full_state(bucketed), load_full_state(tmp_path)
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert [r["loss"] for r in read_metrics(bucketed)] == [r["loss"] for r in read_metrics(tmp_path)]


def _expected_launches(rp: RunnerPlan, rank: int) -> list[tuple[int, tuple[int, ...], int]]:
    """(sync group, bucket layers, stage parameters of earlier layers) for every bucket of ``rank``,
    in the order the last backward reaches them: highest layers first."""
    info = rp.rank_info(rank)
    stage = rp.pipelines[info.pipeline].stages[info.stage]
    tp = stage.replicas[info.replica].tp
    names = [n for n, _ in build_stage(rp.model, stage.start, stage.end, TpGroup(size=tp), dtype="float64").named_parameters()]
    out = []
    for gi, sg in enumerate(rp.sync_groups):
        if rank not in sg.ranks:
            continue
        layers = range(sg.end - 1, sg.start - 1, -1)
        buckets = [(layer,) for layer in layers]  # ZeRO-1 too: a reduce-scatter per bucket
        out += [(gi, b, sum(1 for n in names if layer_of(n) < min(b))) for b in buckets]
    return sorted(out, key=lambda x: -max(x[1]))


@pytest.mark.parametrize("name", ["two-pipelines", "zero1-two-pipelines"])
def test_buckets_start_during_the_last_backward(runs: dict[tuple[str, bool], tuple[RunnerPlan, Path]],
                                                name: str) -> None:
    """Overlap on: every bucket starts from a gradient hook inside the last backward, while exactly the
    parameters of the earlier layers are still pending; several start with work left. Overlap off:
    all of them after it."""
    for overlap in (True, False):
        rp, out = runs[(name, overlap)]
        ranks = read_metrics(out)[-1]["ranks"]
        early = 0
        for r in range(rp.world_size):
            got = [(x["group"], tuple(x["layers"]), x["pending_params"], x["during_backward"])
                   for x in ranks[r]["grad_sync"]["launches"]]
            want = [(g, b, pending if overlap else 0, overlap) for g, b, pending in _expected_launches(rp, r)]
            assert got == want, f"{name} overlap {overlap} rank {r}"
            early += sum(1 for x in got if x[2] > 0)
        assert (early >= 4) if overlap else early == 0, early


def test_memory_counts_match_the_model(runs: dict[tuple[str, bool], tuple[RunnerPlan, Path]]) -> None:
    """Per rank: parameter and gradient bytes are the stage's (tp shard) parameters x 8; Adam's state
    is two moments per parameter it steps (ZeRO-1: its slice of the sharded groups) plus one
    step counter (float32) per tensor it steps; the activation peak is the in-flight microbatches' saved bytes
    (1F1B: stage 0 of 2 keeps 2 of its 2 microbatches, the last stage 1)."""
    for name in ("two-pipelines", "zero1-two-pipelines"):
        rp, out = runs[(name, True)]
        ranks = read_metrics(out)[-1]["ranks"]
        for r in range(rp.world_size):
            info = rp.rank_info(r)
            pipe = rp.pipelines[info.pipeline]
            stage = pipe.stages[info.stage]
            tp = stage.replicas[info.replica].tp
            params = list(build_stage(rp.model, stage.start, stage.end, TpGroup(size=tp), dtype="float64").parameters())
            numel = sum(p.numel() for p in params)
            mem = ranks[r]["memory"]
            assert mem["parameters"] == mem["gradients"] == 8 * numel
            named = list(build_stage(rp.model, stage.start, stage.end, TpGroup(size=tp), dtype="float64").named_parameters())
            zero = [sg for sg in rp.sync_groups if sg.zero and r in sg.ranks]
            in_zero = [p for n, p in named if any(sg.start <= layer_of(n) < sg.end for sg in zero)]
            plain = len(params) - len(in_zero)
            stepped = numel - sum(p.numel() for p in in_zero)
            for sg in zero:  # this member's slice of every bucket (one layer each) it steps (one step counter)
                for layer in range(sg.start, sg.end):
                    lo, hi = shard_bounds(sum(p.numel() for n, p in named if layer_of(n) == layer),
                                          len(sg.ranks), sorted(sg.ranks).index(r))
                    stepped += hi - lo
                plain += 1
            assert mem["optimizer"] == 2 * 8 * stepped + 4 * plain, (name, r)  # float32 step counters
            assert mem["in_flight"] == min(len(pipe.stages) - info.stage, pipe.num_microbatches)
            assert mem["activations"] == mem["in_flight"] * mem["activations_per_microbatch"]


def test_memory_meter_by_hand() -> None:
    """A linear layer followed by GELU on a (2, 4) float32 input: autograd saves the linear's input
    (32 B; its weight is a parameter, not counted) and the GELU's input (2 x 3 x 4 = 24 B). Two
    microbatches in flight hold twice that; after one backward the live bytes drop back."""
    from hgopt.runner.memory import MemoryMeter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU())
    meter = MemoryMeter(model)
    meter.start_step()
    outs = {}
    for m in range(2):
        with meter.forward(m):
            outs[m] = model(torch.randn(2, 4, requires_grad=m == 1)).sum()
        meter.output(m, outs[m])  # the 4-byte output, kept until its backward
    assert meter.saved_per_microbatch == {0: 32 + 24, 1: 32 + 24}
    assert (meter.peak_saved, meter.peak_in_flight, meter.peak_with_outputs) == (2 * 56, 2, 2 * 60)
    outs.pop(0).backward()
    meter.backward_done(0)
    with meter.forward(2):
        outs[2] = model(torch.randn(2, 4)).sum()
    assert meter.peak_saved == 2 * 56  # never three in flight
    meter.after_backward()
    assert meter.gradients == 4 * (4 * 3 + 3)
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    meter.after_step(opt)
    assert meter.optimizer == 2 * 4 * (4 * 3 + 3) + 2 * 4  # two moments + a float32 step per tensor
    s = meter.summary()
    assert (s["parameters"], s["activations"], s["activations_with_outputs"], s["in_flight"]) == (4 * 15, 112, 120, 2)


def test_delay_emulation_serialises_the_buckets(tmp_path: Path) -> None:
    """Data parallelism across clusters a and b (one single-stage pipeline each), links slowed to
    about 1 MB/s, ``delay`` emulation: a rank's cross-cluster buckets run one after another, so every
    step lasts at least the sum of their emulated ring times (computed from the logged bucket bytes),
    with overlap on and off. (A lower bound: the emulation sleeps at least that long.)"""
    from hgopt.plan import Pipeline, ReplicaGroup, Stage
    from hgopt.runner.grad_sync import emulated_ring_s

    one = lambda c: Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster=c, mbs=2),)),),  # noqa: E731
                             num_microbatches=1)
    for overlap in (True, False):
        plan = Plan(pipelines=(one("a"), one("b")), overlap_grad_sync=overlap, grad_bucket_mb=SMALL)
        rp = build_runner_plan(plan, runner_instance(global_batch=4), ExportOptions(link_scale=1e-3, steps=2))
        (sg,) = rp.sync_groups
        assert sg.clusters == ("a", "b")
        out = tmp_path / str(overlap)
        assert run_forked(rp, out, emulation="delay", timeout_s=120) == {0: 0, 1: 0}
        link = rp.link("a", "b")
        assert link is not None and link.bytes_per_s < 2e6
        for rec in read_metrics(out):
            launches = rec["ranks"][0]["grad_sync"]["launches"]
            assert len(launches) == 4 and all(x["during_backward"] == overlap for x in launches)
            floor = sum(emulated_ring_s(x["wire_bytes"], 2, link.bytes_per_s, link.latency_s) for x in launches)
            assert rec["time_s"] >= floor > 0.3, (overlap, rec["time_s"], floor)
