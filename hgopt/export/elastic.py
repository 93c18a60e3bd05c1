"""What the elastic launcher (``python -m hgopt.runner --elastic``) needs to re-plan: the plan, the
instance it runs on and the export options, written by ``hgopt export --elastic`` as ``elastic.json``
next to the runner plan. Pure Python (no torch): the planning side writes it, the runner reads it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hgopt.export.build import ExportOptions
from hgopt.plan import Plan
from hgopt.spec import Instance, instance_from_dict, model_profile_to_dict, topology_to_dict

__all__ = ["ELASTIC_FILE", "ElasticSource", "instance_to_dict", "read_elastic_source", "write_elastic_source"]

ELASTIC_FILE = "elastic.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticSource:
    plan: Plan
    instance: Instance
    export: ExportOptions


def instance_to_dict(inst: Instance) -> dict[str, Any]:
    """The instance in the file format (``instance_from_dict`` reads it back)."""
    job = inst.job
    return {"name": inst.name, **({"description": inst.description} if inst.description else {}),
            "model": model_profile_to_dict(inst.model),
            "topology": topology_to_dict(inst.topology),
            "job": {"global_batch": job.global_batch, "seq_len": job.seq_len, "precision": job.precision,
                    "optimizer": job.optimizer, "workspace_gb": job.workspace_bytes / 1e9}}


def write_elastic_source(out_dir: str | Path, plan: Plan, instance: Instance, opts: ExportOptions) -> Path:
    path = Path(out_dir) / ELASTIC_FILE
    doc = {"format": "hgopt-elastic", "version": 1, "plan": plan.to_dict(), "instance": instance_to_dict(instance),
           "export": dataclasses.asdict(opts)}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_elastic_source(path: str | Path) -> ElasticSource:
    """``elastic.json``; ValueError naming the file when it is missing or not one."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"{p}: cannot read ({exc.strerror or exc}); --elastic needs the plan and instance that "
                         "`hgopt export --elastic` writes next to the runner plan") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != "hgopt-elastic":
        raise ValueError(f"{p}: not an hgopt elastic file (written by `hgopt export --elastic`)")
    fields = {f.name for f in dataclasses.fields(ExportOptions)}
    raw = {k: v for k, v in doc["export"].items() if k in fields}
    if "data_files" in raw:
        raw["data_files"] = tuple(raw["data_files"])
    return ElasticSource(plan=Plan.from_dict(doc["plan"], str(p)),
                         instance=instance_from_dict(doc["instance"], str(p)), export=ExportOptions(**raw))
