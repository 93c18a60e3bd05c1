"""Small plans for the exporter and runner tests (tiny instances from tests/factories.py)."""

from __future__ import annotations

from dataclasses import replace

from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology

__all__ = ["G", "pipeline", "plan_dp_tp", "plan_four_stages", "plan_reshard", "plan_two_pipelines", "plan_zero_dp_tp",
           "runner_instance", "with_zero"]


def G(cluster: str, tp: int = 1, dp: int = 1, mbs: int = 1) -> ReplicaGroup:
    return ReplicaGroup(cluster=cluster, tp=tp, dp=dp, mbs=mbs)


def pipeline(stages: list[tuple[tuple[int, int], list[ReplicaGroup]]], m: int,
             bounds: list[tuple[str, str]] | None = None, schedule: str = "1f1b") -> Pipeline:
    return Pipeline(
        stages=tuple(Stage(start=lo, end=hi, groups=tuple(gs)) for (lo, hi), gs in stages),
        num_microbatches=m,
        boundaries=tuple(Boundary(fwd=f, bwd=b) for f, b in bounds or []),  # type: ignore[arg-type]
        schedule=schedule,  # type: ignore[arg-type]
    )


def runner_instance(num_layers: int = 4, global_batch: int = 8, embed_head: bool = False,
                    gpus_per_cluster: tuple[int, int] = (2, 2)) -> Instance:
    """Two clusters a (GPU A) and b (GPU B), each ``nodes x gpus_per_node``; optional embedding/head
    layers at the ends of the layer list."""
    model = tiny_model(num_layers=num_layers)
    if embed_head:
        model["layers"][0]["kind"] = "embedding"
        model["layers"][-1]["kind"] = "head"
    nodes, gpn = gpus_per_cluster
    topo = tiny_topology(clusters=(("a", "A", nodes, gpn, 40.0), ("b", "B", nodes, gpn, 16.0)))
    return tiny_instance(global_batch=global_batch, model=model, topology=topo)


def plan_dp_tp(bounds: tuple[str, str] = ("native", "native")) -> Plan:
    """Stage 0: two replicas with 3 and 1 samples per microbatch (cluster a); stage 1: tp 2 (cluster b).
    8 samples per step on ``runner_instance()``."""
    return Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=3), G("a", mbs=1)]), ((2, 4), [G("b", tp=2, mbs=4)])],
                                    m=2, bounds=[bounds]),))


def plan_four_stages(bounds: list[tuple[str, str]] | None = None, schedule: str = "gpipe") -> Plan:
    """Embedding, 4 blocks, head over 4 stages, 2 samples x 3 microbatches (6 samples per step on
    ``runner_instance(6, 6, embed_head=True)``)."""
    return Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=2)]), ((2, 3), [G("a", mbs=2)]), ((3, 5), [G("b", mbs=2)]),
                                     ((5, 6), [G("b", mbs=2)])], m=3, bounds=bounds, schedule=schedule),))


def plan_reshard() -> Plan:
    """Three stages with dp 1, 2 (1 + 3 samples) and 2 (2 + 2): every boundary is re-sharded.
    8 samples per step."""
    return Plan(pipelines=(pipeline([((0, 1), [G("a", mbs=4)]), ((1, 3), [G("a", mbs=1), G("a", mbs=3)]),
                                     ((3, 4), [G("b", dp=2, mbs=2)])], m=2),))


def plan_two_pipelines() -> Plan:
    """Two pipelines with different splits; layers 0-1 are held by a tp-2 and a tp-1 replica (the
    'full' gradient sync). Pipeline 1's boundary is bf16 forward, fp16 backward. 8 samples per step."""
    return Plan(pipelines=(
        pipeline([((0, 2), [G("a", tp=2, mbs=2)]), ((2, 4), [G("b", mbs=2)])], m=2),
        pipeline([((0, 3), [G("a", mbs=2)]), ((3, 4), [G("b", mbs=2)])], m=2, bounds=[("bf16", "fp16")]),
    ))


def with_zero(plan: Plan) -> Plan:
    """``plan`` with ``zero: 1`` on every stage."""
    return replace(plan, pipelines=tuple(replace(p, stages=tuple(replace(s, zero=1) for s in p.stages))
                                         for p in plan.pipelines))


def plan_zero_dp_tp() -> Plan:
    """ZeRO-1 on both stages. Stage 0: two replicas with 3 and 1 samples per microbatch (cluster a);
    stage 1: two tp-2 replicas with 2 samples each (cluster b). 6 ranks, 8 samples per step on
    ``runner_instance()``."""
    return with_zero(Plan(pipelines=(pipeline([((0, 2), [G("a", mbs=3), G("a", mbs=1)]),
                                               ((2, 4), [G("b", tp=2, dp=2, mbs=2)])], m=2),)))
