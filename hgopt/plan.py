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
    "OUTER_PLAN_VERSION",
    "PLAN_VERSION",
    "Boundary",
    "DeltaPrecision",
    "LinkPrecision",
    "OuterSync",
    "Pipeline",
    "Plan",
    "ReplicaGroup",
    "Stage",
    "Violation",
    "load_plan",
    "validate",
]

PLAN_VERSION = 1
OUTER_PLAN_VERSION = 2
"""Written instead of PLAN_VERSION when a plan has an outer synchronisation (:class:`OuterSync`), so that
an hgopt that does not know it refuses the file rather than training it synchronously."""
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


# ---- outer synchronisation across groups (DiLoCo; issue #15) ---------------------------------
DeltaPrecision = Literal["native", "fp32", "bf16", "fp8", "int8"]
"""Precision of the parameter deltas exchanged by the outer synchronisation; fp8 and int8 carry one
fp32 scale per block of :attr:`OuterSync.block` elements. ``native``: the training dtype."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterSync:
    """DiLoCo-style training (Douillard et al., 2023): the pipelines are split into ``groups``; inside a
    group gradients are all-reduced every step as usual, across groups only every ``steps`` (H) inner
    steps the parameter deltas since the last outer step are averaged and applied by an outer SGD with
    (Nesterov) momentum. ``fragments`` > 1 streams the delta layer range by layer range, fragment k
    synchronised k·H/fragments steps after fragment 0 (Streaming DiLoCo, 2025); ``overlap`` lets a
    fragment's exchange run during the following inner steps (priced by the kernel; the runner runs it
    blocking)."""

    groups: tuple[tuple[int, ...], ...]
    """Pipeline indices of each group (a partition of the plan's pipelines, at least two groups)."""
    steps: int = 50
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    precision: DeltaPrecision = "fp32"
    block: int = 128
    """Elements per scale for fp8/int8 deltas."""
    fragments: int = 1
    overlap: bool = False

    def group_of(self, pipeline: int) -> int:
        return next(g for g, members in enumerate(self.groups) if pipeline in members)

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [list(g) for g in self.groups], "steps": self.steps, "lr": self.lr,
                "momentum": self.momentum, "nesterov": self.nesterov, "precision": self.precision,
                "block": self.block, "fragments": self.fragments, "overlap": self.overlap}


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
    outer: OuterSync | None = None
    """Outer synchronisation every H steps across groups of pipelines (None: all pipelines synchronous)."""

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
            "version": PLAN_VERSION if self.outer is None else OUTER_PLAN_VERSION,
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
            **({"outer": self.outer.to_dict()} if self.outer is not None else {}),
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
        if version not in (PLAN_VERSION, OUTER_PLAN_VERSION):
            raise self._fail("version", f"unsupported plan version {version!r} (this hgopt reads {PLAN_VERSION} "
                                        f"and {OUTER_PLAN_VERSION})")
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
            outer=self.outer(obj["outer"]) if obj.get("outer") is not None else None,
        )

    def outer(self, data: Any) -> OuterSync:
        """The ``outer`` object (issue #15); ranges are checked by :func:`validate`."""
        obj = self._obj(data, "outer")
        groups = []
        for i, g in enumerate(self._list(obj.get("groups"), "outer.groups")):
            members = self._list(g, f"outer.groups[{i}]")
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in members):
                raise self._fail(f"outer.groups[{i}]", f"expected pipeline indices (integers), got {members!r}")
            groups.append(tuple(members))
        prec = obj.get("precision", "fp32")
        if prec not in get_args(DeltaPrecision):
            raise self._fail("outer.precision", f"must be one of {', '.join(get_args(DeltaPrecision))}, got {prec!r}")
        nums = {}
        for key, default in (("lr", 0.7), ("momentum", 0.9)):
            v = obj.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self._fail(f"outer.{key}", f"expected a number, got {v!r}")
            nums[key] = float(v)
        flags = {}
        for key, default in (("nesterov", True), ("overlap", False)):
            v = obj.get(key, default)
            if not isinstance(v, bool):
                raise self._fail(f"outer.{key}", f"must be true or false, got {v!r}")
            flags[key] = v
        return OuterSync(groups=tuple(groups), steps=self._int(obj, "steps", "outer", 50),
                         block=self._int(obj, "block", "outer", 128),
                         fragments=self._int(obj, "fragments", "outer", 1), precision=prec, **nums, **flags)

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
    if plan.outer is not None:
        out.extend(_validate_outer(plan.outer, len(plan.pipelines), inst=instance))
    return out


def _validate_outer(o: OuterSync, pipelines: int, inst: Instance) -> list[Violation]:
    """[issue #15] The outer synchronisation's groups partition the pipelines; its numbers are in range."""
    out: list[Violation] = []
    seen = sorted(i for g in o.groups for i in g)
    if len(o.groups) < 2 or any(not g for g in o.groups):
        out.append(Violation(where="outer.groups", problem=f"needs at least two non-empty groups, got {[list(g) for g in o.groups]}"))
    if seen != list(range(pipelines)):
        out.append(Violation(where="outer.groups", problem=f"must hold every pipeline index 0..{pipelines - 1} exactly once, got {seen}"))
    checks = (("steps", o.steps >= 1, "must be >= 1"), ("lr", 0 < o.lr < float("inf"), "must be > 0"),
              ("momentum", 0 <= o.momentum < 1, "must be in [0, 1)"), ("block", o.block >= 1, "must be >= 1"),
              ("fragments", 1 <= o.fragments <= min(o.steps, inst.model.num_layers),
               f"must be between 1 and min(steps, layers) = {min(o.steps, inst.model.num_layers)}"))
    for key, ok, problem in checks:
        if not ok:
            out.append(Violation(where=f"outer.{key}", problem=f"{problem}, got {getattr(o, key)!r}"))
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
