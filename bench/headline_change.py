"""Before → after table of a headline change: two ``bench/plan_quality.py --out`` JSON files (the same
command on two trees), every plan of the second re-scored by this tree's ``evaluate`` with the
plan's own gradient-sync setting (the headline) and with ``overlap_grad_sync`` off ([C7]).

    .venv/bin/python bench/headline_change.py BEFORE.json AFTER.json

"plan changed": the plans' pipelines differ (the sync fields and metadata ignored).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from hgopt.cost import evaluate
from hgopt.instances import load_instance
from hgopt.plan import Plan


def _rows(path: str) -> dict[tuple[str, str], dict[str, Any]]:
    with open(path) as f:
        return {(r["instance"], r["planner"]): r for r in json.load(f)["rows"]}


def _cell(row: dict[str, Any] | None) -> str:
    if row is None or row.get("iteration_time_s") is None:
        return "—"
    lb = row.get("lower_bound_s")
    return f"{row['iteration_time_s']:.3f} ({row['status']}{f', lb {lb:.3f}' if lb else ''})"


def _shape(row: dict[str, Any]) -> Any:
    return [p for p in row["plan"]["pipelines"]]


def main(argv: list[str]) -> int:
    before, after = _rows(argv[0]), _rows(argv[1])
    print("| instance | planner | before | after (headline) | after plan, overlap off [C7] | plan changed |")
    print("|---|---|---|---|---|---|")
    for key, r in after.items():
        b = before.get(key)
        off = "—"
        if r.get("plan"):
            inst = load_instance(key[0])
            plan = Plan.from_dict(r["plan"])
            ev = evaluate(dataclasses.replace(plan, overlap_grad_sync=False), inst)
            off = f"{ev.iteration_time_s:.3f}" if ev.feasible else "infeasible"
        changed = "—"
        if b is not None and b.get("plan") and r.get("plan"):
            changed = "yes" if _shape(b) != _shape(r) else "no"
        print(f"| {key[0]} | {key[1]} | {_cell(b)} | {_cell(r)} | {off} | {changed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
