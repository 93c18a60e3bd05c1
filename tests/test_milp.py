"""The exact planner against brute-force enumeration of its plan space, scored by ``evaluate``."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any, Iterator, NamedTuple

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.search import PlanOptions
from hgopt.search.exact import plan_exact
from hgopt.search.milp import batch_splits
from hgopt.solvers import available_backends
from hgopt.spec import Instance
from tests.factories import chain_brute_force, chain_space, tiny_instance, tiny_model, tiny_topology


@pytest.fixture(autouse=True)
def _k_identical_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    """colgen: this file checks the k-identical space's certificate against its own brute force;
    the certificate over grouped plans too is tests/test_master.py's."""
    monkeypatch.setattr("hgopt.search.exact.GROUPED_BOUND_DEFAULT", "off")


@pytest.fixture(autouse=True)
def _fluid_closed_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """closed8: the MILP's rows model the fluid closed form (round trips [M12]-[M16]/[M15w]) exactly, so its
    exactness is checked against that form (``pipeline.CLOSED_CAP`` off); with the cap (the default) its
    bounds' validity is tests/test_closed_form.py's."""
    monkeypatch.setattr("hgopt.cost.pipeline.CLOSED_CAP", False)

BACKENDS = available_backends()
SEEDS = 10


def _instance(seed: int) -> Instance:
    """2-3 clusters of 1-2 nodes x 2 GPUs, 3-5 identical layers, memory from roomy to tight; no
    recomputation (the brute force's space, :func:`_space`)."""
    rng = random.Random(seed)
    n_clusters = rng.choice([2, 3])
    names = ["a", "b", "c"][:n_clusters]
    gpus = {"A": 0.01, "B": 0.02, "C": 0.013}
    clusters = tuple((n, g, rng.choice([1, 2]), 2, rng.choice([1.14, 1.2, 40.0])) for n, g in zip(names, gpus))
    topo = tiny_topology(clusters=clusters, wan_gbit_s=rng.choice([2.0, 8.0, 50.0]), wan_latency_ms=rng.choice([1.0, 10.0, 80.0]))
    topo["links"]["pairs"] = [
        {"src": a, "dst": b, "directed": True, "gbit_s": rng.choice([1.0, 4.0, 20.0]), "latency_ms": rng.choice([2.0, 20.0, 80.0])}
        for a, b in itertools.permutations(names, 2) if rng.random() < 0.5]
    model = tiny_model(num_layers=rng.randint(3, 5), gpus=dict(list(gpus.items())[:n_clusters]),
                       activation_bytes=rng.choice([1e6, 2e7]))
    for t in model["timings"]:  # tp 2 runs at 60 % of tp 1's time, not 50 %
        if t["tp"] == 2:
            t["fwd"] = [x * 1.2 for x in t["fwd"]]
            t["bwd"] = [x * 1.2 for x in t["bwd"]]
    return tiny_instance(global_batch=rng.choice([2, 4, 8]), model=model, topology=topo, recompute="off")


def _space(inst: Instance) -> Iterator[tuple[Any, Pipeline]]:
    """(batch split, pipeline) for every plan of the MILP's space with native links
    (``factories.chain_space``: k identical pipelines, each an ordered chain of distinct clusters with
    one contiguous block each, uniform local stages, any partition). The instances here plan without
    recomputation (``job.recompute: off``), so this is the MILP's whole space; its recomputing layouts
    are checked against brute force in tests/test_recompute_plan.py."""
    assert inst.job.recompute == "off"
    return chain_space(inst)


def brute_force(inst: Instance) -> float:
    """Best evaluate() over every plan of the space (:func:`_space`)."""
    assert inst.job.recompute == "off"
    return chain_brute_force(inst)


_CACHE: dict[int, float] = {}


def _expected(seed: int) -> float:
    if seed not in _CACHE:
        _CACHE[seed] = brute_force(_instance(seed))
    return _CACHE[seed]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(SEEDS))
