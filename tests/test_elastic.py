"""``python -m hgopt.runner --elastic`` (issue 14): SIGKILL one rank of a 2-cluster local run at step 5;
the survivors stop, the launcher re-plans without the lost node, re-exports and resumes from the last
checkpoint; the run reaches step 10 on the remaining ranks, the log names the restart and its reason,
and the parameters are those of never stopping (float64). Runs the real launcher as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from hgopt.export import ExportOptions, build_runner_plan, write_export  # noqa: E402
from hgopt.export.elastic import read_elastic_source, write_elastic_source  # noqa: E402
from hgopt.runner.checkpoint import load_full_state  # noqa: E402
from hgopt.runner.elastic import dead_rank  # noqa: E402
from hgopt.runner.reference import train_reference  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from hgopt.search import PlanOptions, get_planner  # noqa: E402
from tests.test_replan_resume import instance  # noqa: E402

HEARTBEAT_S = 6.0  # a loaded 2-core machine starves heartbeat threads at start-up: 3 s gave false deaths


def test_dead_rank_is_the_silent_one_not_the_first_to_exit() -> None:
    assert dead_rank({"reason": "rank 2 (cluster b, pipeline 0 stage 0 replica 1 tp rank 0) stopped responding "
                                "(no heartbeat for 3.1 s)", "first": (0, 1)}) == 2
    assert dead_rank({"reason": None, "first": (3, -9)}) == 3
    assert dead_rank({"reason": "rank 1 (cluster a, ...) failed: RuntimeError: boom", "first": (1, 1)}) is None


def test_elastic_run_survives_a_killed_rank(tmp_path: Path) -> None:
    inst = instance()
    plan = get_planner("heuristic")(inst, PlanOptions(time_limit_s=5)).plan
    assert plan is not None and set(plan.gpus_by_cluster()) == {"a", "b"}
    opts = ExportOptions(dtype="float64", checkpoint_format="dcp", local=True, master_port=0, steps=10,
                         checkpoint_every=1, heartbeat_timeout_s=HEARTBEAT_S, timeout_s=60, emulate_links="delay",
                         link_scale=1e-3)  # slow WAN: a few steps per second, so the kill lands near step 5
    rp = build_runner_plan(plan, inst, opts)
    files = write_export(rp, tmp_path)
    write_elastic_source(tmp_path, plan, inst, opts)
    back = read_elastic_source(tmp_path / "elastic.json")
    assert (back.plan, back.instance.topology, back.instance.model, back.export) == (plan, inst.topology, inst.model, opts)
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan), "--threads", "1",
                                 "--elastic", "--max-restarts", "1"], stderr=subprocess.PIPE, text=True, env=env)
    victim = next(r.rank for r in rp.ranks() if r.cluster == "b")
    try:
        end = time.monotonic() + 180
        while len(read_metrics(out)) < 5:
            assert launcher.poll() is None and time.monotonic() < end, "no 5 steps"
            time.sleep(0.05)
        killed_at = max(r["step"] for r in read_metrics(out))
        os.kill(json.loads((out / "pids.json").read_text())[str(victim)], signal.SIGKILL)
        _, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err[-4000:]
    assert killed_at < 10
    (restart,) = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
    assert restart["dead_rank"] == victim and restart["change"] == "cluster=b:-1"
    assert "stopped responding" in restart["reason"] and f"rank {victim} (cluster b" in restart["reason"]
    assert restart["resume_step"] >= killed_at - 1  # a checkpoint every step: at most one step lost
    assert "elastic: restart 1/1" in err and f"rank {victim} (cluster b" in err
    by_step = {r["step"]: r for r in read_metrics(out)}  # a re-run step replaces its earlier record
    assert sorted(by_step) == list(range(1, 11))
    after = [by_step[s] for s in range(restart["resume_step"] + 1, 11)]
    assert after and all(len(r["ranks"]) == restart["world_size"] < rp.world_size for r in after)
    ref, losses = train_reference(rp, 10)
    got = load_full_state(out)
    assert max(float((p.detach() - got[n]).abs().max()) for n, p in ref.named_parameters()) <= 1e-12
    assert [by_step[s]["loss"] for s in range(1, 11)] == pytest.approx(losses, rel=1e-12)  # the curve goes on
