"""[C5]/[C7o] SyncMemo (hgopt/cost/evaluate.py): a memo filled by other holders, layer ranges,
precisions and bucket sizes returns exactly what a fresh computation does, and evaluate with one memo
shared over many plans equals evaluate alone. Each key input is varied against a memo that already
holds the other variants, so a key that missed it would hand back a stale value: the test checks that
the fresh values differ across the variants (else it could not catch that)."""

from __future__ import annotations

import pytest

from tests.factories import tiny_instance, tiny_model, tiny_topology
from hgopt.cost import build_tables, evaluate
from hgopt.cost.evaluate import SyncMemo, segment_allreduce, segment_bucket_syncs, segment_buckets, segment_sync
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage


def _instance():
    topo = tiny_topology(clusters=(("a", "A", 2, 2, 40.0), ("b", "B", 2, 2, 16.0), ("c", "A", 2, 2, 40.0)))
    topo["clusters"][1]["intra_node"] = {"gbyte_s": 20}  # b's rings slower than a's: the cluster matters
    topo["links"]["pairs"] = [{"src": "b", "dst": "c", "gbit_s": 2.0, "latency_ms": 30.0}]  # a slower WAN pair: the cluster set matters
    return tiny_instance(global_batch=8, model=tiny_model(num_layers=6), topology=topo, precision="fp32")


def _st(*groups: tuple[str, int, int], lo: int = 0, hi: int = 6, zero: int = 0) -> Stage:
    return Stage(start=lo, end=hi, groups=tuple(ReplicaGroup(cluster=c, tp=tp, dp=dp) for c, tp, dp in groups),
                 zero=zero)


# holders variants differing in exactly one thing the pricing reads
HOLDERS = {
    "base": [_st(("a", 1, 2)), _st(("b", 1, 2))],
    "dp": [_st(("a", 1, 4)), _st(("b", 1, 2))],  # a ring over both of a's nodes
    "tp": [_st(("a", 2, 2)), _st(("b", 1, 2))],
    "all-tp2": [_st(("a", 2, 2)), _st(("b", 2, 2))],
    "cluster": [_st(("a", 1, 2)), _st(("c", 1, 2))],
    "order": [_st(("b", 1, 2)), _st(("a", 1, 2))],
    "one-cluster": [_st(("a", 1, 2)), _st(("a", 1, 2))],
    "three": [_st(("a", 1, 2)), _st(("b", 1, 2)), _st(("c", 1, 2))],
    "groups": [_st(("a", 1, 2), ("b", 1, 2))],  # the same key as "base" (what the pricing reads is equal)
    "zero": [_st(("a", 1, 2), zero=1), _st(("b", 1, 2), zero=1)],  # ZeRO-1 sharded: the same all-reduce
}
RANGES = [(0, 6), (0, 3), (2, 6), (5, 6)]
PRECISIONS = ["native", "fp16"]


def test_allreduce_memo_equals_fresh_for_every_key_input() -> None:
    inst = _instance()
    tables = build_tables(inst)
    memo = SyncMemo(inst, tables)
    fresh = {}
    for _ in range(2):  # the second pass reads everything back from the memo
        for name, holders in HOLDERS.items():
            for lo, hi in RANGES:
                for prec in PRECISIONS:
                    want = segment_allreduce(inst, tables, holders, lo, hi, prec)
                    got = segment_allreduce(inst, tables, holders, lo, hi, prec, memo)
                    assert got == want, (name, lo, hi, prec)
                    assert segment_sync(inst, tables, holders, lo, hi, prec, memo) == \
                        segment_sync(inst, tables, holders, lo, hi, prec)
                    fresh[(name, lo, hi, prec)] = want
    # power: each key input changes the value somewhere, so a key without it would return a wrong one
    for name in HOLDERS:
        if name not in ("base", "groups", "zero"):
            assert fresh[(name, 0, 6, "fp16")] != fresh[("base", 0, 6, "fp16")], name
    assert fresh[("base", 0, 3, "native")] != fresh[("base", 2, 6, "native")] != fresh[("base", 0, 6, "native")]
    assert fresh[("base", 0, 3, "native")] != fresh[("base", 0, 3, "fp16")]


