"""Which of ``evaluate`` and ``simulate`` is right where they disagree: run plans of the validation
bench's small GPT (bench/validate_cost_model.py: embedding, 4 blocks, head; hidden 128; global batch
16; every rank a paced device) with the PyTorch runner on links emulated by its ``delay`` mode
(exactly the configured bandwidth and latency, no root needed), and print both predictions next to
the measured median step time.

    PYTHONPATH=$PWD .venv/bin/python bench/simulate_vs_runner.py [--out DIR] [--steps 8] [--pace 0.15]
        [--only NAME,...] [--emulate]

Plans (default): 1F1B pipelines with a slow (50 or 200 ms) link between two middle stages, where [C3]'s round trip
from stage s to the end misses the window around the slow hop; one plan without latency as a
control. Each plan gets a fresh profile of its microbatch sizes just before its run (as in the
validation bench, measured with as many paced co-tenants as the plan has ranks) and both predictions
use it; the ranks are paced in device regions, as in the validation bench (docs/validation.md). The
validation bench itself now reports both predictions for its 14 plans; this one keeps the plans with a
slow middle hop.

``--emulate`` (round 8, issue #10 items 2/4): plans on clusters of several one-GPU nodes whose links the
``delay`` mode emulates per node (hgopt/runner/linkemu.py): (a) a stage whose replicas span two clusters
([C3s]), (b) a gradient ring crossing a capped link the pipelines also use ([C7c]), (c) a per-flow link
used by two node pairs at once, against one shared pipe and a cap (bench/RESULTS.md "The runner on
per-node emulated links").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench._harness as harness  # noqa: E402
from bench._harness import load_average, run_plan  # noqa: E402
from bench.validate_cost_model import (GLOBAL_BATCH, MODEL, Net, calibrated, g, instance, pipe, plan_mbs,  # noqa: E402
                                       profile_model)
from hgopt.cost import evaluate  # noqa: E402
from hgopt.plan import Pipeline, Plan, Stage  # noqa: E402
from hgopt.simulate import simulate  # noqa: E402
from hgopt.spec import Instance, instance_from_dict  # noqa: E402

NETS = {
    "w100-50ms": Net(name="w100-50ms", mbit_s=100.0, latency_ms=50.0),
    "w1000-50ms": Net(name="w1000-50ms", mbit_s=1000.0, latency_ms=50.0),
    "w1000-200ms": Net(name="w1000-200ms", mbit_s=1000.0, latency_ms=200.0),
}


# ---- emulate (issue #10 items 2/4): per-node NICs, per-flow links, aggregate caps ------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class EmuNet:
    """Two clusters a, b of ``nodes`` one-GPU nodes each (so the export's placement, one rank per node,
    is the simulator's and the kernel's: every replica on a node of its own; ``gpus_per_node`` 2 with
    ``nodes`` 1 is the validation bench's layout); the link a <-> b per flow
    (one node pair) or one shared pipe per direction, with an optional aggregate cap; every node's NIC
    at the measured loopback (``nic_mbit_s`` None) or at an emulated rate."""

    name: str
    kind: str
    mbit_s: float
    latency_ms: float
    aggregate_mbit_s: float | None = None
    nodes: int = 2
    nic_mbit_s: float | None = None
    gpus_per_node: int = 1


EMU_NETS = {
    "pf20-20ms": EmuNet(name="pf20-20ms", kind="per_flow", mbit_s=20.0, latency_ms=20.0),
    "pipe20-20ms": EmuNet(name="pipe20-20ms", kind="shared_pipe", mbit_s=20.0, latency_ms=20.0),
    "pf20-cap30-20ms": EmuNet(name="pf20-cap30-20ms", kind="per_flow", mbit_s=20.0, latency_ms=20.0,
                              aggregate_mbit_s=30.0),
    "pf40-cap20-20ms": EmuNet(name="pf40-cap20-20ms", kind="per_flow", mbit_s=40.0, latency_ms=20.0,
                              aggregate_mbit_s=20.0),
    "pf100-50ms": EmuNet(name="pf100-50ms", kind="per_flow", mbit_s=100.0, latency_ms=50.0),
    "pipe200-1node": EmuNet(name="pipe200-1node", kind="shared_pipe", mbit_s=200.0, latency_ms=0.0, nodes=1,
                            gpus_per_node=2),  # bench/validate_cost_model.py's w200
    "pf100-50ms-nic50": EmuNet(name="pf100-50ms-nic50", kind="per_flow", mbit_s=100.0, latency_ms=50.0,
                               nic_mbit_s=50.0),
}


def emu_instance(net: EmuNet, prof: dict[str, Any], links: dict[str, dict[str, float]]) -> Instance:
    """The instance of an :class:`EmuNet` (what the delay mode's per-node emulation carries exactly)."""
    local = {"gbyte_s": links["loopback"]["gbyte_s"], "latency_ms": links["loopback"]["latency_ms"]}
    nic = local if net.nic_mbit_s is None else {"gbit_s": net.nic_mbit_s / 1000.0, "latency_ms": 0.0}
    bw = {"gbit_s": net.mbit_s / 1000.0, "latency_ms": net.latency_ms}
    source = f"emulated: delay mode, {net.kind} {net.mbit_s:g} Mbit/s + {net.latency_ms:g} ms"
    if net.kind == "per_flow":
        wan: dict[str, Any] = {"kind": "per_flow", "per_flow": bw, "source": source}
        if net.aggregate_mbit_s is not None:
            wan["aggregate"] = {"gbit_s": net.aggregate_mbit_s / 1000.0}
    else:
        wan = {"kind": "shared_pipe", **bw, "source": source}
    clusters = [{"name": c, "region": f"r{c}", "gpu": "cpu", "gpu_memory_gb": 16, "nodes": net.nodes,
                 "gpus_per_node": net.gpus_per_node, "intra_node": local, "inter_node": nic} for c in ("a", "b")]
    return instance_from_dict({
        "name": f"emulate-{net.name}", "model": prof,
        "topology": {"clusters": clusters, "links": {"default": wan}},
        "job": {"global_batch": GLOBAL_BATCH, "seq_len": MODEL.seq, "precision": "fp32"},
    })


def emu_plans() -> list[tuple[str, str, Plan]]:
    """(a) [C3s]: stage 1 spans a and b; (b) [C7c]: two pipelines a|b and b|a, so the first segment's
    ring (a <-> b) crosses the capped link the pipelines send over; (c) a per-flow link used by two
    node pairs at once, against one shared pipe and against a cap between one and two flows."""
    one = lambda *p: Plan(pipelines=tuple(p))  # noqa: E731
    span = Pipeline(stages=(Stage(start=0, end=2, groups=(g("a", mbs=2),)),
                            Stage(start=2, end=4, groups=(g("a", mbs=1), g("b", mbs=1))),
                            Stage(start=4, end=6, groups=(g("b", mbs=2),))), num_microbatches=8)
    dp2 = pipe([0, 3, 6], [g("a", dp=2, mbs=2), g("b", dp=2, mbs=2)], 4)
    return [
        ("(a) 3st a|a+b|b m8 spanning", "pf100-50ms", one(span)),
        ("(a) 3st a|a+b|b m8 spanning nic50", "pf100-50ms-nic50", one(span)),
        ("(b) a|b + b|a ring on cap", "pf40-cap20-20ms",
         one(pipe([0, 3, 6], [g("a", mbs=2), g("b", mbs=2)], 4), pipe([0, 3, 6], [g("b", mbs=2), g("a", mbs=2)], 4))),
        ("(c) 2st dp2 a|b per-flow", "pf20-20ms", one(dp2)),
        ("(c) 2st dp2 a|b shared pipe", "pipe20-20ms", one(dp2)),
        ("(c) 2st dp2 a|b per-flow cap1.5", "pf20-cap30-20ms", one(dp2)),
        # the validation bench's plan: one node of two ranks per cluster, both stage-0 ranks on one pipe
        ("(c) w200 2st dp2 a|b one node each", "pipe200-1node", one(dp2)),
    ]


def plans() -> list[tuple[str, str, Plan]]:
    one = lambda *p: Plan(pipelines=tuple(p))  # noqa: E731
    return [
        ("4st aa|bb m8 200ms", "w1000-200ms",
         one(pipe([0, 2, 3, 4, 6], [g("a", mbs=2), g("a", mbs=2), g("b", mbs=2), g("b", mbs=2)], 8))),
        ("4st aa|bb m8 (slow middle)", "w1000-50ms",
         one(pipe([0, 2, 3, 4, 6], [g("a", mbs=2), g("a", mbs=2), g("b", mbs=2), g("b", mbs=2)], 8))),
        ("3st a|b|b m8", "w100-50ms", one(pipe([0, 2, 4, 6], [g("a", mbs=2), g("b", mbs=2), g("b", mbs=2)], 8))),
        ("2st a|b m4", "w100-50ms", one(pipe([0, 3, 6], [g("a"), g("b")], 4))),
    ]


def _patient_export(timeout_s: float):  # type: ignore[no-untyped-def]
    """The harness's export with longer heartbeat and collective timeouts: on a host shared with
    other jobs (load average ~15 on 2 cores) a paced rank can be descheduled for > 15 s."""
    from dataclasses import replace

    build = harness.build_runner_plan

    def patched(*a, **k):  # type: ignore[no-untyped-def]
        return replace(build(*a, **k), heartbeat_timeout_s=timeout_s, timeout_s=4 * timeout_s)

    return patched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/hgopt-simcheck")
    ap.add_argument("--steps", type=int, default=8, help="runner steps per plan (the first 3 are warm-up)")
    ap.add_argument("--pace", type=float, default=0.15, help="device speed of every rank, in cores")
    ap.add_argument("--nice", type=int, default=-10)
    ap.add_argument("--only", default="", help="plan names, comma-separated")
    ap.add_argument("--in-situ", action="store_true", help="also predict from the run's own warm-up steps (steps 2, 3: "
                    "every stage's layers rescaled to the device time its operations took there, as the validation bench does)")
    ap.add_argument("--emulate", action="store_true", help="the per-node emulation's plans (issue #10 items 2/4): "
                    "(a) a spanning stage, (b) a ring on a capped link, (c) per-flow links vs a shared pipe")
    ap.add_argument("--heartbeat", type=float, default=120.0, help="runner heartbeat timeout (s)")
    args = ap.parse_args()
    harness.build_runner_plan = _patient_export(args.heartbeat)
    if os.geteuid() == 0:
        os.environ.setdefault("HGOPT_PACE_RT", "1")  # paced ranks and profiles under SCHED_RR (hgopt.profiler.paced)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # ranks of one cluster talk over loopback: measured once
    from bench.validate_cost_model import _hgopt

    lb = out / "links-loopback.json"
    _hgopt(["profile", "--links", "--ranks", "2", "--repeat", "5", "--sizes", "65536,262144,1048576,4194304",
            "-o", str(lb)])
    links = {"loopback": json.loads(lb.read_text())["point_to_point"]}
    keep = set(filter(None, args.only.split(",")))
    rows = []
    t0, load0 = time.perf_counter(), load_average()
    chosen = emu_plans() if args.emulate else plans()
    for name, net, plan in chosen:
        if keep and name not in keep:
            continue
        folder = out / "runs" / "".join(c if c.isalnum() else "_" for c in name)
        prof = profile_model(folder / "profile.json", args.pace, plan_mbs(plan), repeat=15, tenants=plan.num_gpus())
        inst = emu_instance(EMU_NETS[net], prof, links) if args.emulate else instance(NETS[net], prof, links)
        ev, sim = evaluate(plan, inst), simulate(plan, inst)
        run = run_plan(plan, inst, folder, model=MODEL, steps=args.steps, warmup_steps=3, mode="delay",
                       pace=args.pace, nice=args.nice, device_regions=True, op_trace=args.in_situ)
        situ = ""
        if args.in_situ:  # emulate: both predictions again from the run's own warm-up steps' stage times
            cal = calibrated(prof, plan, folder / "trace", args.pace, [2, 3])
            inst_c = emu_instance(EMU_NETS[net], cal, links) if args.emulate else instance(NETS[net], cal, links)
            ie, isim = evaluate(plan, inst_c).iteration_time_s, simulate(plan, inst_c).iteration_time_s
            situ = (f" {ie:.3f} | {isim:.3f} | {(ie - run.median_s) / run.median_s:+.1%} | "
                    f"{(isim - run.median_s) / run.median_s:+.1%} |")
        rows.append((name, net, ev.iteration_time_s, sim.iteration_time_s, run.median_s, run, situ))
        print(f"{name:<28} evaluate {ev.iteration_time_s:.3f} s  simulate {sim.iteration_time_s:.3f} s  "
              f"measured {run.median_s:.3f} s (steps {', '.join(f'{s:.3f}' for s in run.step_s)}; "
              f"lag {run.lag_s:.2f} s, load {run.load_before:.1f}){situ}", flush=True)
    lines = ["| plan | link | evaluate (s) | simulate (s) | measured (s) | evaluate error | simulate error | step spread |"
             + (" in situ: evaluate (s) | in situ: simulate (s) | in situ: evaluate error | in situ: simulate error |"
                if args.in_situ else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if args.in_situ else "")]
    for name, net, e, s, m, run, situ in rows:
        later = run.step_s[3:]
        spread = (max(later) - min(later)) / m if later else 0.0
        lines.append(f"| {name.replace('|', chr(92) + '|')} | {net} | {e:.3f} | {s:.3f} | {m:.3f} | {(e - m) / m:+.1%} | {(s - m) / m:+.1%} | "
                     f"{spread:.0%} |{situ}")
    if rows:
        lines.append("")
        lines.append(f"median |error|: evaluate {statistics.median(abs(e - m) / m for _, _, e, _, m, _, _ in rows):.1%}, "
                     f"simulate {statistics.median(abs(s - m) / m for _, _, _, s, m, _, _ in rows):.1%}; "
                     f"load average {load0:.1f} at start, {load_average():.1f} at end; "
                     f"{time.perf_counter() - t0:.0f} s; pace {args.pace} core per rank")
    text = "\n".join(lines)
    print("\n" + text)
    (out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
