"""Issue 14's resume test: plan an instance, train 5 steps, checkpoint (torch.distributed.checkpoint),
lose half of one cluster (``--change``), re-plan, resume under the new plan (other layer ranges,
replica counts and ZeRO-1 shards: DCP reshards by per-layer keys), train 5 more steps. The parameters
equal those of plan B's training continued in one process from the same checkpoint, and those of
never stopping (float64, <= 1e-12)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from hgopt.changes import apply_changes, parse_change  # noqa: E402
from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.runner.checkpoint import load_full_state  # noqa: E402
from hgopt.runner.dcp_checkpoint import load_full_dcp_state  # noqa: E402
from hgopt.runner.launch import run_forked  # noqa: E402
from hgopt.runner.reference import train_reference  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from hgopt.search import PlanOptions, get_planner  # noqa: E402
from hgopt.search.replan import replan  # noqa: E402
from tests.factories import tiny_instance, tiny_model, tiny_topology  # noqa: E402


def instance():  # type: ignore[no-untyped-def]
    """Two clusters of 2 one-GPU nodes; 1.15 GB per GPU (1 GiB of it workspace) makes the planner
    split the 4 layers into stages."""
    return tiny_instance(global_batch=8, model=tiny_model(num_layers=4), topology=tiny_topology(
        clusters=(("a", "A", 2, 1, 1.15), ("b", "B", 2, 1, 1.15))))


def _layout(plan):  # type: ignore[no-untyped-def]
    return [[(s.start, s.end, s.replicas, s.zero) for s in p.stages] for p in plan.pipelines]


def _worst(model, got) -> float:  # type: ignore[no-untyped-def]
    assert set(got) == {n for n, _ in model.named_parameters()}
    return max(float((p.detach() - got[n]).abs().max()) for n, p in model.named_parameters())


def test_resume_under_the_replanned_partition_continues_exactly(tmp_path: Path) -> None:
    inst = instance()
    heuristic = get_planner("heuristic")
    plan_a = heuristic(inst, PlanOptions(time_limit_s=5)).plan
    assert plan_a is not None
    lost = apply_changes(inst, [parse_change("cluster=b:-1")])  # half of cluster b is gone
    res = replan(plan_a, inst, lost, "heuristic", heuristic, PlanOptions(time_limit_s=5), horizon_steps=100)
    assert res.chosen is not None
    plan_b = res.chosen.plan
    assert _layout(plan_a) != _layout(plan_b)  # another partition: the resume must reshard
    assert plan_a.gpus_by_cluster().get("b", 0) > lost.topology.cluster("b").num_gpus  # A cannot run on what is left

    opts = ExportOptions(dtype="float64", checkpoint_format="dcp", local=True, master_port=0, steps=10,
                         checkpoint_every=5)
    rp_a = build_runner_plan(plan_a, inst, replace(opts, steps=5))
    rp_b = build_runner_plan(plan_b, lost, opts)
    assert rp_a.global_batch == rp_b.global_batch
    out = tmp_path / "run"
    assert run_forked(rp_a, out, steps=5, timeout_s=240) == {r: 0 for r in range(rp_a.world_size)}
    saved = tmp_path / "step5"
    shutil.copytree(out / "checkpoints" / "step000005", saved)
    assert run_forked(rp_b, out, steps=10, resume=True, timeout_s=240) == {r: 0 for r in range(rp_b.world_size)}
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 11))  # the loss curve goes on from step 6
    got = load_full_state(out)

    params, optim = load_full_dcp_state(saved)
    continued, _ = train_reference(rp_b, 10, start=(5, params, optim))  # plan B, one process, same state
    assert _worst(continued, got) <= 1e-12
    never_stopped, _ = train_reference(rp_a, 10)
    assert _worst(never_stopped, got) <= 1e-12
