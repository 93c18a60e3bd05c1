"""Same input, ``--time-limit`` and ``--seed`` in separate processes with different string-hash seeds
(``PYTHONHASHSEED``): the same plan? (issue #11 item 5, deadline2). One JSON line per run on stdout
with the status, iteration time, bound, search time, the load average before the run and a digest of
the plan (its JSON without ``meta``); then one line per instance saying whether the plans agree.

    PYTHONPATH=$PWD .venv/bin/python bench/deadline_determinism.py [--time-limit 30] [--hash-seeds 1,2]
        [--planner milp] [--work-limit W] [--burn N] [instance ...]     # default: sailor-het-16+16 sailor-geo-5x32

determinism (round 8): each row also has the run's CPU seconds (``os.wait4``'s rusage of the child) and
``cut``, the note saying the wall clock (not the work budget) ended a phase or the command's watchdog stopped
the search ("stopped by ..."; null when none); ``--burn N`` runs N busy-looping processes beside every run
(a loaded machine on a quiet one)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time


def run(instance: str, limit: float, hash_seed: int, planner: str, work: float | None = None) -> dict[str, object]:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "hgopt", "-q", "plan", instance, "--planner", planner, "--json",
                          "--time-limit", f"{limit:g}", "--why-not-time", "0", "--seed", "0",
                          *(("--work-limit", f"{work:g}") if work is not None else ())],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    out = p.stdout.read() if p.stdout is not None else ""
    _, rc, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(rc)
    wall = time.monotonic() - t0
    doc = json.loads(out) if out.strip() else {}
    plan = {k: v for k, v in (doc.get("plan") or {}).items() if k != "meta"}
    return {"instance": instance, "hash_seed": hash_seed, "rc": p.returncode, "load": round(load, 2),
            "status": doc.get("status"), "iteration_time_s": doc.get("iteration_time_s"),
            "lower_bound_s": doc.get("lower_bound_s"), "search_time_s": doc.get("search_time_s"),
            "plan_digest": hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:12],
            "first_note": (doc.get("notes") or [None])[0], "wall_s": round(wall, 2),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "cut": next((n[:120] for n in doc.get("notes") or [] if n.startswith("stopped by")), None)}


def _burners(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instances", nargs="*", default=["sailor-het-16+16", "sailor-geo-5x32"])
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--hash-seeds", default="1,2")
    ap.add_argument("--planner", default="milp")
    ap.add_argument("--work-limit", type=float, default=None, help="plan's --work-limit (default: none given)")
    ap.add_argument("--burn", type=int, default=0, help="busy-looping processes run beside each run")
    args = ap.parse_args()
    seeds = [int(x) for x in args.hash_seeds.split(",")]
    burners = _burners(args.burn)
    try:
        _bench(args, seeds)
    finally:
        for b in burners:
            b.kill()
            b.wait()


def _bench(args: argparse.Namespace, seeds: list[int]) -> None:
    for name in args.instances:
        rows = [run(name, args.time_limit, h, args.planner, args.work_limit) for h in seeds]
        for r in rows:
            print(json.dumps(r), flush=True)
        same = len({r["plan_digest"] for r in rows}) == 1
        print(json.dumps({"instance": name, "same_plan": same, "same_bound": len({r["lower_bound_s"] for r in rows}) == 1,
                          "statuses": [r["status"] for r in rows]}), flush=True)


if __name__ == "__main__":
    main()
