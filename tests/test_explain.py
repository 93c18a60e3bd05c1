"""``hgopt.explain``: utilisation, MFU and dollars from evaluate's reports, checked by hand on a tiny
instance; why-not lines from the heuristic with a cluster required; infeasibility with numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import hgopt.explain as explain_mod
from hgopt.cli import main
from hgopt.cost import build_tables, evaluate
from hgopt.errors import SpecError
from hgopt.explain import explain, infeasibility, why_not
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Instance
from tests.factories import tiny_instance, tiny_model, tiny_topology

# GPU names from the GPU table (hgopt/profiles/gpus.py): A100-40 peaks at 19.5 TFLOP/s in fp32
GPUS = {"A100-40": 0.01, "V100-16": 0.02}


def _inst(price_a: float | None = 3.6, mem: float = 40.0, flops: float | None = None) -> Instance:
    model = tiny_model(gpus=GPUS)
    if flops is not None:
        for layer in model["layers"]:
            layer["flops"] = flops
    topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, mem), ("b", "V100-16", 2, 2, mem)))
    if price_a is not None:
        topo["clusters"][0]["cost_per_gpu_hour"] = price_a
    return tiny_instance(global_batch=8, model=model, topology=topo)


def _plan_on_a() -> Plan:
    """4 replicas on cluster a, tp 1, mbs 1, 2 microbatches (8 samples)."""
    return Plan(pipelines=(Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster="a", dp=4, mbs=1),)),),
                                    num_microbatches=2),))


def test_busy_share_and_dollars_by_hand() -> None:
    inst, plan = _inst(), _plan_on_a()
    ev = evaluate(plan, inst)
    T = ev.iteration_time_s
    e = explain(plan, inst, ev)
    a, b = e.clusters
    # per GPU: m = 2 microbatches x (forward 4 layers x 0.01 s + backward 4 x 0.02 s)
    assert a.gpus_used == 4 and a.busy_share == pytest.approx(2 * (0.04 + 0.08) / T)
    assert b.gpus_used == 0 and b.busy_share is None
    assert e.money.gpu_usd_per_iteration == pytest.approx(4 * 3.6 * T / 3600)
    assert e.money.usd_per_million_tokens == pytest.approx(4 * 3.6 * T / 3600 / (8 * 128) * 1e6)
    assert e.money.egress_usd_per_iteration is None  # no link has an egress price
    assert e.stages[0].peak_memory_bytes == ev.stages[0].peak_memory_bytes
    assert json.dumps(e.to_dict())  # JSON-able, no inf/nan


def test_unpriced_cluster_and_missing_flops_say_why() -> None:
    inst, plan = _inst(price_a=None), _plan_on_a()
    e = explain(plan, inst)
    assert e.money.usd_per_iteration is None and "no cost_per_gpu_hour for a" in e.money.notes[0]
    assert e.mfu is None and "no per-layer FLOPs" in e.mfu_note
    assert e.clusters[0].mfu is None and "no per-layer FLOPs" in e.clusters[0].mfu_note


def test_mfu_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 1e12 forward FLOPs per sample per layer: 3 x 4 layers x 1e12 x 8 samples per iteration
    over 4 GPUs x T x 19.5e12 (A100-40's fp32 datasheet peak)."""
    inst, plan = _inst(), _plan_on_a()
    monkeypatch.setattr(explain_mod, "_layer_flops", lambda instance: [1e12] * 4)
    e = explain(plan, inst)
    T = evaluate(plan, inst).iteration_time_s
    want = 3 * 4 * 1e12 * 8 / (4 * T * 19.5e12)
    assert e.clusters[0].mfu == pytest.approx(want) and e.mfu == pytest.approx(want)


def test_mfu_from_the_profile_field() -> None:
    try:
        inst = _inst(flops=1e12)
    except SpecError:
        pytest.skip("this checkout's model profiles have no per-layer `flops` field yet")
    T = evaluate(_plan_on_a(), inst).iteration_time_s
    assert explain(_plan_on_a(), inst).mfu == pytest.approx(3 * 4 * 1e12 * 8 / (4 * T * 19.5e12))


def test_why_not_names_the_idle_cluster_with_evaluates_time() -> None:
    inst, plan = _inst(), _plan_on_a()
    ev = evaluate(plan, inst)
    (w,) = why_not(plan, inst, ev, time_limit_s=5.0)
    assert w.cluster == "b" and w.gpus_used == 0 and w.planner == "heuristic"
    assert w.alternative_s is not None and dict(w.alternative_gpus).get("b", 0) > 0
    assert w.slower == pytest.approx(w.alternative_s / ev.iteration_time_s - 1)
    # b's V100-16 computes at half the speed and has no price: the alternative is not cheaper to know
    assert w.costlier is None


