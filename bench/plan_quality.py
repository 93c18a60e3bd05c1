"""Plan quality and planning time: every shipped instance × every planner, all plans scored by
``evaluate``; geometric-mean throughput ratios (hgopt exact vs metis, hgopt heuristic vs metis,
heuristic vs exact, hgopt's best vs metis) over all instances and over the geo-distributed
heterogeneous ones (``geo-*``); and the heuristic's speed on 512 GPUs in 8 clusters.

    .venv/bin/python bench/plan_quality.py [--time-limit 60] [--instances ...] [--planners ...]
                                           [--out bench/plan_quality.json] [--speed-only]

Writes the raw rows as JSON (``--out``) and prints Markdown tables for bench/RESULTS.md. Timings
on a machine shared with other jobs are inflated: the load average is recorded with every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hgopt.cost import build_tables, evaluate
from hgopt.instances import list_instances, load_instance
from hgopt.search import PlanOptions, get_planner, planner_names
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic
from hgopt.spec import Instance, Topology

PLANNERS = ("milp", "heuristic", "metis", "metis:slowest-link", "uniform", "dp-only")


def run_one(inst: Instance, planner: str, time_limit: float) -> dict[str, Any]:
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    # "metis:slowest-link" = metis told the slowest WAN link; "milp:auto", "heuristic:fp8" = link precision
    name, _, variant = planner.partition(":")
    extra = {("bandwidth" if name == "metis" else "link_precision"): variant} if variant else {}
    try:
        res = get_planner(name)(inst, PlanOptions(time_limit_s=time_limit, extra=extra))
    except ValueError as exc:  # e.g. the exact planner refuses a model that is not trunk-shaped
        return {"instance": inst.name, "planner": planner, "status": "error", "note": str(exc)[:200],
                "iteration_time_s": None, "wall_s": time.perf_counter() - t0, "load": load}
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t = None
    gpus = 0
    if res.plan is not None:
        ev = evaluate(res.plan, inst)
        t = ev.iteration_time_s if ev.feasible else None
        gpus = ev.gpus_used
    return {"instance": inst.name, "planner": planner, "status": res.status, "iteration_time_s": t,
            "lower_bound_s": res.lower_bound_s, "search_time_s": res.search_time_s, "wall_s": wall, "cpu_s": cpu,
            "gpus": gpus, "load": load, "notes": list(res.notes[:2]),
            "plan": res.plan.to_dict() if res.plan is not None else None}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def ratios(rows: list[dict[str, Any]], names: list[str]) -> dict[str, tuple[float, int]]:
    """Geometric means of throughput ratios A/B = T_B / T_A over the instances where both have a plan."""
    t = {(r["instance"], r["planner"]): r["iteration_time_s"] for r in rows}

    def best(n: str) -> float | None:
        vals = [v for p in ("milp", "heuristic") if (v := t.get((n, p))) is not None]
        return min(vals) if vals else None

    pairs = {
        "exact vs metis": lambda n: (t.get((n, "milp")), t.get((n, "metis"))),
        "heuristic vs metis": lambda n: (t.get((n, "heuristic")), t.get((n, "metis"))),
        "heuristic vs exact": lambda n: (t.get((n, "heuristic")), t.get((n, "milp"))),
        "hgopt best vs metis": lambda n: (best(n), t.get((n, "metis"))),
        "hgopt best vs uniform": lambda n: (best(n), t.get((n, "uniform"))),
        "hgopt best vs dp-only": lambda n: (best(n), t.get((n, "dp-only"))),
    }
    out = {}
    for label, f in pairs.items():
        vals = [b / a for a, b in map(f, names) if a and b]
        out[label] = (geomean(vals), len(vals))
    return out


def speed_instance() -> Instance:
    """geo-8r-llama70b with 64 GPUs in each of its 8 clusters: 512 GPUs in 8 clusters."""
    base = load_instance("geo-8r-llama70b")
    clusters = tuple(dataclasses.replace(c, nodes=64 // c.gpus_per_node) for c in base.topology.clusters)
    topo = Topology(clusters=clusters, links=base.topology.links)
    return dataclasses.replace(base, name="geo-8r-llama70b-512", topology=topo)


def speed(repeats: int = 5) -> dict[str, Any]:
    inst = speed_instance()
    tables = build_tables(inst)
    walls, cpus, loads = [], [], []
    res = None
    for _ in range(repeats):
        loads.append(os.getloadavg()[0])
        t0, c0 = time.perf_counter(), time.process_time()
        # the whole search: the default 10 s wall-clock limit would cut it short under load (looks faster)
        res = plan_heuristic(inst, tables=tables, options=HeuristicOptions(time_limit_s=None))
        assert not res.stopped, res.stopped
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    assert res is not None and res.plan is not None
    return {"instance": inst.name, "gpus": inst.topology.num_gpus(), "clusters": len(inst.topology.clusters),
            "wall_s": walls, "cpu_s": cpus, "median_wall_s": statistics.median(walls),
            "median_cpu_s": statistics.median(cpus), "load": loads, "iteration_time_s": res.iteration_time_s}


def breakdown(inst: Instance, plan_dict: dict[str, Any]) -> dict[str, Any]:
    """Where a plan's time goes: pipeline vs gradient sync + optimizer, stages whose replicas span
    regions, the slowest boundary transfer."""
    from hgopt.plan import Plan

    plan = Plan.from_dict(plan_dict)
    ev = evaluate(plan, inst)
    region = {c.name: c.region for c in inst.topology.clusters}
    spans = [st for st in ev.stages if len({region[c] for c in st.clusters}) > 1]
    return {
        "T": ev.iteration_time_s, "pipeline_s": ev.pipeline_time_s, "tail_s": ev.sync_optimizer_time_s,
        "stages": len(plan.pipelines[0].stages), "pipelines": len(plan.pipelines), "gpus": ev.gpus_used,
        "regions_used": len({region[c] for c in plan.gpus_by_cluster()}),
        "stages_spanning_regions": len({(s.pipeline, s.stage) for s in spans}),
        "max_sync_spanning_s": max((s.sync_s for s in spans), default=0.0),
        "max_send_s": max((max(s.send_fwd_s, s.send_bwd_s) for s in ev.stages), default=0.0),
        "estimate_s": float(dict(plan.meta).get("metis_estimate_s", "nan")),
    }


def explain(rows: list[dict[str, Any]]) -> str:
    """Metis vs hgopt's best plan on the geo-* instances, term by term."""
    t = {(r["instance"], r["planner"]): r for r in rows}
    lines = ["| instance | plan | iteration (s) | Metis's own estimate (s) | pipeline (s) | sync+opt (s) | GPUs | "
             "regions | stages × pipelines | stages spanning regions | their sync (s) | slowest transfer (s) |",
             "|" + "---|" * 12]
    for n in dict.fromkeys(r["instance"] for r in rows):
        if not n.startswith("geo-"):
            continue
        inst = load_instance(n)
        best = min((t[(n, p)] for p in ("milp", "heuristic") if (n, p) in t and t[(n, p)]["iteration_time_s"]),
                   key=lambda r: r["iteration_time_s"], default=None)
        for label, r in (("metis", t.get((n, "metis"))), ("hgopt", best)):
            if r is None or not r.get("plan"):
                continue
            b = breakdown(inst, r["plan"])
            est = f"{b['estimate_s']:.2f}" if math.isfinite(b["estimate_s"]) else "—"
            lines.append(f"| {n} | {label} | {b['T']:.2f} | {est} | {b['pipeline_s']:.2f} | {b['tail_s']:.2f} | "
                         f"{b['gpus']} | {b['regions_used']} | {b['stages']} × {b['pipelines']} | "
                         f"{b['stages_spanning_regions']} | {b['max_sync_spanning_s']:.2f} | {b['max_send_s']:.3f} |")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], planners: list[str]) -> str:
    names = list(dict.fromkeys(r["instance"] for r in rows))
    t = {(r["instance"], r["planner"]): r for r in rows}
    head = "| instance | " + " | ".join(planners) + " | heuristic / exact |"
    lines = [head, "|" + "---|" * (len(planners) + 2)]
    for n in names:
        cells = []
        for p in planners:
            r = t.get((n, p))
            if r is None or r["iteration_time_s"] is None:
                cells.append("—" if r is None or r["status"] != "error" else "n/a")
            else:
                extra = ""
                if p == "milp" and r.get("lower_bound_s"):
                    gap = (r["iteration_time_s"] - r["lower_bound_s"]) / r["iteration_time_s"]
                    extra = f" ({r['status']}, gap {100 * gap:.1f} %)"
                cells.append(f"{r['iteration_time_s']:.3f}{extra}")
        h, e = t.get((n, "heuristic")), t.get((n, "milp"))
        rel = (f"{h['iteration_time_s'] / e['iteration_time_s']:.4f}"
               if h and e and h["iteration_time_s"] and e["iteration_time_s"] else "—")
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {rel} |")
    lines += ["", "| planner | median search (s) | max search (s) | instances with a plan |", "|---|---|---|---|"]
    for p in planners:
        rs = [r for r in rows if r["planner"] == p and r["iteration_time_s"] is not None]
        if rs:
            st = [r["search_time_s"] for r in rs]
            lines.append(f"| {p} | {statistics.median(st):.2f} | {max(st):.2f} | {len(rs)}/{len(names)} |")
    for label, subset in (("all instances", names), ("geo-* instances", [n for n in names if n.startswith("geo-")])):
        lines += ["", f"Geometric-mean throughput ratios, {label}:", "", "| ratio | value | instances |", "|---|---|---|"]
        for k, (v, cnt) in ratios(rows, subset).items():
            lines.append(f"| {k} | {v:.3f}x | {cnt} |" if cnt else f"| {k} | — | 0 |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--instances", nargs="*", default=None)
    ap.add_argument("--planners", nargs="*", default=list(PLANNERS))
    ap.add_argument("--out", default="bench/plan_quality.json")
    ap.add_argument("--speed-only", action="store_true")
    ap.add_argument("--report", metavar="JSON", help="print the tables of an earlier run's JSON and exit")
    args = ap.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
        print(markdown(data["rows"], args.planners))
        print()
        print(explain(data["rows"]))
        return 0
    for p in args.planners:
        if p.partition(":")[0] not in planner_names():
            raise SystemExit(f"--planners: unknown planner {p!r} (choices: {', '.join(planner_names())})")
    sp = speed()
    print(f"heuristic on {sp['instance']} ({sp['gpus']} GPUs, {sp['clusters']} clusters): median wall "
          f"{sp['median_wall_s']:.3f} s, median CPU {sp['median_cpu_s']:.3f} s over {len(sp['wall_s'])} runs, "
          f"load average {min(sp['load']):.1f}-{max(sp['load']):.1f}", flush=True)
    if args.speed_only:
        return 0
    names = args.instances or [e.name for e in list_instances()]
    rows = []
    for n in names:
        inst = load_instance(n)
        for p in args.planners:
            r = run_one(inst, p, args.time_limit)
            rows.append(r)
            tt = r["iteration_time_s"]
            print(f"{n:28s} {p:10s} {r['status']:10s} T={tt if tt is None else round(tt, 4)} "
                  f"search={r.get('search_time_s') or r['wall_s']:.2f}s load={r['load']:.1f}", flush=True)
            Path(args.out).write_text(json.dumps({"speed": sp, "time_limit_s": args.time_limit, "rows": rows},
                                                 indent=1))
    print()
    print(markdown(rows, args.planners))
    print()
    print(explain(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
