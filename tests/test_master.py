"""The certificate over data parallelism across cluster groups (``hgopt.search.master``): the grouped
bound never exceeds any grouped plan found by brute force over groupings, batch shares and group plans
on tiny instances, nor any plan of any planner; the exact planner reports min(k-identical, grouped)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Plan
from hgopt.search import PlanOptions, get_planner
from hgopt.search.exact import plan_exact
from hgopt.search.groups import rate_bound, sub_instance, wan_allreduce_floor
from hgopt.search.hierarchical import Skeleton, realize
from hgopt.search.master import (GroupedBound, certify, cross_floor, gradient_floor, grouped_bound, min_gradient_bytes,
                                 partitions)
from hgopt.search.milp import batch_splits, link_policy
from hgopt.spec import Instance
from tests.factories import compositions, tiny_instance, tiny_model, tiny_topology


def _instance(seed: int) -> Instance:
    rng = random.Random(seed)
    gpus = {"A": rng.choice([0.01, 0.02]), "B": rng.choice([0.01, 0.03])}
    names = (("a", "A"), ("b", "B"), ("c", "A"))[: 2 + seed % 2]
    clusters = tuple((n, g, 1, rng.choice([2, 4]), rng.choice([16.0, 40.0])) for n, g in names)
    return tiny_instance(
        global_batch=8,
        model=tiny_model(num_layers=4, gpus=gpus, params=rng.choice([1e6, 3e7]),
                         activation_bytes=rng.choice([1e6, 3e7])),
        topology=tiny_topology(clusters=clusters, wan_gbit_s=rng.choice([1.0, 10.0]),
                               wan_latency_ms=rng.choice([1.0, 20.0])),
    )


def _group_plans(inst: Instance, group: tuple[str, ...], share: int) -> list[Plan]:
    """Every k-identical plan the heuristic's realisation gives on the group's sub-instance with this
    share: every split of the share, every ordered subset of the group's clusters, every layer split."""
    sub = sub_instance(inst, group, share)
    tables = build_tables(sub)
    L = inst.model.num_layers
    out = []
    for sp in batch_splits(sub):
        for r in range(1, len(group) + 1):
            for order in itertools.permutations(group, r):
                for layers in compositions(L, r):
                    plan = realize(sub, tables, Skeleton(pipelines=sp.k, microbatch=sp.microbatch, order=order,
                                                         layers=layers))
                    if plan is not None and evaluate(plan, sub, tables).feasible:
                        out.append(plan)
    return out


def _brute_force_grouped(inst: Instance, precisions: tuple[str, ...] = ("native", "bf16")) -> float:
    """The best evaluate over grouped plans: every partition into >= 2 groups, every batch share
    vector, every combination of each group's plans (at most 3 per group and share, the fastest
    on the group alone, and the slowest for variety), gradients across groups in each of ``precisions``."""
    tables = build_tables(inst)
    names = [c.name for c in inst.topology.clusters]
    G = inst.job.global_batch
    best = math.inf
    memo: dict[tuple[tuple[str, ...], int], list[Plan]] = {}
    for part in partitions(names):
        if len(part) < 2:
            continue
        for shares in itertools.product(range(1, G), repeat=len(part)):
            if sum(shares) != G:
                continue
            choices = []
            for g, b in zip(part, shares):
                if (g, b) not in memo:
                    sub = sub_instance(inst, g, b)
                    plans = sorted(_group_plans(inst, g, b), key=lambda p: evaluate(p, sub).iteration_time_s)
                    memo[(g, b)] = plans[:2] + plans[-1:] if len(plans) > 3 else plans
                choices.append(memo[(g, b)])
            for combo in itertools.product(*choices):
                pipes = tuple(p for plan in combo for p in plan.pipelines)
                for prec in precisions:
                    ev = evaluate(Plan(pipelines=pipes, grad_sync_precision=prec), inst, tables)  # type: ignore[arg-type]
                    if ev.feasible:
                        best = min(best, ev.iteration_time_s)
    return best


def test_partitions_are_every_set_partition_once() -> None:
    for n, bell in ((1, 1), (2, 2), (3, 5), (4, 15), (5, 52), (6, 203)):
        items = [f"c{i}" for i in range(n)]
        got = list(partitions(items))
        assert len(got) == bell
        canon = {frozenset(frozenset(b) for b in p) for p in got}
        assert len(canon) == bell  # no partition twice
        for p in got:
            assert sorted(c for b in p for c in b) == sorted(items)
            assert all(b for b in p)


