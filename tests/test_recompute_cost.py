"""Activation recomputation priced by the cost kernel ([C2r], [C6r]; hfrunner): a stage with
``recompute: full`` pays its forward again in the backward and keeps only layer inputs (plus one
layer's activations during a backward); the other stages are priced as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hgopt.cost.evaluate import evaluate
from hgopt.cost.memory import recompute_activation_bytes, stage_memory_terms
from hgopt.cost.pipeline import in_flight
from hgopt.cost.tables import build_tables
from hgopt.instances import load_instance
from hgopt.plan import Plan
from tests.runner_plans import G, pipeline


def _plan(recompute_stage: int | None) -> Plan:
    p = pipeline([((0, 1), [G("us-a100-80", mbs=2)]), ((1, 3), [G("us-a100-80", mbs=2)]),
                  ((3, 4), [G("eu-a100-40", tp=2, mbs=2)])], m=4)
    stages = tuple(replace(s, recompute="full") if k == recompute_stage else s for k, s in enumerate(p.stages))
    return Plan(pipelines=(replace(p, stages=stages),))


def test_recompute_stage_priced_by_hand() -> None:
    inst = load_instance("hf-llama-tiny-2r")
    tables = build_tables(inst)
    plain, rec = evaluate(_plan(None), inst, tables), evaluate(_plan(1), inst, tables)
    sa = {s.stage: s for s in plain.stages}
    sb = {s.stage: s for s in rec.stages}
    assert sb[1].fwd_s == sa[1].fwd_s and sb[1].bwd_s == pytest.approx(sa[1].bwd_s + sa[1].fwd_s, rel=1e-12)
    for k in (0, 2):
        assert (sb[k].fwd_s, sb[k].bwd_s, sb[k].peak_memory_bytes) == (sa[k].fwd_s, sa[k].bwd_s, sa[k].peak_memory_bytes)
    # stage 1 holds blocks 1 and 2: inputs = the embedding's and block 1's outputs; one block rebuilt at a time
    layers = inst.model.layers
    tab = tables.table("A100-80", 1)
    depth = in_flight(3, 1, 4, "1f1b")
    by_hand = depth * 2 * (layers[0].activation_bytes + layers[1].activation_bytes) + 2 * layers[1].act_mem_bytes
    assert recompute_activation_bytes(inst, tab, 1, 3, 2, depth) == pytest.approx(by_hand, rel=1e-12)
    cluster = inst.topology.cluster("us-a100-80")
    terms = stage_memory_terms(inst, tables, cluster, 1, 1, 3, 2, depth, recompute=True)
    plain_terms = stage_memory_terms(inst, tables, cluster, 1, 1, 3, 2, depth)
    assert terms.activations == pytest.approx(by_hand) and by_hand < plain_terms.activations
    assert (terms.weights, terms.optimizer) == (plain_terms.weights, plain_terms.optimizer)
    assert sb[1].peak_memory_bytes == pytest.approx(sa[1].peak_memory_bytes - plain_terms.activations + by_hand)
    assert rec.iteration_time_s > plain.iteration_time_s
    # layer 0 recomputing keeps the token ids only
    assert recompute_activation_bytes(inst, tab, 0, 1, 2, 1) == pytest.approx(2 * 8 * 32 + 2 * layers[0].act_mem_bytes)
