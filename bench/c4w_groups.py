"""Which cached plans have different pipelines sharing a capped link direction ([C4j] applies there,
``joint.capped_groups``): the plans whose ``evaluate`` the joint replay can change.

    PYTHONPATH=$PWD .venv/bin/python bench/c4w_groups.py bench/cost_fidelity_plans.json [more caches]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from hgopt.cost import build_tables
from hgopt.cost.evaluate import _wan_loads
from hgopt.cost.joint import capped_groups
from hgopt.instances import load_instance
from hgopt.plan import Plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("caches", nargs="+")
    args = ap.parse_args()
    for cache in args.caches:
        data = json.load(open(cache))
        hits, plans = [], 0
        for key, v in data.items():
            if not isinstance(v, dict) or not v.get("plan"):
                continue
            plans += 1
            inst = load_instance(key.split(" ")[0])
            plan = Plan.from_dict(v["plan"])
            tables = build_tables(inst)
            copies = Counter(plan.pipelines)
            loads = [_wan_loads(inst, tables, (p,), copies[p]) for p in copies]
            capped = {d for load in loads for d in load if inst.topology.link_spec(*d).aggregate is not None}
            if capped_groups(loads, capped):
                hits.append(key)
        print(f"{cache}: {len(hits)} of {plans} plans with different pipelines on one capped direction {hits}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
