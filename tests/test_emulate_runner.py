"""The runner's ``delay`` mode on per-node emulated links (hgopt/runner/linkemu.py through comm.Wire and
the gradient sync): which hops a real run books, and the ring's booking on a shared hop ([C7c]). The
verdicts read the ledger the ranks shared (names and byte counts), not elapsed time."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.export.runner_plan import NicSpec, SyncGroup  # noqa: E402
from hgopt.plan import Plan  # noqa: E402
from hgopt.runner.engine import StageWorker  # noqa: E402
from hgopt.runner.launch import resolve_emulation, run_forked  # noqa: E402
from hgopt.runner.linkemu import LEDGER_FILE, LinkEmulator, MemoryLedger  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from tests.runner_plans import G, pipeline, runner_instance  # noqa: E402


def _per_flow(cap: float | None = 1.5, gpus_per_cluster: tuple[int, int] = (2, 1)):  # type: ignore[no-untyped-def]
    inst = runner_instance(gpus_per_cluster=gpus_per_cluster)
    return replace(inst, topology=replace(inst.topology, links=tuple(
        replace(lk, kind="per_flow", aggregate=None if cap is None else lk.bandwidth.scaled(cap))
        for lk in inst.topology.links)))


def test_a_run_books_every_node_pair_its_nics_and_the_cap(tmp_path: Path) -> None:
    """Stage 0 on nodes 0, 1 of a, stage 1 on nodes 2, 3 of b (one GPU per node): the run's ledger has
    both node pairs in both directions, every node's NIC and the cap of each direction, and no pair
    between replicas that exchange no rows."""
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", dp=2, mbs=2)]), ((2, 4), [G("b", dp=2, mbs=2)])], m=2),))
    rp = build_runner_plan(plan, _per_flow(), ExportOptions(local=True, steps=2, master_port=0, emulate_links="delay",
                                                             link_scale=0.001))
    assert run_forked(rp, tmp_path, emulation="delay", timeout_s=120) == {r: 0 for r in range(4)}
    carried = json.loads((tmp_path / LEDGER_FILE).read_text())["carried"]
    assert {"pair:0->2", "pair:1->3", "pair:2->0", "pair:3->1", "agg:a->b", "agg:b->a"} <= set(carried)
    assert {f"nic-out:{n}" for n in range(4)} | {f"nic-in:{n}" for n in range(4)} <= set(carried)
    assert not set(carried) & {"pair:0->3", "pair:1->2"}
    assert {h for h in carried if h.startswith("chan:")} == {"chan:0->2", "chan:1->3", "chan:2->0", "chan:3->1"}
    # every activation byte the runner counted on the WAN went over the a -> b cap, split over the two pairs
    wan = sum(r["bytes"]["p0.b0.fwd.wan"] for r in read_metrics(tmp_path))
    assert carried["agg:a->b"] == wan == carried["pair:0->2"] + carried["pair:1->3"]
    assert carried["pair:0->2"] == carried["nic-out:0"] == carried["nic-in:2"] == wan / 2  # 2 of 4 rows each


def _stub(rp, rank: int):  # type: ignore[no-untyped-def]
    wire = SimpleNamespace(mode="delay", emulator=LinkEmulator(rp), ledger=MemoryLedger())
    return SimpleNamespace(rp=rp, rank=rank, wire=wire, _rings=0)


def test_a_ring_edge_joins_the_link_s_shared_hop() -> None:
    """[C7c] in the emulation: a two-member ring a <-> b puts its edge's bytes on the cap (4 B/s), shared
    with a pipeline message there; the member in b uses b -> a. Without a cap (per flow only) nothing
    is registered."""
    from hgopt.runner.linkemu import Hop, Route, deliveries, send

    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=2)]), ((2, 4), [G("b", mbs=2)])], m=2),
                           pipeline([((0, 2), [G("b", mbs=2)]), ((2, 4), [G("a", mbs=2)])], m=2)))
    rp = build_runner_plan(plan, _per_flow(), ExportOptions(emulate_links="delay"))
    rp = replace(rp, links=tuple(replace(lk, bytes_per_s=10.0, aggregate_bytes_per_s=4.0) for lk in rp.links))
    sg = next(s for s in rp.sync_groups if s.start == 0)
    a_member, b_member = sg.ranks
    assert (rp.rank_info(a_member).cluster, rp.rank_info(b_member).cluster) == ("a", "b")
    me = _stub(rp, a_member)
    state = me.wire.ledger.state
    send(state, Route(channel="chan:x", hops=(Hop(name="agg:a->b", bytes_per_s=4.0),), latency_s=0.0), 8.0, 0.0)
    import hgopt.runner.engine as engine

    clock = [0.0]
    real = engine.time
    engine.time = SimpleNamespace(time=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))  # type: ignore[assignment]
    try:
        done = StageWorker._ring_on_shared(me, sg, 8.0)
        assert done is not None
        assert done() == pytest.approx(4.0)  # 8 B + 8 B at 4 B/s shared: both through at 4 s
    finally:
        engine.time = real
    assert deliveries([(Route(channel="r", hops=(Hop(name="agg:a->b", bytes_per_s=4.0),), latency_s=0.0), 8.0, 0.0)]) \
        == [pytest.approx(2.0)]  # alone: 2 s
    other = _stub(rp, b_member)
    assert StageWorker._ring_on_shared(other, sg, 8.0) is not None
    assert [m["hops"] for m in other.wire.ledger.state["msgs"].values()] == [[["agg:b->a", 4.0]]]
    uncapped = _stub(replace(rp, links=tuple(replace(lk, aggregate_bytes_per_s=None) for lk in rp.links)), a_member)
    assert StageWorker._ring_on_shared(uncapped, sg, 8.0) is None and uncapped.wire.ledger.state == {}


def test_a_ring_over_several_nodes_of_one_cluster_runs_at_the_nic() -> None:
    """Inside one cluster: a group on two nodes rings at the node NIC's figure, on one node it is not
    emulated; across clusters the slowest link's (unchanged)."""
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", dp=2, mbs=2)]), ((2, 4), [G("b", dp=2, mbs=2)])], m=2),))
    for gpus, emulated in (((2, 1), True), ((1, 2), False)):  # two one-GPU nodes / one two-GPU node
        rp = build_runner_plan(plan, _per_flow(gpus_per_cluster=gpus), ExportOptions(emulate_links="delay"))
        rp = replace(rp, nics=(NicSpec(cluster="a", bytes_per_s=7.0, latency_s=0.5),
                               NicSpec(cluster="b", bytes_per_s=9.0, latency_s=0.5)))
        sg = next(s for s in rp.sync_groups if s.start == 0)
        assert sg.clusters == ("a",)
        got = StageWorker._emulated_link(_stub(rp, sg.ranks[0]), sg)
        assert got == ((7.0, 0.5) if emulated else None)
    cross = SyncGroup(start=0, end=2, ranks=(0, 2), clusters=("a", "b"))
    assert StageWorker._emulated_link(_stub(rp, 0), cross) == (min(lk.bytes_per_s for lk in rp.links),
                                                               max(lk.latency_s for lk in rp.links))


def test_one_cluster_on_several_nodes_is_emulated_in_delay_mode_only() -> None:
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=2)]), ((2, 4), [G("a", mbs=2)])], m=4),))
    rp = build_runner_plan(plan, _per_flow(), ExportOptions(emulate_links="delay"))
    assert len(rp.clusters) == 1 and len(rp.nodes) == 2 and rp.nics
    assert resolve_emulation("delay", rp) == "delay"
    assert resolve_emulation("off", rp) == "off"
    assert resolve_emulation("delay", replace(rp, nics=())) == "off"  # an older file: nothing to emulate
    assert resolve_emulation("netns", rp) == "off"
