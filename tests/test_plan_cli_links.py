"""`hgopt plan --link-precision`: honoured by the milp and heuristic planners, refused (not ignored) by
the others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.factories import tiny_model, tiny_topology


def _instance(tmp: Path) -> Path:
    # a slow WAN link (0.1 Gbit/s) between two clusters that each need the other to fit the batch fast
    data = {"name": "links", "model": tiny_model(num_layers=4),
            "topology": tiny_topology(wan_gbit_s=0.1, wan_latency_ms=1.0),
            "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}
    p = tmp / "links.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _split_instance(tmp: Path) -> Path:
    # three clusters whose GPUs hold at most 3 of the 5 layers each: every plan crosses a 0.5 Gbit/s link
    clusters = (("a", "A", 1, 2, 1.6), ("b", "B", 1, 2, 1.6), ("c", "C", 1, 2, 1.6))
    data = {"name": "split", "model": tiny_model(num_layers=5, gpus={"A": 0.01, "B": 0.02, "C": 0.013},
                                                 activation_bytes=2e7, params=2e7),
            "topology": tiny_topology(clusters=clusters, wan_gbit_s=0.5, wan_latency_ms=5.0),
            "job": {"global_batch": 4, "seq_len": 128, "precision": "fp32"}}
    p = tmp / "split.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hgopt", "plan", *args], capture_output=True, text=True, timeout=300)


def test_native_planners_refuse_link_precision_instead_of_ignoring_it(tmp_path: Path) -> None:
    r = _plan(str(_instance(tmp_path)), "--planner", "uniform", "--link-precision", "fp8")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--link-precision" in r.stderr and "--planner milp" in r.stderr


def test_heuristic_uses_only_the_allowed_precision(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = _plan(str(_instance(tmp_path)), "--planner", "heuristic", "--link-precision", "fp8", "--time-limit", "20",
              "-o", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    used = {b[k] for p in plan["pipelines"] for b in p.get("boundaries", []) for k in ("fwd", "bwd")}
    assert used <= {"native", "fp8"}


def test_milp_auto_with_one_compressed_link(tmp_path: Path) -> None:
    """`--planner milp --link-precision auto --max-compressed-links 1`: one inter-cluster boundary of
    the plan compressed, shown in the stage table, with a bound no higher than evaluate's time."""
    out = tmp_path / "plan.json"
    r = _plan(str(_split_instance(tmp_path)), "--planner", "milp", "--link-precision", "auto",
              "--max-compressed-links", "1", "--time-limit", "60", "--json", "-o", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == "optimal" and doc["lower_bound_s"] <= doc["iteration_time_s"] * (1 + 1e-9)
    assert "at most 1 compressed" in doc["plan_space"]
    pipe = json.loads(out.read_text())["pipelines"][0]
    cluster = [s["groups"][0]["cluster"] for s in pipe["stages"]]
    inter = [b for i, b in enumerate(pipe["boundaries"]) if cluster[i] != cluster[i + 1]]
    assert sum((b["fwd"], b["bwd"]) != ("native", "native") for b in inter) == 1
    table = _plan(str(_split_instance(tmp_path)), "--link-precision", "auto", "--max-compressed-links", "1",
                  "--time-limit", "60")
    assert table.returncode == 0 and "link to next" in table.stdout and "fp8" in table.stdout


def test_bad_link_penalty_names_the_option(tmp_path: Path) -> None:
    r = _plan(str(_instance(tmp_path)), "--link-precision", "auto", "--link-penalty", "fp9=1")
    assert r.returncode == 2 and "--link-penalty" in r.stderr and "Traceback" not in r.stderr


def test_heuristic_reads_the_link_penalty(tmp_path: Path) -> None:
    """The same option names reach the heuristic: fp8 costs 10 s per boundary, so auto uses bf16."""
    out = tmp_path / "plan.json"
    r = _plan(str(_split_instance(tmp_path)), "--planner", "heuristic", "--link-precision", "auto",
              "--link-penalty", "fp8=10", "--time-limit", "20", "-o", str(out))
    assert r.returncode == 0, r.stderr
    used = {b[k] for p in json.loads(out.read_text())["pipelines"] for b in p.get("boundaries", []) for k in ("fwd", "bwd")}
    assert "fp8" not in used and "bf16" in used