def test_bucket_memo_equals_fresh_for_every_key_input() -> None:
    inst = _instance()
    tables = build_tables(inst)
    memo = SyncMemo(inst, tables)
    fresh = {}
    for _ in range(2):
        for name, holders in HOLDERS.items():
            for lo, hi in RANGES:
                for mb in (4.0, 8.0, 25.0):
                    want = segment_buckets(inst, tables, holders, lo, hi, mb)
                    assert segment_buckets(inst, tables, holders, lo, hi, mb, memo) == want
                    for prec in PRECISIONS:
                        assert segment_bucket_syncs(inst, tables, holders, lo, hi, mb, prec, memo) == \
                            segment_bucket_syncs(inst, tables, holders, lo, hi, mb, prec)
                    fresh[(name, lo, hi, mb)] = want
    # 4 MB fp32 layers: 4 MiB buckets hold one layer, 8 MiB two of tp 1 or four of tp 2 (the tp matters)
    assert fresh[("base", 0, 6, 4.0)] != fresh[("base", 0, 6, 8.0)]
    assert fresh[("all-tp2", 0, 6, 8.0)] != fresh[("base", 0, 6, 8.0)]
    assert fresh[("base", 0, 6, 8.0)] != fresh[("base", 0, 3, 8.0)]
    # the ZeRO-1 rule: a sharded segment's buckets are reduce-scattered (the same buckets, other seconds)
    assert fresh[("zero", 0, 6, 8.0)] == fresh[("base", 0, 6, 8.0)]
    assert segment_bucket_syncs(inst, tables, HOLDERS["zero"], 0, 6, 8.0, "fp16", memo) != \
        segment_bucket_syncs(inst, tables, HOLDERS["base"], 0, 6, 8.0, "fp16", memo)
    # the memo's list is the caller's own: changing it does not change the memo
    got = segment_buckets(inst, tables, HOLDERS["base"], 0, 6, 8.0, memo)
    got.clear()
    assert segment_buckets(inst, tables, HOLDERS["base"], 0, 6, 8.0, memo) == fresh[("base", 0, 6, 8.0)]


def _plans() -> list[Plan]:
    out = []
    for cut in (2, 3, 4):
        for second in ("b", "c"):
            for zero in (0, 1):
                for tp in (1, 2):
                    stages = (_st(("a", tp, 1), lo=0, hi=cut, zero=zero), _st((second, 1, 1), lo=cut, hi=6, zero=zero))
                    other = (_st(("a", 1, 1), lo=0, hi=6 - cut, zero=zero), _st((second, 1, 1), lo=6 - cut, hi=6, zero=zero))
                    out.append(Plan(pipelines=(Pipeline(stages=stages, num_microbatches=4),
                                               Pipeline(stages=other, num_microbatches=4))))
    return out


@pytest.mark.parametrize("precision", ["native", "fp16"])
def test_evaluate_with_shared_memo_equals_evaluate_alone(precision: str) -> None:
    from dataclasses import replace

    inst = _instance()
    tables = build_tables(inst)
    memo = SyncMemo(inst, tables)
    plans = [replace(p, grad_sync_precision=precision, grad_bucket_mb=mb)  # type: ignore[call-arg]
             for p in _plans() for mb in (4.0, 25.0)]
    alone = [evaluate(p, inst, tables).to_dict() for p in plans]
    assert all(a["feasible"] for a in alone)
    assert len({a["iteration_time_s"] for a in alone}) > len(plans) // 2  # the plans are priced differently
    assert [evaluate(p, inst, tables, memo).to_dict() for p in plans] == alone
    assert [evaluate(p, inst, tables, memo).to_dict() for p in reversed(plans)] == alone[::-1]


def test_memo_refuses_other_tables_or_instance() -> None:
    inst = _instance()
    tables = build_tables(inst)
    memo = SyncMemo(inst, tables)
    plan = _plans()[0]
    with pytest.raises(ValueError):
        evaluate(plan, inst, build_tables(inst), memo)
    with pytest.raises(ValueError):
        segment_allreduce(_instance(), tables, HOLDERS["base"], 0, 6, "native", memo)
