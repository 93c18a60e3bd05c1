"""A feasibility witness for an instance: a simple plan that fits in memory, judged by ``evaluate``.

One pipeline, microbatch 1, one replica per stage at the largest profiled tp that divides the node
size; clusters are filled in order of GPU memory, each stage taking as many layers as fit. With S
stage slots allowed in flight (1F1B keeps at most ``stages - i`` microbatches on stage ``i``), the
smallest S whose packing needs at most S stages is used. It is a witness that the instance is
trainable, not a good plan.
"""

from __future__ import annotations

from hgopt.cost.tables import CostTables, build_tables
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Cluster, Instance

__all__ = ["witness_plan"]


def _slots(inst: Instance) -> list[tuple[Cluster, int]]:
    out: list[tuple[Cluster, int]] = []
    for c in sorted(inst.topology.clusters, key=lambda c: -c.gpu_memory_bytes):
        tps = [t for t in inst.model.tps(c.gpu) if c.gpus_per_node % t == 0]
        if tps:
            out.extend([(c, max(tps))] * (c.num_gpus // max(tps)))
    return out


def _memory(inst: Instance, tables: CostTables, c: Cluster, tp: int, lo: int, hi: int, in_flight: int) -> float:
    tab = tables.table(c.gpu, tp)
    params = float(tab.params[hi] - tab.params[lo])
    act = float(tab.act_mem[hi] - tab.act_mem[lo])
    return (2.0 * params * tables.dtype_bytes + params * tables.optimizer_bytes_per_param
            + in_flight * act + inst.job.workspace_bytes)


def _pack(inst: Instance, tables: CostTables, slots: list[tuple[Cluster, int]], in_flight: int) -> list[Stage] | None:
    L, start, stages = tables.num_layers, 0, []
    for c, tp in slots:
        end = start
        while end < L and _memory(inst, tables, c, tp, start, end + 1, in_flight) <= c.gpu_memory_bytes:
            end += 1
        if end > start:
            stages.append(Stage(start=start, end=end, groups=(ReplicaGroup(cluster=c.name, tp=tp, dp=1, mbs=1),)))
            start = end
        if start == L or len(stages) > in_flight:
            break
    return stages if start == L else None


def witness_plan(inst: Instance) -> Plan | None:
    """A memory-feasible plan, or ``None`` when this simple packing finds none."""
    tables = build_tables(inst)
    slots = _slots(inst)
    for s in range(1, min(len(slots), tables.num_layers) + 1):
        stages = _pack(inst, tables, slots, s)
        if stages is not None and len(stages) <= s:
            pipe = Pipeline(stages=tuple(stages), num_microbatches=inst.job.global_batch)
            return Plan(pipelines=(pipe,), planner="witness", instance=inst.name)
    return None
