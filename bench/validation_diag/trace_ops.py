#!/usr/bin/env python
"""Diagnostics of bench/RESULTS.md "Cost-model validation re-run": run validation plans with every rank's
operations timed from outside the runner (bench/_op_trace.py) and print, per rank, device seconds of the
stage model's forward, autograd's backward, whole ops, optimizer step and the rest, and per boundary the
arrival delay of activations and gradients.

    sudo env HGOPT_PACE_RT=1 REG=1 BURST=30000 PYTHONPATH=$PWD python bench/validation_diag/trace_ops.py \
        "lan 4st m4,w200 2st a|b m4" /tmp/trace [TENANTS]

REG=1: ranks paced in device regions; TENANTS: co-tenants of the profile (default: the plan's ranks).
Throwaway diagnostics, not a benchmark."""
import sys, json, statistics
from pathlib import Path
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
import bench._harness as H
import bench.validate_cost_model as V
from hgopt.cost import evaluate

def paced_python(out, pace, nice, regions=False):
    path = out / "paced-python"
    (out / "pace").mkdir(exist_ok=True); (out / "trace").mkdir(exist_ok=True)
    for f in (out / "trace").glob("*.json"): f.unlink()
    path.write_text(f"#!/bin/sh\nHGOPT_OP_TRACE={out / 'trace'} HGOPT_PACE_REPORT={out / 'pace'} HGOPT_PACE_NICE={nice} "
                    f"exec {sys.executable} -m hgopt.profiler.paced {pace}{' --device-regions' if regions else ''} -m bench._op_trace \"$@\"\n")
    path.chmod(0o755)
    return str(path)
H._paced_python = paced_python
names = sys.argv[1].split(",")
out = Path(sys.argv[2])
pace = 0.15
from hgopt.plan import Plan
extra = [("lan 1st m4", "lan", Plan(pipelines=(V.pipe([0, 6], [V.g("a")], 4),))),
         ("lan 4st m8 mbs2", "lan", Plan(pipelines=(V.pipe([0, 2, 3, 4, 6], [V.g("a", mbs=2)] * 4, 8),)))]
for name, net, plan in V.plans() + extra:
    if name not in names: continue
    folder = out / name.replace(" ", "_").replace("|", "-").replace("+", "p")
    prof = V.profile_model(folder / "profile.json", pace, V.plan_mbs(plan), repeat=5, tenants=int(sys.argv[3]) if len(sys.argv) > 3 else plan.num_gpus())
    links = {"loopback": {"gbyte_s": 1.0, "latency_ms": 0.05}}
    inst = V.instance(V.NETS[net], prof, links)
    ev = evaluate(plan, inst)
    run = H.run_plan(plan, inst, folder, model=V.MODEL, steps=9, warmup_steps=3, mode=V.NETS[net].mode, burst_bytes=int(__import__("os").environ.get("BURST","3000")), pace=pace, nice=-10, device_regions=bool(int(__import__("os").environ.get("REG","0"))))
    print(name, "pred", round(ev.iteration_time_s,3), "meas", round(run.median_s,3))
    for s in ev.stages: print("  eval stage", s.stage, "fwd", round(s.fwd_s,4), "bwd", round(s.bwd_s,4))
    tim = prof["timings"][0]
    for f in sorted((folder/"trace").glob("*.json")):
        steps = json.loads(f.read_text())
        if not steps: continue
        st = steps[3:]
        r = st[0]["stage"]
        def med(fn): return statistics.median(fn(s) for s in st)/pace
        F = lambda s: [o for o in s["ops"] if o["kind"]=="F"]
        B = lambda s: [o for o in s["ops"] if o["kind"]=="B"]
        print(f"  rank {st[0]['rank']} stage {r}: step cpu/pace {med(lambda s:s['cpu']):.4f} wall {statistics.median(s['wall'] for s in st):.4f}"
              f" | F op {med(lambda s: sum(o['cpu'] for o in F(s))/len(F(s))):.4f} model {med(lambda s: sum(o['model_fwd'] for o in F(s))/len(F(s))):.4f}"
              f" | B op {med(lambda s: sum(o['cpu'] for o in B(s))/len(B(s))):.4f} autograd {med(lambda s: sum(o['backward'] for o in B(s))/len(B(s))):.4f}"
              f" | opt {med(lambda s:s['opt']):.4f} finish {med(lambda s:s['finish']):.4f}"
              f" | other {med(lambda s: s['cpu']-sum(o['cpu'] for o in s['ops'])-s['opt']):.4f}")
        print("     faults per op (median):", statistics.median(o["faults"] for s in st for o in s["ops"]),
              " per-F model:", [round(o["model_fwd"]/pace,4) for o in F(st[-1])], " per-B:", [round(o["backward"]/pace,4) for o in B(st[-1])])
    for f in sorted((folder/"pace").glob("*.json")): print("   pace", f.read_text())
    # transfers: stage s F_k end (send posted) -> stage s+1 F_k receive done; B similarly
    tr = {}
    for f in sorted((folder/"trace").glob("ops-*.json")):
        steps = json.loads(f.read_text())
        if steps: tr[steps[0]["stage"]] = steps
    S = len(tr)
    for si in range(S - 1):
        a, b = tr[si], tr[si + 1]
        lat_f, lat_b, waits = [], [], []
        for sa, sb in list(zip(a, b))[3:]:
            Fa = {o["mb"]: o for o in sa["ops"] if o["kind"] == "F"}; Fb = {o["mb"]: o for o in sb["ops"] if o["kind"] == "F"}
            Ba = {o["mb"]: o for o in sa["ops"] if o["kind"] == "B"}; Bb = {o["mb"]: o for o in sb["ops"] if o["kind"] == "B"}
            for k in Fa:
                # F op of b: starts, waits for receive, then computes. receive done ~ w0 + recv_wait
                lat_f.append(Fb[k]["w0"] + Fb[k]["recv_wait"] - Fa[k]["w1"])
                lat_b.append(Ba[k]["w0"] + Ba[k]["recv_wait"] - Bb[k]["w1"])
                waits.append((round(Fb[k]["recv_wait"], 4), round(Ba[k]["recv_wait"], 4)))
        print(f"  boundary {si}: fwd arrival after send (median) {statistics.median(lat_f):.4f}  bwd {statistics.median(lat_b):.4f}; per-mb arrivals fwd {[round(x,4) for x in lat_f[:8]]} bwd {[round(x,4) for x in lat_b[:8]]}")