def test_milp_optimum_equals_brute_force(seed: int, backend: str) -> None:
    inst = _instance(seed)
    expect = _expected(seed)
    # CP-SAT sees times rounded to integers: its bound carries that slack, so it proves a looser gap
    tol, gap = (1e-4, 5e-3) if backend == "cp-sat" else (1e-7, 1e-7)
    # no warm start and no relaxation bound: the backend's MILP must find and prove the optimum
    extra = {"warm_start": "none", "relaxation": "off"}
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=gap, solver=backend, extra=extra))
    if not math.isfinite(expect):
        assert res.plan is None and res.status == "infeasible"
        return
    assert res.plan is not None, res
    ev = evaluate(res.plan, inst)
    assert ev.feasible
    # no plan beats the brute force; "optimal" is proven within the gap asked (CP-SAT's two workers
    # are not deterministic under load: it may stop at a plan 1.6e-4 above the optimum, inside 5e-3)
    assert expect * (1 - tol) <= ev.iteration_time_s <= expect * (1 + max(gap, tol))
    assert res.iteration_time_s == pytest.approx(ev.iteration_time_s, rel=1e-12)
    assert res.lower_bound_s is not None and res.lower_bound_s <= ev.iteration_time_s * (1 + 1e-9)
    assert res.lower_bound_s >= expect * (1 - max(gap, 10 * tol))
    assert res.status == "optimal"
    assert res.solver  # a MILP was solved


@pytest.mark.parametrize("seed", range(SEEDS))
def test_pruned_search_agrees_with_the_plain_milp(seed: int) -> None:
    """Warm start + relaxation bound prune splits but never change the optimum or its proof."""
    inst = _instance(seed)
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-7))
    expect = _expected(seed)
    if not math.isfinite(expect):
        assert res.plan is None
        return
    assert res.iteration_time_s == pytest.approx(expect, rel=1e-7)
    assert res.lower_bound_s is not None and expect * (1 - 1e-6) <= res.lower_bound_s <= res.iteration_time_s * (1 + 1e-9)


def test_plan_space_tiny_instances_use_several_clusters_and_pipelines() -> None:
    """The cross-check is meaningful: optima across the seeds use more than one cluster somewhere
    and the 1F1B round trip sets the pace somewhere [C3]. (Since WAN links are shared [C4w], k
    identical pipelines cost what one pipeline with k-fold data parallelism costs, so k > 1 is rarely
    strictly better; the brute force still enumerates every k.)"""
    from hgopt.cost.evaluate import round_trip_bound

    multi_cluster = multi_pipe = round_trip = False
    for seed in range(SEEDS):
        res = plan_exact(_instance(seed), PlanOptions(time_limit_s=30, gap=1e-7))
        if res.plan is None:
            continue
        multi_cluster |= len(res.plan.pipelines[0].stages[0].clusters() + res.plan.pipelines[0].stages[-1].clusters()) > 1 \
            and res.plan.pipelines[0].stages[0].groups[0].cluster != res.plan.pipelines[0].stages[-1].groups[0].cluster
        multi_pipe |= len(res.plan.pipelines) > 1
        ev = evaluate(res.plan, _instance(seed))
        st = [r for r in ev.stages if r.pipeline == 0]
        classic = max(max(r.fwd_s + r.bwd_s, r.send_fwd_s, r.send_bwd_s) for r in st)
        round_trip |= round_trip_bound(st, res.plan.pipelines[0].num_microbatches) > classic * (1 + 1e-9)
    assert multi_cluster and round_trip


class _Chain(NamedTuple):
    """A 3-cluster chain of block options chosen among ``opts`` (built at ``split`` with cheap bounds ``cb``)."""

    inst: Instance
    split: Any
    tables: Any
    cb: Any
    opts: Any
    chosen: list[Any]
    order: list[str]


