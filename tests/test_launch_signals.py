"""The local launcher (`python -m hgopt.runner --plan ...`): start-up progress lines while the ranks
connect, and SIGTERM forwarded to every rank, ending with status 143 and no traceback. Waits for
lines and processes (generous timeouts), never for fixed times."""

from __future__ import annotations

import json
import os
import queue
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


@pytest.mark.parametrize("mode", ["off", "delay", "netns"])
def test_startup_progress_and_sigterm_forwarded(tmp_path: Path, mode: str) -> None:
    """In every link-emulation mode (netns: the store runs in a helper inside a namespace the launcher
    cannot reach, and the helper reports the ranks connected)."""
    from hgopt.export import netns

    if mode == "netns" and not netns.available():
        pytest.skip("needs root and ip/tc to create network namespaces")
    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(
        local=True, steps=100_000, master_port=0, heartbeat_timeout_s=30.0, timeout_s=120, emulate_links=mode))
    files = write_export(rp, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan), "--threads", "1"],
                                stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    assert launcher.stderr is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:  # the ranks inherit the pipe: a reader thread, so that no wait here can hang
        assert launcher.stderr is not None
        for line in launcher.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []

    def take(until: float) -> str | None:
        try:
            line = lines.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            return None
        if line is not None:
            seen.append(line)
        return line

    try:
        end = time.monotonic() + 300  # generous: 4 interpreters importing torch on a loaded machine
        while True:
            line = take(end)
            if line is None:
                pytest.fail("no rendezvous progress line:\n" + "".join(seen[-40:]))
            if line.startswith("[launcher] rendezvous ") and line.split()[2] != "0/4":
                break  # at least one rank has reached the store
        pids = json.loads((tmp_path / "run" / "pids.json").read_text())
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
        end = time.monotonic() + 30
        while take(end) is not None:
            pass
    finally:
        if launcher.poll() is None:  # a broken launcher: stop it (it tears down namespaces), then its group
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    err = "".join(seen)
    assert launcher.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "[launcher] SIGTERM: stopping" in err
    assert f"links: {mode}" in err
    end = time.monotonic() + 30
    while any(_alive(int(p)) for p in pids.values()) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_alive(int(p)) for p in pids.values())
    if mode == "netns":  # the namespaces are gone
        port = err.split("store 10.99.0.1:")[1].split(",")[0]
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"hg{port}c" not in left
