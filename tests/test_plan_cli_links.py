"""`hgopt plan --link-precision`: honoured by the heuristic, refused (not ignored) by other planners."""

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


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hgopt", "plan", *args], capture_output=True, text=True, timeout=300)


def test_milp_refuses_link_precision_instead_of_ignoring_it(tmp_path: Path) -> None:
    r = _plan(str(_instance(tmp_path)), "--link-precision", "fp8")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--link-precision" in r.stderr and "--planner heuristic" in r.stderr


def test_heuristic_uses_only_the_allowed_precision(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = _plan(str(_instance(tmp_path)), "--planner", "heuristic", "--link-precision", "fp8", "--time-limit", "20",
              "-o", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    used = {b[k] for p in plan["pipelines"] for b in p.get("boundaries", []) for k in ("fwd", "bwd")}
    assert used <= {"native", "fp8"}