def _fixed_chain(chain: _Chain) -> tuple[float, Plan]:
    """(MILP objective with y fixed to the chain's block options and z to its cluster order, the decoded
    plan), the MILP built over the options the chain was chosen from."""
    from hgopt.search.milp import build_milp, decode
    from hgopt.solvers import SolveOptions, solve

    form = build_milp(chain.inst, chain.tables, chain.split, chain.opts, chain.cb)
    fixed = 0
    for j, o in form.y.items():
        if any(o is c for c in chain.chosen):
            form.model.add_row(f"fix{j}", {j: 1.0}, 1.0, 1.0)
            fixed += 1
    assert fixed == len(chain.chosen)
    for a, b in zip(chain.order, chain.order[1:]):
        form.model.add_row(f"arc{a}{b}", {form.z[(a, b)]: 1.0}, 1.0, 1.0)
    res = solve(form.model, "highs", SolveOptions(time_limit_s=30, relative_gap=1e-9))
    assert res.values is not None, res
    return res.objective, decode(chain.inst, form, res.values)


def _random_chain(seed: int, global_batch: int, num_microbatches: int) -> _Chain:
    """A random 3-cluster chain over 7 layers: a random WAN latency, cluster order and layer counts, one
    random block option per cluster (options up to 3 stages deep) at microbatch 2, one pipeline."""
    from hgopt.search.blocks import Window, block_options, cheap_bounds
    from hgopt.search.milp import BatchSplit

    rng = random.Random(seed)
    clusters = (("a", "A", 1, 2, 40.0), ("b", "B", 2, 2, 40.0), ("c", "C", 1, 2, 40.0))
    topo = tiny_topology(clusters=clusters, wan_gbit_s=4.0, wan_latency_ms=rng.choice([30.0, 80.0, 150.0]))
    model = tiny_model(num_layers=7, gpus={"A": 0.01, "B": 0.02, "C": 0.013}, activation_bytes=2e7)
    inst = tiny_instance(global_batch=global_batch, model=model, topology=topo)
    split = BatchSplit(k=1, microbatch=2, num_microbatches=num_microbatches)
    tables = build_tables(inst)
    cb = cheap_bounds(inst, tables, replicas=1, microbatch=2, num_microbatches=num_microbatches)
    opts = block_options(inst, tables, replicas=1, microbatch=2, num_microbatches=num_microbatches, d_cap=3,
                         window=Window(t_lb=cb.t_lb, s_lb=cb.s_lb, weight=cb.weight))
    order = rng.sample(["a", "b", "c"], 3)
    n = sorted(rng.sample(range(1, 7), 2))
    counts = [n[0], n[1] - n[0], 7 - n[1]]
    roles = ["first", "middle", "end"]
    chosen = [rng.choice(opts[(c, r, k)]) for c, r, k in zip(order, roles, counts)]
    return _Chain(inst, split, tables, cb, opts, chosen, order)


@pytest.mark.parametrize("seed", range(6))
def test_milp_objective_of_a_fixed_chain_equals_evaluate(seed: int) -> None:
    """Fix a random 3-cluster chain of block options: the MILP's objective (bottleneck, WAN, round
    trip [M12]-[M16], fill, tail) must equal evaluate() of that plan."""
    chain = _random_chain(seed, global_batch=8, num_microbatches=4)
    got, plan = _fixed_chain(chain)
    assert got == pytest.approx(evaluate(plan, chain.inst, chain.tables).iteration_time_s, rel=1e-9)


@pytest.mark.parametrize("name", [e.name for e in __import__("hgopt.instances", fromlist=["x"]).list_instances()])
def test_shipped_instances_plan_is_never_below_the_reported_bound(name: str) -> None:
    """With a short time limit, on every shipped instance: the returned plan re-scored by evaluate is
    feasible and at or above the reported lower bound, and the gap is what the two numbers say."""
    from hgopt.instances import load_instance

    inst = load_instance(name)
    res = plan_exact(inst, PlanOptions(time_limit_s=3.0))
    assert res.lower_bound_s is not None and res.lower_bound_s >= 0
    # positive unless the limit ran out before every split had its cheap bound (load-dependent: the
    # opening phase checks the deadline since issue #11), which a note then says
    unbounded = any(n.startswith("time limit reached before the cheap bounds") for n in res.notes)
    assert res.lower_bound_s > 0 or unbounded
    if res.plan is None:
        assert res.status in ("error", "infeasible")
        return
    ev = evaluate(res.plan, inst)
    assert ev.feasible, ev.violations
    assert ev.iteration_time_s >= res.lower_bound_s * (1 - 1e-9)
    assert res.gap == pytest.approx((ev.iteration_time_s - res.lower_bound_s) / ev.iteration_time_s, abs=1e-9)