def test_why_not_alternative_is_a_real_plan_scored_by_evaluate() -> None:
    """The heuristic with require_clusters returns a plan using the cluster; its time is evaluate's."""
    from hgopt.search import PlanOptions, get_planner

    inst = _inst()
    res = get_planner("heuristic")(inst, PlanOptions(time_limit_s=5.0, extra={"require_clusters": "b"}))
    assert res.plan is not None and "b" in res.plan.gpus_by_cluster()
    assert res.iteration_time_s == pytest.approx(evaluate(res.plan, inst).iteration_time_s)
    with pytest.raises(ValueError, match="unknown cluster"):
        get_planner("heuristic")(inst, PlanOptions(time_limit_s=5.0, extra={"require_clusters": "zz"}))


def _fullest_by_hand(inst: Instance, layout: list[tuple[str, int, int]]) -> tuple[float, float]:
    """(peak bytes, capacity) of the stage closest to its limit; layout = (cluster, start, end), tp 2."""
    plan = Plan(pipelines=(Pipeline(stages=tuple(
        Stage(start=lo, end=hi, groups=(ReplicaGroup(cluster=c, tp=2, dp=1, mbs=1),)) for c, lo, hi in layout),
        num_microbatches=8),))
    ev = evaluate(plan, inst, build_tables(inst))
    s = max(ev.stages, key=lambda s: s.peak_memory_bytes / s.memory_capacity_bytes)
    return s.peak_memory_bytes, s.memory_capacity_bytes


def test_infeasibility_names_memory_with_evaluates_numbers() -> None:
    inst = _inst(mem=0.01)  # 10 MB GPUs: nothing fits
    lines = infeasibility(inst)
    # cluster a by hand: tp 2 (largest profiled), mbs 1, pp 2 = min(4 GPUs / 2, 4 layers) or halved to 1
    pp2 = _fullest_by_hand(inst, [("a", 0, 2), ("a", 2, 4)])
    pp1 = _fullest_by_hand(inst, [("a", 0, 4)])
    (need, cap), pp = min(((pp2, 2), (pp1, 1)), key=lambda x: x[0][0] / x[0][1])
    assert lines[0].startswith(f"a: the smallest replica (tp 2 x pp {pp}, microbatch size 1)")
    assert f"needs {need / 1e9:.1f} GB per GPU" in lines[0] and "does not fit" in lines[0]
    # one pipeline over a and b: 2 layers each (equal memory), 2 stages per cluster or 1
    deep = _fullest_by_hand(inst, [("a", 0, 1), ("a", 1, 2), ("b", 2, 3), ("b", 3, 4)])
    flat = _fullest_by_hand(inst, [("a", 0, 2), ("b", 2, 4)])
    need, cap = min((deep, flat), key=lambda x: x[0] / x[1])
    assert lines[-1].startswith("memory binds") and f"needs {need / 1e9:.1f} GB per GPU" in lines[-1]


