"""``hgopt init -o FILE --cluster NAME:GPU:COUNT@REGION ... --model SHAPE.yaml|config.json``: write an
annotated instance (analytic model profile, clusters with GPU-table defaults, WAN links, job) that
loads as it is and is meant to be edited. The model is a transformer shape (the analytic generator's
keys) or a Hugging Face ``config.json`` (a ``model_type`` key; read by :mod:`hgopt.profiles.hf`). The
file is validated by the one loader before it is written."""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hgopt.commands._paths import check_output_file
from hgopt.errors import SpecError
from hgopt.profiles.gpus import DEFAULT_LINK_LATENCY_MS, GPUS, gpu_spec
from hgopt.spec import LIMITS, instance_from_dict, load_document

__all__ = ["ClusterArg", "parse_cluster", "register", "render_instance"]

_CLUSTER_RE = re.compile(r"^(?P<name>[^:@\s]+):(?P<gpu>[^:@\s]+):(?P<count>\d+)@(?P<region>[^:@\s]+)$")
_SHAPE_KEYS = ("name", "layers", "hidden", "heads", "vocab", "seq_len", "ffn", "kv_heads", "glu", "flash_attention")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterArg:
    name: str
    gpu: str
    count: int
    region: str


def parse_cluster(text: str) -> ClusterArg:
    """``NAME:GPU:COUNT@REGION`` (COUNT GPUs in total); ValueError naming --cluster otherwise."""
    m = _CLUSTER_RE.match(text)
    if not m:
        raise ValueError(f"--cluster: expected NAME:GPU:COUNT@REGION (e.g. us-h100:H100-80:64@us-east), got {text!r}")
    count = int(m["count"])
    if count < 1:
        raise ValueError(f"--cluster {text}: COUNT must be >= 1")
    return ClusterArg(name=m["name"], gpu=m["gpu"], count=count, region=m["region"])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write an annotated instance from --cluster flags and a model shape",
                       description="Write an annotated instance file that `hgopt plan` reads as it is. GPU "
                                   "memory and node bandwidths come from the GPU table (written as comments to "
                                   "override); the model profile is the analytic generator's.")
    p.add_argument("-o", "--output", required=True, metavar="FILE.yaml", help="instance file to write")
    p.add_argument("--cluster", action="append", required=True, metavar="NAME:GPU:COUNT@REGION",
                   help=f"a cluster of COUNT GPUs (repeat the flag); GPU one of {', '.join(sorted(GPUS))}")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="GPUs per node (default 8; a cluster with fewer GPUs is one node)")
    p.add_argument("--model", required=True, metavar="SHAPE|CONFIG",
                   help="YAML/JSON file with the transformer shape: name, layers, hidden, heads, vocab, seq_len "
                        "(optional ffn, kv_heads, glu, flash_attention), or a Hugging Face config.json")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="tokens per sequence (default: the shape's seq_len / the config's max_position_embeddings)")
    p.add_argument("--name", default=None, help="instance name (default: the output file's stem)")
    p.add_argument("--global-batch", type=int, default=512, metavar="N", help="sequences per iteration (default 512)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                   help="training precision (default bf16, fp16 if a GPU has no BF16 tensor cores)")
    p.add_argument("--wan-gbit-s", type=float, default=10.0, help="bandwidth between regions, Gbit/s (default 10)")
    p.add_argument("--wan-latency-ms", type=float, default=50.0, help="one-way latency between regions (default 50)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_output_file(args.output, "-o/--output")
    out = Path(args.output)
    if out.exists() and not args.force:
        raise ValueError(f"-o/--output: {out} exists (add --force to overwrite)")
    text = render_instance(args)
    data = yaml.safe_load(text)
    # The one validation path, on a temporary file next to the output (relative paths in it, and the
    # generators' base folder, are the output's): a broken instance is never written.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        try:
            instance_from_dict(load_document(tmp), str(tmp), tmp.parent)
        except SpecError as exc:
            raise SpecError(str(out), exc.field, exc.problem.replace(str(tmp), str(out))) from None
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out}: {len(data['topology']['clusters'])} clusters, "
          f"{sum(c['nodes'] * c['gpus_per_node'] for c in data['topology']['clusters'])} GPUs; "
          f"try `hgopt show {out}` and `hgopt plan {out}`")
    return 0


def _is_hf(doc: Any) -> bool:
    return isinstance(doc, dict) and "model_type" in doc


def _shape(path: str) -> dict[str, Any]:
    doc = load_document(path)
    if not isinstance(doc, dict):
        raise ValueError(f"--model {path}: expected a mapping of the transformer shape, got {type(doc).__name__}")
    if _is_hf(doc):
        return doc
    unknown = sorted(set(doc) - set(_SHAPE_KEYS) - {"dtype"}, key=str)
    if unknown:
        raise ValueError(f"--model {path}: unknown key {unknown[0]!r} (allowed: {', '.join(_SHAPE_KEYS)})")
    for key in ("name", "layers", "hidden", "heads", "vocab", "seq_len"):
        if key not in doc:
            raise ValueError(f"--model {path}: {key} is required")
    return doc


