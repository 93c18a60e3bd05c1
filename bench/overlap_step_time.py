"""Measured step time of the runner with the gradient all-reduce overlapped with the last backward
(``overlap_grad_sync`` on) and not (off), next to the cost model's prediction for both settings.

    sudo PYTHONPATH=$PWD .venv/bin/python bench/overlap_step_time.py [--out DIR] [--steps 7] [--pace 0.15]

One plan of ``bench/validate_cost_model.py``'s GPT (embedding, 4 blocks, head; hidden 128, seq 128):
two pipelines of one stage each, one in cluster a and one in cluster b (data parallelism across the
two clusters), 2 microbatches of 4 samples; buckets of 1 MiB (about one block each). The WAN link
is 50 Mbit/s with 20 ms latency, emulated by the runner's ``delay`` mode (a cross-cluster bucket
ends at max(launch of its slowest member, end of the previous bucket) + [C5]'s ring time). Every rank
is a paced device (``--pace`` cores, hgopt/profiler/paced.py); compute is profiled first with
``hgopt profile`` at that pace and the instance built from it as in the validation bench. Prints, for
overlap off and on: the runner's median step (after 2 warm-up steps), ``evaluate``'s
``iteration_time_overlap_s`` ([C7o]) and, where ``hgopt.simulate`` exists, the simulator's iteration
time. Needs no root (delay mode); ~3 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._harness import run_plan  # noqa: E402
from bench.validate_cost_model import MODEL, Net, _hgopt, g, instance, pipe, profile_model  # noqa: E402
from hgopt.cost import evaluate  # noqa: E402
from hgopt.plan import Plan  # noqa: E402

NET = Net(name="w50-20ms", mbit_s=50.0, latency_ms=20.0)
BUCKET_MB = 1.0


def the_plan(overlap: bool) -> Plan:
    return Plan(pipelines=(pipe([0, 6], [g("a", mbs=4)], 2), pipe([0, 6], [g("b", mbs=4)], 2)),
                overlap_grad_sync=overlap, grad_bucket_mb=BUCKET_MB)


def simulated(plan: Plan, inst: object) -> float | None:
    try:
        from hgopt.simulate import simulate  # type: ignore[attr-defined]
    except ImportError:
        return None
    return float(simulate(plan, inst).iteration_time_s)  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/hgopt-overlap", help="folder for the profile and the runs")
    ap.add_argument("--steps", type=int, default=7, help="runner steps per setting (the first 2 are warm-up)")
    ap.add_argument("--pace", type=float, default=0.15, help="device speed of every rank, in cores")
    ap.add_argument("--nice", type=int, default=0, help="CPU priority of the paced ranks (root for < 0)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prof = profile_model(out / "profile.json", args.pace, (4,), repeat=5)
    path = out / "links-loopback.json"
    _hgopt(["profile", "--links", "--ranks", "2", "--repeat", "5", "--sizes", "65536,262144,1048576,4194304",
            "-o", str(path)])
    links = {"loopback": json.loads(path.read_text())["point_to_point"]}
    inst = instance(replace(NET), prof, links)
    rows = []
    for overlap in (False, True):
        plan = the_plan(overlap)
        ev = evaluate(plan, inst)
        run = run_plan(plan, inst, out / f"overlap-{'on' if overlap else 'off'}", model=MODEL, steps=args.steps,
                       warmup_steps=2, mode=NET.mode, pace=args.pace, nice=args.nice)
        rows.append({"overlap": overlap, "measured_s": run.median_s, "steps_s": list(run.step_s),
                     "evaluate_s": getattr(ev, "iteration_time_overlap_s", ev.iteration_time_s),
                     "evaluate_no_overlap_s": ev.iteration_time_s, "simulate_s": simulated(plan, inst),
                     "lag_s": run.lag_s})
    print("| overlap_grad_sync | runner median step (s) | evaluate [C7o] (s) | simulate (s) | steps (s) |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        sim = "-" if r["simulate_s"] is None else f"{r['simulate_s']:.3f}"
        print(f"| {'on' if r['overlap'] else 'off'} | {r['measured_s']:.3f} | {r['evaluate_s']:.3f} | {sim} | "
              + ", ".join(f"{t:.3f}" for t in r["steps_s"]) + " |")
    off, on = rows
    print(f"\nmeasured saving {off['measured_s'] - on['measured_s']:.3f} s "
          f"({1 - on['measured_s'] / off['measured_s']:.1%}); evaluate's {off['evaluate_s'] - on['evaluate_s']:.3f} s")
    ref = run_plan(the_plan(True), inst, out / "links-off", model=MODEL, steps=args.steps, warmup_steps=2, mode="off",
                   pace=args.pace, nice=args.nice)
    ev = evaluate(the_plan(True), inst)
    compute = ev.pipeline_time_s + max(s.optimizer_s for s in ev.stages)
    print(f"links not emulated (compute, loopback sync, optimizer): runner median {ref.median_s:.3f} s "
          f"(steps {', '.join(f'{t:.3f}' for t in ref.step_s)}), evaluate's pipeline + optimizer {compute:.3f} s")
    print("pace lag (s of the run a paced rank fell behind): " + ", ".join(
        f"overlap {'on' if r['overlap'] else 'off'} {r['lag_s']:.2f}" for r in rows) + f", links off {ref.lag_s:.2f}")
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
