"""``hgopt export PLAN --instance INSTANCE -o DIR``: the runner plan and per-node torchrun commands."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hgopt.commands._paths import check_output_dir
from hgopt.export import ExportOptions, build_runner_plan, write_export
from hgopt.export.build import check_comm_options
from hgopt.instances import load_instance
from hgopt.plan import load_plan

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write the runner plan and the torchrun command of every node",
                       description="Export a plan for the PyTorch runner (python -m hgopt.runner).")
    p.add_argument("plan", help="plan JSON (from `hgopt plan` or written by hand)")
    p.add_argument("--instance", required=True, help="instance name (see `hgopt instances`) or path")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="folder to write plan.json and node scripts to")
    p.add_argument("--local", action="store_true", help="run every rank on this machine (rendezvous 127.0.0.1)")
    p.add_argument("--emulate-links", choices=("off", "delay", "netns", "auto"), default="off",
                   help="shape cross-cluster traffic like the topology's links: netns (namespaces + tc tbf, root), "
                        "delay (sleep bytes/bandwidth + latency), auto (netns when possible)")
    p.add_argument("--link-scale", type=float, default=1.0, help="multiply emulated link bandwidths by this")
    p.add_argument("--json", action="store_true",
                   help="print a JSON summary (files written, ranks, per-node commands) instead of the listing")
    p.add_argument("--elastic", action="store_true",
                   help="also write elastic.json (the plan, the instance, these options) for "
                        "`python -m hgopt.runner --elastic`, which re-plans when a rank dies")
    m = p.add_argument_group("runner model (small CPU-friendly defaults)")
    m.add_argument("--hidden", type=int, default=64)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--vocab", type=int, default=256)
    m.add_argument("--seq", type=int, default=32, help="tokens per sample")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--optimizer", choices=("adam", "sgd"), default=None, help="default: the instance job's")
    t.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default=None,
                   help="compute dtype; bfloat16: bf16 compute with fp32 master weights and optimizer state "
                        "(default: bfloat16 when the job trains in bf16, else float32)")
    t.add_argument("--data", choices=("corpus", "random", "text"), default="corpus",
                   help="corpus: shipped text by paragraph, bytes; random: random tokens; text: the token stream of "
                        "--data-file files (default: the shipped corpus), tokenised with --tokenizer (else bytes)")
    t.add_argument("--data-file", action="append", default=[], metavar="FILE", help="text data file (repeatable)")
    t.add_argument("--tokenizer", default="", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json")
    t.add_argument("--mbs-unit", type=int, default=None, metavar="N",
                   help="runner samples per gcd of the plan's microbatch sizes (scales the batch, keeps the ratios)")
    t.add_argument("--microbatches", type=int, default=None, help="microbatches per pipeline (default: the plan's)")
    t.add_argument("--checkpoint-format", choices=("torch", "dcp"), default="torch",
                   help="torch: torch.save files per stage tp rank; dcp: torch.distributed.checkpoint (per-rank "
                        "shards + metadata, loadable under another plan)")
    t.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    c = p.add_argument_group("communication")
    c.add_argument("--master-addr", default="", help="rendezvous host (node 0); default $MASTER_ADDR, 127.0.0.1 with --local")
    c.add_argument("--master-port", type=int, default=29500)
    c.add_argument("--timeout", type=float, default=120.0, help="seconds before a collective or receive gives up")
    c.add_argument("--heartbeat-timeout", type=float, default=15.0, help="seconds without a heartbeat before a rank is declared dead")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the ranks compute: cpu (gloo), cuda (nccl, one GPU per rank), auto (cuda when the rank "
                        "sees a GPU); the runner's --device overrides it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    opts = ExportOptions(
        hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq, steps=args.steps, lr=args.lr,
        seed=args.seed, optimizer=args.optimizer, dtype=args.dtype, data=args.data, data_files=tuple(args.data_file),
        tokenizer=args.tokenizer, checkpoint_format=args.checkpoint_format, mbs_unit=args.mbs_unit,
        microbatches=args.microbatches, checkpoint_every=args.checkpoint_every, local=args.local,
        emulate_links=args.emulate_links, link_scale=args.link_scale, master_addr=args.master_addr,
        master_port=args.master_port, timeout_s=args.timeout, heartbeat_timeout_s=args.heartbeat_timeout, device=args.device,
    )
    check_comm_options(opts)  # before any work: bad options and a bad -o fail in a second
    check_output_dir(args.out, "-o/--out")
    instance = load_instance(args.instance)
    plan = load_plan(args.plan)
    rp = build_runner_plan(plan, instance, opts)
    files = write_export(rp, args.out)
    if args.elastic:  # re-planning inputs for the elastic launcher (issue 14)
        from hgopt.export.elastic import write_elastic_source

        write_elastic_source(args.out, plan, instance, opts)
    if args.json:
        print(json.dumps(_summary(rp, files), indent=2))
        return 0
    print(f"runner plan: {files.plan}  ({rp.world_size} ranks on {len(rp.nodes)} nodes, "
          f"{len(rp.pipelines)} pipeline(s), global batch {rp.global_batch} x {rp.model.seq} tokens)")
    for r in rp.ranks():
        p = rp.pipelines[r.pipeline]
        s = p.stages[r.stage]
        rep = s.replicas[r.replica]
        print(f"  rank {r.rank:>3}  node {r.node}  {r.cluster:<12} pipeline {r.pipeline} stage {r.stage} "
              f"layers [{s.start},{s.end})  tp {r.tp_rank}/{rep.tp}  rows [{rep.offset},{rep.offset + rep.mbs}) "
              f"x {p.num_microbatches} microbatches")
    print("per-node commands:")
    for script, cmd in zip(files.node_scripts, files.commands):
        print(f"  {script.name}: {cmd}")
    if files.local_script is not None:
        print(f"run everything here: {files.local_script}   (or: python -m hgopt.runner --plan {files.plan})")
    return 0


def _summary(rp: Any, files: Any) -> dict[str, Any]:
    """The --json document: what was written and how to start it."""
    return {
        "plan": str(files.plan),
        "world_size": rp.world_size,
        "nodes": len(rp.nodes),
        "pipelines": len(rp.pipelines),
        "global_batch": rp.global_batch,
        "seq": rp.model.seq,
        "ranks": [
            {"rank": r.rank, "node": r.node, "cluster": r.cluster, "pipeline": r.pipeline, "stage": r.stage,
             "replica": r.replica, "tp_rank": r.tp_rank}
            for r in rp.ranks()
        ],
        "node_scripts": [str(s) for s in files.node_scripts],
        "commands": list(files.commands),
        "local_script": str(files.local_script) if files.local_script is not None else None,
    }
