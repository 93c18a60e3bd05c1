"""Every command under its ``--time-limit`` (issue #11 item 4, deadline2): whole-process wall time,
CPU seconds and peak RSS of the child (``os.wait4``'s rusage: ``ru_maxrss``, user + system time) of

- ``hgopt plan I --json --time-limit T`` (the milp planner) for T in ``--limits`` on every shipped instance,
- ``hgopt plan I --objective cost --json --time-limit 10`` on the priced instances, plus
  ``scale-16r-4096-gpt175b`` with a stand-in price of $1 per GPU-hour on every cluster (written to a temporary
  file; a bench stand-in, not a hardware or cloud figure: the bench measures the deadline, not dollars),
- ``hgopt compare I --json --time-limit 10`` (every default planner) on every shipped instance,

with the status, bound and contract verdict (wall <= max(1.1 T, T + 2 s)) per run and the load average
before each run (a shared machine inflates wall times). A child still running at 3 T + 30 s gets
SIGABRT (it runs with ``-X faulthandler``: its threads' stacks are kept in the row) and is recorded as
killed. ``--nice N`` runs the children under ``nice -n N`` (default 0). One JSON line per run goes to ``--out`` (appended), a Markdown table to stdout.

    PYTHONPATH=$PWD .venv/bin/python bench/deadline.py [--limits 5,10,30] [--commands plan,cost,compare]
        [--out bench/deadline_runs.jsonl] [--nice N] [instance ...]
    PYTHONPATH=$PWD .venv/bin/python bench/deadline.py --table bench/deadline_runs.jsonl   # the table again
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from hgopt.commands._deadline import hard_limit
from hgopt.instances import list_instances, load_instance

STAND_IN_USD_PER_GPU_HOUR = 1.0
"""The bench's stand-in price for instances without prices (not a cloud figure: see the module text)."""

PRICED_STAND_IN = ("scale-16r-4096-gpt175b",)


def _time_v(cmd: list[str], timeout_s: float, nice: int = 0) -> dict[str, Any]:
    """Run ``cmd`` (stdout/stderr to files), its own rusage from ``os.wait4``: wall (monotonic),
    user + system CPU seconds and peak RSS (``ru_maxrss``, KiB on Linux). Past ``timeout_s`` the
    child gets SIGABRT (``-X faulthandler`` dumps every thread's stack to its stderr) and, 5 s later,
    SIGKILL; the stack dump is kept in the row."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.monotonic()
        full = (["nice", "-n", str(nice)] if nice else []) + [cmd[0], "-X", "faulthandler", *cmd[1:]]  # nice execs
        p = subprocess.Popen(full, stdout=out, stderr=err, text=True)
        killed: list[float] = []

        def abort() -> None:
            killed.append(time.monotonic() - t0)
            p.send_signal(signal.SIGABRT)
            threading.Timer(5.0, lambda: p.poll() is None and p.kill()).start()

        timer = threading.Timer(timeout_s, abort)
        timer.start()
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.monotonic() - t0
        timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    row: dict[str, Any] = {"rc": p.returncode, "wall_s": round(wall, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
                           "peak_rss_mb": round(ru.ru_maxrss / 1024, 1), "load": round(load, 2),
                           "stdout": stdout, "stderr_tail": stderr[-600:]}
    if killed:
        row.update(rc=None, killed_after_s=round(killed[0], 1), stack_dump=stderr[-4000:])
    return row


def _summary(kind: str, doc: Any) -> dict[str, Any]:
    if kind == "plan":
        return {"status": doc.get("status"), "iteration_time_s": doc.get("iteration_time_s"),
                "lower_bound_s": doc.get("lower_bound_s"), "gap": doc.get("gap"), "skipped": doc.get("skipped"),
                "deadline_note": next((n for n in doc.get("notes", []) if "deadline" in n), None)}
    if kind == "cost":
        ch = doc.get("chosen") or {}
        return {"status": ch.get("status"), "usd_per_iteration": ch.get("usd_per_iteration"),
                "lower_bound": doc.get("lower_bound"), "gap": doc.get("gap"),
                "unsearched_subsets": doc.get("unsearched_subsets"), "deadline_note": doc.get("stopped_by_deadline")}
    return {"rows": [(r["planner"], r["status"], r["iteration_time_s"]) for r in doc]}


def run_one(kind: str, instance: str, limit: float, source: str, nice: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hgopt", "-q"]  # (-X faulthandler is added by _time_v)
    if kind == "compare":
        cmd += ["compare", source, "--json", "--time-limit", f"{limit:g}"]
    else:
        cmd += ["plan", source, "--json", "--time-limit", f"{limit:g}"]
        if kind == "cost":
            cmd += ["--objective", "cost"]
    res = _time_v(cmd, 3 * limit + 30, nice)
    row: dict[str, Any] = {"command": kind, "instance": instance, "T": limit, "contract_s": hard_limit(limit),
                           "nice": nice, "utc": time.strftime("%H:%M:%S", time.gmtime()), "commit": _commit()}
    row.update({k: v for k, v in res.items() if k not in ("stdout", "stderr_tail")})
    if row.get("rc") not in (0, None):
        row["stderr_tail"] = res.get("stderr_tail")
    try:
        row.update(_summary(kind, json.loads(res.get("stdout") or "null") or {}))
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
        row["error"] = res.get("stderr_tail", "")[-300:]
    row["within"] = row.get("wall_s") is not None and row["wall_s"] <= row["contract_s"]
    return row


def _commit() -> str:
    """The checkout's HEAD (``+dirty`` with uncommitted changes to tracked files): what the run imported."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")