# --------------------------------------------------------------------------------------------
# Link precision per inter-cluster boundary [M17]-[M19]
# --------------------------------------------------------------------------------------------
AUTO_PAIRS = tuple((f, b) for f in ("native", "bf16", "fp8") for b in ("native", "bf16", "fp8"))


def _links_instance(variant: int, free_casts: bool = False) -> Instance:
    """3 clusters of 2 GPUs whose memory holds at most 3 of the 5 layers each: every plan crosses a
    slow WAN link (0.5 Gbit/s). Variant 1: link a→c fast (400 Gbit/s), c→a slow (2 Gbit/s) and slow
    HBM (20 GB/s: casts cost as much as a fast link saves), so the directions want different
    precisions; 8 samples per batch. No recomputation (the brute force's space, :func:`_space`).
    ``free_casts``: HBM as fast as the spec allows, so casts cost next to nothing (the brute force's
    bound, :func:`brute_force_link_families`)."""
    clusters = (("a", "A", 1, 2, 1.6), ("b", "B", 1, 2, 1.6), ("c", "C", 1, 2, 1.6))
    topo = tiny_topology(clusters=clusters, wan_gbit_s=0.5, wan_latency_ms=5.0)
    if variant == 1:
        for c in topo["clusters"]:
            c["memory_bandwidth_gbyte_s"] = 20.0
        topo["links"]["pairs"] = [{"src": "a", "dst": "c", "directed": True, "gbit_s": 400.0, "latency_ms": 1.0},
                                  {"src": "c", "dst": "a", "directed": True, "gbit_s": 2.0, "latency_ms": 1.0}]
    if free_casts:
        for c in topo["clusters"]:
            c["memory_bandwidth_gbyte_s"] = 100_000.0
    model = tiny_model(num_layers=5, gpus={"A": 0.01, "B": 0.02, "C": 0.013}, activation_bytes=2e7, params=2e7)
    return tiny_instance(global_batch=8 if variant else 4, model=model, topology=topo, recompute="off")


def _with_links(pipe: Pipeline, cluster_of: list[str], pairs: tuple[tuple[str, str], ...]) -> Pipeline:
    """``pipe`` with ``pairs`` on its inter-cluster boundaries (in order), native inside clusters."""
    from hgopt.plan import Boundary

    it = iter(pairs)
    bounds = []
    for i in range(len(pipe.stages) - 1):
        if cluster_of[i] != cluster_of[i + 1]:
            f, b = next(it)
            bounds.append(Boundary(fwd=f, bwd=b))  # type: ignore[arg-type]
        else:
            bounds.append(Boundary())
    return Pipeline(stages=pipe.stages, num_microbatches=pipe.num_microbatches, boundaries=tuple(bounds),
                    schedule=pipe.schedule)


def _precision_combos(pipe: Pipeline, pairs: tuple[tuple[str, str], ...], cap: int | None) -> Iterator[Pipeline]:
    """``pipe`` with every assignment of ``pairs`` to its inter-cluster boundaries (at most ``cap``
    of them compressed)."""
    clusters = [s.groups[0].cluster for s in pipe.stages]
    n = sum(a != b for a, b in zip(clusters, clusters[1:]))
    for combo in itertools.product(pairs, repeat=n):
        if cap is None or sum(p != ("native", "native") for p in combo) <= cap:
            yield _with_links(pipe, clusters, combo)


Family = tuple[tuple[tuple[str, str], ...], "int | None"]
"""Precision pairs allowed on every inter-cluster boundary, and at most how many compressed ones."""


