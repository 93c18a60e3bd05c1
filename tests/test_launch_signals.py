"""The local launcher (`python -m hgopt.runner --plan ...`): start-up progress lines while the ranks
connect, and SIGTERM forwarded to every rank, ending with status 143 and no traceback. Waits for
lines and processes (generous timeouts), never for fixed times."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hgopt.export import ExportOptions, build_runner_plan, write_export  # noqa: E402
from tests.runner_plans import plan_dp_tp, runner_instance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_startup_progress_and_sigterm_forwarded(tmp_path: Path) -> None:
    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(
        local=True, steps=100_000, master_port=0, heartbeat_timeout_s=30.0, timeout_s=120))
    files = write_export(rp, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan), "--threads", "1"],
                                stderr=subprocess.PIPE, text=True, env=env)
    assert launcher.stderr is not None
    seen: list[str] = []
    guard = threading.Timer(600, launcher.kill)  # a broken launcher must not hang the suite
    guard.start()
    try:
        for line in launcher.stderr:
            seen.append(line)
            if line.startswith("[launcher] rendezvous ") and line.split()[2] != "0/4":
                break  # at least one rank has reached the store
        else:
            pytest.fail("no rendezvous progress line:\n" + "".join(seen[-40:]))
        pids = json.loads((tmp_path / "run" / "pids.json").read_text())
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        guard.cancel()
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    err = "".join(seen) + err
    assert launcher.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "[launcher] SIGTERM: stopping" in err
    end = time.monotonic() + 30
    while any(_alive(int(p)) for p in pids.values()) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_alive(int(p)) for p in pids.values())
