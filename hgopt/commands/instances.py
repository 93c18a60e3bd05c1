"""``hgopt instances [--json]``: the shipped instances with their size (clusters, GPUs, GPU types,
layers). An instance that fails to load is listed with its error and makes the exit status 2."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from hgopt.errors import SpecError
from hgopt.instances import InstanceEntry, list_instances, load_instance
from hgopt.table import format_table

__all__ = ["InstanceSummary", "register", "summarize"]


@dataclass(frozen=True, kw_only=True, slots=True)
class InstanceSummary:
    name: str
    path: str
    clusters: int | None = None
    gpus: int | None = None
    gpu_types: tuple[str, ...] = ()
    layers: int | None = None
    model: str = ""
    params_billion: float | None = None
    global_batch: int | None = None
    description: str = ""
    error: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("instances", help="list the shipped instances (name, clusters, GPUs, layers)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=run)


def summarize(entry: InstanceEntry) -> InstanceSummary:
    """Load ``entry`` and count what it holds; a loading error is kept, not raised."""
    try:
        inst = load_instance(entry.path)
    except SpecError as exc:
        return InstanceSummary(name=entry.name, path=str(entry.path), error=str(exc))
    t, m = inst.topology, inst.model
    return InstanceSummary(
        name=entry.name,
        path=str(entry.path),
        clusters=len(t.clusters),
        gpus=t.num_gpus(),
        gpu_types=tuple(dict.fromkeys(c.gpu for c in t.clusters)),
        layers=m.num_layers,
        model=m.name,
        params_billion=round(m.total_params() / 1e9, 3),
        global_batch=inst.job.global_batch,
        description=inst.description,
        error="",
    )


def run(args: argparse.Namespace) -> int:
    rows = [summarize(e) for e in list_instances()]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(format_table(
            ["name", "clusters", "GPUs", "GPU types", "layers", "model", "params (B)", "batch"],
            [
                [r.name, r.clusters, r.gpus, ", ".join(r.gpu_types), r.layers, r.model, r.params_billion, r.global_batch]
                if not r.error else [r.name, "-", "-", "-", "-", f"ERROR: {r.error}", "-", "-"]
                for r in rows
            ],
        ))
    return 2 if any(r.error for r in rows) else 0
