"""``hgopt show INSTANCE [--json]``: clusters, links and a model summary; cluster fields filled in
from the GPU table are listed under the cluster table."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hgopt.instances import load_instance
from hgopt.spec import Instance
from hgopt.table import fmt_bytes, format_table

__all__ = ["register", "describe", "describe_json"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="describe an instance: clusters, links, model")
    p.add_argument("instance", help="instance name (see `hgopt instances`) or path")
    p.add_argument("--json", action="store_true", help="machine-readable output (the instance as the planner reads it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    inst = load_instance(args.instance)
    print(json.dumps(describe_json(inst), indent=2) if args.json else describe(inst))
    return 0


def describe_json(inst: Instance) -> dict[str, Any]:
    """The instance as loaded (generated profiles summarised, defaults filled in and listed)."""
    from hgopt.spec import topology_to_dict

    m, j = inst.model, inst.job
    topo = topology_to_dict(inst.topology)
    for c, d in zip(inst.topology.clusters, topo["clusters"]):
        d["defaults"] = list(c.defaults)
    return {
        "name": inst.name,
        "source": inst.source,
        "description": inst.description,
        "model": {
            "name": m.name, "dtype": m.dtype, "seq_len": m.seq_len, "layers": m.num_layers,
            "kinds": {k: sum(1 for layer in m.layers if layer.kind == k) for k in ("embedding", "block", "head")},
            "params": m.total_params(), "profiled": {g: list(m.tps(g)) for g in m.gpu_types()}, "source": m.source,
        },
        "job": {"global_batch": j.global_batch, "seq_len": j.seq_len, "precision": j.precision,
                "optimizer": j.optimizer, "workspace_bytes": j.workspace_bytes},
        "topology": topo,
    }


def describe(inst: Instance) -> str:
    m, t, j = inst.model, inst.topology, inst.job
    kinds = {k: sum(1 for layer in m.layers if layer.kind == k) for k in ("embedding", "block", "head")}
    lines = [
        f"instance {inst.name}  ({inst.source})",
        *( [inst.description] if inst.description else [] ),
        "",
        f"model {m.name}: {m.num_layers} layers ({kinds['embedding']} embedding, {kinds['block']} blocks, "
        f"{kinds['head']} head), {m.total_params() / 1e9:.2f} B parameters, trained in {m.dtype}",
        f"  profiled GPUs: {', '.join(f'{g} (tp {list(m.tps(g))})' for g in m.gpu_types())}",
        *( [f"  source: {m.source}"] if m.source else [] ),
        f"job: global batch {j.global_batch} x {j.seq_len} tokens, {j.precision}, {j.optimizer}, "
        f"workspace {fmt_bytes(j.workspace_bytes)}/GPU",
        "",
        f"clusters ({len(t.clusters)}, {t.num_gpus()} GPUs):",
        format_table(
            ["name", "region", "gpu", "nodes x gpus", "memory", "intra-node", "inter-node"],
            [
                [c.name, c.region, c.gpu, f"{c.nodes} x {c.gpus_per_node}", fmt_bytes(c.gpu_memory_bytes),
                 _bw(c.intra_node), _bw(c.inter_node)]
                for c in t.clusters
            ],
        ),
    ]
    defaulted = [f"  {c.name}: {', '.join(c.defaults)}" for c in t.clusters if c.defaults]
    if defaulted:
        lines += ["fields not in the file, from the GPU table (hgopt.profiles.gpus; `hgopt show --json` prints "
                  "the values):", *defaulted]
    if len(t.clusters) > 1:
        lines += ["", "inter-cluster links (GB/s for a 64 MB message, latency):", _link_matrix(inst)]
    return "\n".join(lines)


def _bw(b: object) -> str:
    from hgopt.cost.tables import bandwidth_bytes_per_s

    gbs = bandwidth_bytes_per_s(b, 64e6) / 1e9  # type: ignore[arg-type]
    lat = b.latency_s * 1e3  # type: ignore[attr-defined]
    return f"{gbs:.3g} GB/s" + (f" {lat:.3g} ms" if lat else "")


def _link_matrix(inst: Instance) -> str:
    names = [c.name for c in inst.topology.clusters]
    rows = [[a] + ["-" if a == b else _bw(inst.topology.link(a, b)) for b in names] for a in names]
    return format_table(["from \\ to", *names], rows)
