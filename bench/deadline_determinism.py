"""Same input, ``--time-limit`` and ``--seed`` in separate processes with different string-hash seeds
(``PYTHONHASHSEED``): the same plan? (issue #11 item 5, deadline2). One JSON line per run on stdout
with the status, iteration time, bound, search time, the load average before the run and a digest of
the plan (its JSON without ``meta``); then one line per instance saying whether the plans agree.

    PYTHONPATH=$PWD .venv/bin/python bench/deadline_determinism.py [--time-limit 30] [--hash-seeds 1,2]
        [--planner milp] [instance ...]     # default: sailor-het-16+16 sailor-geo-5x32
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys


def run(instance: str, limit: float, hash_seed: int, planner: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    load = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-m", "hgopt", "-q", "plan", instance, "--planner", planner, "--json",
                        "--time-limit", f"{limit:g}", "--why-not-time", "0", "--seed", "0"],
                       capture_output=True, text=True, env=env)
    doc = json.loads(p.stdout) if p.stdout.strip() else {}
    plan = {k: v for k, v in (doc.get("plan") or {}).items() if k != "meta"}
    return {"instance": instance, "hash_seed": hash_seed, "rc": p.returncode, "load": round(load, 2),
            "status": doc.get("status"), "iteration_time_s": doc.get("iteration_time_s"),
            "lower_bound_s": doc.get("lower_bound_s"), "search_time_s": doc.get("search_time_s"),
            "plan_digest": hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:12],
            "first_note": (doc.get("notes") or [None])[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("instances", nargs="*", default=["sailor-het-16+16", "sailor-geo-5x32"])
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--hash-seeds", default="1,2")
    ap.add_argument("--planner", default="milp")
    args = ap.parse_args()
    seeds = [int(x) for x in args.hash_seeds.split(",")]
    for name in args.instances:
        rows = [run(name, args.time_limit, h, args.planner) for h in seeds]
        for r in rows:
            print(json.dumps(r))
        same = len({r["plan_digest"] for r in rows}) == 1
        print(json.dumps({"instance": name, "same_plan": same, "statuses": [r["status"] for r in rows]}))


if __name__ == "__main__":
    main()
