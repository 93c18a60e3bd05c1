"""Whole-process wall time and peak RSS of ``hgopt plan X --time-limit T`` (the exact planner's hard
time limit, issue #11), measured with ``/usr/bin/time -v``; one line per instance with the status,
the bound and the machine's load average (wall times on a shared machine are inflated by its load;
CPU seconds of the process are listed too).

    PYTHONPATH=$PWD .venv/bin/python bench/time_limit.py [--time-limit 5] [--why-not-time 0] [--planner milp]
        [--in-process] [instance ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from hgopt.instances import list_instances


def run(name: str, limit: float, why_not: float | None, planner: str = "milp") -> dict[str, object]:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "hgopt", "plan", name, "--planner", planner,
           "--time-limit", f"{limit:g}", "--json"]
    if why_not is not None:
        cmd += ["--why-not-time", f"{why_not:g}"]
    load = os.getloadavg()[0]
    p = subprocess.run(cmd, capture_output=True, text=True)
    err = p.stderr

    def field(label: str) -> str:
        m = re.search(rf"{re.escape(label)}: (.+)", err)
        return m.group(1).strip() if m else ""

    h, mnt, sec = ([0.0] + [float(x) for x in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":")])[-3:]
    out: dict[str, object] = {"instance": name, "rc": p.returncode, "wall_s": round(h * 3600 + mnt * 60 + sec, 2),
                              "cpu_s": round(float(field("User time (seconds)") or 0) + float(field("System time (seconds)") or 0), 2),
                              "peak_rss_mb": round(int(field("Maximum resident set size (kbytes)") or 0) / 1024, 1),
                              "load": round(load, 1)}
    try:
        doc = json.loads(p.stdout)
        res = doc.get("result", doc)
        out.update(status=res.get("status"), lower_bound_s=res.get("lower_bound_s"),
                   iteration_time_s=res.get("iteration_time_s"), search_time_s=res.get("search_time_s"))
    except (json.JSONDecodeError, AttributeError):
        out["error"] = (p.stdout + err)[-300:]
    return out


def in_process(names: list[str], limit: float, planner: str) -> None:
    """The planner called in this process (no start-up, no output): its own wall and CPU seconds."""
    import time

    from hgopt.instances import load_instance
    from hgopt.search import PlanOptions, get_planner

    print("| instance | limit s | wall s | CPU s | search s | status | bound s | plan s | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in names:
        inst = load_instance(n)
        t, c = time.perf_counter(), time.process_time()
        r = get_planner(planner)(inst, PlanOptions(time_limit_s=limit))
        print(f"| {n} | {limit:g} | {time.perf_counter() - t:.2f} | {time.process_time() - c:.2f} | "
              f"{r.search_time_s:.2f} | {r.status} | {_num(r.lower_bound_s)} | {_num(r.iteration_time_s)} | "
              f"{os.getloadavg()[0]:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--why-not-time", type=float, default=None)
    ap.add_argument("--planner", default="milp")
    ap.add_argument("instances", nargs="*")
    ap.add_argument("--in-process", action="store_true", help="call the planner here (no CLI start-up/output)")
    args = ap.parse_args()
    names = args.instances or [e.name for e in list_instances()]
    if args.in_process:
        in_process(names, args.time_limit, args.planner)
        return
    print("| instance | limit s | wall s | CPU s | peak RSS MB | search s | status | bound s | plan s | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        r = run(n, args.time_limit, args.why_not_time, args.planner)
        print(f"| {n} | {args.time_limit:g} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_mb']} | "
              f"{_num(r.get('search_time_s'))} | {r.get('status')} | {_num(r.get('lower_bound_s'))} | "
              f"{_num(r.get('iteration_time_s'))} | {r['load']} |", flush=True)


def _num(x: object) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else str(x)


if __name__ == "__main__":
    main()