def brute_force_link_families(inst: Instance, families: dict[str, Family],
                               free: Instance) -> dict[str, tuple[float, int]]:
    """Per family: (best evaluate(), number of feasible plans) over the MILP's space with the
    family's precision pairs on the inter-cluster boundaries: every skeleton, local pipeline and
    assignment. One enumeration serves every family. ``free``: the same instance with (next to) free
    casts; a feasible skeleton with fp8 both ways on every inter-cluster boundary, scored on it,
    bounds every assignment of that skeleton from below (the fewest bytes on every send, no cast
    cost), so skeletons are visited in order of that bound and a family's assignments of a skeleton
    are scored only while the bound is below the family's best so far (branch and bound: the same
    minima as scoring all ~100k plans, with a fraction of the evaluate calls). Every scored plan is
    checked to be at or above its skeleton's bound. The counts need no scoring (memory does not
    depend on the boundaries' precision)."""
    tables, free_tables = build_tables(inst), build_tables(free)
    out = {name: (math.inf, 0) for name in families}
    skeletons = []
    for sp, pipe in _space(inst):
        if not evaluate(Plan(pipelines=(pipe,) * sp.k), inst, tables).feasible:
            continue
        combos = {name: list(_precision_combos(pipe, ps, cap)) for name, (ps, cap) in families.items()}
        for name, cs in combos.items():
            out[name] = (math.inf, out[name][1] + len(cs))
        fp8 = next(_precision_combos(pipe, (("fp8", "fp8"),), None))
        lb = evaluate(Plan(pipelines=(fp8,) * sp.k), free, free_tables).iteration_time_s
        skeletons.append((lb, len(skeletons), sp.k, combos))
    best = {name: math.inf for name in families}
    for lb, _, k, combos in sorted(skeletons, key=lambda x: x[:2]):
        scored: dict[tuple[tuple[str, str], ...], float] = {}
        for name in families:
            if lb >= best[name]:
                continue  # no assignment of this skeleton beats the family's best
            for p in combos[name]:
                key = tuple(_inter_links(Plan(pipelines=(p,))))
                if key not in scored:
                    scored[key] = evaluate(Plan(pipelines=(p,) * k), inst, tables).iteration_time_s
                    assert scored[key] >= lb * (1 - 1e-12), (key, scored[key], lb)
                best[name] = min(best[name], scored[key])
    return {name: (best[name], count) for name, (_, count) in out.items()}


NATIVE = (("native", "native"),)
LINK_FAMILIES: dict[str, Family] = {
    "auto": (AUTO_PAIRS, None), "auto-1": (AUTO_PAIRS, 1), "native": (NATIVE, None),
    "bf16": ((("bf16", "bf16"),), None), "fp8": ((("fp8", "fp8"),), None),
    "native-bf16": (tuple((f, b) for f in ("native", "bf16") for b in ("native", "bf16")), None),
}
"""The families the link tests compare the planner with, all from one enumeration per instance."""
_LINK_CACHE: dict[int, dict[str, tuple[float, int]]] = {}


def _links_expected(variant: int, family: str = "auto") -> tuple[float, int]:
    if variant not in _LINK_CACHE:
        _LINK_CACHE[variant] = brute_force_link_families(_links_instance(variant), LINK_FAMILIES,
                                                         _links_instance(variant, free_casts=True))
    return _LINK_CACHE[variant][family]


def _inter_links(plan: Plan) -> list[tuple[str, str]]:
    p = plan.pipelines[0]
    return [(p.boundary(i).fwd, p.boundary(i).bwd) for i in range(len(p.stages) - 1)
            if p.stages[i].groups[0].cluster != p.stages[i + 1].groups[0].cluster]


def _intra_links(plan: Plan) -> list[tuple[str, str]]:
    p = plan.pipelines[0]
    return [(p.boundary(i).fwd, p.boundary(i).bwd) for i in range(len(p.stages) - 1)
            if p.stages[i].groups[0].cluster == p.stages[i + 1].groups[0].cluster]


