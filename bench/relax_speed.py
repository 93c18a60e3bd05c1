"""CPU seconds (``time.process_time``, not wall: independent of how much of a core the process gets) of
the exact planner's per-split work, by part: the cheap bound [B4], the relaxation's row tables
(``relax.relax_split``, with the split's arc table [M8f] timed apart), the one-cluster bound [R0]
(``milp._best_single``), the bound's search over bottleneck intervals (``relax.split_bound``: the subset
DP [R3] at each τ), and the block options of the split's first MILP (``blocks.block_options`` at the cap
``milp.solve_split`` starts with). Splits are taken in the planner's order (``milp.batch_splits``),
evenly spaced when ``--splits`` limits them; the parts run in the order the planner runs them (cheap
bound, relaxation, MILP options), all on one ``CostTables`` as in one ``plan_milp`` call.

    PYTHONPATH=$PWD .venv/bin/python bench/relax_speed.py sailor-geo-5x32 sailor-het-32+96
    PYTHONPATH=$PWD .venv/bin/python bench/relax_speed.py scale-16r-4096-gpt175b --splits 2 --options 2
    PYTHONPATH=$PWD .venv/bin/python bench/relax_speed.py sailor-geo-5x32 --profile 30
    PYTHONPATH=$PWD .venv/bin/python bench/relax_speed.py sailor-geo-5x32 --target 2.2314 --options 0

``--options N``: block options on N of the splits (0: none; they are the slow part on large instances).
``--profile K``: cProfile of everything, the K functions of most cumulative time. ``--values``: print each
split's bounds (repr), to compare two trees.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import sys
import time
from collections import defaultdict

from hgopt.cost import build_tables
from hgopt.cost.pipeline import stages_that_matter
from hgopt.instances import load_instance
from hgopt.search.blocks import Window, arc_table, block_options, cheap_bounds, model_shape
from hgopt.search.milp import WIDEN, _best_single, batch_splits, link_policy, milp_composition
from hgopt.search.relax import relax_split, split_bound

PARTS = ("cheap", "arcs", "rows", "single", "bound", "options")


def _pick(n: int, k: int | None) -> list[int]:
    """k of range(n), evenly spaced (all when k is None or >= n)."""
    if k is None or k >= n:
        return list(range(n))
    if k <= 0:
        return []
    return sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})


def run(name: str, splits: int | None, options: int, values: bool, target: float = math.inf) -> dict[str, float]:
    inst = load_instance(name)
    t = time.process_time()
    tables = build_tables(inst)
    links = link_policy(inst, {})
    shape = model_shape(inst)
    every = batch_splits(inst)
    chosen = [every[i] for i in _pick(len(every), splits)]
    with_options = {id(chosen[i]) for i in _pick(len(chosen), options)}
    cpu: dict[str, float] = defaultdict(float)
    cpu["tables"] = time.process_time() - t
    n_opts = 0
    for sp in chosen:
        t = time.process_time()
        cb = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                          links=links)
        cpu["cheap"] += (t1 := time.process_time()) - t
        arcs = arc_table(inst, tables, sp.microbatch, sp.k, links, shape) if len(inst.topology.clusters) <= 12 else None
        cpu["arcs"] += (t2 := time.process_time()) - t1
        rs = relax_split(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches,
                         cheap=cb, links=links, arcs=arcs)
        cpu["rows"] += (t3 := time.process_time()) - t2
        single = bound = math.nan
        if rs is not None:
            single = _best_single(inst, tables, sp, cb)
            cpu["single"] += (t4 := time.process_time()) - t3
            bound = split_bound(rs, cb, target=target, single=single)
            cpu["bound"] += time.process_time() - t4
        if values:
            print(f"  {sp}: cheap {cb.value!r} single {single!r} relaxation {bound!r}")
        if id(sp) in with_options:
            t5 = time.process_time()
            t_cap = cb.t_lb * WIDEN if cb.weight > 0 else math.inf  # solve_split's first cap without an incumbent
            win = Window(t_lb=cb.t_lb, s_lb=cb.s_lb, t_cap=t_cap, weight=cb.weight, mbs_matters=links.compresses,
                         per_stage=milp_composition(inst, sp, cb).per_stage)
            opts = block_options(inst, tables, replicas=sp.k, microbatch=sp.microbatch,
                                 num_microbatches=sp.num_microbatches, d_cap=stages_that_matter(sp.num_microbatches),
                                 window=win)
            cpu["options"] += time.process_time() - t5
            n_opts += sum(len(v) for v in opts.values())
    n, no = len(chosen), max(len(with_options), 1)
    per = {p: cpu[p] / (no if p == "options" else n) for p in PARTS}
    relax = per["arcs"] + per["rows"] + per["single"] + per["bound"]
    print(f"{name}: {n} of {len(every)} splits; CPU s per split: cheap {per['cheap']:.4f}, relaxation {relax:.4f} "
          f"(arcs {per['arcs']:.4f}, rows {per['rows']:.4f}, [R0] single {per['single']:.4f}, bound {per['bound']:.4f}); "
          f"block options {per['options']:.3f} on {len(with_options)} split(s), {n_opts} options; "
          f"tables {cpu['tables']:.3f} s")
    return per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("instances", nargs="+")
    ap.add_argument("--splits", type=int, default=None, help="at most this many splits per instance (evenly spaced)")
    ap.add_argument("--options", type=int, default=1, help="block options on this many of those splits")
    ap.add_argument("--profile", type=int, default=0, help="cProfile: print the K functions of most cumulative time")
    ap.add_argument("--values", action="store_true", help="print each split's bounds (repr)")
    ap.add_argument("--target", type=float, default=math.inf,
                    help="the bound's target (the planner passes incumbent·(1 − gap/2)): intervals below it are refined")
    args = ap.parse_args(argv)
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    for name in args.instances:
        run(name, args.splits, args.options, args.values, args.target)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
