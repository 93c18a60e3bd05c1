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
from hgopt.runner.linkemu import FileLedger, Hop, LinkEmulator, MemoryLedger, Route, deliveries, poll, send, wait_arrival
from tests.runner_plans import G, pipeline, runner_instance


def _route(name: str, *hops: tuple[str, float], latency: float = 0.0) -> Route:
    return Route(channel=f"chan:{name}", hops=tuple(Hop(name=h, bytes_per_s=r) for h, r in hops), latency_s=latency)


def test_one_message_takes_its_slowest_hop_plus_latency() -> None:
    r = _route("0->1", ("nic-out:0", 100.0), ("pair:0->1", 10.0), ("nic-in:1", 50.0), latency=0.5)
    assert deliveries([(r, 30.0, 2.0)]) == [pytest.approx(2.0 + 3.0 + 0.5)]


def test_per_flow_pairs_run_in_parallel_a_shared_pipe_shares_its_rate() -> None:
    """Two node pairs send 30 B each at t=0 over a 10 B/s link: per flow, both arrive at 3 s; through
    one shared pipe they share it (5 B/s each) and both arrive at 6 s."""
    pairs = deliveries([(_route("0->2", ("pair:0->2", 10.0)), 30.0, 0.0), (_route("1->3", ("pair:1->3", 10.0)), 30.0, 0.0)])
    assert pairs == [pytest.approx(3.0), pytest.approx(3.0)]
    pipe = deliveries([(_route("0->2", ("agg:a->b", 10.0)), 30.0, 0.0), (_route("1->3", ("agg:a->b", 10.0)), 30.0, 0.0)])
    assert pipe == [pytest.approx(6.0), pytest.approx(6.0)]


@pytest.mark.parametrize("n, per_flow, cap, each", [
    (3, 10.0, 15.0, 6.0),   # cap binds: 30 B at min(10, 15 / 3) = 5 B/s
    (3, 10.0, 45.0, 3.0),   # cap does not bind: 30 B at 10 B/s
    (2, 10.0, 20.0, 3.0),   # exactly at the cap
    (1, 10.0, 5.0, 6.0),    # one flow, cap below per flow
])
def test_n_flows_share_min_n_per_flow_aggregate(n: int, per_flow: float, cap: float, each: float) -> None:
    """[C4w] by hand: n concurrent 30 B flows between different node pairs move at
    min(per_flow, aggregate / n) each, min(n·per_flow, aggregate) together."""
    got = deliveries([(_route(f"{i}->{i + n}", (f"pair:{i}->{i + n}", per_flow), ("agg:a->b", cap)), 30.0, 0.0)
                      for i in range(n)])
    assert got == [pytest.approx(each)] * n
    assert each == pytest.approx(n * 30.0 / min(n * per_flow, cap))


def test_a_later_message_shares_the_rest_and_the_first_speeds_up_when_it_ends() -> None:
    """Pipe 10 B/s: A (30 B) at t=0 runs alone until t=1 (20 B left); B (10 B) joins, both at 5 B/s:
    B ends at t=3, A (10 B left) alone again at 10 B/s ends at t=4; latency 0.5 on top."""
    a, b = _route("0->2", ("agg:a->b", 10.0), latency=0.5), _route("1->3", ("agg:a->b", 10.0), latency=0.5)
    assert deliveries([(a, 30.0, 0.0), (b, 10.0, 1.0)]) == [pytest.approx(4.5), pytest.approx(3.5)]
    state: dict[str, object] = {}
    first = send(state, a, 30.0, 0.0)
    send(state, b, 10.0, 1.0)
    # A would need 4 s more at its present share, but B's end (2 s on) speeds it up: look again then
    assert poll(state, first, 1.0) == (None, pytest.approx(2.0))


def test_ranks_of_one_node_share_its_nic_and_a_channel_keeps_order() -> None:
    # ranks 0 and 1 on node 0 (NIC out 20 B/s), to nodes 1 and 2 at 100 B/s per flow: 10 B/s each
    got = deliveries([(_route("0->2", ("nic-out:0", 20.0), ("pair:0->1", 100.0)), 40.0, 0.0),
                      (_route("1->3", ("nic-out:0", 20.0), ("pair:0->2", 100.0)), 40.0, 0.0)])
    assert got == [pytest.approx(4.0), pytest.approx(4.0)]
    # one channel: the second message is in flight from the end of the first, the third from its send
    r = _route("0->1", ("pair:0->1", 10.0), latency=1.0)
    assert deliveries([(r, 10.0, 0.0), (r, 10.0, 0.5), (r, 10.0, 5.0)]) == [
        pytest.approx(2.0), pytest.approx(3.0), pytest.approx(7.0)]


def test_poll_reports_in_flight_then_the_arrival_and_forgets_it() -> None:
    state: dict[str, object] = {}
    r = _route("0->1", ("pair:0->1", 10.0), latency=1.0)
    first, second = send(state, r, 20.0, 0.0), send(state, r, 10.0, 0.0)
    assert poll(state, first, 1.0) == (None, pytest.approx(1.0))  # 10 B left at 10 B/s
    assert poll(state, second, 1.0) == (None, pytest.approx(1.0))  # behind the first: the next event is its end
    assert poll(state, first, 0.5) == (None, pytest.approx(1.0))  # an older clock: taken at the ledger's time
    arrival, _ = poll(state, first, 2.5)
    assert arrival == pytest.approx(3.0)
    assert str(first) not in state["msgs"]  # type: ignore[operator]
    assert poll(state, second, 10.0)[0] == pytest.approx(4.0)
    clock = iter([10.0, 10.5, 11.5])  # wait_arrival looks again at each next event until the ledger has it
    third = send(state, r, 10.0, 10.0)
    slept: list[float] = []
    with MemoryLedger(state=state).open() as same:  # type: ignore[arg-type]
        assert same is state
    assert wait_arrival(MemoryLedger(state=state), third, lambda: next(clock), slept.append,  # type: ignore[arg-type]
                        poll_s=5.0) == pytest.approx(12.0)
    assert slept == [pytest.approx(1.0), pytest.approx(0.5)]  # until the next event: the message's end


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
    # both replicas send 30 B at t=0: pairs 10 B/s, the 15 B/s cap shared: 7.5 B/s each, 4 s (+ 0.25)
    assert deliveries([(emu.route(s, d), 30.0, 0.0) for s, d in ((0, 2), (1, 3))]) == [  # type: ignore[misc]
        pytest.approx(4.25), pytest.approx(4.25)]
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
        i = send(state, _route("1->3", ("agg:a->b", 10.0)), 30.0, start)
        out.put(poll(state, i, start + 100.0)[0])


def test_file_ledger_is_shared_between_processes(tmp_path: Path) -> None:
    """A message another process registered shares the pipe with this one's: both end at 6 s."""
    path = tmp_path / "ledger.json"
    with FileLedger(path=path).open() as state:
        mine = send(state, _route("0->2", ("agg:a->b", 10.0)), 30.0, 100.0)
    q: mp.Queue = mp.get_context("spawn").Queue()  # type: ignore[type-arg]
    p = mp.get_context("spawn").Process(target=_book_in_child, args=(str(path), 100.0, q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == pytest.approx(106.0)
    with FileLedger(path=path).open() as state:
        assert poll(state, mine, 200.0)[0] == pytest.approx(106.0)
