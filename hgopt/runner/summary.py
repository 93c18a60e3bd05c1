"""The run's summary from rank 0's ``metrics.jsonl``: per-step loss, step time, tokens/s and bytes sent
over every stage boundary (as counted by the ranks that called send). Pure Python."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from hgopt.export.runner_plan import RunnerPlan

__all__ = ["print_summary", "read_metrics", "summarize"]


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(rp: RunnerPlan, out: str | Path) -> dict[str, Any]:
    """Writes and returns ``summary.json``; steps after a resume replace the earlier records of the
    same step number."""
    by_step = {r["step"]: r for r in read_metrics(out)}
    steps = [by_step[k] for k in sorted(by_step)]
    if not steps:
        return {}
    times = [s["time_s"] for s in steps]
    later = times[1:] or times  # the first step includes warm-up
    out_dict = {
        "steps": len(steps),
        "final_loss": steps[-1]["loss"],
        "first_loss": steps[0]["loss"],
        "median_step_s": statistics.median(later),
        "tokens_per_s": rp.global_batch * rp.model.seq / statistics.median(later),
        "bytes_per_step": {k: v for k, v in steps[-1]["bytes"].items() if v},
        "memory": [{k: r[k] for k in ("rank", "pipeline", "stage", "replica", "tp_rank", "memory")}
                   for r in steps[-1].get("ranks", [])],
        "boundaries": {f"p{pi}.b{k}": {"fwd": p.boundaries[k].fwd, "bwd": p.boundaries[k].bwd}
                       for pi, p in enumerate(rp.pipelines) for k in range(len(p.stages) - 1)},
    }
    Path(out, "summary.json").write_text(json.dumps(out_dict, indent=1) + "\n")
    return out_dict


def print_summary(rp: RunnerPlan, out: str | Path) -> None:
    s = summarize(rp, out)
    if not s:
        print("no steps recorded")
        return
    print(f"steps {s['steps']}: loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}, median step "
          f"{s['median_step_s'] * 1e3:.1f} ms, {s['tokens_per_s']:.0f} tokens/s")
    for name, prec in s["boundaries"].items():
        b = s["bytes_per_step"]
        print(f"  boundary {name} ({prec['fwd']}/{prec['bwd']}): {b.get(name + '.fwd', 0)} B forward, "
              f"{b.get(name + '.bwd', 0)} B backward per step ({b.get(name + '.fwd.wan', 0)} / "
              f"{b.get(name + '.bwd.wan', 0)} B across clusters)")
    print(f"metrics: {Path(out) / 'metrics.jsonl'}  summary: {Path(out) / 'summary.json'}")
