"""[H2] The estimate cache (``hier_tables``'s per-search dict, shared by the [H9] groups' searches)
returns what a fresh build does, whatever was cached before: other global batches, node counts,
memories, microbatch counts; and the row-stacked config estimates equal one config at a time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hgopt.cost import build_tables
from hgopt.instances import load_instance
from hgopt.search.baselines._common import block_layout
from hgopt.search.hier_tables import _config_estimates, cluster_tables
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic
from hgopt.spec import Instance

FIELDS = ("bottleneck", "fill", "sync_opt", "stages", "tp", "dp", "recompute")


def _with(inst: Instance, *, batch: int | None = None, nodes: int | None = None,
          memory: float | None = None) -> Instance:
    """``inst`` with another global batch, node count or GPU memory of every cluster."""
    clusters = tuple(dataclasses.replace(c, nodes=nodes if nodes is not None else c.nodes,
                                         gpu_memory_bytes=memory if memory is not None else c.gpu_memory_bytes)
                     for c in inst.topology.clusters)
    return dataclasses.replace(inst, topology=dataclasses.replace(inst.topology, clusters=clusters),
                               job=dataclasses.replace(inst.job, global_batch=batch or inst.job.global_batch))


def _tables_of(inst: Instance, tables, cache, *, k: int, B: int, m: int, d: int):  # type: ignore[no-untyped-def]
    layout = block_layout(inst)
    return {(c.name, role): cluster_tables(inst, tables, layout, c, role, microbatch=B, num_microbatches=m,
                                           gpu_budget=c.num_gpus // k, replicas=k, stages_after=d,
                                           weights=(1, max(1, m // 8), 4 * m + 4, 0), cache=cache)
            for c in inst.topology.clusters for role in ("first", "middle", "last", "only")}


def _same(got: dict, fresh: dict) -> None:  # type: ignore[type-arg]
    for key, by_w in fresh.items():
        assert by_w.keys() == got[key].keys()
        for w, tab in by_w.items():
            for f in FIELDS:
                assert np.array_equal(getattr(got[key][w], f), getattr(tab, f)), (key, w, f)


def test_cache_filled_by_other_batches_nodes_and_memory_gives_fresh_tables() -> None:
    """Every variant's tables from one shared cache (filled by the other variants first) equal that
    variant's tables built with an empty cache: the keys name every dependency (a key missing the
    batch — which layouts may recompute [I3r] — the node count, or the memory would fail here)."""
    base = load_instance("sailor-het-16+16")
    tables = build_tables(base)
    # pairs that differ only in the batch (which layouts may recompute), in the memory, in the nodes
    variants = [base, _with(base, memory=16e9), _with(base, batch=8, memory=16e9), _with(base, memory=1e13),
                _with(base, nodes=2), _with(base, batch=64, nodes=1, memory=12e9)]
    calls = [(1, 4, 8, 0), (2, 4, 8, 2), (2, 8, 32, 1)]
    checked = 0
    for order in (variants, variants[::-1]):  # a missing key would hand either side the other's tables
        shared: dict[tuple[object, ...], object] = {}
        for inst in order:  # fill the cache with every variant
            for k, B, m, d in calls:
                _tables_of(inst, tables, shared, k=k, B=B, m=m, d=d)
        for inst in order:
            for k, B, m, d in calls:
                fresh = _tables_of(inst, tables, {}, k=k, B=B, m=m, d=d)
                _same(_tables_of(inst, tables, shared, k=k, B=B, m=m, d=d), fresh)
                checked += sum(np.isfinite(t.fill).sum() for by_w in fresh.values() for t in by_w.values())
    assert checked > 0  # some estimates fit (the comparison is not of all-infinite tables)
    # and the pairs do differ (else the cache could not have been wrong)
    for x, y, call in ((1, 2, (2, 4, 8, 2)), (0, 3, (2, 4, 8, 2)), (0, 4, (1, 4, 8, 0))):
        a = _tables_of(variants[x], tables, {}, k=call[0], B=call[1], m=call[2], d=call[3])
        b = _tables_of(variants[y], tables, {}, k=call[0], B=call[1], m=call[2], d=call[3])
        assert any(not np.array_equal(a[key][w].fill, b[key][w].fill) for key in a for w in a[key]), (x, y)

def test_cache_refuses_other_cost_tables() -> None:
    """Another optimizer (or precision, or model) means other cost tables, which the keys do not
    name: sharing the cache is refused rather than answered from the other tables."""
    base = load_instance("sailor-het-16+16")
    other = dataclasses.replace(base, job=dataclasses.replace(base.job, optimizer="sgd"))
    adam, sgd = build_tables(base), build_tables(other)
    assert adam.optimizer_bytes_per_param != sgd.optimizer_bytes_per_param
    shared: dict[tuple[object, ...], object] = {}
    _tables_of(base, adam, shared, k=1, B=4, m=8, d=0)
    _tables_of(base, build_tables(base), {}, k=1, B=4, m=8, d=0)  # equal tables, own cache: fine
    with pytest.raises(ValueError, match="same cost tables"):
        _tables_of(other, sgd, shared, k=1, B=4, m=8, d=0)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("role", [(True, False), (False, False), (False, True), (True, True)])
def test_stacked_config_estimates_equal_one_config_alone(recompute: bool, role: tuple[bool, bool]) -> None:
    """The configs of a block estimated together (rows stacked) give, bit for bit, what each config
    gives estimated alone."""
    inst = load_instance("sailor-het-16+16")
    tables, layout = build_tables(inst), block_layout(inst)
    c = inst.topology.clusters[1]
    has_pre, has_post = role
    L = tables.num_layers
    n = np.array([L]) if has_pre and has_post else np.arange(L + 1)
    nb = n - (layout.pre if has_pre else 0) - (layout.post if has_post else 0)
    specs = [(tp, dp, 8 // dp) for tp in (1, 2, 4) for dp in (1, 2, 4, 8) if tp * dp <= 16]
    together = _config_estimates(inst, tables, layout, c, specs, 16, 2, nb, has_pre, has_post, {}, recompute)
    assert len(together) == len(specs)
    for spec, got in zip(specs, together):
        (alone,) = _config_estimates(inst, tables, layout, c, [spec], 16, 2, nb, has_pre, has_post, {}, recompute)
        assert len(got) == len(alone) == 9
        for a, b in zip(got, alone):
            assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), spec
    # the configs differ from each other (a mix-up of rows would show)
    assert not np.array_equal(together[0][0], together[-1][0])


def test_group_searches_sharing_a_cache_plan_as_fresh_ones() -> None:
    """Searches on sub-instances (other batch, other node count) that share one estimate cache, as
    the [H9] groups do, return the plans of searches with their own cache."""
    base = load_instance("sailor-het-16+16")
    tables = build_tables(base)
    subs = [_with(base, batch=128), _with(base, batch=128, nodes=2), _with(base, batch=256, nodes=3)]
    opts = HeuristicOptions(time_limit_s=None, cross_cluster_dp=False, finalists=2, polish_extra=0)
    shared: dict[tuple[str, int, int], object] = {}
    for inst in subs:
        fresh = plan_heuristic(inst, tables=tables, options=opts)
        got = plan_heuristic(inst, tables=tables, options=opts, estimate_cache=shared)
        assert fresh.plan is not None and got.plan is not None
        assert got.plan.to_json() == fresh.plan.to_json() and got.iteration_time_s == fresh.iteration_time_s
