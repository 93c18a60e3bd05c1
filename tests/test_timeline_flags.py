"""`--timeline` on plan, evaluate and compare hands the plan and its planner variant to
report.plot_timeline; output paths are checked before any search starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import hgopt.commands.plan as plan_cmd
import hgopt.report as report
from hgopt.cli import main
from hgopt.plan import Plan
from tests.factories import tiny_model, tiny_topology


def _instance_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps({"name": "tiny", "model": tiny_model(), "topology": tiny_topology(),
                                "job": {"global_batch": 8, "seq_len": 128, "precision": "fp32"}}))
    return path


@pytest.fixture()
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def fake(plan: Plan, instance: object, path: str, tables: object = None, label: str | None = None) -> Path:
        calls.append({"plan": plan, "path": path, "label": label})
        Path(path).write_bytes(b"png")
        return Path(path)

    monkeypatch.setattr(report, "plot_timeline", fake)
    return calls


def test_plan_timeline_names_the_variant(tmp_path: Path, drawn: list[dict[str, Any]]) -> None:
    inst, out, tl = _instance_file(tmp_path), tmp_path / "p.json", tmp_path / "t.png"
    rc = main(["plan", str(inst), "--planner", "heuristic", "--link-precision", "auto", "--time-limit", "5",
               "--why-not-time", "0", "-o", str(out), "--timeline", str(tl)])
    assert rc == 0 and len(drawn) == 1
    assert drawn[0]["label"] == "heuristic:auto" and drawn[0]["path"] == str(tl)
    assert drawn[0]["plan"] == Plan.from_json(out.read_text())
    rc = main(["evaluate", str(inst), str(out), "--timeline", str(tmp_path / "e.png")])
    assert rc == 0 and drawn[-1]["label"] == "heuristic" and drawn[-1]["plan"] == drawn[0]["plan"]


def test_compare_timeline_is_the_best_rows(tmp_path: Path, drawn: list[dict[str, Any]],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    inst = _instance_file(tmp_path)
    rc = main(["compare", str(inst), "--planners", "uniform,heuristic:auto", "--time-limit", "5", "--json",
               "--timeline", str(tmp_path / "c.png")])
    rows = json.loads(capsys.readouterr().out)
    best = min((r for r in rows if r["iteration_time_s"]), key=lambda r: r["iteration_time_s"])
    assert rc == 0 and len(drawn) == 1 and drawn[0]["label"] == best["planner"]
    assert drawn[0]["plan"] == Plan.from_dict(best["plan"])


@pytest.mark.parametrize("flag", ["-o", "--timeline"])
def test_plan_output_paths_are_checked_before_the_search(tmp_path: Path, flag: str, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    monkeypatch.setattr(plan_cmd, "get_planner", lambda name: ran.append(name))
    rc = main(["plan", str(_instance_file(tmp_path)), flag, str(tmp_path / "missing" / "x")])
    assert rc == 2 and not ran
    assert flag in capsys.readouterr().err


def test_plan_timeline_numbers_match_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The real picture of `hgopt plan sailor-het-16+16 --link-precision auto --timeline`: its title's
    evaluate time and dashed line equal the table's iteration time, and its row labels carry each table
    row's GPU, tp, dp, mbs and the boundary precision of the table's `link to next` column."""
    import re

    pytest.importorskip("matplotlib")
    real = report._pyplot()
    figs: list[Any] = []

    class Keep:  # pyplot, but figures stay open for inspection
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        @staticmethod
        def subplots(*a: Any, **kw: Any) -> Any:
            fig, ax = real.subplots(*a, **kw)
            figs.append((fig, ax))
            return fig, ax

        @staticmethod
        def close(fig: Any) -> None:
            pass

    monkeypatch.setattr(report, "_pyplot", lambda: Keep())
    tl = tmp_path / "t.png"
    assert main(["-q", "plan", "sailor-het-16+16", "--planner", "heuristic", "--link-precision", "auto",
                 "--time-limit", "20", "--why-not-time", "0", "--timeline", str(tl)]) == 0
    out = capsys.readouterr().out
    assert tl.stat().st_size > 0 and len(figs) == 1
    fig, ax = figs[0]
    try:
        value, unit = re.search(r"^iteration time ([\d.]+) (s|ms)", out, re.M).groups()  # type: ignore[union-attr]
        table_s = float(value) * (1e-3 if unit == "ms" else 1.0)
        title_s = float(re.search(r"iteration ([\d.]+) s by evaluate", ax.get_title()).group(1))  # type: ignore[union-attr]
        assert title_s == pytest.approx(table_s, abs=1e-3 if unit == "s" else 1e-4)
        dashed = [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert len(dashed) == 1 and dashed[0] == pytest.approx(table_s, abs=1e-3)
        assert "heuristic:auto" in ax.get_title()
        labels = [t.get_text() for t in ax.get_yticklabels()]
        head = out.split("stage  layers")[1].splitlines()
        rows = [ln.split() for ln in head[2:] if re.match(r"^\d+\.\d+ ", ln)]
        assert rows and len(labels) == len(rows)
        for row, label in zip(rows, labels):
            stage, _, _, gpu, tp, dp, mbs = row[:7]
            p, s = stage.split(".")
            assert label.startswith(f"p{p}") and f".s{s} " in label and gpu in label
            assert f"tp{tp}×dp{dp} mbs{mbs}" in label
            link = row[-1] if row[-1] in ("bf16", "fp16", "fp8", "fp32") else None
            assert (f"↓{link}/{link}" in label) == (link is not None), (row, label)
        assert any("↓" in label for label in labels)  # the auto policy compressed a boundary here
    finally:
        real.close(fig)
