"""The exact planner under ``--objective time``, ``--objective cost`` and a budget on a priced instance:
one row per run with evaluate's time, money's $ (``hgopt.cost.money``), the bound and gap of the
chosen objective.

    PYTHONPATH=. .venv/bin/python bench/milp_cost.py [--instance geo-3r-gpt1.3b] [--time-limit 30] [--budget 20]

``--options K,B,M ... --incumbent USD``: instead, per batch split the block options (and the MILP's
estimated nonzeros) without $ pruning and with [C4] at that incumbent (formulations/cluster_milp.md §10).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time


from hgopt.cost import build_tables, evaluate
from hgopt.cost.money import gpu_usd_per_second, layer_work_usd, money
from hgopt.cost.pipeline import stages_that_matter
from hgopt.instances import load_instance
from hgopt.search import PlanOptions, get_planner
from hgopt.search.blocks import Window, block_options, cheap_bounds
from hgopt.search.milp import estimated_nonzeros, link_policy
from hgopt.spec import Instance
from hgopt.table import format_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instance", default="geo-3r-gpt1.3b")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--budget", type=float, default=20.0, help="$/hour for the budget rows")
    ap.add_argument("--options", nargs="*", default=None, help="K,B,M splits: count block options instead")
    ap.add_argument("--incumbent", type=float, default=math.inf, help="$ per iteration for --options")
    args = ap.parse_args()
    inst = load_instance(args.instance)
    if args.options:
        options_table(inst, args.options, args.incumbent)
        return
    tables = build_tables(inst)
    tokens = inst.job.global_batch * inst.job.seq_len
    planner = get_planner("milp")
    rows = []
    runs = [("time", None), ("cost", None), ("time", args.budget), ("cost", args.budget)]
    for objective, budget in runs:
        t0 = time.perf_counter()
        res = planner(inst, PlanOptions(time_limit_s=args.time_limit, objective=objective,  # type: ignore[arg-type]
                                        budget_usd_per_hour=budget))
        wall = f"{time.perf_counter() - t0:.1f}"  # the whole call (warm start included) against --time-limit
        if res.plan is None:
            rows.append([objective, "-" if budget is None else f"{budget:g}", res.status] + ["-"] * 7 + [wall])
            continue
        ev = evaluate(res.plan, inst, tables)
        usd = money(res.plan, inst, tables, ev.iteration_time_s, tokens).usd_per_iteration or math.nan
        if objective == "cost":
            bound, gap = f"${res.usd_lower_bound:.6g}", res.usd_gap
        else:
            bound, gap = f"{res.lower_bound_s:.6g} s", res.gap
        gpus = "+".join(f"{n}x{c.split('-')[-2]}" for c, n in sorted(res.plan.gpus_by_cluster().items()))
        rows.append([objective, "-" if budget is None else f"{budget:g}", res.status, f"{ev.iteration_time_s:.4g}",
                     f"{usd:.6g}", f"{usd / ev.iteration_time_s * 3600:.4g}", gpus, bound,
                     "-" if gap is None else f"{100 * gap:.2f} %", dict(res.plan.meta).get("split", ""), wall])
    print(f"{inst.name}, --time-limit {args.time_limit:g}")
    print(format_table(["objective", "budget $/h", "status", "iteration s", "$/iteration", "$/hour", "GPUs", "bound",
                        "gap", "split", "wall s"], rows))


def options_table(inst: Instance, splits: list[str], incumbent: float) -> None:
    """Block options per split without and with the $ pruning [C4] at ``incumbent``."""
    tables = build_tables(inst)
    rate = tuple((c.name, gpu_usd_per_second(inst, c.name) or 0.0) for c in inst.topology.clusters)
    layers = layer_work_usd(inst, tables)
    rows = []
    for spec in splits:
        k, b, m = map(int, spec.split(","))
        cheap = cheap_bounds(inst, tables, replicas=k, microbatch=b, num_microbatches=m, links=link_policy(inst, {}))
        base = Window(t_lb=cheap.t_lb, s_lb=cheap.s_lb, weight=cheap.weight, gpus_matter=True)
        row = [spec]
        for win in (base, dataclasses.replace(base, gpu_usd_per_s=rate, usd_cap=incumbent, time_floor=cheap.lb_above,
                                              layer_usd=layers)):
            t0 = time.perf_counter()
            opts = block_options(inst, tables, replicas=k, microbatch=b, num_microbatches=m,
                                 d_cap=stages_that_matter(m), window=win)
            row += [str(sum(map(len, opts.values()))), str(estimated_nonzeros(opts, len(inst.topology.clusters))),
                    f"{time.perf_counter() - t0:.1f}"]
        rows.append(row)
    print(f"{inst.name}, block options without / with [C4] at ${incumbent:g} per iteration")
    print(format_table(["split", "options", "nonzeros", "s", "options [C4]", "nonzeros [C4]", "s [C4]"], rows))


if __name__ == "__main__":
    main()
