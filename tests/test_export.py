"""hgopt export: runner plan contents, rank placement, re-sharding pieces, gradient-sync groups,
torchrun commands, and that the export path never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hgopt.export import ExportOptions, build_runner_plan, node_command, write_export
from hgopt.export.runner_plan import RunnerPlan, load_runner_plan
from tests.runner_plans import G, pipeline, plan_dp_tp, plan_reshard, plan_two_pipelines, runner_instance
from hgopt.plan import Plan
from tests.factories import tiny_model, tiny_topology


def test_ranks_rows_and_nodes_of_dp_tp_plan() -> None:
    rp = build_runner_plan(plan_dp_tp(("fp8", "bf16")), runner_instance(), ExportOptions())
    info = {r.rank: r for r in rp.ranks()}
    assert rp.world_size == 4 and [n.ranks for n in rp.nodes] == [(0, 1), (2, 3)]
    assert [(n.cluster, n.cluster_node) for n in rp.nodes] == [("a", 0), ("b", 0)]
    s0, s1 = rp.pipelines[0].stages
    assert [(r.ranks, r.offset, r.mbs) for r in s0.replicas] == [((0,), 0, 3), ((1,), 3, 1)]
    assert [(r.ranks, r.offset, r.mbs) for r in s1.replicas] == [((2, 3), 0, 4)]
    assert info[3].tp_rank == 1 and info[3].stage == 1 and info[3].cluster == "b"
    # the two stage-0 replicas hand rows 0-2 and 3 to the one stage-1 replica
    assert [(p.src, p.dst, p.lo, p.hi) for p in rp.pipelines[0].pieces(0)] == [(0, 0, 0, 3), (1, 0, 3, 4)]
    # stage 0's replicas all-reduce their gradients; stage 1 has one replica (tp ranks split, no sync)
    assert [(g.start, g.end, g.ranks, g.mode) for g in rp.sync_groups] == [(0, 2, (0, 1), "shard")]
    assert rp.pipelines[0].boundaries[0].fwd == "fp8" and rp.pipelines[0].boundaries[0].bwd == "bf16"


def test_json_round_trip_and_per_rank_view(tmp_path: Path) -> None:
    rp = build_runner_plan(plan_two_pipelines(), runner_instance(), ExportOptions(local=True, steps=5, lr=0.01))
    files = write_export(rp, tmp_path)
    back = load_runner_plan(files.plan)
    assert back == rp
    data = json.loads(files.plan.read_text())
    r0 = data["ranks"][0]
    assert r0["tp_group"] == [0, 1] and r0["layers"] == [0, 2] and r0["num_microbatches"] == 2
    assert data["ranks"][4]["boundary_in"] == {"fwd": "bf16", "bwd": "fp16"}
    assert data["train"]["steps"] == 5 and data["train"]["lr"] == 0.01


def test_reshard_pieces_tile_both_sides() -> None:
    rp = build_runner_plan(plan_reshard(), runner_instance(), ExportOptions())
    p = rp.pipelines[0]
    # stage 1 splits 1 + 3, stage 2 splits 2 + 2
    assert [(x.src, x.dst, x.lo, x.hi) for x in p.pieces(1)] == [(0, 0, 0, 1), (1, 0, 1, 2), (1, 1, 2, 4)]
    for k in range(len(p.stages) - 1):
        rows = sorted((x.lo, x.hi) for x in p.pieces(k))
        assert rows[0][0] == 0 and rows[-1][1] == p.microbatch
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))


def test_sync_groups_across_pipelines_with_mixed_tp() -> None:
    rp = build_runner_plan(plan_two_pipelines(), runner_instance(), ExportOptions())
    # p0: s0 ranks (0,1) tp2 layers 0-1, s1 rank 3 layers 2-3; p1: s0 rank 2 layers 0-2, s1 rank 4 layer 3
    groups = [(g.start, g.end, g.ranks, g.mode) for g in rp.sync_groups]
    assert groups == [(0, 2, (0, 1, 2), "full"), (2, 3, (3, 2), "shard"), (3, 4, (3, 4), "shard")]
    assert rp.global_batch == 8 and [p.sample_offset for p in rp.pipelines] == [0, 4]


def test_mbs_unit_scales_batch_and_keeps_ratios() -> None:
    inst = runner_instance(global_batch=32)
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=4), G("a", mbs=12)]), ((2, 4), [G("b", dp=2, mbs=8)])], m=2),))
    rp = build_runner_plan(plan, inst, ExportOptions(mbs_unit=1, microbatches=3))
    s0, s1 = rp.pipelines[0].stages
    assert [r.mbs for r in s0.replicas] == [1, 3] and [r.mbs for r in s1.replicas] == [2, 2]
    assert rp.pipelines[0].num_microbatches == 3 and rp.global_batch == 12


def test_tp_groups_never_straddle_nodes() -> None:
    inst = runner_instance(gpus_per_cluster=(3, 2))
    # cluster a: tp1, tp2, tp1 in plan order -> the tp-2 group is placed first, on node 0
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=1), G("a", tp=2, mbs=2), G("a", mbs=1)]),
                                     ((2, 4), [G("b", mbs=4)])], m=2),))
    rp = build_runner_plan(plan, inst, ExportOptions())
    tp_rep = rp.pipelines[0].stages[0].replicas[1]
    node_of = {r: n.index for n in rp.nodes for r in n.ranks}
    assert tp_rep.tp == 2 and node_of[tp_rep.ranks[0]] == node_of[tp_rep.ranks[1]]


def test_torchrun_commands(tmp_path: Path) -> None:
    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(master_port=29611))
    files = write_export(rp, tmp_path)
    assert [p.name for p in files.node_scripts] == ["node0.sh", "node1.sh"] and files.local_script is None
    cmd = files.commands[1]
    for part in ("torchrun", "--nnodes 2", "--node-rank 1", "--nproc-per-node 2", "--master-port 29611",
                 "-m hgopt.runner", "--node-index 1", str(files.plan)):
        assert part in cmd
    assert "MASTER_ADDR" in cmd  # no address given: taken from the environment
    local = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(local=True))
    assert "--master-addr 127.0.0.1" in node_command(local, local.nodes[0], "plan.json")
    netns = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(local=True, emulate_links="netns"))
    assert node_command(netns, netns.nodes[1], "plan.json").startswith("ip netns exec hg29500c1 env GLOO_SOCKET_IFNAME=")


@pytest.mark.parametrize(
    "opts, needle",
    [
        (ExportOptions(heads=3), "--hidden 64 must be a multiple of --heads 3"),
        (ExportOptions(hidden=48, heads=3), "--heads 3 is not divisible by tp 2"),
        (ExportOptions(vocab=100), "--vocab 100 is too small"),
        (ExportOptions(mbs_unit=0), "--mbs-unit must be >= 1"),
    ],
)
def test_bad_options_name_the_setting(opts: ExportOptions, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        build_runner_plan(plan_dp_tp(), runner_instance(), opts)


def test_invalid_plan_is_refused() -> None:
    with pytest.raises(ValueError, match="global batch"):
        build_runner_plan(plan_dp_tp(), runner_instance(global_batch=16), ExportOptions())


def test_hand_edited_runner_plan_is_checked(tmp_path: Path) -> None:
    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions())
    data = rp.to_dict()
    data["pipelines"][0]["stages"][0]["replicas"][1]["mbs"] = 2
    with pytest.raises(ValueError, match=r"stages\[1\]: processes 4 rows per microbatch, stage 0 processes 5"):
        RunnerPlan.from_dict(data)
    data = rp.to_dict()
    data["ranks"][2]["tp_group"] = [2]
    with pytest.raises(ValueError, match="ranks: the per-rank view does not match the pipelines"):
        RunnerPlan.from_dict(data)


def test_export_cli_writes_files_without_importing_torch(tmp_path: Path) -> None:
    inst = tmp_path / "inst.json"
    inst.write_text(json.dumps({"name": "tiny", "model": tiny_model(), "topology": tiny_topology(),
                                "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}))
    plan = tmp_path / "plan.json"
    plan.write_text(plan_dp_tp(("bf16", "fp8")).to_json())
    code = (
        "import sys; from hgopt.commands.export import register, run; import argparse;"
        "p = argparse.ArgumentParser(); sub = p.add_subparsers(); register(sub);"
        f"a = p.parse_args(['export', {str(plan)!r}, '--instance', {str(inst)!r}, '-o', {str(tmp_path / 'out')!r}, '--local']);"
        "rc = a.func(a); assert 'torch' not in sys.modules, 'export imported torch'; sys.exit(rc)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "rank   3  node 1  b" in res.stdout
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"plan.json", "node0.sh", "node1.sh", "run_local.sh"}
    rp = load_runner_plan(out / "plan.json")
    assert rp.local and rp.pipelines[0].boundaries[0].fwd == "bf16" and rp.pipelines[0].boundaries[0].bwd == "fp8"


def test_zero1_sync_groups_and_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    """zero 1 becomes a sharded sync group where every holder asks for it and holders share one tp degree;
    the rest keep full copies, said at INFO (no warning any more)."""
    from dataclasses import replace

    from tests.runner_plans import plan_zero_dp_tp, with_zero

    with caplog.at_level("INFO", logger="hgopt.export.build"):
        rp = build_runner_plan(plan_zero_dp_tp(), runner_instance(), ExportOptions())
    assert [(g.start, g.end, g.ranks, g.mode, g.zero) for g in rp.sync_groups] == [
        (0, 2, (0, 1), "shard", 1), (2, 4, (2, 4), "shard", 1), (2, 4, (3, 5), "shard", 1)]
    assert [s.zero for s in rp.pipelines[0].stages] == [1, 1]
    assert not caplog.records
    caplog.clear()
    with caplog.at_level("INFO", logger="hgopt.export.build"):
        mixed_tp = build_runner_plan(with_zero(plan_two_pipelines()), runner_instance(), ExportOptions())
    assert [(g.start, g.mode, g.zero) for g in mixed_tp.sync_groups] == [(0, "full", 0), (2, "shard", 1), (3, "shard", 1)]
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "layers [0, 2) are held with different tp degrees (1, 2)" in caplog.text
    caplog.clear()
    plan = plan_two_pipelines()
    half = replace(plan, pipelines=(with_zero(Plan(pipelines=plan.pipelines[:1])).pipelines[0], plan.pipelines[1]))
    with caplog.at_level("INFO", logger="hgopt.export.build"):
        rp = build_runner_plan(half, runner_instance(), ExportOptions())
    assert all(g.zero == 0 for g in rp.sync_groups)
    assert "also held by stages without zero 1" in caplog.text
    assert all(r.levelname == "INFO" for r in caplog.records)


def test_zero_and_device_round_trip_and_checks(tmp_path: Path) -> None:
    from tests.runner_plans import plan_zero_dp_tp

    rp = build_runner_plan(plan_zero_dp_tp(), runner_instance(), ExportOptions(device="cpu"))
    back = load_runner_plan(write_export(rp, tmp_path).plan)
    assert back == rp and back.device == "cpu" and back.sync_groups[0].zero == 1
    data = rp.to_dict()
    data["sync_groups"][0]["mode"] = "full"
    with pytest.raises(ValueError, match=r"sync_groups\[0\]\.zero: ZeRO-1 needs holders of one tp degree"):
        RunnerPlan.from_dict(data)
    data = rp.to_dict()
    data["comm"]["device"] = "gpu"
    with pytest.raises(ValueError, match=r"comm\.device: must be one of auto, cpu, cuda, got 'gpu'"):
        RunnerPlan.from_dict(data)
    data = rp.to_dict()
    del data["comm"]["device"], data["sync_groups"][0]["zero"]  # a plan exported before these fields
    old = RunnerPlan.from_dict(data)
    assert old.device == "auto" and old.sync_groups[0].zero == 0


def test_link_emulation_warns_where_per_flow_links_carry_several_node_pairs(caplog: pytest.LogCaptureFixture) -> None:
    """The emulation is one shared pipe per cluster pair and direction: exact for shared_pipe links,
    too slow for per_flow links used by several node pairs (evaluate runs those flows in parallel)."""
    from dataclasses import replace

    inst = runner_instance(gpus_per_cluster=(2, 1))  # two nodes of one GPU per cluster
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", dp=2, mbs=2)]), ((2, 4), [G("b", dp=2, mbs=2)])], m=2),))
    per_flow = replace(inst, topology=replace(inst.topology, links=tuple(
        replace(lk, kind="per_flow", aggregate=None) for lk in inst.topology.links)))
    assert {lk.kind for lk in inst.topology.links} == {"shared_pipe"}
    for instance, emulate, warned in ((inst, "netns", False), (per_flow, "off", False), (per_flow, "netns", True),
                                      (per_flow, "delay", False)):  # emulate: delay emulates per-flow links
        caplog.clear()
        with caplog.at_level("WARNING", logger="hgopt.export.build"):
            rp = build_runner_plan(plan, instance, ExportOptions(emulate_links=emulate))  # type: ignore[arg-type]
        assert ("a->b, b->a are per_flow" in caplog.text) == warned, (emulate, caplog.text)
        assert {lk.bytes_per_s for lk in rp.links} == {instance.topology.link("a", "b").gbyte_s * 1e9}
    one_node = runner_instance(gpus_per_cluster=(1, 2))
    one_node = replace(one_node, topology=replace(one_node.topology, links=tuple(
        replace(lk, kind="per_flow", aggregate=None) for lk in one_node.topology.links)))
    caplog.clear()
    with caplog.at_level("WARNING", logger="hgopt.export.build"):
        build_runner_plan(plan, one_node, ExportOptions(emulate_links="netns"))
    assert not caplog.records  # one node pair: the shared pipe is the per-flow link


def test_link_emulation_warns_where_a_cluster_s_inter_node_traffic_goes_unshaped(caplog: pytest.LogCaptureFixture) -> None:
    """Inside a cluster the emulation shapes nothing: a plan on several nodes of one cluster gets a warning
    (its inter-node transfers and rings are priced at inter_node, emulated at loopback speed); one node each
    or no emulation: none."""
    several = runner_instance(gpus_per_cluster=(2, 1))  # two nodes of one GPU per cluster
    one_node = runner_instance(gpus_per_cluster=(1, 2))
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", dp=2, mbs=2)]), ((2, 4), [G("b", dp=2, mbs=2)])], m=2),))
    for instance, emulate, warned in ((several, "delay", False), (several, "netns", True), (several, "off", False),
                                      (one_node, "delay", False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="hgopt.export.build"):
            build_runner_plan(plan, instance, ExportOptions(emulate_links=emulate))  # type: ignore[arg-type]
        assert ("shapes only the links between clusters (netns; the delay mode emulates node NICs); inside a, b"
                in caplog.text) == warned, (emulate, caplog.text)
