"""Mixed-precision stage boundaries, measured with the PyTorch runner: training quality, bytes on the
wire and step time, next to what ``evaluate`` predicts.

    sudo .venv/bin/python bench/mixed_precision.py [--out DIR] [--steps 300]

(1) Quality: a small GPT (the runner's model) on the runner's shipped corpus, 4 stages across two
emulated clusters (stages 0-1 in cluster a, 2-3 in b; the a->b boundary crosses the emulated link,
``netns`` shaping), trained ``--steps`` steps with that boundary in fp32, bf16 and fp8 (both
directions); same seed and data order. Reported: the final loss (mean of the last 20 steps) of bf16 and
fp8 relative to fp32, and the three loss curves (bench/mixed_precision_loss.png).
(2) Bytes: what the runner counted over the compressed boundary per step, relative to fp32.
(3) Step time on constrained links (``--mbit``): the same plan with every rank a paced device
(hgopt/profiler/paced.py), median step time for each precision, next to ``evaluate``'s prediction from
a fresh ``hgopt profile`` and the measured link (``hgopt profile --links --emulate``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._harness import ModelOpts, RunResult, load_average, run_plan  # noqa: E402
from bench.validate_cost_model import _hgopt, profile_model  # noqa: E402
from hgopt.cost import evaluate  # noqa: E402
from hgopt.plan import Boundary, Pipeline, Plan, ReplicaGroup, Stage  # noqa: E402
from hgopt.spec import Instance, instance_from_dict  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8")
COLORS = {"fp32": "C0", "bf16": "C1", "fp8": "C2"}
QUALITY_MODEL = ModelOpts(hidden=128, heads=4, vocab=256, seq=64, data="corpus", lr=1e-3, seed=0)
TIMING_MODEL = ModelOpts(hidden=128, heads=4, vocab=256, seq=128, data="random")
BLOCKS = 4


def plan_4_stages(precision: str, mbs: int, m: int) -> Plan:
    """Layers 0 embedding, 1-4 blocks, 5 head: [0,2) [2,3) on a | [3,4) [4,6) on b; the precision
    applies to the a->b boundary (boundary 1), the local ones stay native."""
    cuts, where = [0, 2, 3, 4, 6], ["a", "a", "b", "b"]
    stages = tuple(Stage(start=lo, end=hi, groups=(ReplicaGroup(cluster=c, mbs=mbs),))
                   for lo, hi, c in zip(cuts, cuts[1:], where))
    wan = Boundary(fwd=precision, bwd=precision)  # type: ignore[arg-type]
    return Plan(pipelines=(Pipeline(stages=stages, num_microbatches=m, boundaries=(Boundary(), wan, Boundary())),))


def instance(prof: dict[str, Any], seq: int, wan: dict[str, float], local: dict[str, float],
             memory_gbyte_s: float, global_batch: int) -> Instance:
    clusters = [{"name": c, "region": f"r{c}", "gpu": "cpu", "gpu_memory_gb": 16, "nodes": 1, "gpus_per_node": 2,
                 "intra_node": local, "inter_node": local, "memory_bandwidth_gbyte_s": memory_gbyte_s}
                for c in ("a", "b")]
    return instance_from_dict({"name": "mixed-precision", "model": prof,
                               "topology": {"clusters": clusters, "links": {"default": wan}},
                               "job": {"global_batch": global_batch, "seq_len": seq, "precision": "fp32"}})


def dummy_profile(seq: int) -> dict[str, Any]:
    """A placeholder profile for the quality runs (their timing is not predicted): shapes only."""
    kinds = ["embedding", *["block"] * BLOCKS, "head"]
    n = len(kinds)
    return {"name": "runner-gpt", "dtype": "fp32", "seq_len": seq,
            "layers": [{"name": f"{k}{i}", "kind": k, "params": 1.0, "activation_bytes": 1.0, "act_mem_bytes": 1.0}
                       for i, k in enumerate(kinds)],
            "timings": [{"gpu": "cpu", "tp": 1, "mbs": 1, "fwd": [1e-3] * n, "bwd": [1e-3] * n, "update": [0.0] * n}]}


def wan_bytes(run: RunResult) -> dict[str, int]:
    return {d: run.bytes_last_step.get(f"p0.b1.{d}.wan", 0) for d in ("fwd", "bwd")}


# ---- (1) + (2): quality and bytes ----------------------------------------------------------------
def quality(out: Path, steps: int) -> dict[str, RunResult]:
    fast = {"gbit_s": 1.0, "latency_ms": 0.0}
    inst = instance(dummy_profile(QUALITY_MODEL.seq), QUALITY_MODEL.seq, fast, {"gbyte_s": 2.0}, 900.0, 16)
    runs = {}
    for prec in PRECISIONS:
        t = time.perf_counter()
        runs[prec] = run_plan(plan_4_stages(prec, 4, 4), inst, out / f"quality-{prec}", model=QUALITY_MODEL,
                              steps=steps, warmup_steps=3, mode="netns")
        r = runs[prec]
        print(f"quality {prec}: {steps} steps in {time.perf_counter() - t:.0f} s, loss {r.losses[0]:.3f} -> "
              f"{statistics.fmean(r.losses[-20:]):.4f} (mean of last 20), a->b bytes/step {wan_bytes(r)}", flush=True)
    return runs


def loss_plot(losses: dict[str, list[float]], path: Path) -> None:
    """The three curves, and below them each compressed run's difference to fp32 (20-step mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(6.4, 5.2), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    for prec, style in zip(PRECISIONS, ("-", "--", ":")):
        ax.plot(range(1, len(losses[prec]) + 1), losses[prec], style, lw=1.2, color=COLORS[prec],
                label=f"{prec} boundary")
    ax.set_ylabel("training loss")
    ax.set_title("4 stages on 2 emulated clusters: compressed a->b boundary", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    base = losses["fp32"]
    for prec, style in zip(PRECISIONS[1:], ("--", ":")):
        rel = [(a - b) / b for a, b in zip(losses[prec], base)]
        smooth = [statistics.fmean(rel[max(0, i - 19): i + 1]) for i in range(len(rel))]
        dx.plot(range(1, len(smooth) + 1), [100 * v for v in smooth], style, lw=1.2, color=COLORS[prec],
                label=f"{prec} vs fp32")
    dx.axhline(0, color="black", lw=0.8)
    dx.set_xlabel("step")
    dx.set_ylabel("difference (%)")
    dx.legend(fontsize=8)
    dx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def read_losses(out: Path) -> dict[str, list[float]]:
    """Losses of the quality runs from their metrics (for --plot-only)."""
    return {p: [json.loads(line)["loss"] for line in (out / f"quality-{p}" / "metrics.jsonl").read_text().splitlines()
                if line.strip()] for p in PRECISIONS}


# ---- (3): step time on a constrained link --------------------------------------------------------
def timing(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for mbit in (float(x) for x in args.mbit.split(",")):
        rows += timing_one_link(out / f"link-{mbit:g}", mbit, args)
    return rows


def timing_one_link(out: Path, mbit: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    link_doc = out / "link.json"
    _hgopt(["profile", "--links", "--emulate", str(mbit), "--burst", str(args.burst), "--repeat", "3",
            "--sizes", "65536,262144,1048576,2097152", "-o", str(link_doc)])
    wan = json.loads(link_doc.read_text())["point_to_point"]
    local_doc = out / "loopback.json"
    _hgopt(["profile", "--links", "--ranks", "2", "--repeat", "5", "--sizes", "65536,262144,1048576,4194304",
            "-o", str(local_doc)])
    local = json.loads(local_doc.read_text())["point_to_point"]
    memory = cast_bandwidth(args.pace)
    print(f"link {wan['gbyte_s'] * 8e3:.1f} Mbit/s, loopback {local['gbyte_s']:.2f} GB/s, paced device casts at "
          f"{memory:.2f} GB/s", flush=True)
    rows = []
    for prec in PRECISIONS:
        plan = plan_4_stages(prec, args.mbs, args.microbatches)
        prof = profile_model(out / f"timing-{prec}" / "profile.json", args.pace, (args.mbs,), repeat=6)
        inst = instance(prof, TIMING_MODEL.seq, wan, local, memory, args.mbs * args.microbatches)
        ev = evaluate(plan, inst)
        run = run_plan(plan, inst, out / f"timing-{prec}", model=TIMING_MODEL, steps=args.timing_steps,
                       warmup_steps=3, mode="netns", pace=args.pace, nice=-10, burst_bytes=args.burst)
        rows.append({"mbit": mbit, "precision": prec, "predicted_s": ev.iteration_time_s, "measured_s": run.median_s,
                     "send_fwd_s": ev.stages[1].send_fwd_s, "bytes": wan_bytes(run), "lag_s": run.lag_s,
                     "load": run.load_before})
        print(f"timing {mbit:g} Mbit/s {prec}: predicted {ev.iteration_time_s:.3f} s, measured {run.median_s:.3f} s "
              f"(steps {[round(x, 3) for x in run.step_s]}, lag {run.lag_s:.2f} s)", flush=True)
    return rows


def cast_bandwidth(pace: float) -> float:
    """GB/s of the paced device for a float32 -> bfloat16 cast (reads 4, writes 2 bytes per value), in
    the unit [C4q] uses (cluster memory_bandwidth_gbyte_s): thread CPU time / pace."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(1 << 22)  # 16 MiB
    times = []
    for _ in range(7):
        t = time.thread_time()
        x.to(torch.bfloat16)
        times.append((time.thread_time() - t) / pace)
    return 6 * x.numel() / statistics.median(times) / 1e9


# ---- report ----------------------------------------------------------------------------------------
def report(runs: dict[str, RunResult], timing_rows: list[dict[str, Any]], args: argparse.Namespace,
           load0: float, wall: float) -> str:
    final = {p: statistics.fmean(runs[p].losses[-20:]) for p in PRECISIONS}
    last = {p: runs[p].losses[-1] for p in PRECISIONS}
    lines = [f"Quality: {args.steps} steps, 4 stages (a, a | b, b), global batch 16 x {QUALITY_MODEL.seq} tokens, "
             f"hidden {QUALITY_MODEL.hidden}, corpus, Adam lr {QUALITY_MODEL.lr}, seed {QUALITY_MODEL.seed}",
             "",
             "| a->b boundary | first loss | final loss (mean of last 20) | vs fp32 | last-step loss | "
             "a->b bytes/step fwd | bwd | vs fp32 |",
             "|---|---|---|---|---|---|---|---|"]
    b32 = wan_bytes(runs["fp32"])
    for p in PRECISIONS:
        b = wan_bytes(runs[p])
        lines.append(f"| {p} | {runs[p].losses[0]:.4f} | {final[p]:.4f} | {final[p] / final['fp32'] - 1:+.2%} | "
                     f"{last[p]:.4f} | {b['fwd']:,} | {b['bwd']:,} | "
                     f"{(b['fwd'] + b['bwd']) / max(1, b32['fwd'] + b32['bwd']):.3f} |")
    lines += ["", f"Step time: same 4-stage plan, mbs {args.mbs} x {args.microbatches} microbatches, seq "
              f"{TIMING_MODEL.seq}, a->b link tbf (burst {args.burst} B), every rank paced at {args.pace} core", "",
              "| link | a->b boundary | predicted (s) | measured (s) | error | predicted gain vs fp32 | "
              "measured gain vs fp32 | a->b bytes/step |", "|---|---|---|---|---|---|---|---|"]
    for r in timing_rows:
        base = next(b for b in timing_rows if b["mbit"] == r["mbit"] and b["precision"] == "fp32")
        lines.append(f"| {r['mbit']:g} Mbit/s | {r['precision']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
                     f"{r['predicted_s'] / r['measured_s'] - 1:+.1%} | {1 - r['predicted_s'] / base['predicted_s']:+.1%} | "
                     f"{1 - r['measured_s'] / base['measured_s']:+.1%} | {r['bytes']['fwd'] + r['bytes']['bwd']:,} |")
    lines += ["", f"load average {load0:.1f} at start, {load_average():.1f} at end; {wall:.0f} s in all"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/hgopt-mixed-precision")
    ap.add_argument("--steps", type=int, default=300, help="training steps of each quality run (>= 200)")
    ap.add_argument("--mbit", default="100,20", help="constrained links of the step-time runs (Mbit/s, comma separated)")
    ap.add_argument("--burst", type=int, default=3000)
    ap.add_argument("--pace", type=float, default=0.15)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--timing-steps", type=int, default=10)
    ap.add_argument("--png", default=str(ROOT / "bench" / "mixed_precision_loss.png"))
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--plot-only", action="store_true", help="redraw the loss plot from the runs in --out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        loss_plot(read_losses(out), Path(args.png))
        return 0
    t0, load0 = time.perf_counter(), load_average()
    runs = quality(out, args.steps) if not args.skip_quality else {}
    if runs:
        loss_plot({p: list(r.losses) for p, r in runs.items()}, Path(args.png))
    rows = timing(out, args)
    text = report(runs, rows, args, load0, time.perf_counter() - t0) if runs else json.dumps(rows, indent=1)
    print("\n" + text)
    (out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
