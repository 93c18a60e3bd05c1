"""Memory model [C6] vs what torch really holds in the runner, per stage and term.

    PYTHONPATH=$PWD python bench/memory_check.py [--out DIR] [--json FILE]

For each of a few small plans of the runner's GPT (embedding, 4 blocks, head; hidden 64, 4 heads,
vocabulary 256, 32 tokens, float32, Adam) on a two-cluster instance whose model is the *analytic*
profile of exactly that shape (``hgopt.profiles.analytic``, fp32, no dropout like the runner's
model — the profile the planner uses when nothing is measured): the runner trains one step on this CPU and every rank reports the bytes
of its parameters, gradients, optimizer state and the peak of the tensors autograd saved
(``hgopt/runner/memory.py``); the cost model's terms for the same stage group come from the kernel
(``hgopt.cost.memory.stage_memory_terms`` with ``hgopt.cost.pipeline.in_flight``), never from a
formula written here. Prints one row per (plan, stage, replica group, term): runner bytes, model
bytes, relative error (model − runner) / runner; target |error| <= 10 %. The runner's workspace is not
measured (the model's fixed ``workspace_gb`` is left out). The last column adds the stage output
tensors the runner keeps until their backward (not saved by autograd, not in [C6]).

``--hf`` adds plans of the shipped Llama-shaped ``instances/hf/llama-tiny/config.json`` (embedding, 2
``LlamaDecoderLayer`` blocks, head; hidden 256, 4 heads, 2 KV heads; float32) built by the runner from
``transformers``' modules, against the analytic profile ``hgopt.profiles.hf`` makes of that config —
one of them with activation recomputation on a stage ([C6r]).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hgopt.cost.memory import recompute_activation_bytes, stage_memory_terms  # noqa: E402
from hgopt.cost.pipeline import in_flight  # noqa: E402
from hgopt.cost.tables import build_tables  # noqa: E402
from hgopt.export import ExportOptions, build_runner_plan  # noqa: E402
from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage  # noqa: E402
from hgopt.profiles.analytic import TransformerConfig, generate_profile  # noqa: E402
from hgopt.spec import Instance, ModelProfile, instance_from_dict, model_profile_to_dict  # noqa: E402

HIDDEN, HEADS, VOCAB, SEQ, BLOCKS = 64, 4, 256, 32, 4
TERMS = ("weights", "gradients", "optimizer", "activations")
RUNNER_KEY = {"weights": "parameters", "gradients": "gradients", "optimizer": "optimizer", "activations": "activations"}


def _g(cluster: str, tp: int = 1, dp: int = 1, mbs: int = 2) -> ReplicaGroup:
    return ReplicaGroup(cluster=cluster, tp=tp, dp=dp, mbs=mbs)


def plans() -> dict[str, Plan]:
    """Layers: 0 embedding, 1-4 blocks, 5 head."""
    def one(stages: list[tuple[int, int, list[ReplicaGroup]]], m: int, schedule: str = "1f1b", zero: int = 0) -> Plan:
        return Plan(pipelines=(Pipeline(stages=tuple(Stage(start=a, end=b, groups=tuple(gs), zero=zero) for a, b, gs in stages),
                                        num_microbatches=m, schedule=schedule),))  # type: ignore[arg-type]
    return {
        "1f1b, 2 stages: dp 2 / tp 2, m 4": one([(0, 3, [_g("a", dp=2)]), (3, 6, [_g("b", tp=2, mbs=4)])], 4),
        "gpipe, 3 stages, m 3": one([(0, 2, [_g("a")]), (2, 4, [_g("a")]), (4, 6, [_g("b")])], 3, schedule="gpipe"),
        "1f1b, 2 stages, zero 1: dp 2 (mbs 1 + 3) / dp 2, m 4": one(
            [(0, 3, [_g("a", mbs=1), _g("a", mbs=3)]), (3, 6, [_g("b", dp=2)])], 4, zero=1),
    }


HF_CONFIG = ROOT / "instances" / "hf" / "llama-tiny" / "config.json"


def hf_plans() -> dict[str, Plan]:
    """Layers: 0 embedding, 1-2 Llama blocks, 3 head."""
    def one(stages: list[tuple[int, int, list[ReplicaGroup], str]], m: int) -> Plan:
        return Plan(pipelines=(Pipeline(stages=tuple(Stage(start=a, end=b, groups=tuple(gs), recompute=r)  # type: ignore[arg-type]
                                                     for a, b, gs, r in stages), num_microbatches=m),))
    return {
        "llama 1f1b, 2 stages: dp 2 / tp 2, m 4": one([(0, 2, [_g("a", dp=2)], "none"),
                                                      (2, 4, [_g("b", tp=2, mbs=4)], "none")], 4),
        "llama 1f1b, 3 stages, m 3": one([(0, 1, [_g("a")], "none"), (1, 2, [_g("a")], "none"),
                                          (2, 4, [_g("b")], "none")], 3),
        "llama 1f1b, 2 stages, recompute on 0, m 4": one([(0, 3, [_g("a")], "full"), (3, 4, [_g("b")], "none")], 4),
    }


def hf_instance(global_batch: int) -> Instance:
    from hgopt.profiles.hf import hf_profile, read_hf_config

    prof = hf_profile(read_hf_config(HF_CONFIG), ["A100-80"], source=str(HF_CONFIG), seq_len=SEQ, dtype="fp32",
                      tps=(1, 2), mbss=(1, 2, 3, 4))
    return _instance(prof, global_batch)


def instance(global_batch: int) -> Instance:
    cfg = TransformerConfig(name="runner-gpt", layers=BLOCKS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq_len=SEQ,
                            dtype="fp32", dropout=False)
    return _instance(generate_profile(cfg, ["A100-80"], tps=(1, 2), mbss=(1, 2, 3, 4)), global_batch)


def _instance(prof: ModelProfile, global_batch: int) -> Instance:
    clusters = [{"name": c, "region": f"r-{c}", "gpu": "A100-80", "gpu_memory_gb": 80, "nodes": 1, "gpus_per_node": 4,
                 "intra_node": {"gbyte_s": 100}, "inter_node": {"gbit_s": 100}} for c in ("a", "b")]
    return instance_from_dict({"name": "memory-check", "model": model_profile_to_dict(prof),
                               "topology": {"clusters": clusters, "links": {"default": {"gbit_s": 10, "latency_ms": 1}}},
                               "job": {"global_batch": global_batch, "seq_len": SEQ, "precision": "fp32", "optimizer": "adam"}})


def run_plan(plan: Plan, inst: Instance, out: Path) -> list[dict[str, Any]]:
    """One step of the runner; every rank's memory record."""
    from hgopt.runner.launch import run_forked
    from hgopt.runner.summary import read_metrics

    rp = build_runner_plan(plan, inst, ExportOptions(hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ, steps=1,
                                                     dtype="float32", data="random", optimizer="adam"))
    codes = run_forked(rp, out, steps=1, timeout_s=300)
    if any(codes.values()):
        raise RuntimeError(f"runner failed: exit codes {codes}")
    return read_metrics(out)[-1]["ranks"]


