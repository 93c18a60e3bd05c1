"""Diagnostics: one transformer block (hidden 128, 4 heads, seq 128, mbs 4) and its Adam step, CPU seconds
of the thread per phase with warm caches (phases repeated back to back, as the layer-by-layer profile
times the optimizer step) against the same phase after EVICT MB of other data were touched (the caches
a pipelined rank finds after the other microbatches' work and the other ranks' bursts). The two
conditions alternate, so a slow spell of the shared host lands on both.
  PYTHONPATH=$PWD nice -n 19 /work/main/.venv/bin/python bench/validation_diag/cold_cache.py [EVICT_MB]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from hgopt.export.runner_plan import ModelConfig
from hgopt.profiler.runner_model import runner_layer_cases

torch.set_num_threads(1)
evict_mb = float(sys.argv[1]) if len(sys.argv) > 1 else 16.0
cfg = ModelConfig(hidden=128, heads=4, seq=128, vocab=256, layers=("embedding", "block", "block", "head"))
c = runner_layer_cases(cfg)[1]
x = c.make_input(4)[0].detach().requires_grad_(True)
with torch.no_grad():
    g = torch.randn_like(c.module(x))
opt = torch.optim.Adam(c.module.parameters(), lr=1e-6)
junk = torch.zeros(int(evict_mb * 2**20 / 4))
res: dict[str, list[float]] = {k: [] for k in ("fwd warm", "fwd cold", "bwd warm", "bwd cold", "adam warm", "adam cold")}
for rep in range(40):
    for cold in (False, True):
        tag = "cold" if cold else "warm"
        x.grad = None
        c.module.zero_grad(set_to_none=True)
        if cold:
            junk.add_(1.0)
        t = time.thread_time(); out = c.module(x); f = time.thread_time() - t
        if cold:
            junk.add_(1.0)
        t = time.thread_time(); out.backward(g); b = time.thread_time() - t
        if not cold:
            opt.step()  # warm: the step right after another step's data (as the profile's loop)
        else:
            junk.add_(1.0)
        t = time.thread_time(); opt.step(); a = time.thread_time() - t
        if rep >= 5:
            res[f"fwd {tag}"].append(f); res[f"bwd {tag}"].append(b); res[f"adam {tag}"].append(a)
for phase in ("fwd", "bwd", "adam"):
    w, k = statistics.median(res[f"{phase} warm"]), statistics.median(res[f"{phase} cold"])
    print(f"{phase}: warm {w * 1e3:.3f} ms, after touching {evict_mb:g} MB {k * 1e3:.3f} ms CPU ({k / w - 1:+.0%})")
