"""The certificate over data parallelism across cluster groups (``hgopt.search.master``): the grouped
bound never exceeds any grouped plan found by brute force over groupings, batch shares and group plans
on tiny instances, nor any plan of any planner; the exact planner reports min(k-identical, grouped)."""

from __future__ import annotations

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
from hgopt.search.master import GroupedBound, certify, cross_floor, grouped_bound, partitions
from hgopt.search.milp import batch_splits, link_policy
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology


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


def _compositions(L: int, parts: int) -> list[tuple[int, ...]]:
    out = []
    for cuts in itertools.combinations(range(1, L), parts - 1):
        c = (0, *cuts, L)
        out.append(tuple(b - a for a, b in zip(c, c[1:])))
    return out


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
                for layers in _compositions(L, r):
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
    res = plan_exact(inst, PlanOptions(time_limit_s=20.0))
    assert res.plan is not None and res.lower_bound_s is not None
    assert "data parallelism across cluster groups" in res.plan_space
    # native links: the space's gradients across groups are native (bf16 ones can be faster: not covered)
    assert res.lower_bound_s <= _brute_force_grouped(inst, ("native",)) * (1 + 1e-9)
    for name in ("heuristic", "metis", "uniform", "dp-only"):
        other = get_planner(name)(inst, PlanOptions(time_limit_s=10.0))
        if other.plan is not None and math.isfinite(other.iteration_time_s):
            assert res.lower_bound_s <= other.iteration_time_s * (1 + 1e-9), name
    assert res.iteration_time_s == pytest.approx(evaluate(res.plan, inst).iteration_time_s, rel=1e-12)
