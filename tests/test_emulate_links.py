"""The ``delay`` mode's link model (hgopt/runner/linkemu.py): per-node NICs, per-flow node pairs, an
aggregate cap, shared pipes. Tiny message schedules whose delivery times are computed by hand; the
verdicts are on the times the queues schedule, never on elapsed time. No torch."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace
from pathlib import Path

import pytest

from hgopt.export import ExportOptions, build_runner_plan
from hgopt.export.runner_plan import LinkSpec, NicSpec, RunnerPlan
from hgopt.plan import Plan
from hgopt.runner.linkemu import FileLedger, Hop, LinkEmulator, MemoryLedger, Route, book, reserve
from tests.runner_plans import G, pipeline, runner_instance


def _route(name: str, *hops: tuple[str, float], latency: float = 0.0) -> Route:
    return Route(channel=f"chan:{name}", hops=tuple(Hop(name=h, bytes_per_s=r) for h, r in hops), latency_s=latency)


def test_one_message_takes_its_slowest_hop_plus_latency() -> None:
    state: dict[str, float] = {}
    r = _route("0->1", ("nic-out:0", 100.0), ("pair:0->1", 10.0), ("nic-in:1", 50.0), latency=0.5)
    assert reserve(state, r, 30.0, now=2.0) == pytest.approx(2.0 + 3.0 + 0.5)
    assert state == {"nic-out:0": pytest.approx(2.3), "pair:0->1": pytest.approx(5.0), "nic-in:1": pytest.approx(2.6),
                     "chan:0->1": pytest.approx(5.0)}


def test_per_flow_pairs_run_in_parallel_a_shared_pipe_serialises_them() -> None:
    """Two node pairs send 30 B each at t=0 over a 10 B/s link: per flow, both arrive at 3 s; through
    one shared pipe the second waits for the first (6 s)."""
    state: dict[str, float] = {}
    t1 = reserve(state, _route("0->2", ("pair:0->2", 10.0)), 30.0, 0.0)
    t2 = reserve(state, _route("1->3", ("pair:1->3", 10.0)), 30.0, 0.0)
    assert (t1, t2) == (pytest.approx(3.0), pytest.approx(3.0))
    state = {}
    t1 = reserve(state, _route("0->2", ("agg:a->b", 10.0)), 30.0, 0.0)
    t2 = reserve(state, _route("1->3", ("agg:a->b", 10.0)), 30.0, 0.0)
    assert (t1, t2) == (pytest.approx(3.0), pytest.approx(6.0))


@pytest.mark.parametrize("n, per_flow, cap, makespan", [
    (3, 10.0, 15.0, 6.0),   # cap binds: 3 x 30 B / min(3 x 10, 15) B/s
    (3, 10.0, 45.0, 3.0),   # cap does not bind: 30 B / 10 B/s
    (2, 10.0, 20.0, 3.0),   # exactly at the cap
    (1, 10.0, 5.0, 6.0),    # one flow slower than per flow: the cap
])
def test_n_flows_share_min_n_per_flow_aggregate(n: int, per_flow: float, cap: float, makespan: float) -> None:
    """[C4w] by hand: n concurrent 30 B flows between different node pairs finish together after
    n·30 / min(n·per_flow, aggregate) seconds (the last of them; FIFO on the cap, not processor sharing)."""
    state: dict[str, float] = {}
    ends = [reserve(state, _route(f"{i}->{i + n}", (f"pair:{i}->{i + n}", per_flow), ("agg:a->b", cap)), 30.0, 0.0)
            for i in range(n)]
    assert max(ends) == pytest.approx(makespan)
    assert max(ends) == pytest.approx(n * 30.0 / min(n * per_flow, cap))


def test_ranks_of_one_node_share_its_nic_and_a_channel_keeps_order() -> None:
    state: dict[str, float] = {}
    # ranks 0 and 1 on node 0: NIC 20 B/s; to nodes 1 and 2, per flow 100 B/s
    t1 = reserve(state, _route("0->2", ("nic-out:0", 20.0), ("pair:0->1", 100.0)), 40.0, 0.0)
    t2 = reserve(state, _route("1->3", ("nic-out:0", 20.0), ("pair:0->2", 100.0)), 40.0, 0.0)
    assert (t1, t2) == (pytest.approx(2.0), pytest.approx(4.0))
    # one channel: the second message starts when the first is done, even on a free hop
    state = {}
    r = _route("0->1", ("pair:0->1", 10.0), latency=1.0)
    assert reserve(state, r, 10.0, 0.0) == pytest.approx(2.0)
    assert reserve(state, r, 10.0, 0.5) == pytest.approx(3.0)
    assert reserve(state, r, 10.0, 5.0) == pytest.approx(7.0)  # idle by then: starts at 5
    assert book(state, Hop(name="pair:0->1", bytes_per_s=10.0), 10.0, 0.0) == pytest.approx(7.0)


def _plan_two_node_pairs() -> tuple[RunnerPlan, Plan]:
    """Stage 0: two replicas on two nodes of a; stage 1: two replicas on two nodes of b (one GPU per node)."""
    inst = runner_instance(gpus_per_cluster=(2, 1))
    plan = Plan(pipelines=(pipeline([((0, 2), [G("a", dp=2, mbs=2)]), ((2, 4), [G("b", dp=2, mbs=2)])], m=2),))
    per_flow = replace(inst, topology=replace(inst.topology, links=tuple(
        replace(lk, kind="per_flow", aggregate=lk.bandwidth.scaled(1.5)) for lk in inst.topology.links)))
    return build_runner_plan(plan, per_flow, ExportOptions(emulate_links="delay")), plan


def test_export_carries_kind_cap_and_nics_and_json_round_trips() -> None:
    rp, _ = _plan_two_node_pairs()
    assert {lk.kind for lk in rp.links} == {"per_flow"}
    assert all(lk.aggregate_bytes_per_s == pytest.approx(1.5 * lk.bytes_per_s) for lk in rp.links)
    assert [n.cluster for n in rp.nics] == ["a", "b"] and all(n.bytes_per_s > 0 for n in rp.nics)
    back = RunnerPlan.from_dict(rp.to_dict())
    assert back.links == rp.links and back.nics == rp.nics
    old = rp.to_dict()  # a file written before the link kinds: one shared pipe per direction, no NICs
    del old["nics"]
    for lk in old["links"]:
        del lk["kind"], lk["aggregate_bytes_per_s"]
    legacy = RunnerPlan.from_dict(old)
    assert {lk.kind for lk in legacy.links} == {"shared_pipe"} and legacy.nics == ()
    bad = rp.to_dict()
    bad["links"][0]["kind"] = "pipe"
    with pytest.raises(ValueError, match=r"links\[0\]\.kind: must be one of per_flow, shared_pipe"):
        RunnerPlan.from_dict(bad)


def test_routes_follow_the_plan_s_nodes() -> None:
    """Ranks 0, 1: stage 0 on nodes 0, 1 of a; ranks 2, 3: stage 1 on nodes 2, 3 of b (export order)."""
    rp, _ = _plan_two_node_pairs()
    rp = replace(rp, links=tuple(replace(lk, bytes_per_s=10.0, aggregate_bytes_per_s=15.0, latency_s=0.25)
                                 for lk in rp.links),
                 nics=(NicSpec(cluster="a", bytes_per_s=100.0, latency_s=0.01),
                       NicSpec(cluster="b", bytes_per_s=200.0, latency_s=0.02)))
    emu = LinkEmulator(rp)
    assert [emu.node_of[r] for r in range(4)] == [0, 1, 2, 3]
    r = emu.route(0, 2)
    assert r is not None and r.latency_s == 0.25 and r.channel == "chan:0->2"
    assert [(h.name, h.bytes_per_s) for h in r.hops] == [("nic-out:0", 100.0), ("nic-in:2", 200.0),
                                                        ("pair:0->2", 10.0), ("agg:a->b", 15.0)]
    inside = emu.route(0, 1)  # two nodes of one cluster: their NICs only
    assert inside is not None and [h.name for h in inside.hops] == ["nic-out:0", "nic-in:1"]
    assert inside.latency_s == 0.01
    # both replicas send 30 B at t=0: pairs in parallel (3 s each), the 15 B/s cap serialises: 2 s, 4 s
    state: dict[str, float] = {}
    assert [reserve(state, emu.route(s, d), 30.0, 0.0) for s, d in ((0, 2), (1, 3))] == [  # type: ignore[arg-type]
        pytest.approx(3.25), pytest.approx(4.25)]
    # without NIC figures (an older file) nothing inside a cluster is emulated
    assert LinkEmulator(replace(rp, nics=())).route(0, 1) is None
    # a shared pipe: one hop for the whole direction at the link's rate
    pipe = LinkEmulator(replace(rp, nics=(), links=tuple(replace(lk, kind="shared_pipe", aggregate_bytes_per_s=None)
                                                          for lk in rp.links)))
    hops = [(h.name, h.bytes_per_s) for h in pipe.route(1, 3).hops]  # type: ignore[union-attr]
    assert hops == [("agg:a->b", 10.0)]
    assert pipe.aggregate_hop("a", "b") == Hop(name="agg:a->b", bytes_per_s=10.0)
    assert emu.aggregate_hop("b", "a") == Hop(name="agg:b->a", bytes_per_s=15.0)
    assert LinkEmulator(replace(rp, links=tuple(replace(lk, aggregate_bytes_per_s=None) for lk in rp.links))
                        ).aggregate_hop("a", "b") is None


def _book_in_child(path: str, start: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    ledger = FileLedger(path=Path(path))
    with ledger.open() as state:
        out.put(reserve(state, _route("1->3", ("agg:a->b", 10.0)), 30.0, start))


def test_file_ledger_is_shared_between_processes(tmp_path: Path) -> None:
    """What one process books on the shared pipe, the next one queues behind."""
    path = tmp_path / "ledger.json"
    with FileLedger(path=path).open() as state:
        assert reserve(state, _route("0->2", ("agg:a->b", 10.0)), 30.0, 100.0) == pytest.approx(103.0)
    q: mp.Queue = mp.get_context("spawn").Queue()  # type: ignore[type-arg]
    p = mp.get_context("spawn").Process(target=_book_in_child, args=(str(path), 100.0, q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == pytest.approx(106.0)
    with MemoryLedger().open() as mem:
        assert mem == {}
