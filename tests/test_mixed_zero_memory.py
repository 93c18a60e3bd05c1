"""hetgap (issue #11 item 3): ZeRO-1 memory and optimizer step of a stage whose replica groups differ in
tp. The export keeps the full optimizer state on every rank of such a stage (``export/build.py``
``_zero_level``), so ``evaluate`` must count it unsharded there, and sharded over the replicas where the
groups share one tp degree."""

from __future__ import annotations

import pytest

from hgopt.cost import build_tables, evaluate
from hgopt.cost.memory import stage_memory_terms
from hgopt.export.build import ExportOptions, build_runner_plan
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from tests.factories import tiny_instance, tiny_model, tiny_topology


def _instance():
    topo = tiny_topology(clusters=(("a", "A", 1, 4, 40.0), ("b", "A", 1, 4, 40.0)), wan_gbit_s=100.0,
                         wan_latency_ms=0.0)
    for c in topo["clusters"]:
        c["region"] = "zone-1"
    model = tiny_model(num_layers=2, gpus={"A": 0.01}, tps=(1, 2), mbss=(1, 2), params=1e7, activation_bytes=1e3,
                       act_mem_bytes=1e3)
    return tiny_instance(global_batch=8, model=model, topology=topo, name="zero-tp")


def _plan(tp_b: int) -> Plan:
    groups = (ReplicaGroup(cluster="a", tp=1, dp=2, mbs=1), ReplicaGroup(cluster="b", tp=tp_b, dp=2, mbs=1))
    return Plan(pipelines=(Pipeline(num_microbatches=2, stages=(Stage(start=0, end=2, zero=1, groups=groups),)),))


@pytest.mark.parametrize("tp_b", [1, 2])
def test_zero1_memory_matches_what_the_export_shards(tp_b):
    inst = _instance()
    tables = build_tables(inst)
    plan = _plan(tp_b)
    ev = evaluate(plan, inst, tables)
    rp = build_runner_plan(plan, inst, ExportOptions())
    groups = rp.sync_groups
    assert groups
    sharded = all(g.zero == 1 for g in groups)
    assert sharded == (tp_b == 1)  # the export shards only a stage of one tp degree
    a = inst.topology.cluster("a")
    # the tp-1 group (cluster a) is the one closest to its limit in both plans (it holds whole layers)
    whole = stage_memory_terms(inst, tables, a, 1, 0, 2, 1, 1, shards=1)
    four = stage_memory_terms(inst, tables, a, 1, 0, 2, 1, 1, shards=4)
    assert whole.optimizer == pytest.approx(4 * four.optimizer)
    want = four.total if sharded else whole.total
    assert ev.stages[0].peak_memory_bytes == pytest.approx(want, rel=1e-12)
    # the optimizer step likewise: over 4 shards, or the whole update on every replica
    tab = tables.table("A", 1)
    update = float(tab.update[2] - tab.update[0])
    assert ev.stages[0].optimizer_s == pytest.approx(update / 4 if sharded else update, rel=1e-12)