def compare(name: str, plan: Plan, inst: Instance, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tables = build_tables(inst)
    rows = []
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            k = in_flight(len(pipe.stages), si, pipe.num_microbatches, pipe.schedule)
            replica = 0
            for gi, g in enumerate(stage.groups):
                terms = stage_memory_terms(inst, tables, inst.topology.cluster(g.cluster), g.tp, stage.start, stage.end,
                                           g.mbs, k, stage.replicas if stage.zero else 1, stage.recompute == "full")
                mine = [r["memory"] for r in ranks if (r["pipeline"], r["stage"]) == (pi, si)
                        and replica <= r["replica"] < replica + g.dp]
                replica += g.dp
                for term in TERMS:
                    got = max(m[RUNNER_KEY[term]] for m in mine)  # the group's fullest GPU, as [C6] reports
                    want = getattr(terms, term)
                    if term == "activations" and stage.recompute == "full":
                        # [C6r] = inputs kept by the k microbatches in flight + one layer rebuilt during a
                        # backward (the kernel's value at k = 0); the meter sees the kept inputs only
                        tab = tables.table(inst.topology.cluster(g.cluster).gpu, g.tp)
                        want -= recompute_activation_bytes(inst, tab, stage.start, stage.end, g.mbs, 0)
                        term = "activations (kept inputs, [C6r] less its rebuilt layer)"
                    rows.append({"plan": name, "pipeline": pi, "stage": si, "layers": [stage.start, stage.end],
                                 "group": f"{g.dp}x tp{g.tp} mbs{g.mbs}", "in_flight": k, "term": term,
                                 "runner_bytes": got, "model_bytes": want,
                                 "error": (want - got) / got if got else float("nan"),
                                 "runner_with_outputs": max(m.get("activations_with_outputs", 0) for m in mine)
                                 if term.startswith("activations") else None,
                                 "runner_in_flight": max(m["in_flight"] for m in mine)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| plan | stage [layers) in-flight model/runner | group | term | runner (torch) B | model [C6] B | error "
           "| runner + stage outputs B |",
           "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        where = f"{r['stage']} [{r['layers'][0]},{r['layers'][1]}) k={r['in_flight']}/{r['runner_in_flight']}"
        out.append(f"| {r['plan']} | {where} | {r['group']} "
                   f"| {r['term']} | {r['runner_bytes']:,.0f} | {r['model_bytes']:,.0f} | {100 * r['error']:+.1f} % | "
                   + (f"{r['runner_with_outputs']:,.0f} |" if r.get("runner_with_outputs") is not None else " |"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--hf", action="store_true", help="also the Llama-shaped Hugging Face config's plans")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = args.out or Path(tmp)
        cases = [(name, plan, instance) for name, plan in plans().items()]
        cases += [(name, plan, hf_instance) for name, plan in hf_plans().items()] if args.hf else []
        for k, (name, plan, make) in enumerate(cases):
            inst = make(plan.pipelines[0].samples * len(plan.pipelines))
            rows += compare(name, plan, inst, run_plan(plan, inst, base / f"plan{k}"))
    print(table(rows))
    bad = [r for r in rows if not abs(r["error"]) <= 0.10]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} terms within 10 %; worst by term: " + ", ".join(
        f"{t} {100 * max((abs(r['error']) for r in rows if r['term'].startswith(t)), default=0):.1f} %" for t in TERMS))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
