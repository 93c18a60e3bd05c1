"""[H9] Skipping a grouping's rating searches when no subset's estimate can reach the realisation
threshold (``groups.subsets_cannot_reach``): the bound never exceeds the least estimate of any subset
of the groups as the real ratings give them (brute force over every subset), and the heuristic's plans
are the same with the skip disabled."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.instances import load_instance
from hgopt.search import groups
from hgopt.search.groups import group_rate_bound, sub_instance, subset_estimate, subsets_cannot_reach
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology


def _instance(seed: int) -> Instance:
    """Three or four clusters of two GPU speeds and sizes behind shared-pipe WAN links (each direction
    capped) of random speeds, one pair sometimes fast (multi-cluster groupings); gradients from small
    to large next to the compute."""
    rng = random.Random(seed)
    n = rng.choice([3, 4])
    clusters = tuple((f"c{i}", rng.choice("AB"), rng.choice([1, 2]), rng.choice([2, 4]), 40.0) for i in range(n))
    topo = tiny_topology(clusters=clusters, wan_gbit_s=rng.choice([0.5, 2.0, 20.0]),
                         wan_latency_ms=rng.choice([1.0, 20.0]))
    if rng.random() < 0.7:  # one fast pair: a grouping with a two-cluster group
        fast = {"gbit_s": rng.choice([50.0, 200.0]), "latency_ms": 0.5}
        topo["links"]["pairs"] = [{"src": "c0", "dst": "c1", **fast}, {"src": "c1", "dst": "c0", **fast}]
    model = tiny_model(num_layers=rng.choice([4, 6]), gpus={"A": 0.01, "B": rng.choice([0.02, 0.05])},
                       params=rng.choice([1e5, 1e6, 2e7]), activation_bytes=rng.choice([1e5, 1e6, 2e7]))
    return tiny_instance(global_batch=rng.choice([16, 32, 64]), model=model, topology=topo)


def _recorded_ratings(inst: Instance, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list, dict, str]]:
    """Every (rated groups, widest stages, precision) ``best_grouped_plan`` hands to its subset search
    with the skip disabled (incumbent infinite: every grouping is rated)."""
    seen: list[tuple[list, dict, str]] = []
    real = groups._greedy_subsets

    def spy(instance, tables, rated, precision, widest=None):  # type: ignore[no-untyped-def]
        seen.append((list(rated), dict(widest or {}), precision))
        return real(instance, tables, rated, precision, widest)

    monkeypatch.setattr(groups, "_greedy_subsets", spy)
    monkeypatch.setattr(groups, "subsets_cannot_reach", lambda *a, **k: False)
    tables = build_tables(inst)
    options = HeuristicOptions(cross_cluster_dp=False, time_limit_s=None)

    def sub_planner(sub: Instance):  # type: ignore[no-untyped-def]
        res = plan_heuristic(sub, tables=tables, options=options)
        return None if res.plan is None else (res.plan, evaluate(res.plan, sub, tables).pipeline_time_s)

    groups.best_grouped_plan(inst, tables, sub_planner, incumbent=float("inf"))
    return seen


@pytest.mark.parametrize("seed", range(8))
def test_bound_never_exceeds_the_least_subset_estimate(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Brute force: with the groups' real ratings, the least estimate over every subset of at least two
    rated groups is at least the bound, i.e. the skip answers False at any threshold just above it (a
    bound too high — a dropped ring factor, the wrong pair, a rate bound below a real rate — fails)."""
    inst = _instance(seed)
    tables = build_tables(inst)
    recorded = _recorded_ratings(inst, monkeypatch)
    assert recorded, "no grouping was rated: the instance tests nothing"
    for rated, widest, precision in recorded:
        if len(rated) < 2:
            continue
        least = min(subset_estimate(inst, tables, list(head), precision, widest)
                    for j in range(2, len(rated) + 1) for head in itertools.combinations(rated, j))
        part = tuple(g for _, _, g in rated)
        assert not subsets_cannot_reach(inst, tables, part, precision, least * (1 + 1e-7)), (part, least)


@pytest.mark.parametrize("seed", range(8))
def test_group_rate_bound_is_never_exceeded_by_a_rating_plan(seed: int) -> None:
    """What the bound's first term rests on: no group's own plan (one cluster or several) processes its
    rating share faster than :func:`group_rate_bound`."""
    inst = _instance(seed)
    tables = build_tables(inst)
    for part in groups.groupings(inst):
        for g in part:
            sub = sub_instance(inst, g, inst.job.global_batch // 2)
            res = plan_heuristic(sub, tables=tables, options=HeuristicOptions(cross_cluster_dp=False, time_limit_s=None))
            if res.plan is None:
                continue
            t = evaluate(res.plan, sub, tables).pipeline_time_s
            assert sub.job.global_batch / t <= group_rate_bound(inst, tables, g) * (1 + 1e-12), g


def _slow_wan(seed: int) -> Instance:
    """:func:`_instance` with 50 Mbit/s shared pipes and large gradients: the cross-group ring alone
    outlasts one cluster's plan, so the skip must fire."""
    inst = _instance(seed)
    doc_links = tuple(dataclasses.replace(l, bandwidth=l.bandwidth.scaled(0.05 / (l.bandwidth.gbyte_s * 8)),
                                          aggregate=None if l.aggregate is None
                                          else l.aggregate.scaled(0.05 / (l.aggregate.gbyte_s * 8)))
                      for l in inst.topology.links)
    return dataclasses.replace(inst, topology=dataclasses.replace(inst.topology, links=doc_links))


@pytest.mark.parametrize("name", ["seed0", "seed1", "seed2", "slow0", "slow3", "geo-3r-gpt1.3b"])
def test_plans_are_the_same_with_the_skip_disabled(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The heuristic's plan (whole search, no time limit) with and without the skip: the same plan and
    time; the skip fires on the slow-WAN instances (else this compares nothing)."""
    inst = (load_instance(name) if not name.startswith(("seed", "slow"))
            else _instance(int(name[-1])) if name.startswith("seed") else _slow_wan(int(name[-1])))
    options = HeuristicOptions(time_limit_s=None)
    fired: list[bool] = []
    real = groups.subsets_cannot_reach

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        got = real(*a, **k)
        fired.append(got)
        return got

    monkeypatch.setattr(groups, "subsets_cannot_reach", counting)
    with_skip = plan_heuristic(inst, options=options)
    monkeypatch.setattr(groups, "subsets_cannot_reach", lambda *a, **k: False)
    without = plan_heuristic(inst, options=options)
    assert with_skip.plan == without.plan
    assert with_skip.iteration_time_s == without.iteration_time_s
    if name.startswith("slow"):
        assert any(fired), "the skip never fired: nothing was compared"