@pytest.mark.parametrize("variant", [0, 1])
def test_auto_links_equal_brute_force_over_skeletons_and_precisions(variant: int) -> None:
    """``link_precision auto``: the MILP's plan is the best of every plan of the space with every
    (fwd, bwd) pair of native/bf16/fp8 on every inter-cluster boundary; its bound is below all of
    them; it beats the native optimum on these slow links. Both with the pruned search (warm start,
    relaxation bound over the fastest precision per link) and with neither."""
    inst = _links_instance(variant)
    expect, count = _links_expected(variant)
    assert count > 1000 and math.isfinite(expect)
    # variant 1's big-M rows reach ~20 s: HiGHS's feasibility tolerance leaves its objective up to
    # ~4e-6 (relative) below evaluate's (formulations/cluster_milp.md §6), hence the looser gap
    gap = 1e-6 if variant == 0 else 1e-5
    native = plan_exact(inst, PlanOptions(time_limit_s=60, gap=gap))
    for extra in ({}, {"warm_start": "none"}, {"warm_start": "none", "relaxation": "off"}):
        res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=gap, extra={"link_precision": "auto", **extra}))
        assert res.plan is not None, (extra, res)
        ev = evaluate(res.plan, inst)
        assert ev.feasible
        assert res.iteration_time_s == pytest.approx(ev.iteration_time_s, rel=1e-12)
        assert ev.iteration_time_s == pytest.approx(expect, rel=gap), extra
        assert res.lower_bound_s is not None and res.lower_bound_s <= expect * (1 + 1e-9)
        assert res.status == "optimal"
        assert any(p != ("native", "native") for p in _inter_links(res.plan))
        assert all(p == ("native", "native") for p in _intra_links(res.plan))
    assert ev.iteration_time_s < native.iteration_time_s * 0.9
    if variant == 1:  # the fast direction stays native, the slow one is compressed
        assert any(f != b for f, b in _inter_links(res.plan)), _inter_links(res.plan)


def test_auto_links_no_worse_than_any_precision_on_the_chosen_skeleton() -> None:
    """On the MILP's own skeleton every precision assignment scores no better than its plan."""
    inst = _links_instance(0)
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-6, extra={"link_precision": "auto"}))
    assert res.plan is not None
    p0 = res.plan.pipelines[0]
    plain = Pipeline(stages=p0.stages, num_microbatches=p0.num_microbatches)
    scores = [evaluate(Plan(pipelines=(p,) * len(res.plan.pipelines)), inst).iteration_time_s
              for p in _precision_combos(plain, AUTO_PAIRS, None)]
    assert len(scores) == 9 ** len(_inter_links(res.plan)) >= 9
    assert res.iteration_time_s <= min(scores) * (1 + 1e-9)
    assert res.lower_bound_s is not None and res.lower_bound_s <= min(scores) * (1 + 1e-9)


def test_max_compressed_links() -> None:
    """0 compressed links: native everywhere, the native optimum; 1: at most one compressed
    boundary, the brute-force optimum of that space."""
    inst = _links_instance(0)
    native = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-6))
    zero = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-6,
                                        extra={"link_precision": "auto", "max_compressed_links": "0"}))
    assert zero.plan is not None and native.plan is not None
    assert all(b == ("native", "native") for b in _inter_links(zero.plan) + _intra_links(zero.plan))
    assert zero.iteration_time_s == pytest.approx(native.iteration_time_s, rel=1e-9)
    # the native optimum itself (its bottleneck is the WAN link, above every stage's compute: the
    # cheap bound [B4] once left such plans out and certified a worse warm start as optimal)
    assert native.iteration_time_s == pytest.approx(_links_expected(0, "native")[0], rel=1e-6)
    one = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-6,
                                       extra={"link_precision": "auto", "max_compressed_links": "1"}))
    assert one.plan is not None
    assert sum(p != ("native", "native") for p in _inter_links(one.plan)) <= 1
    expect, _ = _links_expected(0, "auto-1")
    assert one.iteration_time_s == pytest.approx(expect, rel=1e-6)
    assert one.lower_bound_s is not None and one.lower_bound_s <= expect * (1 + 1e-9)


