"""One batch split of the exact planner, taken apart: its cheap bound [B4], its relaxation bound [R4],
the MILP's objective and dual bound after the cap loop [M0], and ``evaluate`` of the decoded plan
(with the per-stage send times), to tell a weak bound from a weak incumbent.

    PYTHONPATH=$PWD .venv/bin/python bench/exact_split.py sailor-geo-5x32 --split 1,64 --incumbent 2.357 --time-limit 45
    PYTHONPATH=$PWD .venv/bin/python bench/exact_split.py sailor-geo-5x32 --floor-check
    PYTHONPATH=$PWD .venv/bin/python bench/exact_split.py sailor-geo-5x32 --all-splits --incumbent 2.2426

``--all-splits`` (gaps3): every split's cheap and relaxation bound with the relaxation's CPU seconds,
weakest first, and the least of them (what the planner's global bound is once every split has its
relaxation; independent of machine load, unlike a timed run).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from hgopt.cost import build_tables, evaluate
from hgopt.instances import load_instance
from hgopt.search.blocks import cheap_bounds
from hgopt.search.milp import _relaxation_bound, batch_splits, solve_split
from hgopt.solvers import SolveOptions
from hgopt.spec import Instance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("instance")
    ap.add_argument("--split", help="K,B: k pipelines of microbatch B")
    ap.add_argument("--floor-check", action="store_true",
                    help="gaps2: compare the analytic hand-over floor [M8f] with the least evaluate probe over the "
                         "layout pairs on about 12 splits, every arc, and time both")
    ap.add_argument("--all-splits", action="store_true",
                    help="gaps3: cheap and relaxation bound of every split (target: --incumbent), weakest first")
    ap.add_argument("--incumbent", type=float, default=math.inf, help="best plan's time (sets the first cap)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args(argv)
    inst = load_instance(args.instance)
    if args.floor_check:
        return floor_check(inst)
    if args.all_splits:
        return all_splits(inst, args.incumbent)
    if not args.split:
        ap.error("--split K,B is required (or --floor-check)")
    k, b = (int(x) for x in args.split.split(","))
    tables = build_tables(inst)
    sp = next(s for s in batch_splits(inst) if s.k == k and s.microbatch == b)
    t0 = time.perf_counter()
    cb = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches)
    print(f"{sp}: cheap bound {cb.value:.6g} s (t_lb {cb.t_lb:.6g}, tail s_lb {cb.s_lb:.6g}) [{time.perf_counter() - t0:.1f} s]")
    relax, above = _relaxation_bound(inst, tables, sp, cb, args.incumbent, math.inf)
    print(f"relaxation bound {relax:.6g} s [{time.perf_counter() - t0:.1f} s]")
    out = solve_split(inst, tables, sp, cb, solver="highs", incumbent=args.incumbent, lb_above=above,
                      solve_options=SolveOptions(time_limit_s=args.time_limit, relative_gap=0.005))
    for s in out.solves:
        print(f"MILP: {s.status}, objective {s.objective:.6g} s, dual bound {s.bound:.6g} s, {s.wall_s:.1f} s")
    print(f"split bound {out.lower_bound:.6g} s; best plan of the split by evaluate {out.value:.6g} s "
          f"[{time.perf_counter() - t0:.1f} s]")
    if out.plan is not None:
        ev = evaluate(out.plan, inst, tables)
        for r in ev.stages[: len(out.plan.pipelines[0].stages)]:
            print(f"  stage {r.layers} {r.layout}: fwd+bwd {r.fwd_s + r.bwd_s:.4f} s, send {r.send_fwd_s:.4f}/"
                  f"{r.send_bwd_s:.4f} s, sync {r.sync_s:.4f} s")
    return 0


def all_splits(inst: Instance, incumbent: float) -> int:
    """gaps3: per split, the cheap bound [B4] and the relaxation bound [R4] at target ``incumbent``
    (``milp._relaxation_bound``, as the planner's relaxation phase calls it), weakest first."""
    tables = build_tables(inst)
    rows, cpu = [], 0.0
    for sp in batch_splits(inst):
        cb = cheap_bounds(inst, tables, replicas=sp.k, microbatch=sp.microbatch, num_microbatches=sp.num_microbatches)
        t0 = time.process_time()
        relax, _ = _relaxation_bound(inst, tables, sp, cb, incumbent, math.inf)
        dt = time.process_time() - t0
        cpu += dt
        rows.append((max(relax, cb.value), str(sp), cb.value, dt))
    rows.sort()
    for bound, sp, cheap, dt in rows[:12]:
        print(f"{sp}: cheap {cheap:.5g} s, relaxation {bound:.5g} s ({dt:.2f} s CPU)")
    print(f"{inst.name}: {len(rows)} splits, least bound {rows[0][0]:.5g} s ({rows[0][1]}); gap to {incumbent:g} s "
          f"{100 * (incumbent - rows[0][0]) / incumbent:.2f} %; relaxations {cpu:.1f} s CPU")
    return 0


def floor_check(inst: Instance) -> int:
    """[M8f] ``blocks.layout_floor`` (analytic, ``links.handover_floor``) against the least
    ``stage_boundary_time`` less the casts over the split's layout pairs (the round-5 probe floor)."""
    from hgopt.cost.evaluate import stage_boundary_time
    from hgopt.search.blocks import NATIVE_PAIR, _layouts, _probe, layout_floor, model_shape

    tables = build_tables(inst)
    shape = model_shape(inst)
    splits = batch_splits(inst)
    worst, arcs, t_probe, t_floor = math.inf, 0, 0.0, 0.0
    names = [c.name for c in inst.topology.clusters]
    for sp in splits[:: max(1, len(splits) // 12)]:
        for a in names:
            for b in names:
                if a == b:
                    continue
                t0 = time.perf_counter()
                f, g = layout_floor(inst, tables, a, b, sp.microbatch, sp.k, NATIVE_PAIR, shape)
                t_floor += time.perf_counter() - t0
                t0 = time.perf_counter()
                pf = pg = math.inf
                for ka in _layouts(inst, tables, a, sp.microbatch, sp.k):
                    for kb in _layouts(inst, tables, b, sp.microbatch, sp.k):
                        x, y = stage_boundary_time(inst, tables, _probe(a, b, ka, kb, NATIVE_PAIR, shape), 0, copies=sp.k)
                        pf, pg = min(pf, x), min(pg, y)
                t_probe += time.perf_counter() - t0
                if f > pf * (1 + 1e-9) or g > pg * (1 + 1e-9):
                    print(f"NOT A FLOOR: {sp} {a}->{b}: {f:.6g}/{g:.6g} > probe {pf:.6g}/{pg:.6g}")
                    return 1
                worst, arcs = min(worst, f / pf, g / pg), arcs + 1
    print(f"{inst.name}: {arcs} arcs, worst floor / probe {worst:.4f}; floor {t_floor:.3f} s, probe {t_probe:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
