#!/usr/bin/env python
"""Diagnostics: one transformer block (hidden 128, mbs 4) timed as the paced profiler times it, with the
runner's saved-tensor hooks, post-accumulate hooks, gradient accumulation and several microbatches in
flight; run 4 copies at once to see the co-tenant effect:

    for i in 1 2 3 4; do PYTHONPATH=$PWD python bench/validation_diag/block_conditions.py 10 & done; wait
"""
import time, statistics, torch, sys, contextlib
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from hgopt.export.runner_plan import ModelConfig
from hgopt.runner.model import build_stage
from hgopt.runner.memory import MemoryMeter
torch.set_num_threads(1)
PACE = 0.15
cfg = ModelConfig(layers=("embedding","block","block","block","block","head"), hidden=128, heads=4, vocab=256, seq=128)
mod = build_stage(cfg, 1, 2)
mbs = 4
def idle(c): time.sleep(c*(1/PACE-1))
def run(variant, n_mb):
    meter = MemoryMeter(mod)
    handles = []
    if "hooks" in variant:
        handles = [p.register_post_accumulate_grad_hook(lambda t: None) for p in mod.parameters()]
    xs = [torch.randn(mbs, cfg.seq, cfg.hidden).requires_grad_(True) for _ in range(n_mb)]
    g = torch.randn(mbs, cfg.seq, cfg.hidden)
    mod.zero_grad(set_to_none=True)
    outs, fs, bs = [], [], []
    for k, x in enumerate(xs):
        ctx = meter.forward(k) if "saved" in variant else contextlib.nullcontext()
        t = time.thread_time()
        with ctx:
            y = mod(x)
        c = time.thread_time() - t; fs.append(c); idle(c)
        outs.append(y)
        if "inter" in variant:  # 1 forward then 1 backward
            t = time.thread_time(); outs.pop().backward(g); c = time.thread_time() - t; bs.append(c); idle(c)
            if "accum" not in variant: mod.zero_grad(set_to_none=True)
    for y in outs:
        t = time.thread_time(); y.backward(g); c = time.thread_time() - t; bs.append(c); idle(c)
        if "accum" not in variant: mod.zero_grad(set_to_none=True)
    for h in handles: h.remove()
    return fs, bs
variants = [("plain-inter",1), ("saved-inter",1), ("hooks-inter",1), ("accum-inter",4), ("plain",4), ("accum",4), ("saved-hooks-accum",4), ("saved-hooks-accum-inter", 4)]
res = {v: ([], []) for v, _ in variants}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
    for v, n in variants:
        f, b = run(v, n)
        if rep >= 2: res[v][0].extend(f); res[v][1].extend(b)
for v, _ in variants:
    f, b = res[v]
    print(f"{v:<26} fwd {statistics.median(f)/PACE:.4f} bwd {statistics.median(b)/PACE:.4f}")
