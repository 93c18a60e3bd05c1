"""hetgap: the [H11b] bound (hgopt.search.mixed_bound) against the mixed-stage family's plan and the compute
floor, per instance (a markdown row each; CPU seconds of the mixed_bound call). Usage:
    PYTHONPATH=$PWD .venv/bin/python bench/mixed_bound_gap.py sailor-het-16+16 sailor-het-80+240
    PYTHONPATH=$PWD .venv/bin/python bench/mixed_bound_gap.py --plain sailor-het-16+16
``--plain`` (hetgap2): round 7's price search (scale start only, no polishing), so the bound values are
round 7's and the CPU seconds measure the faster dual function alone.
"""
import sys, time
from hgopt.instances import load_instance
from hgopt.cost import build_tables
from hgopt.search.mixed_bound import MixedBoundOptions, mixed_bound
from hgopt.search.mixed import best_mixed_plan, compute_floor
names = [a for a in sys.argv[1:] if not a.startswith("--")]
opts = MixedBoundOptions(warm_start=False, polish_rounds=0) if "--plain" in sys.argv else MixedBoundOptions()
for name in names:
    inst = load_instance(name); tab = build_tables(inst)
    mp = best_mixed_plan(inst, tab)
    t = time.process_time()
    b = mixed_bound(inst, tab, target=mp.iteration_time_s, options=opts)
    c = time.process_time() - t
    print(f"| {name} | {mp.iteration_time_s:.4f} | {b.floor:.4f} | {(mp.iteration_time_s-b.floor)/mp.iteration_time_s*100:.1f} % | {b.value:.4f} | {(mp.iteration_time_s-b.value)/mp.iteration_time_s*100:.1f} % | B {b.microbatch}, m {b.microbatches}, k {b.pipelines} | {c:.1f} |", flush=True)