@pytest.mark.parametrize("prec", ["bf16", "fp8"])
def test_fixed_precision_on_every_inter_cluster_boundary(prec: str) -> None:
    inst = _links_instance(0)
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=1e-6, extra={"link_precision": prec}))
    assert res.plan is not None
    assert _inter_links(res.plan) and all(p == (prec, prec) for p in _inter_links(res.plan))
    assert all(p == ("native", "native") for p in _intra_links(res.plan))
    expect, _ = _links_expected(0, prec)
    assert res.iteration_time_s == pytest.approx(expect, rel=1e-6)
    assert f"{{{prec}}}" in res.plan_space


def test_link_penalty_moves_the_choice_and_keeps_the_bound_valid() -> None:
    """A penalty per fp8 boundary larger than fp8's gain over bf16 makes auto use bf16; the reported
    lower bound stays below evaluate's time of every plan (it is the objective's bound minus the
    most penalty a plan can pay). By brute force, the best native/bf16 plan is slower than the best
    auto plan (which uses fp8) by less than 0.5 s (asserted first), so with 0.5 s per fp8 boundary
    every fp8 plan's objective exceeds the bf16 optimum and bf16 wins. The verdict does not depend on the time limit: the
    choice is asserted once the planner has proven the objective optimal (it does within a few CPU
    seconds; a big penalty such as fp8=10 makes the warm start's fp8 plan a poor incumbent and the
    search slow), and what no limit can change (the bounds) is asserted always."""
    inst = _links_instance(0)
    expect_auto, _ = _links_expected(0)
    expect_bf16, _ = _links_expected(0, "native-bf16")
    assert expect_auto + 0.5 > expect_bf16 > expect_auto  # the instance is what the docstring says
    free = plan_exact(inst, PlanOptions(time_limit_s=600, gap=1e-6, extra={"link_precision": "auto"}))
    assert free.plan is not None and free.lower_bound_s is not None and free.lower_bound_s <= expect_auto * (1 + 1e-9)
    if free.status == "optimal":
        assert any("fp8" in p for p in _inter_links(free.plan))
    res = plan_exact(inst, PlanOptions(time_limit_s=600, gap=1e-6,
                                       extra={"link_precision": "auto", "link_penalty": "fp8=0.5"}))
    assert res.plan is not None
    assert res.lower_bound_s is not None and res.lower_bound_s <= expect_auto * (1 + 1e-9)
    meta = dict(res.plan.meta)
    obj, obj_lb = float(meta["objective_with_link_penalty_s"]), float(meta["objective_lower_bound_s"])
    assert obj_lb <= expect_bf16 * (1 + 1e-9) <= obj * (1 + 1e-9)  # the bf16 optimum pays no penalty
    if obj - obj_lb <= 1e-6 * obj:  # proven optimal objective: the choice is determined
        assert not any("fp8" in p for p in _inter_links(res.plan)) and any("bf16" in p for p in _inter_links(res.plan))
        assert res.iteration_time_s == pytest.approx(expect_bf16, rel=1e-6)


@pytest.mark.parametrize("backend", [b for b in ("highs", "scip", "cp-sat", "cbc") if b in BACKENDS])
def test_link_backends_agree(backend: str) -> None:
    """Every backend solves the auto-precision MILP (no warm start, no relaxation) to the same optimum."""
    inst = _links_instance(1)
    tol, gap = (1e-4, 5e-3) if backend == "cp-sat" else (1e-5, 1e-5)
    res = plan_exact(inst, PlanOptions(time_limit_s=60, gap=gap, solver=backend,
                                       extra={"link_precision": "auto", "warm_start": "none", "relaxation": "off"}))
    assert res.plan is not None and res.solver
    expect = _links_expected(1)[0]  # the brute-force optimum
    assert res.iteration_time_s >= expect * (1 - 1e-9)  # no plan beats it
    assert res.lower_bound_s is not None and res.lower_bound_s <= expect * (1 + 1e-9)  # the bound is one
    if res.status == "optimal":  # proven within the requested gap (what the limit cannot change)
        assert res.iteration_time_s == pytest.approx(expect, rel=max(tol, gap))


