"""The shipped instances: each loads, ``hgopt instances --json`` lists it with the counts its YAML
holds (counted here from the raw YAML, not through the loader), each is trainable (a simple plan
fits in memory, judged by ``evaluate``), the required setups exist, and the Sailor instances equal a
fresh import of Sailor's data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hgopt.cli import main
from hgopt.cost import evaluate
from hgopt.cost.tables import build_tables
from hgopt.instances import list_instances, load_instance
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Instance, load_document, model_profile_from_dict, topology_from_dict

REPO = Path(__file__).resolve().parents[1]
SAILOR = REPO.parent / "shared" / "anchors" / "sailor"
SHIPPED = sorted([*REPO.glob("instances/*.yaml"), REPO / "hgopt" / "data" / "default.yaml"])


def _raw_counts(path: Path) -> dict[str, Any]:
    """Clusters, GPUs, GPU types and layers read straight from the YAML (and its profile JSON)."""
    data = yaml.safe_load(path.read_text())
    topo = data["topology"]
    if isinstance(topo, str):
        topo = load_document(path.parent / topo)
    clusters = topo["clusters"]
    model = data["model"]
    if isinstance(model, str):
        layers = len(json.loads((path.parent / model).read_text())["layers"])
    elif "hf_config" in model:  # a Hugging Face config.json (hfrunner)
        layers = json.loads((path.parent / model["hf_config"]).read_text())["num_hidden_layers"] + 2
    else:
        assert model["generator"] == "analytic"
        layers = model["layers"] + 2  # embedding + blocks + head
    return {
        "clusters": len(clusters),
        "gpus": sum(c["nodes"] * c["gpus_per_node"] for c in clusters),
        "gpu_types": sorted({c["gpu"] for c in clusters}),
        "layers": layers,
    }


def test_instances_json_lists_every_shipped_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["instances", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) >= {p.stem for p in SHIPPED}
    for p in SHIPPED:
        row, raw = rows[p.stem], _raw_counts(p)
        assert Path(row["path"]).resolve() == p.resolve()
        assert (row["clusters"], row["gpus"], row["layers"]) == (raw["clusters"], raw["gpus"], raw["layers"]), p.name
        assert sorted(row["gpu_types"]) == raw["gpu_types"] and row["error"] == ""


def test_instances_table_and_broken_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken.yaml").write_text("name: broken\nmodel: nope.json\ntopology: {}\njob: {}\n")
    monkeypatch.setenv("HGOPT_INSTANCES", str(tmp_path))
    assert main(["instances"]) == 2
    out = capsys.readouterr().out
    assert "sailor-het-32+96" in out and "ERROR" in out and "nope.json" in out


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_instance_loads_and_is_small(path: Path) -> None:
    inst = load_instance(path)
    assert inst.name == path.stem
    for ref in path.parent.glob("profiles/*.json"):
        assert ref.stat().st_size < 400_000, ref
    assert path.stat().st_size < 400_000


# ---- trainability -------------------------------------------------------------------------------
def simple_plan(inst: Instance) -> Plan | None:
    """One pipeline of tp-groups (dp 1, mbs 1, the widest profiled tp per cluster), roomiest GPUs
    first, each stage packed greedily with as many layers as fit in memory when ``S`` stages hold
    microbatches in flight (1F1B: stage i holds S - i). Tries S = 1, 2, ...; None if nothing fits."""
    tabs = build_tables(inst)
    groups = []
    for c in inst.topology.clusters:
        tps = [t for t in inst.model.tps(c.gpu) if c.gpus_per_node % t == 0]
        groups += [(c, max(tps))] * (c.num_gpus // max(tps)) if tps else []
    groups.sort(key=lambda g: -g[0].gpu_memory_bytes)
    L = inst.model.num_layers
    for S in range(1, len(groups) + 1):
        stages, lo = [], 0
        for i, (c, tp) in enumerate(groups[:S]):
            t = tabs.table(c.gpu, tp)

            def mem(hi: int) -> float:
                params = t.params[hi] - t.params[lo]
                return (params * (2 * tabs.dtype_bytes + tabs.optimizer_bytes_per_param)
                        + (S - i) * (t.act_mem[hi] - t.act_mem[lo]) + inst.job.workspace_bytes)

            hi = lo
            while hi < L and mem(hi + 1) <= c.gpu_memory_bytes * 0.98:
                hi += 1
            if hi > lo:
                stages.append(Stage(start=lo, end=hi, groups=(ReplicaGroup(cluster=c.name, tp=tp, dp=1, mbs=1),)))
                lo = hi
            if lo == L:
                pipe = Pipeline(stages=tuple(stages), num_microbatches=inst.job.global_batch)
                return Plan(pipelines=(pipe,), planner="test-greedy", instance=inst.name)
    return None


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_instance_is_trainable(path: Path) -> None:
    inst = load_instance(path)
    plan = simple_plan(inst)
    assert plan is not None, f"{path.stem}: the model does not fit in memory on any simple pipeline"
    ev = evaluate(plan, inst)
    assert ev.feasible, ev.violations
    assert 0 < ev.iteration_time_s < float("inf") and not any(s.oom for s in ev.stages)


# ---- the required set ---------------------------------------------------------------------------
def _by_name() -> dict[str, Instance]:
    return {e.name: load_instance(e.path) for e in list_instances()}


def test_required_instances_exist() -> None:
    insts = _by_name()
    for a100, v100 in ((32, 96), (80, 240), (128, 384), (16, 16)):
        inst = insts[f"sailor-het-{a100}+{v100}"]
        got = {c.gpu: c.num_gpus for c in inst.topology.clusters}
        assert got == {"A100-40": a100, "V100-16": v100} and inst.job.global_batch == 1024
        assert {c.region for c in inst.topology.clusters} == {"us-central1-a"} and inst.model.name == "OPT-350"
    neo = insts["sailor-gptneo-het-32+96"]
    assert neo.model.num_layers == 34 and neo.job.global_batch == 2048
    for n in (32, 80, 128):
        inst = insts[f"sailor-geo-5x{n}"]
        assert [c.num_gpus for c in inst.topology.clusters] == [n] * 5
        assert {c.region for c in inst.topology.clusters} == {
            "us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b"}
    geo = [i for name, i in insts.items() if name.startswith("geo-")]
    assert 5 <= len(geo) <= 6
    for inst in geo:
        assert 3 <= len(inst.topology.clusters) <= 8
        assert len({c.gpu for c in inst.topology.clusters}) >= 3
    assert any(len(i.topology.clusters) >= 8 and i.topology.num_gpus() >= 1024 and i.model.num_layers >= 80
               for i in insts.values())
    assert any(len(i.topology.clusters) >= 16 and i.topology.num_gpus() >= 4096 for i in insts.values())


def test_default_is_self_contained_and_small() -> None:
    entry = next(e for e in list_instances() if e.name == "default")
    pkg = REPO / "hgopt" / "data"
    assert entry.path.resolve() == (pkg / "default.yaml").resolve()
    raw = yaml.safe_load(entry.path.read_text())
    for part in ("model", "topology", "job"):
        if isinstance(raw[part], str):
            assert (pkg / raw[part]).resolve().is_relative_to(pkg.resolve())
    inst = load_instance("default")
    t = inst.topology
    assert len(t.clusters) == 3 and len({c.gpu for c in t.clusters}) == 3 and len({c.region for c in t.clusters}) == 3
    assert inst.model.num_layers <= 26
    for link in t.links:
        assert 1.0 <= link.bandwidth.gbyte_s * 8 <= 10.0 and 0.01 <= link.bandwidth.latency_s <= 0.1


# ---- reproducibility of the Sailor instances -------------------------------------------------------
@pytest.mark.skipif(not SAILOR.is_dir(), reason=f"Sailor's data not found at {SAILOR}")
def test_sailor_instances_equal_a_fresh_import() -> None:
    from hgopt.profiles.sailor import SailorCluster, import_sailor_profile, sailor_topology

    for name, model in (("sailor-opt-350", "OPT-350"), ("sailor-gpt-neo-2.7", "GPT-Neo-2.7")):
        shipped = model_profile_from_dict(json.loads((REPO / "instances" / "profiles" / f"{name}.json").read_text()))
        assert shipped == import_sailor_profile(SAILOR, model, ["A100-40", "V100-16"])
    inst = load_instance(REPO / "instances" / "sailor-geo-5x80.yaml")
    fresh = sailor_topology(SAILOR, [SailorCluster(zone=c.region, gpu="A100-40", count=80) for c in inst.topology.clusters])
    assert topology_from_dict(yaml.safe_load((REPO / "instances" / "sailor-geo-5x80.yaml").read_text())["topology"]) == fresh
