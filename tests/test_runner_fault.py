"""A rank killed mid-run: the others exit on their own, non-zero, within the heartbeat timeout, with a
message naming the dead rank; the checkpoint written before the kill resumes. Runs the real launcher
(`python -m hgopt.runner --plan ...`) as a subprocess, one process per rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hgopt.export import ExportOptions, build_runner_plan, write_export  # noqa: E402
from hgopt.runner.launch import run_forked  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from tests.runner_plans import plan_dp_tp, runner_instance  # noqa: E402

HEARTBEAT_S = 3.0
EXIT_GRACE_S = 3.0
"""The launcher's grace (``--exit-grace``) in the stopped-rank case: ample for the healthy ranks, which exit
within a heartbeat beat of each other once the watchdogs noticed."""


def _wait_for(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_killed_rank_stops_everyone_with_its_name(tmp_path: Path) -> None:
    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(
        local=True, steps=100_000, checkpoint_every=1, master_port=0, heartbeat_timeout_s=HEARTBEAT_S, timeout_s=60))
    files = write_export(rp, tmp_path)
    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan), "--threads", "1"],
                                stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(read_metrics(out)) >= 2, 120, "two training steps")
        pids = json.loads((out / "pids.json").read_text())
        killed = time.monotonic()
        os.kill(pids["2"], signal.SIGKILL)
        _, err = launcher.communicate(timeout=HEARTBEAT_S + 40)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    elapsed = time.monotonic() - killed
    assert launcher.returncode == 1, err[-3000:]
    assert elapsed < HEARTBEAT_S + 25, f"took {elapsed:.1f} s to stop"
    dead = "rank 2 (cluster b, pipeline 0 stage 1 replica 0 tp rank 0)"
    for r in (0, 1, 3):  # every survivor says itself who died, and exits without the launcher's help
        lines = [ln for ln in err.splitlines() if ln.startswith(f"[rank {r}] rank {r}: stopping")]
        assert lines and dead in lines[0], f"rank {r}: {lines}\n{err[-3000:]}"
    assert "killing them" not in err
    assert f"{dead} exited first (status -9)" in err
    # a stopped run loses at most the last interval (1 step): resume one step past the checkpoint
    done = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    assert done >= max(r["step"] for r in read_metrics(out)) - 1
    before = len(read_metrics(out))
    codes = run_forked(rp, out, steps=done + 1, resume=True, timeout_s=120)
    assert codes == {r: 0 for r in range(4)}
    assert [r["step"] for r in read_metrics(out)[before:]] == [done + 1]  # one step: started from the checkpoint


def test_stopped_rank_is_the_one_the_launcher_blames(tmp_path: Path) -> None:
    """A SIGSTOPped rank never exits by itself: a healthy rank that noticed it exits first. The launcher's
    last line must still name the rank the watchdogs found dead, not the first one to exit."""
    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(
        local=True, steps=100_000, master_port=0, heartbeat_timeout_s=HEARTBEAT_S, timeout_s=60))
    files = write_export(rp, tmp_path)
    out = tmp_path / "run"
    # The healthy ranks exit HEARTBEAT_S after the stop; the stopped one never does: the launcher kills it
    # EXIT_GRACE_S after the first of them exited (the default grace, heartbeat + 10 s, would idle 10 s more).
    launcher = subprocess.Popen([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan), "--threads", "1",
                                 "--exit-grace", str(EXIT_GRACE_S)], stderr=subprocess.PIPE, text=True)
    pids: dict[str, int] = {}
    try:
        _wait_for(lambda: len(read_metrics(out)) >= 2, 120, "two training steps")
        pids = json.loads((out / "pids.json").read_text())
        os.kill(pids["2"], signal.SIGSTOP)
        _, err = launcher.communicate(timeout=HEARTBEAT_S + 60)
    finally:
        if pids:
            try:
                os.kill(pids["2"], signal.SIGCONT)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, err[-3000:]
    last = [ln for ln in err.splitlines() if "run failed:" in ln][-1]
    dead = "rank 2 (cluster b, pipeline 0 stage 1 replica 0 tp rank 0)"
    assert last.split("run failed: ", 1)[1].startswith(f"{dead} stopped responding"), last
    # the launcher killed the stopped rank itself (it never exits on its own) ...
    kills = [ln for ln in err.splitlines() if "killing them" in ln]
    assert len(kills) == 1, f"{kills}\n{err[-3000:]}"
    left = json.loads(kills[0].split("ranks ", 1)[1].split(" still running", 1)[0])
    assert 2 in left, kills[0]
    # ... and only after the grace: the survivors (had time to) say themselves who died
    for r in (0, 1, 3):
        if r not in left:
            lines = [ln for ln in err.splitlines() if ln.startswith(f"[rank {r}] rank {r}: stopping")]
            assert lines and dead in lines[0], f"rank {r}: {lines}\n{err[-3000:]}"


@pytest.mark.parametrize("grace", [-1.0, float("nan"), float("inf")])
def test_exit_grace_must_be_finite_and_non_negative(tmp_path: Path, grace: float) -> None:
    from hgopt.runner.launch import LaunchOptions

    with pytest.raises(ValueError, match="exit_grace_s"):
        LaunchOptions(out_dir=tmp_path, exit_grace_s=grace)
    assert LaunchOptions(out_dir=tmp_path, exit_grace_s=0.0).exit_grace_s == 0.0
