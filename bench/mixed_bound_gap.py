"""hetgap: the [H11b] bound (hgopt.search.mixed_bound) against the mixed-stage family's plan and the compute
floor, per instance (a markdown row each; CPU seconds of the mixed_bound call). Usage:
    PYTHONPATH=$PWD .venv/bin/python bench/mixed_bound_gap.py sailor-het-16+16 sailor-het-80+240
"""
import sys, time
from hgopt.instances import load_instance
from hgopt.cost import build_tables
from hgopt.search.mixed_bound import mixed_bound
from hgopt.search.mixed import best_mixed_plan, compute_floor
for name in sys.argv[1:]:
    inst = load_instance(name); tab = build_tables(inst)
    mp = best_mixed_plan(inst, tab)
    t = time.process_time()
    b = mixed_bound(inst, tab, target=mp.iteration_time_s)
    c = time.process_time() - t
    print(f"| {name} | {mp.iteration_time_s:.4f} | {b.floor:.4f} | {(mp.iteration_time_s-b.floor)/mp.iteration_time_s*100:.1f} % | {b.value:.4f} | {(mp.iteration_time_s-b.value)/mp.iteration_time_s*100:.1f} % | B {b.microbatch}, m {b.microbatches}, k {b.pipelines} | {c:.1f} |", flush=True)
