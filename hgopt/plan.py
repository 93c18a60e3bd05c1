"""The plan every planner returns: pipelines of stages placed on clusters, as frozen dataclasses with a
versioned JSON form, and :func:`validate`, the one place that checks a plan against an instance."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from hgopt.errors import PlanError
from hgopt.spec import DTYPE_BYTES, Instance

__all__ = [
    "PLAN_VERSION",
    "Boundary",
    "LinkPrecision",
    "Pipeline",
    "Plan",
    "ReplicaGroup",
    "Stage",
    "Violation",
    "load_plan",
    "validate",
]

PLAN_VERSION = 1
LinkPrecision = Literal["native", "fp32", "bf16", "fp16", "fp8"]
"""``native``: the training dtype, i.e. no compression."""
Schedule = Literal["1f1b", "gpipe"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaGroup:
    """``dp`` identical data-parallel replicas of a stage in one cluster, each ``tp`` GPUs wide,
    each processing ``mbs`` samples of every microbatch."""

    cluster: str
    tp: int = 1
    dp: int = 1
    mbs: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def samples(self) -> int:
        """Samples of one pipeline microbatch that this group processes."""
        return self.dp * self.mbs


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """A contiguous layer range ``[start, end)`` run by one or more replica groups."""

    start: int
    end: int
    groups: tuple[ReplicaGroup, ...]
    zero: int = 0
    """0: every replica keeps the whole optimizer state; 1: it is sharded over the stage's replicas."""
    recompute: Literal["none", "full"] = "none"
    """Activation recomputation (hfrunner): ``full`` keeps only each layer's input for backward and runs
    the layer's forward again there (``torch.utils.checkpoint`` per layer in the runner)."""

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def microbatch(self) -> int:
        return sum(g.samples for g in self.groups)

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    @property
    def replicas(self) -> int:
        return sum(g.dp for g in self.groups)

    def clusters(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.cluster for g in self.groups))


