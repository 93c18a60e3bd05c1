#!/usr/bin/env python
"""Diagnostics: N paced processes (SCHED_RR with $HGOPT_PACE_RT, idling like the paced device) time the
runner GPT's layers, either each process only its own stage of a plan (``--cuts 0,2,3,4,6``: the layers a
rank of that plan holds, as one module, forward and backward of 4 microbatches in 1F1B's steady order,
gradients accumulated) or, with ``--all``, every process every layer one at a time (what
``hgopt profile --tenants N`` does). Prints each process's device seconds per forward / backward.

    sudo env HGOPT_PACE_RT=1 PYTHONPATH=$PWD python bench/validation_diag/stage_tenants.py --cuts 0,2,3,4,6 [--all]
Throwaway diagnostics, not a benchmark."""
import argparse, json, os, statistics, subprocess, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

PACE = 0.15


def worker(a, b, reps, mode):
    import torch
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.runner.model import build_stage
    from hgopt.profiler.paced import realtime_from_env
    torch.set_num_threads(1)
    cfg = ModelConfig(layers=("embedding", "block", "block", "block", "block", "head"), hidden=128, heads=4, vocab=256, seq=128)
    mbs = 4
    mods = [build_stage(cfg, a, b)] if mode.startswith("stage") else [build_stage(cfg, i, i + 1) for i in range(a, b)]
    def inp(i):
        return torch.randint(0, 256, (mbs, 128)) if i == 0 else torch.randn(mbs, 128, 128).requires_grad_(True)
    starts = [a] if mode.startswith("stage") else list(range(a, b))
    realtime_from_env()
    def idle(c):
        time.sleep(c * (1 / PACE - 1) * float(os.environ.get("IDLE", "1")))
    res = {i: ([], []) for i in range(len(mods))}
    for rep in range(reps):
        for j, (mod, s) in enumerate(zip(mods, starts)):
            mod.zero_grad(set_to_none=True)
            outs = []
            for k in range(4 if mode == "stage" else 1):
                if mode == "stage1": mod.zero_grad(set_to_none=True)
                x = inp(s)
                t = time.thread_time(); y = mod(x)
                if y.shape[-1] == 256: y = y.float().mean()
                c = time.thread_time() - t; idle(c); res[j][0].append(c / PACE); outs.append(y)
            for y in outs:
                g = None if y.dim() == 0 else torch.randn_like(y)
                t = time.thread_time(); y.backward(g); c = time.thread_time() - t; idle(c); res[j][1].append(c / PACE)
    out = {f"{s}": (round(statistics.median(f[len(f)//4:]), 4), round(statistics.median(bb[len(bb)//4:]), 4)) for s, (f, bb) in zip(starts, res.values())}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuts", default="0,2,3,4,6")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--one", action="store_true", help="stage mode, but one microbatch in flight, no accumulation")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--worker", nargs=3)
    args = ap.parse_args()
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), args.reps, args.worker[2])
        sys.exit(0)
    cuts = [int(c) for c in args.cuts.split(",")]
    n = len(cuts) - 1
    jobs = [(0, 6, "layers") if args.all else (cuts[i], cuts[i + 1], "stage1" if args.one else "stage") for i in range(n)]
    procs = [subprocess.Popen([sys.executable, __file__, "--reps", str(args.reps), "--worker", str(a), str(b), m],
                              stdout=subprocess.PIPE, text=True) for a, b, m in jobs]
    for (a, b, m), p in zip(jobs, procs):
        print(f"process layers [{a},{b}) {m}: {p.communicate()[0].strip()}")