def _stand_in_priced(name: str, tmp: Path) -> str:
    doc = yaml.safe_load(Path(load_instance(name).source).read_text())
    for c in doc["topology"]["clusters"]:
        c.setdefault("cost_per_gpu_hour", STAND_IN_USD_PER_GPU_HOUR)
    doc["name"] = f"{name}-stand-in-priced"
    path = tmp / f"{name}-priced.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def print_table(rows: list[dict[str, Any]]) -> None:
    """The Markdown table of ``rows`` (one per run) on stdout."""
    print("| command | instance | T | wall s (contract) | CPU s | peak RSS MB | load | status | bound / gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        wall = "killed" if r.get("rc") is None else f"{r['wall_s']:.2f}"
        mark = "" if r["within"] else " **over**"
        if r["command"] == "compare":
            st = ", ".join(f"{p}:{s}" for p, s, _ in r.get("rows", []))
            bound = ""
        else:
            st = str(r.get("status"))
            lb = r.get("lower_bound_s", r.get("lower_bound"))
            bound = f"{lb:.4g} / {100 * r['gap']:.1f} %" if lb is not None and r.get("gap") is not None else "none"
        print(f"| {r['command']} | {r['instance']} | {r['T']:g} | {wall} ({r['contract_s']:g}){mark} | {r.get('cpu_s', '-')} "
              f"| {r.get('peak_rss_mb', '-')} | {r['load']} | {st} | {bound} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instances", nargs="*")
    ap.add_argument("--limits", default="5,10,30")
    ap.add_argument("--commands", default="plan,cost,compare")
    ap.add_argument("--out", default="bench/deadline_runs.jsonl")
    ap.add_argument("--nice", type=int, default=0, help="run the children under nice -n N")
    ap.add_argument("--table", metavar="JSONL", help="only print the table of the runs recorded in JSONL")
    args = ap.parse_args()
    if args.table:
        print_table([json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()])
        return
    names = args.instances or [i.name for i in list_instances()]
    limits = [float(x) for x in args.limits.split(",")]
    kinds = args.commands.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as td, open(args.out, "a") as fh:
        jobs: list[tuple[str, str, float, str]] = []
        if "plan" in kinds:
            jobs += [("plan", n, t, n) for t in limits for n in names]
        if "cost" in kinds:
            for n in names:
                inst = load_instance(n)
                if all(c.cost_per_gpu_hour is not None for c in inst.topology.clusters):
                    jobs.append(("cost", n, 10.0, n))
                elif n in PRICED_STAND_IN:
                    jobs.append(("cost", f"{n} (stand-in $1/GPU-h)", 10.0, _stand_in_priced(n, Path(td))))
        if "compare" in kinds:
            jobs += [("compare", n, 10.0, n) for n in names]
        for kind, name, t, src in jobs:
            row = run_one(kind, name, t, src, args.nice)
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            print(json.dumps(row), file=sys.stderr)
    print_table(rows)


if __name__ == "__main__":
    main()
