"""Property tests of the scorer: monotonicity in bandwidth, microbatches and microbatch size. Every
generated plan is valid (the generator respects each cluster's GPU count) and each test asserts that
``evaluate`` finds it feasible before checking the property."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from hgopt.cost import Evaluation, evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Instance, Topology
from tests.factories import tiny_instance, tiny_model, tiny_topology

CLUSTERS = (("a", "A", 2, 4, 80.0), ("b", "B", 2, 4, 80.0), ("c", "A", 1, 4, 80.0))
CAPACITY = {name: nodes * gpn for name, _, nodes, gpn, _ in CLUSTERS}
MBSS = tuple(range(1, 9))
"""Profiled microbatch sizes: every size the tests use (the memory test goes up to 8)."""

Spec = tuple[list[int], list[tuple[str, int]], int, int, int]


@st.composite
def plans(draw: st.DrawFn) -> Spec:
    """(cut points, per stage (cluster, tp), dp, mbs, num_microbatches) on a 6-layer model. Valid by
    construction: a stage only goes to a cluster with tp·dp GPUs still free, so every generated plan
    uses at most the GPUs each cluster has (the tests assert ``evaluate`` finds it feasible)."""
    n_stages = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(1, 5), min_size=n_stages - 1, max_size=n_stages - 1, unique=True)))
    dp = draw(st.sampled_from([1, 2]))  # the same dp on every stage keeps the microbatch equal
    free = dict(CAPACITY)
    groups = []
    for _ in range(n_stages):
        tp = draw(st.sampled_from([1, 2]))
        fitting = [c for c in sorted(free) if free[c] >= tp * dp]
        assert fitting, free  # 3 stages of at most 4 GPUs always fit in 8 + 8 + 4
        c = draw(st.sampled_from(fitting))
        free[c] -= tp * dp
        groups.append((c, tp))
    return cuts, groups, dp, draw(st.integers(1, 4)), draw(st.integers(1, 6))


def build(spec: Spec, extra_m: int = 0, mbs_override: int | None = None) -> tuple[Plan, Instance]:
    cuts, groups, dp, mbs, m = spec
    mbs = mbs_override or mbs
    bounds = [0, *cuts, 6]
    stages = tuple(
        Stage(start=lo, end=hi, groups=(ReplicaGroup(cluster=c, tp=tp, dp=dp, mbs=mbs),))
        for (lo, hi), (c, tp) in zip(zip(bounds, bounds[1:]), groups)
    )
    m += extra_m
    inst = tiny_instance(
        global_batch=m * dp * mbs,
        model=tiny_model(num_layers=6, mbss=MBSS),
        topology=tiny_topology(clusters=CLUSTERS, wan_gbit_s=4.0, wan_latency_ms=30.0),
    )
    return Plan(pipelines=(Pipeline(stages=stages, num_microbatches=m),)), inst


def feasible(plan: Plan, inst: Instance) -> Evaluation:
    """``evaluate``'s verdict, asserted feasible: a property checked on an invalid plan checks nothing."""
    ev = evaluate(plan, inst)
    assert ev.feasible, ev.violations
    return ev


def scaled(topo: Topology, f: float) -> Topology:
    return Topology(
        clusters=tuple(replace(c, intra_node=c.intra_node.scaled(f), inter_node=c.inter_node.scaled(f)) for c in topo.clusters),
        links=tuple(replace(link, bandwidth=link.bandwidth.scaled(f)) for link in topo.links),
    )


@settings(max_examples=60, deadline=None)
@given(plans(), st.floats(1.0, 20.0))
def test_more_bandwidth_never_increases_iteration_time(spec, factor) -> None:
    plan, inst = build(spec)
    faster = replace(inst, topology=scaled(inst.topology, factor))
    assert feasible(plan, faster).iteration_time_s <= feasible(plan, inst).iteration_time_s * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_adding_a_microbatch_never_decreases_iteration_time(spec) -> None:
    plan, inst = build(spec)
    plan2, inst2 = build(spec, extra_m=1)
    assert feasible(plan2, inst2).iteration_time_s >= feasible(plan, inst).iteration_time_s


@settings(max_examples=60, deadline=None)
@given(plans(), st.integers(1, 7))
def test_memory_grows_with_microbatch_size(spec, mbs) -> None:
    plan, inst = build(spec, mbs_override=mbs)
    plan2, inst2 = build(spec, mbs_override=mbs + 1)
    e1, e2 = feasible(plan, inst), feasible(plan2, inst2)
    assert len(e1.stages) == len(e2.stages) > 0
    for s1, s2 in zip(e1.stages, e2.stages):
        assert s2.peak_memory_bytes > s1.peak_memory_bytes
