"""The link model (hgopt/cost/links.py, formulations/cost_model.md [C1], [C4], [C4w], [C5]): per-flow
bandwidth, aggregate caps, shared node NICs, the topology format and its legacy reading."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import stage_boundary_time
from hgopt.cost.links import aggregate_rate, flow_rate, flows_time, link_time_lower_bound, max_rate_from
from hgopt.errors import SpecError
from hgopt.instances import load_instance
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Bandwidth, Link, instance_from_dict, topology_from_dict, topology_to_dict
from tests.factories import tiny_instance, tiny_model, tiny_topology

GB = 1e9


def _link(per_flow_gbyte_s: float, aggregate_gbyte_s: float | None, latency_s: float = 0.0) -> Link:
    agg = None if aggregate_gbyte_s is None else Bandwidth(gbyte_s=aggregate_gbyte_s)
    return Link(src="a", dst="b", bandwidth=Bandwidth(gbyte_s=per_flow_gbyte_s, latency_s=latency_s), aggregate=agg)


# ---- pure functions: n flows sharing an aggregate cap -----------------------------------------------
def test_n_flows_share_an_aggregate_cap_by_hand() -> None:
    # per flow 1 GB/s, cap 3 GB/s: 2 flows move 2 GB/s (1 each), 4 flows 3 GB/s (0.75 each).
    assert aggregate_rate(1e9, 2, 3e9) == 2e9 and flow_rate(1e9, 2, 3e9) == 1e9
    assert aggregate_rate(1e9, 4, 3e9) == 3e9 and flow_rate(1e9, 4, 3e9) == 0.75e9
    assert aggregate_rate(1e9, 4, None) == 4e9  # no cap: per-node NICs only
    link = _link(1.0, 3.0, latency_s=0.01)
    x = 1e9  # each flow 1 GB
    assert flows_time(link, x, 2 * x) == pytest.approx(0.01 + 1.0)  # per flow binds
    assert flows_time(link, x, 4 * x) == pytest.approx(0.01 + 1.0 / 0.75)  # the cap binds: 4/3 s
    assert flows_time(_link(1.0, None, 0.01), x, 4 * x) == pytest.approx(0.01 + 1.0)


def test_lower_bound_is_below_every_spread_of_the_bytes() -> None:
    link = _link(1.0, 3.0, latency_s=0.01)
    x = 4e9  # one boundary's bytes, at most 4 flows
    lb = link_time_lower_bound(link, x, 4, x)
    for flows in range(1, 5):  # any even spread over 1..4 node pairs
        assert lb <= flows_time(link, x / flows, x) + 1e-12
    assert lb == pytest.approx(0.01 + max(1.0, 4.0 / 3.0))


def test_max_rate_from_is_the_best_rate_at_or_above_a_size() -> None:
    curve = Bandwidth(gbyte_s=6.0, curve=(-0.0367, 0.477, 4.559))  # Sailor's A100 4-GPU VM-pair fit
    from hgopt.cost.tables import bandwidth_bytes_per_s

    for x in (1e5, 8e6, 64e6, 1e9):
        best = max(bandwidth_bytes_per_s(curve, x * 2 ** (k / 8)) for k in range(0, 200))
        assert max_rate_from(curve, x) >= best - 1e-6


# ---- topology format ----------------------------------------------------------------------------------
def _two_region_topology(link: dict[str, Any], gpn: int = 1, nodes: int = 4, inter_gbit: float = 100.0) -> dict[str, Any]:
    topo = tiny_topology(clusters=(("a", "A", nodes, gpn, 40.0), ("b", "B", nodes, gpn, 40.0)))
    for c in topo["clusters"]:
        c["inter_node"] = {"gbit_s": inter_gbit}
    topo["links"] = {"pairs": [{"src": "a", "dst": "b", **link}]}
    return topo


PER_FLOW = {"kind": "per_flow", "per_flow": {"gbit_s": 8, "latency_ms": 10}, "aggregate": {"gbit_s": 24},
            "source": "test"}


def test_per_flow_link_reads_and_round_trips() -> None:
    t = topology_from_dict(_two_region_topology(PER_FLOW))
    lk = t.link_spec("a", "b")
    assert lk.kind == "per_flow" and lk.source == "test"
    assert lk.bandwidth == Bandwidth(gbyte_s=1.0, latency_s=0.01)
    assert lk.aggregate == Bandwidth(gbyte_s=3.0)
    assert t.link_spec("b", "a") == Link(src="b", dst="a", bandwidth=lk.bandwidth, aggregate=lk.aggregate,
                                         kind="per_flow", source="test")
    assert topology_from_dict(topology_to_dict(t)) == t


def test_legacy_link_is_one_shared_pipe_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hgopt.spec"):
        t = topology_from_dict(tiny_topology(), source="legacy.yaml", path="topology")
    lk = t.link_spec("a", "b")
    assert lk.kind == "shared_pipe" and lk.aggregate == lk.bandwidth == Bandwidth(gbyte_s=1.0, latency_s=0.01)
    assert any("legacy.yaml" in r.getMessage() and "topology.links.default" in r.getMessage()
               and "ONE SHARED PIPE" in r.getMessage() for r in caplog.records)
    assert topology_from_dict(topology_to_dict(t)) == t  # written back with an explicit kind


def test_legacy_pipe_prices_as_before() -> None:
    """Two pipelines a -> b over a legacy 8 Gbit/s link: their 2 x 2 samples share one pipe,
    latency + 4 MB / 1 GB/s ([C4w] as it was), whatever the per-flow spread."""
    inst = tiny_instance(global_batch=16)
    pipe = Pipeline(stages=(Stage(start=0, end=2, groups=(ReplicaGroup(cluster="a", dp=2),)),
                            Stage(start=2, end=4, groups=(ReplicaGroup(cluster="b", dp=2),))), num_microbatches=4)
    ev = evaluate(Plan(pipelines=(pipe, pipe)), inst)
    assert ev.stages[0].send_fwd_s == pytest.approx(0.010 + 4 * 1e6 / 1e9)


def test_same_region_clusters_default_to_per_node_nics() -> None:
    topo = tiny_topology()
    topo["clusters"][1]["region"] = topo["clusters"][0]["region"]
    topo["clusters"][1]["inter_node"] = {"gbit_s": 50}
    topo["links"] = {}
    t = topology_from_dict(topo)
    lk = t.link_spec("a", "b")
    assert lk.kind == "per_flow" and lk.aggregate is None and lk.bandwidth == Bandwidth(gbyte_s=50 / 8)


def _set(body: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    node = out
    for k in path[:-1]:
        node = node.setdefault(k, {})
    if value is None:
        node.pop(path[-1])
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (_set(PER_FLOW, ["kind"], "pipe"), "topology.links.pairs[0].kind", "must be one of per_flow, shared_pipe"),
        (_set(PER_FLOW, ["aggregate", "latency_ms"], 5), "topology.links.pairs[0].aggregate.latency_ms", "unknown field"),
        (_set(PER_FLOW, ["aggregate", "gbit_s"], -1), "topology.links.pairs[0].aggregate.gbit_s", "> 0"),
        (_set(PER_FLOW, ["aggregate", "gbyte_s"], 1), "topology.links.pairs[0].aggregate", "exactly one"),
        (_set(PER_FLOW, ["gbit_s"], 10), "topology.links.pairs[0].gbit_s", "under `per_flow:`"),
        (_set(PER_FLOW, ["per_flow"], None), "topology.links.pairs[0].per_flow", "required"),
        (_set(PER_FLOW, ["per_flow", "gbit_s"], 0), "topology.links.pairs[0].per_flow.gbit_s", "> 0"),
        ({"kind": "shared_pipe", "gbit_s": 1, "aggregate": {"gbit_s": 2}}, "topology.links.pairs[0].aggregate",
         "only with kind: per_flow"),
        ({"kind": "shared_pipe"}, "topology.links.pairs[0]", "give a bandwidth"),
        (_set(PER_FLOW, ["egress_usd_per_gb"], -0.1), "topology.links.pairs[0].egress_usd_per_gb", ">= 0"),
    ],
)
def test_bad_link_fields_name_the_field(body: dict[str, Any], field: str, words: str) -> None:
    data = {"name": "x", "model": tiny_model(), "topology": _two_region_topology(body),
            "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}
    with pytest.raises(SpecError) as err:
        instance_from_dict(data, source="bad.yaml")
    assert err.value.source == "bad.yaml" and err.value.field == field and words in str(err.value)


# ---- evaluate: node-pair flows, caps and NICs --------------------------------------------------------
def _two_stage(dp: int, cluster_b: str = "b", mbs: int = 1, tp: int = 1) -> Pipeline:
    return Pipeline(stages=(Stage(start=0, end=2, groups=(ReplicaGroup(cluster="a", dp=dp, mbs=mbs, tp=tp),)),
                            Stage(start=2, end=4, groups=(ReplicaGroup(cluster=cluster_b, dp=dp, mbs=mbs, tp=tp),))),
                    num_microbatches=1)


@pytest.mark.parametrize(("dp", "expected"), [
    # tiny_model: 1e6 bytes per sample. One GPU per node: dp flows of 1 MB each; per flow 1 GB/s,
    # cap 3 GB/s, NICs 12.5 GB/s. 2 flows: 10 ms + 1 ms (per flow); 4 flows: 10 ms + 4 MB / 3 GB/s.
    (1, 0.010 + 1e6 / 1e9),
    (2, 0.010 + 1e6 / 1e9),
    (4, 0.010 + 4e6 / 3e9),
])
def test_cross_cluster_boundary_is_per_flow_capped_by_the_aggregate(dp: int, expected: float) -> None:
    inst = instance_from_dict({"name": "x", "model": tiny_model(), "topology": _two_region_topology(PER_FLOW),
                               "job": {"global_batch": dp, "seq_len": 128, "precision": "fp32"}})
    fwd, bwd = stage_boundary_time(inst, build_tables(inst), _two_stage(dp), 0)
    assert fwd == pytest.approx(expected) and bwd == pytest.approx(expected)


def test_gpus_of_one_node_share_its_nic() -> None:
    """Four replicas of stage 0 on one node (4 GPUs/node) push 4 MB through one 12.5 GB/s NIC; with one
    GPU per node each replica has a NIC of its own. Same cluster, so only NICs matter."""
    one_per_node = tiny_instance(global_batch=4, topology=tiny_topology(clusters=(("a", "A", 8, 1, 40.0), ("b", "B", 2, 2, 16.0))))
    four_per_node = tiny_instance(global_batch=4, topology=tiny_topology(clusters=(("a", "A", 2, 4, 40.0), ("b", "B", 2, 2, 16.0))))
    nic = 100e9 / 8
    for inst, expected in ((one_per_node, 1e6 / nic), (four_per_node, 4e6 / nic)):
        fwd, bwd = stage_boundary_time(inst, build_tables(inst), _two_stage(4, cluster_b="a"), 0)
        assert fwd == pytest.approx(expected) and bwd == pytest.approx(expected)


def test_tensor_parallel_rings_share_the_nic() -> None:
    """dp 2 replicas of tp 2 on two nodes of 2 GPUs: the 2 shard rings cross each node's NIC together,
    each at half of it: ring(2 MB·2 layers / 2 shards... ) = 2(n-1)/n · shard / (NIC/2)."""
    inst = tiny_instance(global_batch=2, topology=tiny_topology(clusters=(("a", "A", 2, 2, 40.0), ("b", "B", 2, 2, 16.0))))
    plan = Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster="a", dp=2, tp=2),)),),
                                    num_microbatches=1),))
    ev = evaluate(plan, inst)
    shard = 4 * 1e6 * 4 / 2  # 4 layers x 1e6 params x 4 bytes, half per tp shard
    nic = 100e9 / 8
    assert ev.stages[0].sync_s == pytest.approx(2 * 1 / 2 * shard / (nic / 2))


# ---- Sailor's setups: traffic spread over many node pairs is priced per flow ---------------------------
def _curve_rate(bw: Bandwidth, nbytes: float) -> float:
    """[C1] by hand: c0·u² + c1·u + c2 GB/s at u = log2(bytes / 1e6), clamped to [1 %, 100 %] of the max."""
    c0, c1, c2 = bw.curve  # type: ignore[misc]
    u = min(max(math.log2(nbytes / 1e6), -10.0), 14.0)
    return min(max(c0 * u * u + c1 * u + c2, 0.01 * bw.gbyte_s), bw.gbyte_s) * 1e9


@pytest.mark.parametrize(("name", "a", "b", "dp"), [
    ("sailor-het-32+96", "A100-40@us-central1-a", "V100-16@us-central1-a", 32),
    ("sailor-geo-5x80", "A100-40@us-central1-a", "A100-40@us-west1-b", 64),
])
def test_spread_cross_cluster_traffic_is_priced_per_flow(name: str, a: str, b: str, dp: int) -> None:
    """One pipeline of two stages, dp replicas (mbs 1) in a then in b, 4 GPUs per VM: dp/4 node pairs
    each carry 4 samples. Time = the slowest of one flow (4 samples at the per-flow curve) and each end's
    NIC (4 samples at its inter-node curve); no aggregate cap on Sailor's links. The old model put all dp
    samples through one pipe."""
    inst = load_instance(name)
    tables = build_tables(inst)
    pipe = Pipeline(stages=(Stage(start=0, end=13, groups=(ReplicaGroup(cluster=a, dp=dp),)),
                            Stage(start=13, end=26, groups=(ReplicaGroup(cluster=b, dp=dp),))),
                    num_microbatches=inst.job.global_batch // dp)
    x = float(tables.activation_bytes[12])  # bytes of one sample at the cut (2048 x 1024 fp32)
    assert x == 2048 * 1024 * 4
    topo = inst.topology
    lk = topo.link_spec(a, b)
    assert lk.kind == "per_flow" and lk.aggregate is None and "Sailor" in lk.source
    assert topo.cluster(a).gpus_per_node == topo.cluster(b).gpus_per_node == 4
    flow = 4 * x
    expected = max(flow / _curve_rate(lk.bandwidth, flow),
                   flow / _curve_rate(topo.cluster(a).inter_node, flow),
                   flow / _curve_rate(topo.cluster(b).inter_node, flow))
    fwd, _ = stage_boundary_time(inst, tables, pipe, 0)
    assert fwd == pytest.approx(expected, rel=1e-9)
    one_pipe = dp * x / _curve_rate(lk.bandwidth, dp * x)  # [C4w] before: every sample through one pipe
    assert fwd < one_pipe / 4
    ev = evaluate(Plan(pipelines=(pipe,)), inst)
    assert ev.stages[0].send_fwd_s == pytest.approx(expected, rel=1e-9)


def test_show_prints_each_links_kind_per_flow_and_cap() -> None:
    from hgopt.commands.show import describe

    het = describe(load_instance("sailor-het-32+96"))
    assert "A100-40@us-central1-a  V100-16@us-central1-a  per_flow" in het and "none (per-node NICs)" in het
    assert "multizone_bandwidths_het.json" in het  # the citation
    geo = describe(load_instance("geo-3r-gpt1.3b"))
    row = next(line for line in geo.splitlines() if line.startswith("us-east-h100-80") and "eu-west-a100-80" in line)
    assert "per_flow" in row and "5 Gbit/s" in row and "59.6 ms" in row
    assert "Amazon EC2 instance network bandwidth" in geo
    legacy = describe(tiny_instance())
    assert "shared_pipe" in legacy and "(one pipe = per flow)" in legacy


@pytest.mark.parametrize(("gpn", "nodes", "expected"), [
    (4, 1, 0.010 + 4e6 / 1e9),  # 4 pipelines' stages on one node each side: one node pair carries 4 MB
    (1, 4, 0.010 + 1e6 / 1e9),  # one GPU per node: 4 node pairs of 1 MB each
])
def test_identical_pipelines_share_nodes(gpn: int, nodes: int, expected: float) -> None:
    """4 identical pipelines a -> b, one GPU per stage, per flow 1 GB/s and no cap: the copies' replicas
    are packed onto nodes together (as the runner places them), so with 4 GPUs per node their 4
    samples travel as one node-pair flow."""
    link = {"kind": "per_flow", "per_flow": {"gbit_s": 8, "latency_ms": 10}}
    inst = instance_from_dict({"name": "x", "model": tiny_model(),
                               "topology": _two_region_topology(link, gpn=gpn, nodes=nodes, inter_gbit=800.0),
                               "job": {"global_batch": 4, "seq_len": 128, "precision": "fp32"}})
    pipe = _two_stage(1)
    ev = evaluate(Plan(pipelines=(pipe,) * 4), inst)
    assert ev.stages[0].send_fwd_s == pytest.approx(expected)
    assert stage_boundary_time(inst, build_tables(inst), pipe, 0, copies=4)[0] == pytest.approx(expected)


def test_every_shipped_instance_states_and_cites_its_links() -> None:
    """No shipped instance relies on the legacy reading: every link is per_flow with a citation."""
    from hgopt.instances import list_instances

    for entry in list_instances():
        inst = load_instance(entry.name)
        for lk in inst.topology.links:
            assert lk.kind == "per_flow", (entry.name, lk.src, lk.dst)
            assert lk.source, (entry.name, lk.src, lk.dst)


@pytest.mark.parametrize("seed", range(40))
def test_handover_lower_bound_is_below_evaluate(seed: int) -> None:
    """The MILP/relaxation's hand-over bound (links.handover_lower_bound, as blocks.arc_times calls it)
    never exceeds evaluate's boundary time of any uniform hand-over of k identical pipelines."""
    import random

    from hgopt.cost.links import handover_lower_bound

    rng = random.Random(seed)
    gpn = rng.choice([1, 2, 4])
    nodes = rng.choice([1, 2, 4])
    link = {"kind": "per_flow", "per_flow": {"gbit_s": rng.choice([1, 8, 40]), "latency_ms": rng.choice([0, 5])}}
    if rng.random() < 0.5:
        link["aggregate"] = {"gbit_s": rng.choice([2, 10, 100])}
    topo = _two_region_topology(link, gpn=gpn, nodes=nodes, inter_gbit=rng.choice([10.0, 100.0]))
    tps = [t for t in (1, 2) if gpn % t == 0]
    tp_a, tp_b = rng.choice(tps), rng.choice(tps)
    total = gpn * nodes
    k = rng.choice([1, 2]) if total >= 4 else 1
    dp_a = rng.randint(1, max(1, total // (tp_a * k)))
    mbs_a = rng.choice([1, 2])
    B = dp_a * mbs_a
    divisors = [d for d in range(1, B + 1) if B % d == 0 and d * tp_b * k <= total]
    dp_b = rng.choice(divisors)
    inst = instance_from_dict({"name": "x", "model": tiny_model(), "topology": topo,
                               "job": {"global_batch": k * B, "seq_len": 128, "precision": "fp32"}})
    pipe = Pipeline(stages=(Stage(start=0, end=2, groups=(ReplicaGroup(cluster="a", dp=dp_a, mbs=mbs_a, tp=tp_a),)),
                            Stage(start=2, end=4, groups=(ReplicaGroup(cluster="b", dp=dp_b, mbs=B // dp_b, tp=tp_b),))),
                    num_microbatches=1)
    fwd, bwd = stage_boundary_time(inst, build_tables(inst), pipe, 0, copies=k)
    t = inst.topology
    x = B * 1e6
    lb_f = handover_lower_bound(t.link_spec("a", "b"), t.cluster("a").inter_node, t.cluster("b").inter_node,
                                x, k * x, B, nodes, nodes, k)
    lb_b = handover_lower_bound(t.link_spec("b", "a"), t.cluster("b").inter_node, t.cluster("a").inter_node,
                                x, k * x, B, nodes, nodes, k)
    assert lb_f <= fwd * (1 + 1e-12) and lb_b <= bwd * (1 + 1e-12)
