"""``hgopt export-model INSTANCE --format mps|lp -o FILE``: write the cluster-level MILP of one batch
split (formulations/cluster_milp.md) so that any external solver can read it.

The MILP is built per batch split (k pipelines × microbatch B × m microbatches). ``--split K,B``
chooses it; without it the split of the hierarchical heuristic's plan is used (the split the exact
planner starts from). Every non-dominated block option is included (no bottleneck cap), so the
file's optimum is the exact optimum of that split."""

from __future__ import annotations

import argparse
import json
import logging
import math

from hgopt.commands._paths import check_output_file
from hgopt.cost import build_tables
from hgopt.cost.pipeline import stages_that_matter
from hgopt.instances import load_instance
from hgopt.search.blocks import Window, block_options, cheap_bounds
from hgopt.search.hierarchical import heuristic_incumbent
from hgopt.search.milp import BatchSplit, build_milp
from hgopt.spec import Instance

__all__ = ["register"]

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-model", help="write the cluster-level MILP of one batch split as MPS or LP")
    p.add_argument("instance", help="instance name (see `hgopt instances`) or path")
    p.add_argument("--format", choices=("mps", "lp"), default="mps", help="file format (default mps)")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="file to write")
    p.add_argument("--split", metavar="K,B", help="pipelines K and microbatch B (default: the heuristic's)")
    p.add_argument("--json", action="store_true", help="print a JSON summary (split, model size, file) on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_output_file(args.output, "-o/--output")
    inst = load_instance(args.instance)
    split = _split(inst, args.split)
    tables = build_tables(inst)
    cheap = cheap_bounds(inst, tables, replicas=split.k, microbatch=split.microbatch,
                         num_microbatches=split.num_microbatches)
    if not math.isfinite(cheap.value):
        raise ValueError(f"--split: no plan of split {split} fits on {inst.name}")
    window = Window(t_lb=cheap.t_lb, s_lb=cheap.s_lb, weight=cheap.weight)
    opts = block_options(inst, tables, replicas=split.k, microbatch=split.microbatch,
                         num_microbatches=split.num_microbatches, d_cap=stages_that_matter(split.num_microbatches),
                         window=window)
    model = build_milp(inst, tables, split, opts, cheap).model
    text = model.to_mps() if args.format == "mps" else model.to_lp()
    with open(args.output, "w") as fh:
        fh.write(text)
    if args.json:
        print(json.dumps({"instance": inst.name, "split": {"k": split.k, "microbatch": split.microbatch,
                                                           "num_microbatches": split.num_microbatches},
                          "variables": len(model.vars), "integer_variables": model.num_integer,
                          "rows": len(model.rows), "nonzeros": model.num_nonzeros, "output": args.output, "format": args.format}, indent=2))
    else:
        print(f"{inst.name}, split {split}: {model.size()} -> {args.output} ({args.format})")
    return 0


def _split(inst: Instance, arg: str | None) -> BatchSplit:
    g = inst.job.global_batch
    if arg:
        try:
            k, b = (int(x) for x in arg.split(","))
        except ValueError:
            raise ValueError(f"--split: expected K,B (two integers), got {arg!r}") from None
        if k < 1 or b < 1 or g % (k * b):
            raise ValueError(f"--split: K·B must divide the global batch {g}, got K={k} B={b}")
        return BatchSplit(k=k, microbatch=b, num_microbatches=g // (k * b))
    h = heuristic_incumbent(inst, time_limit_s=10.0)
    if h.plan is None:
        raise ValueError(f"--split: the heuristic found no plan for {inst.name}; give --split K,B")
    p0 = h.plan.pipelines[0]
    log.info("split of the heuristic's plan: k=%d B=%d", len(h.plan.pipelines), p0.microbatch)
    return BatchSplit(k=len(h.plan.pipelines), microbatch=p0.microbatch, num_microbatches=p0.num_microbatches)
