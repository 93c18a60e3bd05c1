"""Regions that synchronise rarely (issue #15): training quality of DiLoCo-style outer synchronisation
with the PyTorch runner, and what the planner predicts for it on the geo-* instances.

    PYTHONPATH=$PWD .venv/bin/python bench/low_comm.py [--part train|plans|both] [--steps 400]

(1) ``train``: the runner's small GPT (4 blocks, hidden 64, seq 64, byte-level) on the shipped corpus,
two emulated regions (clusters a and b of a two-region instance, one one-stage replica each, 8 samples
per step each: global batch 16), inner optimizer Adam (lr 1e-3), ``--steps`` steps, same seed and data
order, under (a) synchronous data parallelism (gradients all-reduced across the regions every step)
and (b) an outer synchronisation every H = 10, 50, 200 steps (outer SGD, lr 0.7, Nesterov momentum
0.9 — DiLoCo's outer settings) with fp32 and int8 deltas. Trained in one process with the runner's
model, data, optimizer and outer exchange (``hgopt.runner.reference.train_reference`` and
``hgopt.runner.outer_reference.train_outer``, which the distributed runner equals to 1e-12:
tests/test_runner.py, tests/test_runner_outer.py): a rank per region costs a second per step of
collectives on the shared CPU. The link itself is not emulated (the loss does not depend on it). Reported: the training loss (the global mean over both regions' samples,
mean of the last 50 steps), the loss of the final model on 8 batches of samples drawn at steps past
the end (unseen samples of the same corpus, not a held-out split) and both relative to (a), and the
loss curves (bench/low_comm_loss.png).
(2) ``plans``: on every geo-* instance the best plan with H = 50 per delta precision
(``hgopt.search.lowcomm`` over the heuristic's group plans) beside the synchronous plan of the same
planner: tokens/s, GPUs used, WAN bytes per step, and the fluid bounds.
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

from hgopt.plan import OuterSync, Pipeline, Plan, ReplicaGroup, Stage  # noqa: E402

RUNS: tuple[tuple[str, int, str], ...] = (("sync", 0, ""), ("H10 fp32", 10, "fp32"), ("H10 int8", 10, "int8"),
                                          ("H50 fp32", 50, "fp32"), ("H50 int8", 50, "int8"),
                                          ("H200 fp32", 200, "fp32"), ("H200 int8", 200, "int8"))
SAMPLES = 8
"""Per region per step."""


def two_region_plan(steps: int, precision: str) -> Plan:
    pipes = tuple(Pipeline(stages=(Stage(start=0, end=4, groups=(ReplicaGroup(cluster=c, mbs=SAMPLES),)),),
                           num_microbatches=1) for c in ("a", "b"))
    outer = OuterSync(groups=((0,), (1,)), steps=steps, precision=precision) if steps else None  # type: ignore[arg-type]
    return Plan(pipelines=pipes, outer=outer)


def train(steps: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from hgopt.export import ExportOptions, build_runner_plan
    from hgopt.runner.data import IGNORE, Dataset
    from hgopt.runner.outer_reference import train_outer
    from hgopt.runner.reference import train_reference
    from tests.runner_plans import runner_instance

    torch.set_num_threads(1)
    inst = runner_instance(global_batch=2 * SAMPLES)
    res: dict[str, Any] = {"steps": steps, "runs": {}}
    for name, h, prec in RUNS:
        rp = build_runner_plan(two_region_plan(h, prec), inst,
                               ExportOptions(hidden=64, heads=4, seq=64, steps=steps, lr=1e-3, optimizer="adam",
                                             dtype="float32", data="corpus"))
        t0 = time.perf_counter()
        if h:
            models, losses = train_outer(rp, steps)
            model = models[0]  # every run ends with an outer step: both groups hold the outer parameters
        else:
            model, losses = train_reference(rp, steps)
        wall = time.perf_counter() - t0
        with torch.no_grad():
            data = Dataset(rp.model, rp.train, rp.global_batch)
            total = tokens = 0.0
            for k in range(8):
                x, y = data.batch(10**6 + k, range(rp.global_batch))
                logits = model(x)
                total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                           ignore_index=IGNORE, reduction="sum"))
                tokens += float((y != IGNORE).sum())
        res["runs"][name] = {"H": h, "precision": prec or "-", "losses": losses,
                             "final_train": statistics.fmean(losses[-50:]), "eval": total / tokens, "wall_s": wall}
        print(f"{name}: final train loss {res['runs'][name]['final_train']:.4f}, eval {total / tokens:.4f} "
              f"({wall:.0f} s)", flush=True)
    return res


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, r) in enumerate(res["runs"].items()):
        xs = r["losses"]
        k = 20
        smooth = [statistics.fmean(xs[max(0, j - k + 1) : j + 1]) for j in range(len(xs))]
        ax.plot(range(1, len(xs) + 1), smooth, label=name, color=f"C{i}",
                linestyle="-" if r["precision"] in ("-", "fp32") else "--", linewidth=1.2)
    ax.set_xlabel("step (global batch 16 x 64 tokens)")
    ax.set_ylabel("training loss (mean of 20 steps)")
    ax.set_title("bench/low_comm.py: synchronous DP vs outer sync every H steps, two regions")
    ax.legend(ncol=2, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def train_table(res: dict[str, Any]) -> str:
    base = res["runs"]["sync"]
    rows = ["| run | H | delta | final train loss | vs sync | eval loss | vs sync | outer syncs |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in res["runs"].items():
        syncs = res["steps"] // r["H"] if r["H"] else "every step (gradients)"
        rows.append(f"| {name} | {r['H'] or '-'} | {r['precision']} | {r['final_train']:.4f} | "
                    f"{100 * (r['final_train'] / base['final_train'] - 1):+.1f} % | {r['eval']:.4f} | "
                    f"{100 * (r['eval'] / base['eval'] - 1):+.1f} % | {syncs} |")
    return "\n".join(rows)


def plans(time_limit: float) -> list[dict[str, Any]]:
    from hgopt.instances import list_instances, load_instance
    from hgopt.search import PlanOptions
    from hgopt.search.lowcomm import plan_low_comm

    out = []
    for entry in list_instances():
        if not entry.name.startswith("geo-"):
            continue
        inst = load_instance(entry.name)
        t0 = time.perf_counter()
        res = plan_low_comm(inst, [50], PlanOptions(time_limit_s=time_limit), planner="heuristic")
        row: dict[str, Any] = {"instance": inst.name, "gpus": inst.topology.num_gpus(),
                               "sync": {"tokens_per_s": res.sync.tokens_per_s, "gpus": res.sync.gpus_used,
                                        "wan": res.sync.wan_bytes_per_step},
                               "bound": res.compute_bound_tokens_per_s, "search_s": time.perf_counter() - t0}
        if res.choices:
            c = res.choices[0]
            row["chosen"] = c.evaluation.precision
            row["groups"] = [list(g.clusters) for g in c.evaluation.groups]
            row["by_precision"] = {p: {"tokens_per_s": e.tokens_per_s, "gpus": e.gpus_used,
                                       "wan": e.wan_bytes_per_step, "fluid": e.fluid_tokens_per_s,
                                       "exposed_s": e.exposed_sync_s, "inner_s": e.inner_step_s}
                                   for p, e in c.by_precision if e.feasible}
        out.append(row)
        print(f"{inst.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB" if x > 0 else "0"


def plans_table(rows: list[dict[str, Any]]) -> str:
    out = ["| instance | plan | tokens/s | vs sync | GPUs used | WAN bytes/step | fluid (groups alone) | "
           "compute bound |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["sync"]
        out.append(f"| {r['instance']} | synchronous | {s['tokens_per_s']:.4g} | — | {s['gpus']}/{r['gpus']} | "
                   f"{_gb(s['wan'])} | — | {r['bound']:.4g} |")
        for p, e in r.get("by_precision", {}).items():
            mark = " (chosen)" if p == r.get("chosen") else ""
            out.append(f"| | H 50, {p} deltas{mark} | {e['tokens_per_s']:.4g} | "
                       f"{100 * (e['tokens_per_s'] / s['tokens_per_s'] - 1):+.1f} % | {e['gpus']}/{r['gpus']} | "
                       f"{_gb(e['wan'])} | {e['fluid']:.4g} | |")
        if r.get("groups"):
            out.append(f"| | groups: {' / '.join('+'.join(g) for g in r['groups'])} | | | | | | |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("train", "plans", "both"), default="both")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--time-limit", type=float, default=20.0, help="planner budget per instance (plans)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "low_comm.json")
    args = ap.parse_args()
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.part in ("train", "both"):
        if args.steps % 200:
            raise SystemExit("--steps must be a multiple of 200 (every run ends with an outer step)")
        doc["train"] = train(args.steps)
        plot(doc["train"], ROOT / "bench" / "low_comm_loss.png")
        print(train_table(doc["train"]))
    if args.part in ("plans", "both"):
        doc["plans"] = plans(args.time_limit)
        print(plans_table(doc["plans"]))
    args.out.write_text(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main()