@pytest.mark.parametrize("seed", range(4))
def test_the_grouped_bound_is_below_every_grouped_plan(seed: int) -> None:
    """Brute force over groupings, shares and group plans (2–3 clusters): the bound (complete, no
    deadline, no target) is <= every grouped plan's evaluate, and at least the compute-rate floor plus
    the cross-group all-reduce of layer 0 (so it is not trivially 0)."""
    inst = _instance(seed)
    tables = build_tables(inst)
    gb = grouped_bound(inst, tables, link_policy(inst, {"link_precision": "bf16"}), link_precision="bf16")
    assert gb.complete and gb.precisions == ("native", "bf16")
    best = _brute_force_grouped(inst)
    assert math.isfinite(best)
    assert gb.value <= best * (1 + 1e-9)
    names = [c.name for c in inst.topology.clusters]
    floor_t = inst.job.global_batch / sum(rate_bound(inst, tables, c) for c in names)
    pair = min(wan_allreduce_floor(inst, tables, p, "bf16") for p in itertools.combinations(names, 2))
    assert pair > 0
    assert gb.value >= floor_t + pair * (1 - 1e-12)


def test_the_cross_floor_takes_the_cheapest_representatives() -> None:
    """X(π) is the least layer-0 ring over one cluster per group: with three clusters, groups {a, c} | {b}
    take min(ring(a, b), ring(c, b)), by hand."""
    inst = _instance(1)
    tables = build_tables(inst)
    x = cross_floor(inst, tables, (("a", "c"), ("b",)), "native")
    hand = min(wan_allreduce_floor(inst, tables, ("a", "b"), "native"),
               wan_allreduce_floor(inst, tables, ("b", "c"), "native"))
    assert x == pytest.approx(hand, rel=1e-12) and x > 0


def test_at_the_deadline_the_bound_falls_back_to_the_rate_floor() -> None:
    """A deadline already passed: the bound is the least rate floor + X over the partitions, still <=
    the brute-force grouped optimum, flagged incomplete."""
    inst = _instance(0)
    tables = build_tables(inst)
    stopped = grouped_bound(inst, tables, link_policy(inst, {}), deadline=0.0)
    full = grouped_bound(inst, tables, link_policy(inst, {}))
    assert not stopped.complete and full.complete
    assert stopped.value <= full.value * (1 + 1e-12)
    names = [c.name for c in inst.topology.clusters]
    floor_t = inst.job.global_batch / sum(rate_bound(inst, tables, c) for c in names)
    assert stopped.value == pytest.approx(floor_t + wan_allreduce_floor(inst, tables, tuple(names), "native"))


def test_a_target_caps_the_bound() -> None:
    inst = _instance(2)
    tables = build_tables(inst)
    full = grouped_bound(inst, tables, link_policy(inst, {}))
    low = grouped_bound(inst, tables, link_policy(inst, {}), target=full.value * 0.5)
    assert low.value == pytest.approx(full.value * 0.5) and low.partition == ()


def test_certify_takes_the_least_bound_and_names_the_space() -> None:
    inst = _instance(0)
    res = plan_exact(inst, PlanOptions(time_limit_s=10.0, extra={"grouped_bound": "off"}))
    assert res.plan is not None and res.lower_bound_s is not None
    low = GroupedBound(value=res.lower_bound_s * 0.5, partition=(("a",), ("b",)), cross_s=0.1)
    out = certify(res, low, gap=1e-4)
    assert out.lower_bound_s == pytest.approx(res.lower_bound_s * 0.5)
    assert out.status == "feasible" and out.gap == pytest.approx(1 - res.lower_bound_s * 0.5 / res.iteration_time_s)
    assert "data parallelism across cluster groups" in out.plan_space and "outside:" in out.plan_space
    assert dict(out.plan.meta)["lower_bound_s"] == repr(out.lower_bound_s)
    high = GroupedBound(value=res.lower_bound_s * 2)
    assert certify(res, high, gap=1e-4).lower_bound_s == res.lower_bound_s