@dataclass(frozen=True, kw_only=True, slots=True)
class Boundary:
    """Precision of the activations sent forward and of their gradients sent back across a stage
    boundary."""

    fwd: LinkPrecision = "native"
    bwd: LinkPrecision = "native"


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    stages: tuple[Stage, ...]
    num_microbatches: int
    boundaries: tuple[Boundary, ...] = ()
    """One per pair of consecutive stages; empty means all ``native``."""
    schedule: Schedule = "1f1b"

    @property
    def microbatch(self) -> int:
        return self.stages[0].microbatch if self.stages else 0

    @property
    def samples(self) -> int:
        return self.microbatch * self.num_microbatches

    def boundary(self, i: int) -> Boundary:
        return self.boundaries[i] if self.boundaries else Boundary()


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    pipelines: tuple[Pipeline, ...]
    planner: str = "manual"
    instance: str = ""
    grad_sync_precision: LinkPrecision = "native"
    """Precision of the gradients exchanged over WAN links when replicas of a layer span clusters."""
    overlap_grad_sync: bool = True
    """Gradient all-reduce overlapped with the last microbatch's backward, bucket by bucket (False: all
    buckets start when that backward ends)."""
    grad_bucket_mb: float = 25.0
    """Gradient bucket size cap in MiB (PyTorch DDP's ``bucket_cap_mb`` default)."""
    meta: tuple[tuple[str, str], ...] = field(default=())
    """Free-form provenance (solver, status, bound) as key/value strings."""

    def gpus_by_cluster(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pipelines:
            for s in p.stages:
                for g in s.groups:
                    out[g.cluster] = out.get(g.cluster, 0) + g.gpus
        return out

    def num_gpus(self) -> int:
        return sum(self.gpus_by_cluster().values())

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "planner": self.planner,
            "instance": self.instance,
            "meta": dict(self.meta),
            "grad_sync_precision": self.grad_sync_precision,
            "overlap_grad_sync": self.overlap_grad_sync,
            "grad_bucket_mb": self.grad_bucket_mb,
            "pipelines": [
                {
                    "num_microbatches": p.num_microbatches,
                    "schedule": p.schedule,
                    "boundaries": [{"fwd": b.fwd, "bwd": b.bwd} for b in p.boundaries],
                    "stages": [
                        {
                            "layers": [s.start, s.end],
                            "zero": s.zero,
                            **({"recompute": s.recompute} if s.recompute != "none" else {}),
                            "groups": [
                                {"cluster": g.cluster, "tp": g.tp, "dp": g.dp, "mbs": g.mbs} for g in s.groups
                            ],
                        }
                        for s in p.stages
                    ],
                }
                for p in self.pipelines
            ],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_json(text: str, source: str = "<inline>") -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(source, "<file>", f"not valid JSON: {exc}") from None
        return Plan.from_dict(data, source)

    @staticmethod
    def from_dict(data: Any, source: str = "<inline>") -> Plan:
        return _PlanReader(source).plan(data)


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(str(p), "<file>", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # cli-input: name the file
        raise PlanError(str(p), "<file>", f"is not UTF-8 text: {exc}") from None
    return Plan.from_json(text, str(p))


class _PlanReader:
    """Reads the JSON form; structural errors become PlanError naming the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def _fail(self, where: str, problem: str) -> PlanError:
        return PlanError(self.source, where, problem)

    def _obj(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self._fail(where, f"expected an object, got {type(v).__name__}")
        return v

    def _list(self, v: Any, where: str) -> list[Any]:
        if not isinstance(v, list):
            raise self._fail(where, f"expected a list, got {type(v).__name__}")
        return v

    def _int(self, obj: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
        if key not in obj:
            if default is None:
                raise self._fail(f"{where}.{key}", "is required but missing")
            return default
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(f"{where}.{key}", f"expected an integer, got {v!r}")
        return v

    def plan(self, data: Any) -> Plan:
        obj = self._obj(data, "<top>")
        version = obj.get("version")
        if version != PLAN_VERSION:
            raise self._fail("version", f"unsupported plan version {version!r} (this hgopt reads {PLAN_VERSION})")
        pipes = self._list(obj.get("pipelines"), "pipelines")
        meta = self._obj(obj.get("meta", {}), "meta")
        gsp = obj.get("grad_sync_precision", "native")
        if gsp not in get_args(LinkPrecision):
            raise self._fail("grad_sync_precision", f"must be one of {', '.join(get_args(LinkPrecision))}, got {gsp!r}")
        overlap = obj.get("overlap_grad_sync", True)
        if not isinstance(overlap, bool):
            raise self._fail("overlap_grad_sync", f"must be true or false, got {overlap!r}")
        bucket = obj.get("grad_bucket_mb", 25.0)
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not 0 < bucket < float("inf"):
            raise self._fail("grad_bucket_mb", f"must be a number > 0 (MiB), got {bucket!r}")
        return Plan(
            grad_sync_precision=gsp,
            overlap_grad_sync=overlap,
            grad_bucket_mb=float(bucket),
            pipelines=tuple(self.pipeline(p, f"pipelines[{i}]") for i, p in enumerate(pipes)),
            planner=str(obj.get("planner", "manual")),
            instance=str(obj.get("instance", "")),
            meta=tuple((str(k), str(v)) for k, v in meta.items()),
        )

    def pipeline(self, data: Any, where: str) -> Pipeline:
        obj = self._obj(data, where)
        stages = self._list(obj.get("stages"), f"{where}.stages")
        schedule = obj.get("schedule", "1f1b")
        if schedule not in get_args(Schedule):
            raise self._fail(f"{where}.schedule", f"must be one of {', '.join(get_args(Schedule))}, got {schedule!r}")
        bounds = []
        for j, b in enumerate(self._list(obj.get("boundaries", []), f"{where}.boundaries")):
            b = self._obj(b, f"{where}.boundaries[{j}]")
            for key in ("fwd", "bwd"):
                if b.get(key, "native") not in get_args(LinkPrecision):
                    raise self._fail(
                        f"{where}.boundaries[{j}].{key}",
                        f"must be one of {', '.join(get_args(LinkPrecision))}, got {b.get(key)!r}",
                    )
            bounds.append(Boundary(fwd=b.get("fwd", "native"), bwd=b.get("bwd", "native")))
        return Pipeline(
            stages=tuple(self.stage(s, f"{where}.stages[{k}]") for k, s in enumerate(stages)),
            num_microbatches=self._int(obj, "num_microbatches", where),
            boundaries=tuple(bounds),
            schedule=schedule,
        )

    def stage(self, data: Any, where: str) -> Stage:
        obj = self._obj(data, where)
        layers = self._list(obj.get("layers"), f"{where}.layers")
        if len(layers) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
            raise self._fail(f"{where}.layers", f"expected [start, end) as two integers, got {layers!r}")
        groups = self._list(obj.get("groups"), f"{where}.groups")
        out = []
        for i, g in enumerate(groups):
            gw = f"{where}.groups[{i}]"
            g = self._obj(g, gw)
            if not isinstance(g.get("cluster"), str):
                raise self._fail(f"{gw}.cluster", "is required (a cluster name)")
            out.append(
                ReplicaGroup(
                    cluster=g["cluster"],
                    tp=self._int(g, "tp", gw, 1),
                    dp=self._int(g, "dp", gw, 1),
                    mbs=self._int(g, "mbs", gw, 1),
                )
            )
        recompute = obj.get("recompute", "none")
        if recompute not in ("none", "full"):
            raise self._fail(f"{where}.recompute", f"must be none or full, got {recompute!r}")
        return Stage(start=layers[0], end=layers[1], groups=tuple(out), zero=self._int(obj, "zero", where, 0),
                     recompute=recompute)


# --------------------------------------------------------------------------------------------
# Validation: the one path
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Violation:
    where: str
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


def validate(plan: Plan, instance: Instance) -> list[Violation]:
    """Every structural violation of ``plan`` on ``instance`` (memory is checked by ``evaluate``)."""
    out: list[Violation] = []
    if not plan.pipelines:
        out.append(Violation(where="pipelines", problem="the plan has no pipeline"))
    for i, p in enumerate(plan.pipelines):
        out.extend(_validate_pipeline(p, f"pipelines[{i}]", instance))
    total = sum(p.samples for p in plan.pipelines)
    if plan.pipelines and total != instance.job.global_batch:
        out.append(
            Violation(
                where="pipelines",
                problem=f"samples per iteration add up to {total}, the job's global batch is {instance.job.global_batch}",
            )
        )
    gsp = plan.grad_sync_precision
    if gsp != "native" and DTYPE_BYTES[gsp] > DTYPE_BYTES[instance.model.dtype]:
        out.append(Violation(where="grad_sync_precision", problem=f"{gsp} is wider than the training dtype {instance.model.dtype}"))
    if gsp == "fp8":
        out.append(Violation(where="grad_sync_precision", problem="fp8 gradient all-reduce is not supported (collectives cannot sum fp8); use bf16 or fp16"))
    for name, used in plan.gpus_by_cluster().items():
        try:
            have = instance.topology.cluster(name).num_gpus
        except KeyError:
            continue  # reported per group
        if used > have:
            out.append(Violation(where=f"cluster {name}", problem=f"uses {used} GPUs, the cluster has {have}"))
    return out


def _validate_pipeline(p: Pipeline, where: str, inst: Instance) -> list[Violation]:
    out: list[Violation] = []
    L = inst.model.num_layers
    if p.num_microbatches < 1:
        out.append(Violation(where=f"{where}.num_microbatches", problem=f"must be >= 1, got {p.num_microbatches}"))
    if not p.stages:
        return out + [Violation(where=f"{where}.stages", problem="a pipeline needs at least one stage")]
    expect = 0
    for k, s in enumerate(p.stages):
        sw = f"{where}.stages[{k}]"
        if s.start != expect:
            out.append(Violation(where=f"{sw}.layers", problem=f"starts at layer {s.start}, expected {expect} (layers must be covered contiguously)"))
        if s.end <= s.start:
            out.append(Violation(where=f"{sw}.layers", problem=f"[{s.start}, {s.end}) is empty"))
        expect = max(expect, s.end)
        if s.zero not in (0, 1):
            out.append(Violation(where=f"{sw}.zero", problem=f"must be 0 or 1, got {s.zero}"))
        if s.recompute not in ("none", "full"):
            out.append(Violation(where=f"{sw}.recompute", problem=f"must be none or full, got {s.recompute!r}"))
        if s.microbatch != p.microbatch:
            out.append(Violation(where=sw, problem=f"processes {s.microbatch} samples per microbatch, stage 0 processes {p.microbatch}"))
        if not s.groups:
            out.append(Violation(where=f"{sw}.groups", problem="a stage needs at least one replica group"))
        for j, g in enumerate(s.groups):
            out.extend(_validate_group(g, f"{sw}.groups[{j}]", inst))
    if expect != L:
        out.append(Violation(where=f"{where}.stages", problem=f"layers covered up to {expect}, the model has {L}"))
    if p.boundaries and len(p.boundaries) != len(p.stages) - 1:
        out.append(Violation(where=f"{where}.boundaries", problem=f"has {len(p.boundaries)} entries, expected {len(p.stages) - 1} (one per stage boundary)"))
    native = DTYPE_BYTES[inst.model.dtype]
    for j, b in enumerate(p.boundaries):
        for key, prec in (("fwd", b.fwd), ("bwd", b.bwd)):
            if prec != "native" and DTYPE_BYTES[prec] > native:
                out.append(Violation(where=f"{where}.boundaries[{j}].{key}", problem=f"{prec} is wider than the training dtype {inst.model.dtype}"))
    return out


def _validate_group(g: ReplicaGroup, where: str, inst: Instance) -> list[Violation]:
    out: list[Violation] = []
    try:
        c = inst.topology.cluster(g.cluster)
    except KeyError:
        names = ", ".join(c.name for c in inst.topology.clusters)
        return [Violation(where=f"{where}.cluster", problem=f"unknown cluster {g.cluster!r} (clusters: {names})")]
    for key, v in (("tp", g.tp), ("dp", g.dp), ("mbs", g.mbs)):
        if v < 1:
            out.append(Violation(where=f"{where}.{key}", problem=f"must be >= 1, got {v}"))
    if g.tp >= 1 and (c.gpus_per_node % g.tp != 0):
        out.append(Violation(where=f"{where}.tp", problem=f"tp {g.tp} does not divide the {c.gpus_per_node} GPUs per node of {c.name}"))
    elif g.tp not in inst.model.tps(c.gpu):
        out.append(Violation(where=f"{where}.tp", problem=f"tp {g.tp} is not profiled for {c.gpu} (profiled: {inst.model.tps(c.gpu)})"))
    return out
