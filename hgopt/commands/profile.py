"""``hgopt profile``: measure the runner's model layer by layer on this device and write a model
profile; ``hgopt profile --links``: measure point-to-point and all-reduce bandwidth/latency between
ranks (loopback, or a link emulated with network namespaces + tc tbf) and write the link figures.

torch is imported only when a measurement runs (planning never needs it)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hgopt.commands._paths import check_output_file

__all__ = ["register"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure the runner's model per layer (or links between ranks) and write a profile",
                       description="Measure the runner's model layer by layer on this device and write a model "
                                   "profile, or (--links) the bandwidth and latency between ranks and write the "
                                   "link figures. torch is imported only when a measurement runs.")
    p.add_argument("instance", nargs="?", help="take the layer list (kinds and names) from this instance's model")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="JSON file to write")
    p.add_argument("--json", action="store_true",
                   help="print {output, document} as JSON on stdout (the progress lines go to stderr)")
    p.add_argument("--hf-config", metavar="CONFIG_JSON",
                   help="profile this Hugging Face architecture (config.json; transformers' modules, as the runner "
                        "builds it) instead of the runner's GPT: embedding + num_hidden_layers blocks + head")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype; bfloat16 = the runner's mixed precision (profile precision bf16)")
    m = p.add_argument_group("model (the runner's GPT; same meaning as in `hgopt export`)")
    m.add_argument("--blocks", type=int, help="embedding + BLOCKS transformer blocks + head (without an instance)")
    m.add_argument("--hidden", type=int, default=64)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--vocab", type=int, default=256)
    m.add_argument("--seq", type=int, default=32, help="tokens per sample")
    m.add_argument("--ffn-mult", type=int, default=4)
    t = p.add_argument_group("timing")
    t.add_argument("--mbs", default="1,2,4", help="microbatch sizes, comma separated")
    t.add_argument("--tp", default="1", help="tensor-parallel degrees, comma separated (tp > 1: one process per rank)")
    t.add_argument("--gpu", default=None, help="device type name written into the profile (default: cpu / the CUDA name)")
    t.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    t.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    t.add_argument("--pace", type=float, metavar="SPEED",
                   help="CPU: time in thread CPU seconds / SPEED, the device time of a rank paced at SPEED cores "
                        "(python -m hgopt.profiler.paced); robust to other load on the machine")
    t.add_argument("--tenants", type=int, default=1, metavar="N",
                   help="with --pace: time the layers while N-1 companion processes time them too, as N paced ranks "
                        "of a run share this machine's cores and caches (hgopt/profiler/tenants.py)")
    t.add_argument("--pipeline", type=int, default=0, metavar="N",
                   help="with --pace: then run the model as an N-stage pipeline of N paced runner ranks (stages "
                        "balanced by the layer times, 5 steps) and rescale each stage's layers to the device time "
                        "they took there: stage times as inside a pipelined run (hgopt/profiler/pipelined.py)")
    t.add_argument("--pipeline-dp", type=int, default=1, metavar="D",
                   help="--pipeline: D data-parallel replicas of every stage (N x D paced ranks)")
    t.add_argument("--pipeline-dir", default="", metavar="DIR",
                   help="--pipeline: keep the profiling runs (plans, per-op traces) in DIR")
    t.add_argument("--no-pool-blocks", action="store_true",
                   help="keep each block's own timings (default: every block gets the blocks' median; the "
                        "runner's blocks are identical, their differences are noise)")
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--repeat", type=int, default=10)
    lk = p.add_argument_group("links (--links)")
    lk.add_argument("--links", action="store_true", help="measure links between ranks instead of the model")
    lk.add_argument("--ranks", type=int, default=2, help="loopback: processes on this host")
    lk.add_argument("--emulate", type=float, metavar="MBIT_S",
                    help="two ranks in two network namespaces joined by a tc-tbf link of MBIT_S (root)")
    lk.add_argument("--burst", type=int, metavar="BYTES",
                    help="--emulate: token-bucket burst of the link (default: the runner's, 10 ms of traffic)")
    lk.add_argument("--sizes", default=None, help="message sizes in bytes, comma separated (default 4 KiB..4 MiB)")
    lk.add_argument("--topology", help="topology file to write the measured figures into (with --clusters)")
    lk.add_argument("--clusters", help="loopback: the cluster whose intra/inter-node figures to set; "
                                       "--emulate: SRC,DST, the pair whose link to set")
    p.set_defaults(func=run)


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"{name} must list integers >= 1, got {text!r}")
    return out


def run(args: argparse.Namespace) -> int:
    check_output_file(args.out, "-o/--out")  # cli-input: before the measurement
    doc = _run_links(args) if args.links else _run_model(args)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if getattr(args, "json", False):
        print(json.dumps({"output": args.out, "document": doc}, indent=1))
    else:
        print(f"wrote {args.out}")
    return 0


def _say(args: argparse.Namespace, line: str) -> None:
    """A progress line: stdout, or stderr under --json (cli-input)."""
    print(line, file=sys.stderr if getattr(args, "json", False) else sys.stdout)


# ---- model --------------------------------------------------------------------------------------
def _layers(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if args.instance and args.blocks is not None:
        raise ValueError("give either an instance or --blocks, not both")
    if args.instance:
        from hgopt.instances import load_instance

        layers = load_instance(args.instance).model.layers
        return tuple(layer.kind for layer in layers), tuple(layer.name for layer in layers)
    if args.blocks is None or args.blocks < 1:
        raise ValueError("say which model to profile: an instance, or --blocks N (>= 1)")
    kinds = ("embedding", *("block",) * args.blocks, "head")
    return kinds, tuple(f"{k}{i}" if k == "block" else k for i, k in enumerate(kinds))


def _run_model(args: argparse.Namespace) -> dict[str, Any]:
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.profiler.run import ModelRequest, profile_model
    from hgopt.profiler.timing import TimingSettings
    from hgopt.spec import model_profile_to_dict

    if args.hf_config:
        cfg, names, name = _hf_model(args)
    else:
        kinds, names = _layers(args)
        for key, v in (("--hidden", args.hidden), ("--heads", args.heads), ("--vocab", args.vocab), ("--seq", args.seq),
                       ("--ffn-mult", args.ffn_mult)):
            if v < 1:
                raise ValueError(f"{key} must be >= 1, got {v}")
        if args.hidden % args.heads:
            raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
        cfg = ModelConfig(layers=kinds, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq,
                          ffn_mult=args.ffn_mult)
        name = "runner-gpt"
    gpu = args.gpu or _device_name(args.device)
    timing = TimingSettings(gpu=gpu, device=args.device, threads=args.threads, warmup=args.warmup, repeat=args.repeat,
                            pace=args.pace, tenants=args.tenants)
    pipeline = None
    if args.pipeline:
        from hgopt.profiler.pipelined import PipelineSettings

        if args.pace is None:
            raise ValueError("--pipeline needs --pace (the pipelined run's ranks are paced devices)")
        pipeline = PipelineSettings(stages=args.pipeline, dp=args.pipeline_dp, pace=args.pace,
                                    keep_dir=args.pipeline_dir)
    req = ModelRequest(model=cfg, names=names, mbss=_ints(args.mbs, "--mbs"), tps=_ints(args.tp, "--tp"),
                       timing=timing, pool_blocks=not args.no_pool_blocks, dtype=args.dtype, profile_name=name,
                       pipeline=pipeline)
    prof = profile_model(req)
    for t in prof.timings:
        _say(args, f"{t.gpu} tp {t.tp} mbs {t.mbs}: forward {sum(t.fwd) * 1e3:.2f} ms, backward {sum(t.bwd) * 1e3:.2f} ms, "
              f"update {sum(t.update) * 1e3:.2f} ms over {len(t.fwd)} layers")
    return model_profile_to_dict(prof)


def _hf_model(args: argparse.Namespace) -> tuple[Any, tuple[str, ...], str]:
    """The runner model of a Hugging Face config.json (validated by the same mapping as the analytic
    profile, so an unsupported config fails with the same SpecError)."""
    from hgopt.export.runner_plan import ModelConfig
    from hgopt.profiles.hf import hf_transformer_config, read_hf_config

    if args.instance or args.blocks is not None:
        raise ValueError("--hf-config takes the layer list from the config: give no instance and no --blocks")
    path = Path(args.hf_config)
    raw = read_hf_config(path)
    tc = hf_transformer_config(raw, source=str(path), seq_len=args.seq)
    kinds = ("embedding", *("block",) * tc.layers, "head")
    names = ("embedding", *(f"block{i}" for i in range(1, tc.layers + 1)), "head")
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    cfg = ModelConfig(layers=kinds, hidden=tc.hidden, heads=tc.heads, vocab=tc.vocab, seq=args.seq, hf_config=text)
    return cfg, names, path.resolve().parent.name


def _device_name(device: str) -> str:
    if not device.startswith("cuda"):
        if device != "cpu":
            raise ValueError(f"--device must be cpu or cuda[:i], got {device!r}")
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available")
    return torch.cuda.get_device_name(torch.device(device)).replace(" ", "-")


# ---- links ----------------------------------------------------------------------------------------
def _run_links(args: argparse.Namespace) -> dict[str, Any]:
    from hgopt.profiler.links import DEFAULT_SIZES, LinkSettings
    from hgopt.profiler.run import profile_links_emulated, profile_links_loopback

    sizes = _ints(args.sizes, "--sizes") if args.sizes else DEFAULT_SIZES
    settings = LinkSettings(sizes=sizes, warmup=min(args.warmup, 2), repeat=args.repeat, threads=args.threads)
    if args.emulate is not None:
        if args.emulate <= 0:
            raise ValueError(f"--emulate must be > 0 Mbit/s, got {args.emulate}")
        rep = profile_links_emulated(args.emulate / 1000.0, settings, args.burst)
    else:
        if args.ranks < 2:
            raise ValueError(f"--ranks must be >= 2, got {args.ranks}")
        rep = profile_links_loopback(args.ranks, settings)
    p2p = rep.pairs[0].fit
    _say(args, f"point to point: {p2p.gbit_s * 1e3:.1f} Mbit/s, latency {p2p.latency_s * 1e3:.3f} ms "
          f"(worst fit residual {p2p.max_rel_residual:.0%})")
    if rep.allreduce_fit is not None:
        ar = rep.allreduce_fit
        _say(args, f"all-reduce over {rep.world} ranks: {ar.gbit_s * 1e3:.1f} Mbit/s, latency {ar.latency_s * 1e3:.3f} ms")
    doc: dict[str, Any] = {"version": 1, "kind": "hgopt-link-profile", "emulated_mbit_s": args.emulate,
                           "burst_bytes": args.burst,
                           "measured": rep.to_dict(),
                           "point_to_point": _bw(p2p.bytes_per_s, p2p.latency_s)}
    if rep.allreduce_fit is not None:
        doc["allreduce"] = _bw(rep.allreduce_fit.bytes_per_s, rep.allreduce_fit.latency_s)
    if args.topology:
        doc["topology"] = _with_figures(args, doc)
    return doc


def _bw(bytes_per_s: float, latency_s: float) -> dict[str, float]:
    return {"gbyte_s": bytes_per_s / 1e9, "latency_ms": latency_s * 1e3}


def _with_figures(args: argparse.Namespace, doc: dict[str, Any]) -> dict[str, Any]:
    """The topology with the measured figures written in: loopback sets one cluster's intra_node
    (point to point) and inter_node (all-reduce) links; --emulate sets one link pair."""
    from hgopt.spec import load_document, topology_from_dict, topology_to_dict

    topo = topology_to_dict(topology_from_dict(load_document(args.topology), args.topology))
    names = [c["name"] for c in topo["clusters"]]
    wanted = [x for x in (args.clusters or "").split(",") if x]
    for c in wanted:
        if c not in names:
            raise ValueError(f"--clusters: unknown cluster {c!r} (topology has {', '.join(names)})")
    if args.emulate is not None:
        if len(wanted) != 2:
            raise ValueError("--emulate with --topology needs --clusters SRC,DST")
        for pair in topo["links"]["pairs"]:
            if {pair["src"], pair["dst"]} == set(wanted):
                pair.pop("curve", None)
                pair.pop("max_gbyte_s", None)
                pair.update(doc["point_to_point"])
    else:
        if len(wanted) != 1:
            raise ValueError("loopback --links with --topology needs --clusters NAME")
        for c in topo["clusters"]:
            if c["name"] == wanted[0]:
                c["intra_node"] = doc["point_to_point"]
                c["inter_node"] = doc.get("allreduce", doc["point_to_point"])
    return topology_to_dict(topology_from_dict(topo, "<measured>"))
