"""hgopt's best plan against Metis's before and after a ZeRO-1 change: two ``bench/plan_quality.py
--out`` JSON files (the same command on two trees, planners milp, heuristic and metis at least).

    .venv/bin/python bench/zero1_vs_metis.py BEFORE.json AFTER.json

Per instance: Metis's time, hgopt's best (min of milp and heuristic) before and after, the ZeRO
setting of the after plan's stages, the after plan re-scored with every stage ZeRO-1 (what the
ZeRO-1 pricing alone gives, before ``choose_sync``'s ZeRO choice), Metis's plan re-scored with
ZeRO-1 stages (whether Metis's own plan would gain), and the exact planner's lower bound after with
a check that it is at most every after plan's time. Every plan of AFTER is re-scored by this tree's
``evaluate``; BEFORE's numbers are as recorded.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from hgopt.cost import evaluate
from hgopt.instances import load_instance
from hgopt.plan import Plan

HGOPT = ("milp", "heuristic")


def _rows(path: str) -> dict[tuple[str, str], dict[str, Any]]:
    with open(path) as f:
        return {(r["instance"], r["planner"]): r for r in json.load(f)["rows"]}


def _with_zero(plan: Plan, zero: int) -> Plan:
    return dataclasses.replace(plan, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(s, zero=zero) for s in p.stages)) for p in plan.pipelines))


def _t(plan: Plan, inst: Any) -> float | None:
    ev = evaluate(plan, inst)
    return ev.iteration_time_s if ev.feasible else None


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def main(before_path: str, after_path: str) -> None:
    before, after = _rows(before_path), _rows(after_path)
    names = sorted({i for i, _ in after})
    print("| instance | metis | hgopt before | hgopt after | after vs metis | after plan's zero | after plan, all ZeRO-1 |"
          " metis plan, ZeRO-1 | exact lb after | lb <= every plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        inst = load_instance(name)
        metis = after.get((name, "metis"))
        t_metis = _t(Plan.from_dict(metis["plan"]), inst) if metis and metis.get("plan") else None
        hb = [before[(name, p)]["iteration_time_s"] for p in HGOPT if (name, p) in before
              and before[(name, p)].get("iteration_time_s") is not None]
        best, best_plan = None, None
        for p in HGOPT:
            r = after.get((name, p))
            if r and r.get("plan"):
                plan = Plan.from_dict(r["plan"])
                t = _t(plan, inst)
                if t is not None and (best is None or t < best):
                    best, best_plan = t, plan
        zeros = sorted({s.zero for p in best_plan.pipelines for s in p.stages}) if best_plan else []
        all1 = _t(_with_zero(best_plan, 1), inst) if best_plan else None
        metis1 = _t(_with_zero(Plan.from_dict(metis["plan"]), 1), inst) if metis and metis.get("plan") else None
        lb = (after.get((name, "milp")) or {}).get("lower_bound_s")
        times = [_t(Plan.from_dict(r["plan"]), inst) for (i, _), r in after.items() if i == name and r.get("plan")]
        ok = lb is None or all(t is None or t >= lb * (1 - 1e-9) for t in times)
        ratio = f"{t_metis / best:.4f}×" if best and t_metis else "—"
        print(f"| {name} | {_f(t_metis)} | {_f(min(hb) if hb else None)} | {_f(best)} | {ratio} | {zeros} | {_f(all1)} |"
              f" {_f(metis1)} | {_f(lb)} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
