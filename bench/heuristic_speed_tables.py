"""The [H2] cluster tables of one whole search of the speed bench (``bench/heuristic_speed.py``'s 512 GPUs in
8 clusters), replayed with another tree's ``hgopt/search/hier_tables.py`` and this tree's: every table of
every call byte-identical (values and dtypes), and the CPU seconds of each replay (fresh estimate caches,
least of REPEATS).

    PYTHONPATH=$PWD .venv/bin/python bench/heuristic_speed_tables.py OTHER_TREE [REPEATS]

e.g. OTHER_TREE = a ``git archive f80e4a7`` copy. The calls are recorded from this tree's search."""
import importlib.util
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_quality import speed_instance
from hgopt.cost import build_tables
from hgopt.search.hierarchical import HeuristicOptions, plan_heuristic
from hgopt.search.baselines._common import block_layout
import hgopt.search.hier_tables as H
import hgopt.search.hierarchical.estimates as E

spec = importlib.util.spec_from_file_location("base_hier_tables", f"{sys.argv[1]}/hgopt/search/hier_tables.py")
B = importlib.util.module_from_spec(spec); sys.modules["base_hier_tables"] = B; spec.loader.exec_module(B)
inst = speed_instance(); tables = build_tables(inst); layout = block_layout(inst)
calls = []
orig = H.lazy_cluster_tables
def ct(instance, tables, layout, cluster, role, **kw):
    calls.append((cluster, role, {k: v for k, v in kw.items() if k != "cache"}))
    return orig(instance, tables, layout, cluster, role, **kw)
E.lazy_cluster_tables = ct
plan_heuristic(inst, tables=tables, options=HeuristicOptions(time_limit_s=None))
E.lazy_cluster_tables = orig
def run(mod):
    cache = {}
    c0 = time.process_time()
    res = [mod.cluster_tables(inst, tables, layout, c, r, cache=cache, **kw) for c, r, kw in calls]
    return time.process_time() - c0, res
F = ("bottleneck","fill","sync_opt","stages","tp","dp","recompute")
_, a = run(B); _, b = run(H)
same = all(list(x) == list(y) and all(getattr(x[w], f).dtype == getattr(y[w], f).dtype and getattr(x[w], f).tobytes() == getattr(y[w], f).tobytes() for w in x for f in F) for x, y in zip(a, b))
print(len(calls), "calls; identical:", same)
tb, tn = [], []
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
    tb.append(run(B)[0]); tn.append(run(H)[0])
print(f"{sys.argv[1]}: least {min(tb):.3f} s CPU, this tree: least {min(tn):.3f} s CPU, load {os.getloadavg()[0]:.1f}")