def test_plan_cli_explains_and_infeasible_names_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ok = tmp_path / "ok.yaml"
    bad = tmp_path / "bad.yaml"
    for path, mem in ((ok, 40.0), (bad, 0.01)):
        topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, mem), ("b", "V100-16", 2, 2, mem)))
        path.write_text(json.dumps({"name": path.stem, "model": tiny_model(gpus=GPUS), "topology": topo,
                                    "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}))
    assert main(["plan", str(ok), "--planner", "heuristic", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "peak mem/GPU" in out and "busy" in out and "cost " in out
    assert main(["plan", str(ok), "--planner", "heuristic", "--time-limit", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    used = {c["name"] for c in doc["explanation"]["clusters"] if c["gpus_used"]}
    idle = {c["name"] for c in doc["explanation"]["clusters"] if not c["gpus_used"]}
    assert {w["cluster"] for w in doc["explanation"]["why_not"] if w["gpus_used"] == 0} == idle
    assert used and all(math.isfinite(c["busy_share"]) for c in doc["explanation"]["clusters"] if c["gpus_used"])
    assert main(["plan", str(bad), "--planner", "heuristic", "--time-limit", "5"]) == 1
    out = capsys.readouterr().out
    assert "why no plan fits" in out and "does not fit" in out and "GB per GPU" in out


def test_egress_is_priced_per_link_from_the_kernels_wan_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 GB a -> b and 1 GB b -> a per iteration at $0.02 and $0.05 per GB: $0.15 of egress on top of
    the GPU-hours. (The WAN bytes come from the cost kernel; here a stand-in with known numbers.)"""
    import dataclasses
    import importlib
    from types import SimpleNamespace

    inst, plan = _inst(), _plan_on_a()
    ev = evaluate(plan, inst)
    price = {("a", "b"): 0.02, ("b", "a"): 0.05}
    links = tuple(SimpleNamespace(src=l.src, dst=l.dst, bandwidth=l.bandwidth, egress_usd_per_gb=price[(l.src, l.dst)])
                  for l in inst.topology.links)
    priced = dataclasses.replace(inst, topology=dataclasses.replace(inst.topology, links=links))
    e = explain(plan, priced, ev)
    assert e.money.egress_usd_per_iteration == 0.0  # the kernel's WAN bytes of a one-cluster plan: none
    monkeypatch.setattr(importlib.import_module("hgopt.cost.money"), "wan_bytes_per_iteration",
                        lambda p, i, t: {("a", "b"): 5e9, ("b", "a"): 1e9}, raising=False)
    e = explain(plan, priced, ev)
    assert e.money.egress_usd_per_iteration == pytest.approx(5 * 0.02 + 1 * 0.05)
    assert e.money.usd_per_iteration == pytest.approx(4 * 3.6 * ev.iteration_time_s / 3600 + 0.15)


# ---- --time-limit bounds the whole `hgopt plan` (lead's decision of 12:14) ---------------------------
def test_why_not_budget() -> None:
    from hgopt.commands.plan import WHY_NOT_MIN_S, why_not_budget

    from hgopt.commands._deadline import POST_RESERVE_S

    # default: what the search left of the limit, less what explain and the output keep (deadline)
    assert why_not_budget(10.0, None, 3.0) == (7.0 - POST_RESERVE_S, "")
    assert why_not_budget(10.0, 4.0, 50.0) == (4.0, "")  # explicit: extra time on top
    assert why_not_budget(10.0, 0.0, 1.0) == (0.0, "")  # explicit 0: left out, nothing said
    budget, note = why_not_budget(10.0, None, 10.0 - WHY_NOT_MIN_S / 2)
    assert budget == 0.0 and "--time-limit of 10 s" in note and "--why-not-time S" in note


def _tiny_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    topo = tiny_topology(clusters=(("a", "A100-40", 2, 2, 40.0), ("b", "V100-16", 2, 2, 40.0)))
    path.write_text(json.dumps({"name": "tiny", "model": tiny_model(gpus=GPUS), "topology": topo,
                                "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}))
    return path


def test_why_not_lines_get_what_the_search_left_of_the_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import time

    import hgopt.commands.plan as plan_cmd

    calls: list[tuple[float, float]] = []
    real = plan_cmd.why_not

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append((kw["time_limit_s"], time.monotonic()))
        return real(*a, **kw)

    monkeypatch.setattr(plan_cmd, "why_not", spy)
    start = time.monotonic()
    assert main(["plan", str(_tiny_file(tmp_path)), "--planner", "heuristic", "--time-limit", "30"]) == 0
    ((budget, at),) = calls
    from hgopt.commands._deadline import POST_RESERVE_S

    # the rest of the limit, measured from the command's start, less what explain and the output keep (deadline)
    assert 30 - (at - start) - POST_RESERVE_S <= budget <= 30
    assert main(["plan", str(_tiny_file(tmp_path)), "--planner", "heuristic", "--time-limit", "30",
                 "--why-not-time", "3"]) == 0
    assert calls[-1][0] == 3.0  # explicit: on top
    capsys.readouterr()


def test_a_search_that_uses_the_whole_limit_leaves_no_why_not_lines_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    import hgopt.commands.plan as plan_cmd
    from hgopt.search import PlanResult

    def slow(name: str):  # type: ignore[no-untyped-def]
        def planner(instance: Instance, options) -> PlanResult:  # type: ignore[no-untyped-def]
            end = time.monotonic() + options.time_limit_s  # uses its whole budget (no sleep: a busy wait)
            while time.monotonic() < end:
                pass
            plan = _plan_on_a()
            return PlanResult(planner="fake", status="heuristic", plan=plan,
                              iteration_time_s=evaluate(plan, instance).iteration_time_s)
        return planner

    ran: list[object] = []
    monkeypatch.setattr(plan_cmd, "get_planner", slow)
    monkeypatch.setattr(plan_cmd, "why_not", lambda *a, **kw: ran.append(a) or ())
    assert main(["plan", str(_tiny_file(tmp_path)), "--planner", "heuristic", "--time-limit", "0.3"]) == 0
    out = capsys.readouterr().out
    assert not ran and "why-not lines skipped: the search used the whole --time-limit of 0.3 s" in out


def test_plan_returns_within_its_time_limit_plus_slack() -> None:
    """The lead's check (issue #11's bound max(1.1 T, T + 2 s), plus a generous 20 s for a loaded
    machine): `hgopt plan default --time-limit 2`, in process (no interpreter start-up)."""
    import time

    start = time.monotonic()
    assert main(["-q", "plan", "default", "--time-limit", "2", "--json"]) == 0
    assert time.monotonic() - start < max(1.1 * 2, 2 + 2) + 20
