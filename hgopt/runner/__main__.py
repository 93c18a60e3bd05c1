"""``python -m hgopt.runner --plan DIR/plan.json``.

* no ``--rank``/``--node`` and not under torchrun: start every rank on this machine (local launcher);
* ``--node-index K`` under torchrun: this process is local rank ``$LOCAL_RANK`` of node ``K``;
* ``--rank R``: this process is rank ``R`` (store from ``--store`` or ``$MASTER_ADDR:$MASTER_PORT``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from hgopt.export.runner_plan import RunnerPlan, load_runner_plan


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hgopt.runner", description="Train the runner model on an exported plan.")
    p.add_argument("--plan", required=True, help="runner plan written by `hgopt export`")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--rank", type=int, help="run this one rank")
    who.add_argument("--node-index", dest="node", type=int, help="run local rank $LOCAL_RANK of this node (under torchrun)")
    p.add_argument("--out", help="metrics and checkpoints (default: <plan folder>/run)")
    p.add_argument("--steps", type=int, help="train until this many steps are done (default: the plan's)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--emulation", choices=("off", "delay", "netns", "auto"), help="override the plan's link emulation")
    p.add_argument("--threads", type=int, help="torch threads per rank")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="cpu (gloo), cuda (nccl, one GPU per rank: $LOCAL_RANK under torchrun), auto (cuda when "
                        "available; the local launcher takes the CPU when there are fewer GPUs than ranks); "
                        "default: the plan's (auto)")
    p.add_argument("--port", type=int, help="local launcher: rendezvous port (0: any free port)")
    p.add_argument("--exit-grace", dest="exit_grace", type=float, metavar="SECONDS",
                   help="local launcher: after a rank failed, kill the ranks still running this much later "
                        "(default: the plan's heartbeat timeout + 10 s)")
    p.add_argument("--store", help="HOST:PORT of the rendezvous store (single rank)")
    p.add_argument("--elastic", action="store_true",
                   help="local launcher: when a rank dies, re-plan without its node, re-export and resume from the "
                        "last checkpoint (needs elastic.json from `hgopt export --elastic`; see hgopt.runner.elastic)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N", help="--elastic: at most N restarts (default 3)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        rp = load_runner_plan(args.plan)
        rank = _my_rank(rp, args)
        prefix = "[launcher] " if rank is None else f"[rank {rank}] "
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format=prefix + "%(message)s",
                            stream=sys.stderr)
        out = Path(args.out) if args.out else Path(args.plan).resolve().parent / "run"
        if args.elastic and rank is not None:
            raise ValueError("--elastic is for the local launcher (no --rank/--node-index)")
        if rank is None:
            return _launch(rp, args, out)
        return _one_rank(rp, args, out, rank)
    except ValueError as exc:
        print(f"hgopt.runner: error: {exc}", file=sys.stderr)
        return 2


def _my_rank(rp: RunnerPlan, args: argparse.Namespace) -> int | None:
    """The plan rank of this process, or None for the local launcher."""
    if args.rank is not None:
        rp.rank_info(args.rank)  # raises ValueError for a rank not in the plan
        return int(args.rank)
    if args.node is None:
        return None
    if "LOCAL_RANK" not in os.environ:
        raise ValueError("--node-index needs $LOCAL_RANK (start it with torchrun)")
    if not 0 <= args.node < len(rp.nodes):
        raise ValueError(f"--node-index {args.node} is not in the plan (nodes 0..{len(rp.nodes) - 1})")
    ranks = rp.nodes[args.node].ranks
    local = int(os.environ["LOCAL_RANK"])
    if local >= len(ranks):
        raise ValueError(f"node {args.node} runs {len(ranks)} ranks, got LOCAL_RANK {local} (check --nproc-per-node)")
    return ranks[local]


def _launch(rp: RunnerPlan, args: argparse.Namespace, out: Path) -> int:
    from hgopt.runner.launch import LaunchOptions, launch_local
    from hgopt.runner.summary import print_summary

    if not rp.local:
        logging.getLogger(__name__).warning("this plan was exported for several machines; running every rank here")
    opts = LaunchOptions(out_dir=out, steps=args.steps, resume=args.resume, threads=args.threads,
                         emulation=args.emulation, port=args.port, device=args.device,
                         exit_grace_s=args.exit_grace)
    if args.elastic:  # re-plan and resume when a rank dies (issue 14)
        from hgopt.export.elastic import ELASTIC_FILE, read_elastic_source
        from hgopt.runner.elastic import run_elastic

        source = read_elastic_source(Path(args.plan).resolve().parent / ELASTIC_FILE)
        code, last = run_elastic(rp, Path(args.plan).resolve(), opts, source, args.max_restarts)
        print_summary(last, out)
        return code
    code = launch_local(rp, Path(args.plan).resolve(), opts)
    print_summary(rp, out)
    return code


def _one_rank(rp: RunnerPlan, args: argparse.Namespace, out: Path, rank: int) -> int:
    from hgopt.runner.device import resolve_device
    from hgopt.runner.launch import resolve_emulation
    from hgopt.runner.worker import RankOptions, run_rank

    if args.store:
        host, _, port = args.store.rpartition(":")
    else:
        host, port = os.environ.get("MASTER_ADDR", rp.master_addr), os.environ.get("MASTER_PORT", str(rp.master_port))
    device = resolve_device(args.device or rp.device).kind
    mode = args.emulation or rp.emulate_links
    if device == "cuda" and mode == "netns":
        mode = resolve_emulation(mode, rp, device)  # refused: namespaces shape gloo's sockets only
    if mode in ("netns", "auto"):  # under torchrun the namespaces (if any) already shape the bandwidth
        mode = "netns" if os.environ.get("GLOO_SOCKET_IFNAME") and device == "cpu" else "delay"
    mode = resolve_emulation(mode, rp, device) if mode != "netns" else mode
    return run_rank(rp, rank, RankOptions(out_dir=out, store_host=host, store_port=int(port), steps=args.steps,
                                          resume=args.resume, emulation=mode, threads=args.threads or 1, device=device))


if __name__ == "__main__":
    sys.exit(main())
