"""Link emulation: cross-cluster transfers take at least bytes / bandwidth (delay mode: the runner
delays delivery; netns mode: tc tbf on veth pairs between namespaces, when this machine allows it),
and emulation changes timing only, never the numbers."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hgopt.export import ExportOptions, build_runner_plan, netns, write_export  # noqa: E402
from hgopt.runner.launch import run_forked  # noqa: E402
from hgopt.runner.reference import train_reference  # noqa: E402
from hgopt.runner.summary import read_metrics  # noqa: E402
from tests.runner_plans import plan_dp_tp, runner_instance  # noqa: E402

SCALE = 0.0005  # the tiny topology's 8 Gbit/s WAN -> 500 kB/s


def _export(tmp: Path, mode: str):  # type: ignore[no-untyped-def]
    rp = build_runner_plan(plan_dp_tp(), runner_instance(), ExportOptions(
        local=True, steps=4, master_port=0, emulate_links=mode, link_scale=SCALE))
    return rp, write_export(rp, tmp)


def _check(rp, out: Path) -> None:  # type: ignore[no-untyped-def]
    recs = read_metrics(out)
    assert len(recs) == 4
    link = rp.link("b", "a")
    assert link.bytes_per_s == pytest.approx(1e9 * SCALE)
    # stage 1's single leader sends every gradient byte over its one link: a lower bound per step
    back = recs[-1]["bytes"]["p0.b0.bwd.wan"]
    assert back == 8 * 32 * 64 * 4
    assert statistics.median(r["time_s"] for r in recs[1:]) >= back / link.bytes_per_s
    # the losses are those of single-process training (same data, same arithmetic)
    assert [r["loss"] for r in recs] == pytest.approx(train_reference(rp, 4)[1], rel=1e-6)


def test_delay_mode_slows_cross_cluster_transfers(tmp_path: Path) -> None:
    rp, _ = _export(tmp_path, "delay")
    assert run_forked(rp, tmp_path / "run", emulation="delay", timeout_s=120) == {r: 0 for r in range(4)}
    _check(rp, tmp_path / "run")


@pytest.mark.skipif(not netns.available(), reason="needs root and ip/tc to create network namespaces")
def test_netns_mode_shapes_links_and_cleans_up(tmp_path: Path) -> None:
    rp, files = _export(tmp_path, "netns")
    res = subprocess.run([sys.executable, "-m", "hgopt.runner", "--plan", str(files.plan), "--threads", "1"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "links: netns" in res.stderr
    _check(rp, tmp_path / "run")
    port = res.stderr.split("store 10.99.0.1:")[1].split(",")[0]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hg{port}c" not in left