@pytest.mark.parametrize("seed", range(4))
def test_the_exact_planners_bound_is_below_every_planners_plan_and_every_grouped_plan(seed: int) -> None:
    inst = _instance(seed)
    res = plan_exact(inst, PlanOptions(time_limit_s=20.0, extra={"grouped_bound": "on"}))
    assert res.plan is not None and res.lower_bound_s is not None
    assert "data parallelism across cluster groups" in res.plan_space
    # native links: the space's gradients across groups are native (bf16 ones can be faster: not covered)
    assert res.lower_bound_s <= _brute_force_grouped(inst, ("native",)) * (1 + 1e-9)
    for name in ("heuristic", "metis", "uniform", "dp-only"):
        other = get_planner(name)(inst, PlanOptions(time_limit_s=10.0))
        if other.plan is not None and math.isfinite(other.iteration_time_s):
            assert res.lower_bound_s <= other.iteration_time_s * (1 + 1e-9), name
    assert res.iteration_time_s == pytest.approx(evaluate(res.plan, inst).iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("policy", ("native", "bf16"))
def test_on_a_shipped_instance_the_bound_is_below_every_planners_plan(policy: str) -> None:
    """sailor-het-16+16 (two clusters): the exact planner's bound (a short limit: whatever phase it
    stops in, its bound holds), the grouped bound at once-passed deadline (its rate floor) and the
    complete grouped bound (no deadline: its share tables finish) are <= the plan of every planner
    under the same link policy."""
    from hgopt.instances import load_instance

    inst = load_instance("sailor-het-16+16")
    extra = {"link_precision": policy}
    res = plan_exact(inst, PlanOptions(time_limit_s=5.0, extra={**extra, "grouped_bound": "on"}))
    assert res.lower_bound_s is not None and res.lower_bound_s > 0
    floor = grouped_bound(inst, build_tables(inst), link_policy(inst, extra), link_precision=policy, deadline=0.0)
    full = grouped_bound(inst, build_tables(inst), link_policy(inst, extra), link_precision=policy)
    assert full.complete and full.value >= floor.value
    for name in ("heuristic", "metis", "uniform", "dp-only"):
        other = get_planner(name)(inst, PlanOptions(time_limit_s=10.0, extra=extra))
        assert other.plan is not None and math.isfinite(other.iteration_time_s), name
        assert res.lower_bound_s <= other.iteration_time_s * (1 + 1e-9), name
        assert floor.value <= other.iteration_time_s * (1 + 1e-9), name
        assert full.value <= other.iteration_time_s * (1 + 1e-9), name


def test_a_group_that_cannot_hold_the_model_trains_nothing() -> None:
    """holds_a_replica by hand: 4 layers of 5e8 fp32 parameters need 4·5e8·(2·4 + o) bytes over the
    group's GPUs (o: the optimizer's bytes per parameter), each GPU less the workspace; a cluster of
    2 GPUs with room for 0.6 of that does not hold it, the two clusters together do."""
    model = tiny_model(num_layers=4, params=5e8, gpus={"A": 0.01}, tps=(1,))
    probe = tiny_instance(model=model, topology=tiny_topology(clusters=(("a", "A", 1, 2, 40.0),)))
    tables = build_tables(probe)
    need = 4 * 5e8 * (2 * tables.dtype_bytes + tables.optimizer_bytes_per_param)
    ws = probe.job.workspace_bytes
    mem_gb = (0.6 * need / 2 + ws) / 1e9  # per GPU: 0.6 of the need over 2 GPUs, plus the workspace
    topo = tiny_topology(clusters=(("a", "A", 1, 2, mem_gb), ("b", "A", 1, 2, mem_gb)))
    inst = tiny_instance(model=model, topology=topo)
    tables = build_tables(inst)
    from hgopt.search.master import holds_a_replica

    assert not holds_a_replica(inst, tables, ("a",)) and not holds_a_replica(inst, tables, ("b",))
    assert holds_a_replica(inst, tables, ("a", "b"))
    # the only partition into two groups has groups that cannot train: no grouped plan, bound = target
    gb = grouped_bound(inst, tables, link_policy(inst, {}), target=123.0)
    assert gb.value == 123.0 and gb.partition == () and gb.settled_by_rate == 1


def test_above_eight_clusters_grouped_plans_are_named_outside() -> None:
    clusters = tuple((f"c{i}", "A", 1, 2, 40.0) for i in range(9))
    inst = tiny_instance(model=tiny_model(gpus={"A": 0.01}), topology=tiny_topology(clusters=clusters))
    gb = grouped_bound(inst, build_tables(inst), link_policy(inst, {}), target=1.5)
    assert not gb.covered and gb.value == 1.5
    from hgopt.search import PlanResult

    res = PlanResult(planner="milp", status="optimal", plan=Plan(pipelines=()), iteration_time_s=1.5,
                     lower_bound_s=1.5, plan_space="k identical pipelines")
    out = certify(res, gb, gap=1e-4)
    assert out.lower_bound_s == 1.5 and out.status == "optimal"
    assert "outside: data parallelism across cluster groups" in out.plan_space


def _plans_of_partition(inst: Instance, part: tuple[tuple[str, ...], ...], shares: tuple[int, ...]) -> list[Plan]:
    """Grouped plans of ``part`` with these shares: the first two plans of each group, each with every
    stage ZeRO-1 or not, gradients across groups native or bf16."""
    choices = [_group_plans(inst, g, b)[:2] for g, b in zip(part, shares)]
    out = []
    for combo in itertools.product(*choices):
        pipes = tuple(p for plan in combo for p in plan.pipelines)
        for zero in (0, 1):
            zp = tuple(dataclasses.replace(p, stages=tuple(dataclasses.replace(s, zero=zero) for s in p.stages))
                       for p in pipes)
            for prec in ("native", "bf16"):
                out.append(Plan(pipelines=zp, grad_sync_precision=prec))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_every_grouped_plan_is_above_the_whole_gradient_floor(seed: int) -> None:
    """[G6] Every grouped plan's evaluate (ZeRO-1 or not, native or bf16 across groups) is >= W(π) of
    its partition at the cheapest precision, on every partition and several share vectors."""
    inst = _instance(seed)
    tables = build_tables(inst)
    names = [c.name for c in inst.topology.clusters]
    checked = 0
    for part in partitions(names):
        if len(part) < 2:
            continue
        w = gradient_floor(inst, tables, part, "bf16")
        assert w > 0
        n, G = len(part), inst.job.global_batch
        for shares in {(G // 2, G - G // 2), (2, G - 2)} if n == 2 else {(2, 2, G - 4), (4, 2, G - 6)}:
            for plan in _plans_of_partition(inst, part, shares):
                ev = evaluate(plan, inst, tables)
                if ev.feasible:
                    checked += 1
                    assert ev.iteration_time_s >= w * (1 - 1e-9), (part, shares, plan.grad_sync_precision)
    assert checked > 0


def test_the_whole_gradient_floor_by_hand_and_binding() -> None:
    """[G6] Two one-GPU-type clusters joined by a shared pipe (aggregate = per flow = 1 Gbit/s, 20 ms),
    fp32 gradients of 4 layers x 3e7 parameters: B = 4·3e7·4 bytes (tp·shard = the layer), n = 2, so
    W = 1/2 · (2·1/2 · B / 1.25e8 B/s + 2·0.02 s) = 1/2 · (3.84 s + 0.04 s) = 1.94 s, by hand; in bf16 B
    halves: 0.98 s. With fast GPUs it is above the rate floor plus layer 0's ring, so it sets the bound."""
    inst = tiny_instance(
        global_batch=8,
        model=tiny_model(num_layers=4, gpus={"A": 0.001}, params=3e7, activation_bytes=1e6),
        topology=tiny_topology(clusters=(("a", "A", 1, 4, 40.0), ("b", "A", 1, 4, 40.0)), wan_gbit_s=1.0,
                               wan_latency_ms=20.0),
    )
    tables = build_tables(inst)
    assert inst.topology.link_spec("a", "b").aggregate is not None
    assert min_gradient_bytes(inst, tables, ["a", "b"], "native") == pytest.approx(4 * 3e7 * 4)
    part = (("a",), ("b",))
    assert gradient_floor(inst, tables, part, "native") == pytest.approx(1.94, rel=1e-9)
    assert gradient_floor(inst, tables, part, "bf16") == pytest.approx(0.5 * (1.92 + 0.04), rel=1e-9)
    gb = grouped_bound(inst, tables, link_policy(inst, {}))
    floor_t = inst.job.global_batch / sum(rate_bound(inst, tables, c) for c in ("a", "b"))
    x = cross_floor(inst, tables, part, "native")
    assert floor_t + x == pytest.approx(0.012 + 1.0)  # rate floor 8 samples · 4 layers · 0.003 s / 8 GPUs + ring of layer 0 (0.96 + 0.04 s)
    assert gb.value >= 1.94 * (1 - 1e-9) and gb.gradient_s == pytest.approx(1.94)
    best = min(evaluate(p, inst, tables).iteration_time_s for p in _plans_of_partition(inst, part, (4, 4))
               if p.grad_sync_precision == "native" and evaluate(p, inst, tables).feasible)
    assert gb.value <= best * (1 + 1e-9)


def test_with_the_grouped_bound_off_the_space_names_grouped_plans_outside() -> None:
    """grouped_bound=off: the certificate is the k-identical one, and the plan space says that data
    parallelism across cluster groups is outside it; certify of that result names the wider space once."""
    inst = _instance(0)
    res = plan_exact(inst, PlanOptions(time_limit_s=10.0, extra={"grouped_bound": "off"}))
    assert res.plan_space.startswith("k identical pipelines")
    assert "outside: data parallelism across cluster groups (not bounded: grouped_bound off" in res.plan_space
    out = certify(res, GroupedBound(value=res.lower_bound_s * 2), gap=1e-4)
    # (mixed: stages mixing clusters stay named "not bounded" by the exact planner, hgopt.search.exact)
    assert "not bounded: grouped_bound" not in out.plan_space and out.plan_space.count("outside:") == 1


def test_auto_covers_grouped_plans_only_when_one_is_the_result() -> None:
    """grouped_bound=auto: on a tiny instance where no grouped plan beats the k-identical result the
    certificate is the k-identical one (grouped plans named outside); its bound equals the off run's
    search space's claim, never above the plan."""
    inst = _instance(0)
    res = plan_exact(inst, PlanOptions(time_limit_s=10.0, extra={"grouped_bound": "auto"}))
    assert res.plan is not None and res.lower_bound_s is not None
    grouped_result = "the heuristic's plan with data parallelism across cluster groups" in " ".join(res.notes)
    if grouped_result:
        assert "or data parallelism across cluster groups" in res.plan_space
    else:
        assert "outside: data parallelism across cluster groups (not bounded: grouped_bound off" in res.plan_space
    assert res.lower_bound_s <= res.iteration_time_s * (1 + 1e-12)


def _old_share_bound(inst: Instance, tables, group: tuple[str, ...], b: int, links) -> float:
    """The per-step scan's PB_S(b) before the share tables (round 5): max(b / rate_S, min over the
    splits (k, B, m) of b of the split's own cheap bound without its tail)."""
    from hgopt.search.blocks import cheap_bounds

    sub = sub_instance(inst, group, b)
    rate = sum(rate_bound(inst, tables, c) for c in group)
    lowest = math.inf
    for sp in batch_splits(sub):
        cb = cheap_bounds(sub, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                          links=links)
        lowest = min(lowest, dataclasses.replace(cb, s_lb=0.0).value)  # the split's own weight
    return max(b / rate, lowest)


def _groups(names: list[str]) -> list[tuple[str, ...]]:
    return [g for r in range(1, len(names)) for g in itertools.combinations(names, r)]


@pytest.mark.parametrize("seed", range(4))
def test_share_tables_are_at_least_the_old_scan_and_below_every_group_plan(seed: int) -> None:
    """[G2] Every group (one or two clusters) and share: the share table's PB_S(b) is >= the old
    per-step scan's (each split's own cheap bound) and <= the evaluate of every plan the heuristic's
    realisation gives the group with that share (brute force over splits, cluster orders and layer
    splits); its work (cheap_bounds calls) is at most the old scan's (one per distinct (k, B))."""
    from hgopt.search.master import ShareTable

    inst = _instance(seed)
    tables = build_tables(inst)
    links = link_policy(inst, {})
    G = inst.job.global_batch
    checked = 0
    for group in _groups([c.name for c in inst.topology.clusters]):
        table = ShareTable(inst, tables, group, links)
        old_work = {(sp.k, sp.microbatch) for b in range(1, G) for sp in batch_splits(sub_instance(inst, group, b))}
        for b in range(1, G):
            new = table.pipeline_bound(b)
            assert new >= _old_share_bound(inst, tables, group, b, links) * (1 - 1e-12), (group, b)
            sub = sub_instance(inst, group, b)
            for plan in _group_plans(inst, group, b):
                checked += 1
                assert new <= evaluate(plan, sub).iteration_time_s * (1 + 1e-9), (group, b, plan)
        assert 0 < table.structures <= len(old_work)
    assert checked > 0


def test_a_limit_keeps_every_bound_below_it_and_the_scan_stops_at_the_need() -> None:
    """[G2]/[G3] With a limit, PB_S(b) is the same where it is below the limit and inf (>= limit)
    elsewhere; capacity(t, need) is capacity(t) when that is >= need and 0 otherwise."""
    from hgopt.search.master import ShareTable

    inst = _instance(1)
    tables = build_tables(inst)
    links = link_policy(inst, {})
    G = inst.job.global_batch
    for group in _groups([c.name for c in inst.topology.clusters]):
        full = ShareTable(inst, tables, group, links)
        values = [full.pipeline_bound(b) for b in range(1, G)]
        limit = sorted(values)[len(values) // 2]
        cut = ShareTable(inst, tables, group, links, limit=limit)
        for b, v in zip(range(1, G), values):
            assert cut.pipeline_bound(b) == (v if v < limit else math.inf)
        for t in sorted(set(values)):
            cap = full.capacity(t)
            for need in range(1, G):
                assert full.capacity(t, need) == (cap if cap >= need else 0)


@pytest.mark.parametrize("seed", range(4))
def test_the_grouped_bound_is_at_least_the_old_scans(seed: int) -> None:
    """[G3] The grouped bound from the share tables is >= the one the old per-step scan's PB_S gives
    through the same bisection (to its resolution), and complete."""
    from hgopt.search import master

    inst = _instance(seed)
    tables = build_tables(inst)
    links = link_policy(inst, {})
    G = inst.job.global_batch
    names = [c.name for c in inst.topology.clusters]
    floor_t = G / sum(rate_bound(inst, tables, c) for c in names)

    class Old:
        def __init__(self, group: tuple[str, ...]) -> None:
            self.rate = sum(rate_bound(inst, tables, c) for c in group)
            self.gpus = sum(inst.topology.cluster(c).num_gpus for c in group)
            self.pb = {b: _old_share_bound(inst, tables, group, b, links) for b in range(1, G)}

        def rate_capacity(self, t: float) -> int:
            return min(G - 1, math.floor(self.rate * t * (1 + 1e-12)))

        def capacity(self, t: float, need: int = 1) -> int:
            return next((b for b in range(self.rate_capacity(t), need - 1, -1) if self.pb[b] <= t), 0)

    old = math.inf
    for part in partitions(names):
        if len(part) < 2 or not all(master.holds_a_replica(inst, tables, g) for g in part):
            continue
        x = cross_floor(inst, tables, part, "native")
        t = master.partition_time([Old(g) for g in part], G, floor_t, math.inf)
        old = min(old, max(t + x, gradient_floor(inst, tables, part, "native")))
    new = grouped_bound(inst, tables, links)
    assert new.complete and math.isfinite(old)
    assert new.value >= old / master.BISECT_RATIO


@pytest.mark.parametrize("seed", range(2))
def test_a_bound_stopped_at_any_deadline_is_at_most_the_complete_one(seed: int) -> None:
    """[G4] Whatever point the deadline stops the share tables at (mid-table, mid-bisection, between
    partitions), the bound is <= the complete one (so <= every grouped plan): each visited partition
    keeps its complete bound, the one stopped its largest infeasible t, the rest their rate floors. The
    verdict does not depend on where it stops, only the strength does."""
    import time

    inst = _instance(seed)
    tables = build_tables(inst)
    links = link_policy(inst, {})
    full = grouped_bound(inst, tables, links)
    assert full.complete
    for after in (0.0, 1e-4, 1e-3, 1e-2, 5e-2):
        stopped = grouped_bound(inst, tables, links, deadline=time.perf_counter() + after)
        assert stopped.value <= full.value * (1 + 1e-12), after
        assert not stopped.complete or stopped.value == pytest.approx(full.value, rel=1e-12)
