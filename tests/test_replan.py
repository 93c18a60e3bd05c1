"""Re-planning (issue 14): changes parsed and applied to an instance, the migration [M1] priced by hand
on tiny instances, candidates chosen by total time over the horizon, and the ``hgopt replan`` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hgopt.changes import apply_changes, parse_change
from hgopt.cli import main
from hgopt.cost import evaluate
from hgopt.cost.migration import horizon_time, layer_shares, migration
from hgopt.instances import load_instance
from hgopt.plan import Plan, load_plan, validate
from hgopt.search import PlanOptions, PlanResult
from hgopt.search.replan import repairs, replan
from tests.factories import tiny_instance, tiny_model, tiny_topology
from tests.runner_plans import G, pipeline


def _inst(nodes: int = 2, gpn: int = 2):  # type: ignore[no-untyped-def]
    return tiny_instance(global_batch=8, topology=tiny_topology(
        clusters=(("a", "A", nodes, gpn, 40.0), ("b", "B", nodes, gpn, 16.0))))


# ---- changes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ("cluster=a", "expected cluster=NAME:AMOUNT"),
    ("cluster=a:4", "must be signed"),
    ("cluster=a:+0", "changes nothing"),
    ("gpus=a:+2", "expected cluster=NAME"),
    ("link=a-b:2Gbit", "expected a link A>B"),
    ("link=a>a:2Gbit", "two different clusters"),
    ("link=a>b:fast", "expected a bandwidth"),
    ("link=a>b:2parsecs", "expected a bandwidth"),
    ("drop=", "needs a cluster name"),
])
def test_malformed_change_names_itself(text: str, words: str) -> None:
    with pytest.raises(ValueError, match="--change") as exc:
        parse_change(text)
    assert repr(text) in str(exc.value) and words in str(exc.value)


@pytest.mark.parametrize("text, words", [
    ("cluster=c:-2", "unknown cluster 'c'"),
    ("cluster=a:-3", "whole nodes"),
    ("cluster=a:-6", "cannot lose 6"),
    ("link=a>z:1Gbit", "unknown cluster 'z'"),
])
def test_impossible_change_names_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        apply_changes(_inst(), [parse_change(text)])


def test_changes_apply_in_whole_nodes_and_scale_links() -> None:
    inst = _inst()
    lost = apply_changes(inst, [parse_change("cluster=a:-2")])
    assert lost.topology.cluster("a").nodes == 1 and lost.topology.cluster("b").nodes == 2
    gained = apply_changes(inst, [parse_change("cluster=b:+4")])
    assert gained.topology.cluster("b").num_gpus == 8
    gone = apply_changes(inst, [parse_change("cluster=a:-4")])  # 0 GPUs left: dropped, links too
    assert [c.name for c in gone.topology.clusters] == ["b"] and gone.topology.links == ()
    assert apply_changes(inst, [parse_change("drop=b")]).topology.links == ()
    slow = apply_changes(inst, [parse_change("link=a>b:2Gbit")]).topology
    assert slow.link("a", "b").gbyte_s == pytest.approx(0.25)  # 2 Gbit/s = 0.25 GB/s per flow
    assert slow.link("b", "a").gbyte_s == pytest.approx(1.0)  # the other direction untouched (8 Gbit/s)
    both = apply_changes(inst, [parse_change("link=a<>b:x0.5")]).topology
    assert both.link("a", "b").gbyte_s == pytest.approx(0.5) and both.link("b", "a").gbyte_s == pytest.approx(0.5)
    assert both.link("a", "b").latency_s == inst.topology.link("a", "b").latency_s


def test_link_change_scales_the_aggregate_cap_too() -> None:
    inst = load_instance("geo-4r-llama7b")
    lk = next(lk for lk in inst.topology.links if lk.aggregate is not None)
    new = apply_changes(inst, [parse_change(f"link={lk.src}>{lk.dst}:x0.5")]).topology.link_spec(lk.src, lk.dst)
    assert new.aggregate is not None and new.aggregate.gbyte_s == pytest.approx(lk.aggregate.gbyte_s / 2)
    assert new.bandwidth.gbyte_s == pytest.approx(lk.bandwidth.gbyte_s / 2)


# ---- migration [M1] -----------------------------------------------------------------------------------
def _two_stage(split: int, zero: int = 0) -> Plan:
    p = pipeline([((0, split), [G("a", mbs=2)]), ((split, 4), [G("b", mbs=2)])], m=4)
    if zero:
        from dataclasses import replace

        p = replace(p, stages=tuple(replace(s, zero=zero) for s in p.stages))
    return Plan(pipelines=(p,))


def test_moving_one_layer_costs_its_state_over_one_link_by_hand() -> None:
    inst = _inst()
    m = migration(_two_stage(2), _two_stage(3), inst)  # layer 2 moves from b to a
    (f,) = m.flows
    assert (f.src, f.dst, f.layers) == ("b", "a", (2,))
    assert f.param_bytes == 1e6 * 4  # fp32 weights
    assert f.optimizer_bytes == 1e6 * 8  # Adam's two fp32 moments, no masters in fp32 training
    # one flow (one node each side) at 8 Gbit/s = 1 GB/s per flow, 10 ms latency; the 100 Gbit NICs are faster
    assert m.time_s == pytest.approx(0.010 + 12e6 / 1e9)
    assert migration(_two_stage(2), _two_stage(2), inst).flows == ()


def test_zero_sharded_state_moves_by_share() -> None:
    inst = _inst()
    # layers 0-1: ZeRO-1 over two replicas, one in a and one in b: each cluster holds half the moments
    split = Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=1), G("b", mbs=1)]), ((2, 4), [G("b", mbs=2)])], m=4),))
    from dataclasses import replace

    split = replace(split, pipelines=(replace(split.pipelines[0], stages=(
        replace(split.pipelines[0].stages[0], zero=1), split.pipelines[0].stages[1])),))
    shares = layer_shares(split, 4)
    assert shares[0] == {"a": (1.0, 0.5), "b": (1.0, 0.5)} and shares[2] == {"b": (1.0, 1.0)}
    m = migration(split, _two_stage(2), inst)  # layers 0-1 now wholly on a (ZeRO 0): a needs the other half
    (f,) = m.flows
    assert (f.src, f.dst, f.layers) == ("b", "a", (0, 1))
    assert f.param_bytes == 0 and f.optimizer_bytes == pytest.approx(2 * 0.5 * 1e6 * 8)


def test_state_whose_only_holder_was_dropped_comes_from_the_checkpoint() -> None:
    inst = _inst()
    new = apply_changes(inst, [parse_change("drop=b")])
    one = Plan(pipelines=(pipeline([((0, 4), [G("a", mbs=2)])], m=4),))
    m = migration(_two_stage(2), one, new)
    assert m.flows == () and sorted({layer for _, layer, _ in m.from_checkpoint}) == [2, 3]
    assert sum(b for _, _, b in m.from_checkpoint) == pytest.approx(2 * 12e6)


# ---- candidates ---------------------------------------------------------------------------------------
def test_repairs_keep_layer_ranges_and_the_global_batch() -> None:
    inst = _inst()
    wide = Plan(pipelines=(pipeline([((0, 2), [G("a", dp=4, mbs=1)]), ((2, 4), [G("b", dp=2, mbs=2)])], m=2),))
    assert not validate(wide, inst)
    small = apply_changes(inst, [parse_change("cluster=a:-2")])
    (name, fixed), = [r for r in repairs(wide, small) if "replicas" in r[0]]
    assert not validate(fixed, small)
    s0 = fixed.pipelines[0].stages[0]
    assert (s0.start, s0.end, s0.groups[0].dp, s0.groups[0].mbs) == (0, 2, 2, 2)
    two = Plan(pipelines=(pipeline([((0, 4), [G("a", dp=2, mbs=1)])], m=2),
                          pipeline([((0, 4), [G("b", dp=2, mbs=1)])], m=2)))
    gone = apply_changes(inst, [parse_change("drop=b")])
    (name, fixed), = [r for r in repairs(two, gone) if "pipelines" in r[0]]
    assert len(fixed.pipelines) == 1 and fixed.pipelines[0].num_microbatches == 4 and not validate(fixed, gone)
    assert repairs(wide, apply_changes(inst, [parse_change("cluster=b:+4")])) == [("old plan as is", wide)]


def _fixed_planner(plan: Plan):  # type: ignore[no-untyped-def]
    def run(instance, options):  # type: ignore[no-untyped-def]
        return PlanResult(planner="stub", status="heuristic", plan=plan,
                          iteration_time_s=evaluate(plan, instance).iteration_time_s)
    return run


def test_the_horizon_decides_between_moving_and_staying() -> None:
    """Old plan: layers split 2/2 on a slow WAN. The stub planner's plan moves a layer (nonzero
    migration) and is faster per step: a short horizon keeps the old plan, a long one moves."""
    inst = tiny_instance(global_batch=8, model=tiny_model(gpus={"A": 0.01, "B": 0.03}), topology=tiny_topology(
        clusters=(("a", "A", 2, 2, 40.0), ("b", "B", 2, 2, 16.0)), wan_gbit_s=0.08))
    old, new = _two_stage(2), _two_stage(3)
    t_old, t_new = evaluate(old, inst).iteration_time_s, evaluate(new, inst).iteration_time_s
    move = migration(old, new, inst).time_s
    assert t_new < t_old and move > 0
    breakeven = move / (t_old - t_new)
    short, long = max(1, int(breakeven / 2)), int(breakeven * 2) + 1
    for horizon, winner in ((short, "old plan as is"), (long, "stub plan for the new resources")):
        res = replan(old, inst, inst, "stub", _fixed_planner(new), PlanOptions(), horizon)
        assert res.chosen is not None and res.chosen.name == winner, (horizon, breakeven)
        for c in res.candidates:
            assert c.total_s == pytest.approx(horizon_time(c.evaluation.iteration_time_s, c.migration.time_s, horizon))


# ---- CLI ----------------------------------------------------------------------------------------------
def _planned(tmp_path: Path, instance: str = "sailor-het-16+16") -> Path:
    out = tmp_path / "plan.json"
    assert main(["-q", "plan", instance, "--planner", "heuristic", "--why-not-time", "0", "--time-limit", "2",
                 "-o", str(out)]) == 0
    return out


def test_cli_replan_writes_a_valid_plan_for_the_changed_instance(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    plan = _planned(tmp_path)
    inst = load_instance("sailor-het-16+16")
    big = inst.topology.clusters[0]
    lose = f"cluster={big.name}:-{big.num_gpus // 2}"
    capsys.readouterr()
    code = main(["replan", str(plan), "--instance", "sailor-het-16+16", "--change", lose, "--horizon-steps", "100",
                 "-o", str(tmp_path / "new.json"), "--instance-out", str(tmp_path / "new-inst.json"), "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    new_inst = load_instance(tmp_path / "new-inst.json")
    assert new_inst.topology.cluster(big.name).num_gpus == big.num_gpus // 2
    new_plan = load_plan(tmp_path / "new.json")
    assert not validate(new_plan, new_inst) and new_plan.instance == str(tmp_path / "new-inst.json")
    assert sum(p.samples for p in new_plan.pipelines) == inst.job.global_batch
    assert doc["chosen"]["total_time_s"] == min(c["total_time_s"] for c in doc["candidates"])
    assert doc["lower_bound_s"] is None  # the heuristic proves none


def test_cli_replan_with_milp_states_the_bound(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The milp planner states a bound however early its time limit stops it (at worst the cheap and
    relaxation bounds, highs not run): 3 s, not a limit the search would idle out (20 s ran the full 20)."""
    plan = _planned(tmp_path)
    inst = load_instance("sailor-het-16+16")
    a, b = inst.topology.clusters[0].name, inst.topology.clusters[1].name
    capsys.readouterr()
    assert main(["replan", str(plan), "--instance", "sailor-het-16+16", "--change", f"link={a}<>{b}:x0.5",
                 "--planner", "milp", "--time-limit", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["planner"] == "milp" and doc["plan"]["planner"] == "milp"
    assert doc["lower_bound_s"] is not None and 0 < doc["lower_bound_s"] <= doc["chosen"]["iteration_time_s"] + 1e-12
    assert doc["lower_bound_s"] == float(doc["plan"]["meta"]["lower_bound_s"])  # the planner's own bound
    assert doc["horizon_lower_bound_s"] == pytest.approx(doc["lower_bound_s"] * doc["horizon_steps"])


@pytest.mark.parametrize("args, words", [
    (["--change", "cluster=nowhere:-4"], "unknown cluster 'nowhere'"),
    (["--change", "link=x"], "--change 'link=x'"),
    ([], "give at least one --change"),
    (["--change", "drop=b", "--horizon-steps", "0"], "--horizon-steps"),
])
def test_cli_bad_change_exits_2_naming_it(tmp_path: Path, capsys, args: list[str], words: str) -> None:  # type: ignore[no-untyped-def]
    plan = _planned(tmp_path)
    capsys.readouterr()
    assert main(["replan", str(plan), "--instance", "sailor-het-16+16", *args]) == 2
    assert words in capsys.readouterr().err


def test_export_elastic_writes_what_the_elastic_launcher_reads(tmp_path: Path) -> None:
    from hgopt.export.elastic import read_elastic_source

    plan = _planned(tmp_path)
    assert main(["-q", "export", str(plan), "--instance", "sailor-het-16+16", "-o", str(tmp_path / "run"), "--local",
                 "--checkpoint-format", "dcp", "--elastic", "--json"]) == 0
    src = read_elastic_source(tmp_path / "run" / "elastic.json")
    assert src.plan == load_plan(plan) and src.instance.topology == load_instance("sailor-het-16+16").topology
    assert src.export.checkpoint_format == "dcp" and src.export.local
    with pytest.raises(ValueError, match="hgopt export --elastic"):
        read_elastic_source(tmp_path / "missing.json")


def test_lost_clusters_stages_move_to_an_idle_cluster_of_the_same_gpu() -> None:
    inst = tiny_instance(global_batch=8, topology=tiny_topology(
        clusters=(("a", "A", 2, 2, 40.0), ("b", "B", 2, 2, 16.0), ("c", "B", 2, 2, 16.0))))
    old = _two_stage(2)  # layers 0-1 on a, 2-3 on b; c idle
    gone = apply_changes(inst, [parse_change("drop=b")])
    (name, fixed), = [r for r in repairs(old, gone) if "idle" in r[0]]
    assert [(s.start, s.end, s.groups[0].cluster) for s in fixed.pipelines[0].stages] == [(0, 2, "a"), (2, 4, "c")]
    assert not validate(fixed, gone)
    m = migration(old, fixed, gone)  # b's layers had no other holder: they come from the checkpoint
    assert m.flows == () and sorted({layer for _, layer, _ in m.from_checkpoint}) == [2, 3]


def test_migration_egress_is_bytes_times_the_links_price() -> None:
    from dataclasses import replace

    inst = _inst()
    m = migration(_two_stage(2), _two_stage(3), inst)
    assert m.egress_usd(inst) is None  # no prices in the tiny topology
    priced = replace(inst, topology=replace(inst.topology, links=tuple(
        replace(lk, egress_usd_per_gb=0.02 if (lk.src, lk.dst) == ("b", "a") else None) for lk in inst.topology.links)))
    assert m.egress_usd(priced) == pytest.approx(12e6 / 1e9 * 0.02)  # 12 MB of layer 2 from b to a at $0.02/GB


def test_moves_inside_a_cluster_by_hand() -> None:
    """[M1i]: a cluster's added GPUs get their share from the cluster's earlier holders, over NVLink in
    one node and over the node NICs across nodes; a new ZeRO shard count reshuffles every holder."""
    from dataclasses import replace

    inst = _inst()  # 2 nodes x 2 GPUs per cluster; NVLink 100 GB/s, NIC 100 Gbit/s = 12.5 GB/s, no latency
    one = Plan(pipelines=(pipeline([((0, 4), [G("a", dp=1, mbs=2)])], m=4),))
    two = Plan(pipelines=(pipeline([((0, 4), [G("a", dp=2, mbs=1)])], m=4),))
    four = Plan(pipelines=(pipeline([((0, 4), [G("a", dp=4, mbs=1)])], m=2),))
    m = migration(one, two, inst)
    assert m.flows == () and m.inside == (("a", 4 * 1e6 * 12, pytest.approx(48e6 / 100e9)),)
    m = migration(one, four, inst)  # 3 added GPUs on 2 nodes: through the NICs
    assert m.inside == (("a", 3 * 48e6, pytest.approx(3 * 48e6 / 2 / 12.5e9)),)
    zero = replace(two, pipelines=(replace(two.pipelines[0], stages=(replace(two.pipelines[0].stages[0], zero=1),)),))
    m = migration(two, zero, inst)  # shards 1 -> 2: both GPUs keep their weights, take half the moments anew
    assert m.inside == (("a", 2 * 4 * 1e6 * 8 / 2, pytest.approx(32e6 / 100e9)),)
    tp2 = Plan(pipelines=(pipeline([((0, 4), [G("a", tp=2, dp=1, mbs=2)])], m=4),))
    m = migration(two, tp2, inst)  # tp 1 -> 2: both GPUs take their half of weights and moments
    assert m.inside == (("a", 2 * 4 * 1e6 / 2 * 12, pytest.approx(48e6 / 100e9)),)
    assert migration(two, two, inst).inside == ()