def render_instance(args: argparse.Namespace) -> str:
    """The annotated YAML text of the instance ``args`` describe."""
    clusters = [parse_cluster(c) for c in args.cluster]
    names = [c.name for c in clusters]
    if len(set(names)) != len(names):
        raise ValueError(f"--cluster: cluster names must differ, got {', '.join(names)}")
    for c in clusters:
        try:
            gpu_spec(c.gpu)
        except ValueError as exc:
            raise ValueError(f"--cluster {c.name}: {exc}") from None
    if not 1 <= args.gpus_per_node <= LIMITS["gpus_per_node"]:
        raise ValueError(f"--gpus-per-node: must be in 1..{int(LIMITS['gpus_per_node'])}, got {args.gpus_per_node}")
    for flag, v in (("--wan-gbit-s", args.wan_gbit_s), ("--wan-latency-ms", args.wan_latency_ms)):
        if not v >= 0 or (flag == "--wan-gbit-s" and v == 0):
            raise ValueError(f"{flag}: must be > 0, got {v}")
    shape = _shape(args.model)
    hf = _is_hf(shape)
    gpus = list(dict.fromkeys(c.gpu for c in clusters))
    precision = args.precision or (None if hf else shape.get("dtype")) or (
        "bf16" if all(gpu_spec(g).bf16_flops is not None for g in gpus) else "fp16")
    if args.seq_len is not None and not 1 <= args.seq_len <= LIMITS["seq_len"]:
        raise ValueError(f"--seq-len: must be in 1..{int(LIMITS['seq_len'])}, got {args.seq_len}")
    if hf:
        from hgopt.profiles.hf import hf_transformer_config

        tc = hf_transformer_config(shape, source=args.model, seq_len=args.seq_len, dtype=precision)
        seq_len, model_name = tc.seq_len, tc.name
    else:
        seq_len, model_name = args.seq_len or shape["seq_len"], shape["name"]
    name = args.name or Path(args.output).stem
    description = f"{model_name} on " + ", ".join(f"{c.count} {c.gpu} in {c.region}" for c in clusters)
    q = json.dumps  # YAML accepts JSON scalars: safe quoting of names
    lines = [
        "# hgopt instance written by `hgopt init`; edit freely (format: docs/instance-format.md).",
        f"name: {q(name)}",
        f"description: {q(description)}",
        "",
        "# The model profile: per-layer times and sizes from the analytic generator (hgopt.profiles.analytic,",
        "# formulas in docs/profiles-analytic.md) on each GPU type's datasheet figures (hgopt.profiles.gpus).",
        "# Replace it by a measured profile file (`hgopt profile`) for real timings: model: profile.json",
        "model:",
    ]
    if hf:
        config = os.path.relpath(Path(args.model).resolve(), Path(args.output).resolve().parent)
        lines += [f"  hf_config: {q(config)}  # a Hugging Face config.json (relative to this file)",
                  f"  seq_len: {seq_len}"]
    else:
        lines.append("  generator: analytic")
        for key in _SHAPE_KEYS:
            if key in shape:
                lines.append(f"  {key}: {q(seq_len if key == 'seq_len' else shape[key])}")
    lines += [
        f"  dtype: {precision}",
        f"  gpus: [{', '.join(q(g) for g in gpus)}]  # GPU types to tabulate (one per cluster type)",
        "  tps: [1, 2, 4, 8]  # tensor-parallel degrees to tabulate",
        "  mbss: [1, 2, 4, 8]  # microbatch sizes to tabulate",
        "",
        "topology:",
        "  clusters:",
    ]
    for c in clusters:
        spec = gpu_spec(c.gpu)
        gpn = min(args.gpus_per_node, c.count)
        if c.count % gpn:
            raise ValueError(f"--cluster {c.name}: {c.count} GPUs are not a whole number of {gpn}-GPU nodes "
                             "(change COUNT or --gpus-per-node)")
        lines += [
            f"  - name: {q(c.name)}",
            f"    region: {q(c.region)}  # a location: links.default joins clusters in different regions",
            f"    gpu: {q(c.gpu)}  # {spec.source}",
            f"    nodes: {c.count // gpn}",
            f"    gpus_per_node: {gpn}",
            "    # Left out, so taken from the GPU table (uncomment to override):",
            f"    # gpu_memory_gb: {spec.memory_gb:g}",
            f"    # intra_node: {{gbyte_s: {spec.intra_node_gbyte_s:g}, latency_ms: {DEFAULT_LINK_LATENCY_MS:g}}}"
            f"  # {spec.link}, 80 % of one direction",
            f"    # inter_node: {{gbit_s: {spec.node_network_gbit_s:g}, latency_ms: {DEFAULT_LINK_LATENCY_MS:g}}}"
            "  # one node's NIC (assumed)",
            f"    memory_bandwidth_gbyte_s: {spec.memory_gbyte_s:g}  # datasheet; prices link (de)compression",
            "    # cost_per_gpu_hour: 2.5  # USD, optional",
        ]
    lines += [
        "  links:",
        "    # Every pair of clusters not listed under `pairs` (one per ordered pair; symmetric unless",
        "    # `directed: true`) gets `default`. Example of one pair:",
        f"    # pairs: [{{src: {q(names[0])}, dst: {q(names[-1])}, gbit_s: 5, latency_ms: 80}}]",
        f"    default: {{gbit_s: {args.wan_gbit_s:g}, latency_ms: {args.wan_latency_ms:g}}}",
        "",
        "job:",
        f"  global_batch: {args.global_batch}  # sequences per iteration",
        f"  seq_len: {seq_len}  # must equal the model's",
        f"  precision: {precision}  # must equal the model's dtype",
        "  optimizer: adam  # adam or sgd",
        "  # workspace_gb: 1.07  # per-GPU memory kept for the framework (default 1 GiB)",
    ]
    return "\n".join(lines) + "\n"
