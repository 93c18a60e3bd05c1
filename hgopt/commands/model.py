"""``hgopt model import config.json -o profile.json``: the analytic model profile of a Hugging Face
``config.json`` (no weights, no network, no ``transformers``; see :mod:`hgopt.profiles.hf`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hgopt.spec import model_profile_to_dict

__all__ = ["register"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="model profiles from Hugging Face configs (`hgopt model import`)",
                       description="Model profiles from a Hugging Face config.json.")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    imp = msub.add_parser("import", help="write the analytic profile of a Hugging Face config.json",
                          description="Write the analytic model profile (per-layer parameters, FLOPs-based times, "
                                      "boundary and saved-activation bytes) of a Hugging Face config.json. "
                                      "Supported model_type: llama, mistral, qwen2, gpt2, opt, gpt_neox.")
    imp.add_argument("config", help="the model's config.json")
    imp.add_argument("-o", "--output", required=True, metavar="FILE", help="profile JSON to write")
    imp.add_argument("--gpus", help="comma-separated GPU types of the GPU table (default: every one that trains in --dtype)")
    imp.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's max_position_embeddings)")
    imp.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16")
    imp.add_argument("--tps", type=_ints, default=(1, 2, 4, 8), help="tensor-parallel degrees (default 1,2,4,8)")
    imp.add_argument("--mbss", type=_ints, default=(1, 2, 4, 8), help="microbatch sizes (default 1,2,4,8)")
    imp.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    imp.add_argument("--name", help="profile name (default: the config's folder name)")
    imp.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    from hgopt.profiles.hf import hf_profile, read_hf_config

    path = Path(args.config)
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    prof = hf_profile(read_hf_config(path), args.gpus.split(",") if args.gpus else None, source=str(path),
                      seq_len=args.seq_len, dtype=args.dtype, name=args.name or path.resolve().parent.name,
                      tps=args.tps, mbss=args.mbss, optimizer=args.optimizer)
    Path(args.output).write_text(json.dumps(model_profile_to_dict(prof), indent=1) + "\n")
    params = sum(layer.params for layer in prof.layers)
    print(f"{prof.name}: {prof.num_layers} layers ({prof.num_layers - 2} blocks), {params / 1e6:.2f} M parameters "
          f"per layer copy, {len(prof.timings)} timing entries ({', '.join(prof.gpu_types())}) -> {args.output}")
    return 0
