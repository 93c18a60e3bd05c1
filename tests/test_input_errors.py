"""Malformed inputs: each gives exit status 2, one line naming the file and the field, no traceback."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from tests.factories import tiny_model, tiny_topology

GOOD_PLAN = {
    "version": 1,
    "pipelines": [
        {"num_microbatches": 4, "stages": [
            {"layers": [0, 2], "groups": [{"cluster": "a", "dp": 2}]},
            {"layers": [2, 4], "groups": [{"cluster": "b", "dp": 2}]},
        ]}
    ],
}


def good_instance() -> dict[str, Any]:
    return {
        "name": "tiny",
        "model": tiny_model(),
        "topology": tiny_topology(),
        "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"},
    }


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for key in path[:-1]:
            d = d[key]
        if value is _DELETE:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return edit


_DELETE = object()

# (id, edit of the instance, expected field in the message, expected words)
INSTANCE_CASES = [
    ("missing-model-name", _set(["model", "name"], _DELETE), "model.name", "missing"),
    ("bad-layer-kind", _set(["model", "layers", 1, "kind"], "mlp"), "model.layers[1].kind", "one of"),
    ("short-timing-list", _set(["model", "timings", 0, "fwd"], [0.1, 0.1]), "model.timings[0].fwd", "expected 4 values"),
    ("zero-gpus-per-node", _set(["topology", "clusters", 0, "gpus_per_node"], 0), "topology.clusters[0].gpus_per_node", ">= 1"),
    ("duplicate-cluster", _set(["topology", "clusters", 1, "name"], "a"), "topology.clusters[1].name", "duplicate"),
    ("both-bandwidths", _set(["topology", "links", "default", "gbyte_s"], 3), "topology.links.default", "exactly one"),
    ("negative-latency", _set(["topology", "links", "default", "latency_ms"], -5), "topology.links.default.latency_ms", ">= 0"),
    ("no-link", _set(["topology", "links"], {}), "topology.links", "no bandwidth for link a -> b"),
    ("unknown-field", _set(["topology", "clusters", 0, "gpu_mem"], 40), "topology.clusters[0].gpu_mem", "unknown field"),
    ("precision-mismatch", _set(["job", "precision"], "bf16"), "job", "differs from the model profile's dtype"),
    ("gpu-not-profiled", _set(["topology", "clusters", 1, "gpu"], "H100"), "topology.clusters[1].gpu", "no timings"),
    ("string-batch", _set(["job", "global_batch"], "lots"), "job.global_batch", "expected an integer"),
    ("link-to-nowhere", _set(["topology", "links", "pairs"], [{"src": "a", "dst": "z", "gbit_s": 1}]),
     "topology.links.pairs[0].dst", "unknown cluster 'z'"),
]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hgopt", *args], capture_output=True, text=True, timeout=120)


def write(tmp: Path, name: str, data: Any) -> Path:
    p = tmp / name
    p.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    return p


def test_the_good_inputs_evaluate(tmp_path: Path) -> None:
    r = run_cli("evaluate", str(write(tmp_path, "i.yaml", good_instance())), str(write(tmp_path, "p.json", GOOD_PLAN)))
    assert r.returncode == 0, r.stderr
    assert "feasible" in r.stdout


@pytest.mark.parametrize("case", INSTANCE_CASES, ids=[c[0] for c in INSTANCE_CASES])
def test_malformed_instance(tmp_path: Path, case: tuple[str, Any, str, str]) -> None:
    _, edit, field, words = case
    data = copy.deepcopy(good_instance())
    edit(data)
    inst = write(tmp_path, "inst.yaml", data)
    r = run_cli("evaluate", str(inst), str(write(tmp_path, "p.json", GOOD_PLAN)))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert str(inst) in r.stderr and field in r.stderr and words in r.stderr, r.stderr


def test_yaml_syntax_error_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: x\nmodel: [unclosed\n")
    r = run_cli("show", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "broken.yaml" in r.stderr and "not valid YAML" in r.stderr


@pytest.mark.parametrize(
    "plan_edit, field, words",
    [
        (lambda p: p.update(version=7), "version", "unsupported plan version"),
        (lambda p: p["pipelines"][0]["stages"][0].update(layers=[0]), "pipelines[0].stages[0].layers", "two integers"),
        (lambda p: p["pipelines"][0].update(schedule="zigzag"), "pipelines[0].schedule", "one of"),
        (lambda p: p["pipelines"][0]["stages"][1]["groups"][0].update(tp="two"), "pipelines[0].stages[1].groups[0].tp", "integer"),
    ],
)
def test_malformed_plan(tmp_path: Path, plan_edit: Any, field: str, words: str) -> None:
    plan = copy.deepcopy(GOOD_PLAN)
    plan_edit(plan)
    p = write(tmp_path, "plan.json", plan)
    r = run_cli("evaluate", str(write(tmp_path, "i.yaml", good_instance())), str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert str(p) in r.stderr and field in r.stderr and words in r.stderr, r.stderr


def test_plan_that_violates_the_instance_exits_1_listing_every_violation(tmp_path: Path) -> None:
    plan = copy.deepcopy(GOOD_PLAN)
    plan["pipelines"][0]["stages"][1]["groups"][0].update(cluster="zz")
    plan["pipelines"][0]["stages"][0]["groups"][0].update(tp=3, dp=9)
    r = run_cli("evaluate", str(write(tmp_path, "i.yaml", good_instance())), str(write(tmp_path, "p.json", plan)))
    assert r.returncode == 1
    assert "unknown cluster 'zz'" in r.stdout
    assert "tp 3 does not divide" in r.stdout
    assert "uses 27 GPUs, the cluster has 4" in r.stdout
    assert "samples per iteration add up to" in r.stdout
