"""``hgopt replan`` on shipped instances (issue 14): lose a cluster, halve a link, add GPUs, and lose 64
GPUs at 512 GPUs (the heuristic's wall time). Per scenario: the old plan (heuristic), the heuristic
replan (chosen candidate, iteration time before/after, migration bytes and time [M1], wall time) and
the exact planner's lower bound for the new resources (``--planner milp``).

    PYTHONPATH=$PWD python bench/replan.py [--milp-time-limit 30] [--horizon-steps 1000] [--only INSTANCE]

Prints a markdown table and, under it, the CLI commands that give each row."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from hgopt.changes import apply_changes, parse_change
from hgopt.instances import load_instance
from hgopt.search import PlanOptions, get_planner
from hgopt.search.replan import replan

SCENARIOS = (
    ("sailor-geo-5x32", "drop=A100-40@us-central1-f", True),
    ("sailor-geo-5x32", "link=A100-40@us-central1-b<>A100-40@us-central1-c:x0.5", True),
    ("sailor-het-16+16", "cluster=A100-40@us-central1-a:+8", True),
    ("sailor-het-128+384", "cluster=A100-40@us-central1-a:-64", False),
)
"""(instance, change, also run the exact planner for the bound). The old plans of these instances
(heuristic) use the changed cluster / link."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--milp-time-limit", type=float, default=30.0)
    ap.add_argument("--horizon-steps", type=int, default=1000)
    ap.add_argument("--old-time-limit", type=float, default=5.0)
    ap.add_argument("--only", default=None, metavar="INSTANCE", help="only the rows of this instance")
    args = ap.parse_args()
    rows, cmds = [], []
    heuristic = get_planner("heuristic")
    tmp = Path(tempfile.mkdtemp(prefix="hgopt-replan-bench-"))
    for name, change, with_milp in SCENARIOS:
        if args.only is not None and name != args.only:
            continue
        inst = load_instance(name)
        old = heuristic(inst, PlanOptions(time_limit_s=args.old_time_limit)).plan
        assert old is not None
        (tmp / f"{name}.json").write_text(old.to_json())
        new = apply_changes(inst, [parse_change(change)])
        t0, c0 = time.perf_counter(), time.process_time()
        res = replan(old, inst, new, "heuristic", heuristic, PlanOptions(time_limit_s=1.0), args.horizon_steps)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        c = res.chosen
        assert c is not None
        # the whole search without a time limit: its CPU time does not depend on the load, and under
        # 1 s it means the 1 s limit above did not cut the search short (same plan)
        c1 = time.process_time()
        full = replan(old, inst, new, "heuristic", heuristic, PlanOptions(time_limit_s=1e9), args.horizon_steps)
        full_cpu = time.process_time() - c1
        same = full.chosen is not None and full.chosen.plan.to_json() == c.plan.to_json()
        bound = "-"
        if with_milp:
            m = replan(old, inst, new, "milp", get_planner("milp"),
                       PlanOptions(time_limit_s=args.milp_time_limit), args.horizon_steps)
            lb = m.planner.lower_bound_s
            if lb is not None:
                gap = (c.evaluation.iteration_time_s - lb) / c.evaluation.iteration_time_s
                bound = f"{lb:.3f} s ({m.planner.status}; heuristic gap {100 * gap:.1f} %)"
        mig = c.migration
        rows.append([name, f"`{change}`", f"{res.before.iteration_time_s:.3f} s", c.name.replace(" for the new resources", ""),
                     f"{c.evaluation.iteration_time_s:.3f} s", f"{mig.bytes / 1e9:.2f} GB", f"{mig.inside_bytes / 1e9:.2f} GB", f"{mig.time_s:.2f} s",
                     f"{sum(b for _, _, b in mig.from_checkpoint) / 1e9:.2f} GB", bound, f"{wall:.2f} s / {cpu:.2f} s",
                     f"{full_cpu:.2f} s ({'same plan' if same else 'other plan'})"])
        cmds.append(f"hgopt plan {name} --planner heuristic --time-limit {args.old_time_limit:g} -o old.json && "
                    f"hgopt replan old.json --instance {name} --change '{change}' --horizon-steps {args.horizon_steps}"
                    + (f"  # bound: add --planner milp --time-limit {args.milp_time_limit:g}" if with_milp else ""))
    head = ["instance", "change", "iteration before", "chosen", "iteration after", "between clusters", "inside clusters", "move time",
            "from checkpoint", "MILP lower bound (new resources)", "heuristic replan wall / CPU",
            "CPU without time limit"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    for c in cmds:
        print(f"    {c}")


if __name__ == "__main__":
    main()