@pytest.mark.parametrize("seed", range(6))
def test_milp_objective_with_compressed_links_equals_evaluate(seed: int) -> None:
    """Fix a random 3-cluster chain, random block options (microbatch sizes 1 or 2 on either side,
    so the cast block min(mbs_a, mbs_b) [M19] varies) and random precision pairs: the MILP
    objective equals evaluate() of the decoded plan."""
    from hgopt.cost.pipeline import pipeline_time
    from hgopt.search.blocks import Window, block_options, cheap_bounds
    from hgopt.search.milp import BatchSplit, build_milp, decode, link_policy
    from hgopt.solvers import SolveOptions, solve

    rng = random.Random(100 + seed)
    clusters = (("a", "A", 1, 2, 40.0), ("b", "B", 2, 2, 40.0), ("c", "C", 1, 2, 40.0))
    topo = tiny_topology(clusters=clusters, wan_gbit_s=rng.choice([0.5, 4.0]), wan_latency_ms=rng.choice([5.0, 30.0]))
    for c in topo["clusters"]:
        c["memory_bandwidth_gbyte_s"] = rng.choice([5.0, 50.0, 900.0])
    model = tiny_model(num_layers=7, gpus={"A": 0.01, "B": 0.02, "C": 0.013}, activation_bytes=2e7)
    inst = tiny_instance(global_batch=8, model=model, topology=topo)
    split = BatchSplit(k=1, microbatch=2, num_microbatches=4)
    tables = build_tables(inst)
    pol = link_policy(inst, {"link_precision": "auto"})
    cb = cheap_bounds(inst, tables, replicas=1, microbatch=2, num_microbatches=4, links=pol)
    opts = block_options(inst, tables, replicas=1, microbatch=2, num_microbatches=4, d_cap=3,
                         window=Window(t_lb=cb.t_lb, s_lb=cb.s_lb, weight=cb.weight, mbs_matters=True))
    order = rng.sample(["a", "b", "c"], 3)
    n = sorted(rng.sample(range(1, 7), 2))
    counts = [n[0], n[1] - n[0], 7 - n[1]]
    chosen = []
    for c, r, k in zip(order, ["first", "middle", "end"], counts):  # aim at a random mbs per block
        mbs = rng.choice([1, 2])
        chosen.append(rng.choice([o for o in opts[(c, r, k)] if o.cfg.mbs == mbs] or opts[(c, r, k)]))
    pairs = [rng.choice(AUTO_PAIRS[1:]) for _ in range(2)]
    form = build_milp(inst, tables, split, opts, cb, pol)
    for j, o in form.y.items():
        if any(o is c for c in chosen):
            form.model.add_row(f"fix{j}", {j: 1.0}, 1.0, 1.0)
    for (a, b), pair in zip(zip(order, order[1:]), pairs):
        var = next(v for v in form.links[(a, b)] if v.arc.pair == pair)
        form.model.add_row(f"arc{a}{b}", {var.z: 1.0}, 1.0, 1.0)
    res = solve(form.model, "highs", SolveOptions(time_limit_s=30, relative_gap=1e-9))
    assert res.values is not None, res
    plan = decode(inst, form, res.values)
    assert _inter_links(plan) == pairs
    ev = evaluate(plan, inst, tables)
    (pr,) = ev.pipelines
    # the MILP prices the pipeline by [C3]; evaluate by max([C3], [C3p]): where the dependency paths
    # [C3p] bind, the MILP is below evaluate by exactly that excess (the sync tail follows the pipeline end)
    c3 = pipeline_time(pr.num_microbatches, pr.bottleneck_s, pr.fill_drain_s)
    assert pr.time_s >= c3 * (1 - 1e-12)
    assert res.objective <= ev.iteration_time_s * (1 + 1e-6)
    assert res.objective == pytest.approx(ev.iteration_time_s - (pr.time_s - c3), rel=1e-6), \
        [c.cfg.mbs for c in chosen]
