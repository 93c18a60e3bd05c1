"""deadline2 (issue #11 item 5): the same input, ``--time-limit`` and ``--seed`` give the same plan when
the search completes, whatever the process's string-hash seed (``PYTHONHASHSEED``: the iteration
order of every set or dict keyed by cluster names) — run as separate processes, as a user would.

A search that did not complete (not ``optimal`` within ``--gap`` for the exact planner; this instance
has a faster grouped plan, so its proven gap is about 6 % and the runs use ``--gap 0.1``) promises
nothing here: the test is then skipped, naming why (it depends on the machine's speed, which no verdict
may)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.factories import tiny_model, tiny_topology

ROOT = Path(__file__).resolve().parents[1]


def _three_clusters() -> dict[str, Any]:
    topo = tiny_topology(clusters=(("c-east", "A100-40", 2, 2, 40.0), ("a-west", "V100-16", 2, 2, 16.0),
                                   ("b-north", "A100-40", 1, 2, 40.0)))
    return {"name": "det3", "model": tiny_model(gpus={"A100-40": 0.01, "V100-16": 0.02}), "topology": topo,
            "job": {"global_batch": 16, "seq_len": 128, "precision": "fp32", "recompute": "auto"}}


def _plan(path: Path, planner: str, hash_seed: int, *extra: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    p = subprocess.run([sys.executable, "-m", "hgopt", "-q", "plan", str(path), "--planner", planner, "--json",
                        "--time-limit", "30", "--why-not-time", "0", "--seed", "3", *extra],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    doc: dict[str, Any] = json.loads(p.stdout)
    return doc


def _label_free(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if k != "meta"}  # meta carries timings


@pytest.mark.parametrize("planner,extra", [("milp", ("--gap", "0.1")), ("milp", ("--gap", "0.1", "--link-precision", "auto")),
                                           ("heuristic", ())])
def test_the_same_input_limit_and_seed_give_the_same_plan_under_any_hash_seed(
        tmp_path: Path, planner: str, extra: tuple[str, ...]) -> None:
    path = tmp_path / "det3.json"
    path.write_text(json.dumps(_three_clusters()))
    a, b = (_plan(path, planner, h, *extra) for h in (1, 2))
    if planner == "milp" and not (a["status"] == b["status"] == "optimal"):
        pytest.skip(f"the search did not complete ({a['status']}, {b['status']}): no promise of the same plan")
    assert a["plan"] is not None
    assert _label_free(a["plan"]) == _label_free(b["plan"])
    assert a["iteration_time_s"] == b["iteration_time_s"] and a["status"] == b["status"]
