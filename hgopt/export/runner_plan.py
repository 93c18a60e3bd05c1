"""The runner plan: everything a rank of ``hgopt.runner`` needs, as frozen dataclasses with a versioned
JSON form. Written by :mod:`hgopt.export`, read by the runner. Pure Python (no torch), so the planning
side can write it and tests can check it without torch.

A *replica* is one data-parallel copy of a stage: ``tp`` ranks (a tensor-parallel group) that process
rows ``[offset, offset + mbs)`` of every microbatch of its pipeline. Replicas of a stage are ordered
group after group, so their row ranges tile the microbatch; a boundary between two stages whose replicas
split the microbatch differently is re-sharded row range by row range (see :meth:`Pipeline.pieces`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = [
    "RUNNER_PLAN_FORMAT",
    "RUNNER_PLAN_VERSION",
    "Emulation",
    "LinkSpec",
    "ModelConfig",
    "NicSpec",
    "NodeSpec",
    "OuterConfig",
    "Piece",
    "RankInfo",
    "ReplicaSpec",
    "BoundarySpec",
    "Device",
    "RunnerPipeline",
    "RunnerPlan",
    "RunnerStage",
    "SyncGroup",
    "TrainConfig",
    "check_runner_plan",
    "load_runner_plan",
]

RUNNER_PLAN_FORMAT = "hgopt-runner-plan"
RUNNER_PLAN_VERSION = 1
Precision = Literal["native", "fp32", "bf16", "fp16", "fp8"]
Emulation = Literal["off", "delay", "netns", "auto"]
Device = Literal["auto", "cpu", "cuda"]
ComputeDtype = Literal["float32", "float64", "bfloat16"]
LayerKind = Literal["embedding", "block", "head"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The runner's GPT-style decoder. ``layers`` follows the instance's layer list, so plan layer
    ranges apply unchanged; when the list has no embedding (head) layer, token embedding (final norm
    and output projection) is folded into the first (last) layer."""

    layers: tuple[LayerKind, ...]
    hidden: int = 64
    heads: int = 4
    vocab: int = 256
    """Byte-level tokens need 256."""
    seq: int = 32
    """Tokens per sample."""
    ffn_mult: int = 4
    """MLP width = ffn_mult × hidden."""
    hf_config: str = ""
    """A Hugging Face ``config.json`` (compact JSON): the runner builds that architecture with
    ``transformers``' modules (:mod:`hgopt.runner.hf`); ``hidden``, ``heads`` and ``vocab`` then are the
    config's. ``""``: the runner's own GPT-style decoder."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def tp_problem(self, tp: int) -> str | None:
        """Why ``tp`` cannot split this model, or None."""
        if self.hf_config:
            data = json.loads(self.hf_config)
            if tp > 1 and data.get("model_type") == "gpt2":
                return "the runner has no tensor-parallel path for GPT-2 (fused Conv1D projections)"
            heads = data.get("num_attention_heads")
            sizes = (("num_attention_heads", heads), ("num_key_value_heads", data.get("num_key_value_heads", heads)),
                     ("the MLP width", data.get("intermediate_size", data.get("ffn_dim"))),
                     ("vocab_size (vocabulary-parallel embedding and head)", data.get("vocab_size")))
        else:
            sizes = (("model.heads", self.heads), ("the MLP width", self.ffn_mult * self.hidden),
                     ("model.vocab (vocabulary-parallel embedding and head)", self.vocab))
        for name, v in sizes:
            if isinstance(v, int) and v % tp:
                return f"tp {tp} must divide {name} {v}"
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    """The plan's outer synchronisation (``Plan.outer``, issue #15; :mod:`hgopt.runner.outer`): pipelines
    in ``groups`` train apart and average their parameter deltas every ``steps`` steps."""

    groups: tuple[tuple[int, ...], ...]
    steps: int
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    precision: str = "fp32"
    block: int = 128
    fragments: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    optimizer: Literal["adam", "sgd"] = "adam"
    dtype: ComputeDtype = "float32"
    """Compute dtype; ``native`` boundaries send this dtype. ``bfloat16``: mixed precision — bf16
    weights, activations and gradients, fp32 master weights and optimizer state
    (:mod:`hgopt.runner.precision`)."""
    data: Literal["corpus", "random", "text"] = "corpus"
    """``corpus``: the shipped text, byte-level, documents padded with ignored targets; ``random``:
    uniformly random tokens, every target counted; ``text``: the token stream of ``data_files``
    (tokenised with ``tokenizer``, else bytes) cut into consecutive windows, shuffled per epoch, read
    in order across steps (:mod:`hgopt.runner.data`)."""
    data_files: tuple[str, ...] = ()
    """``text``: local UTF-8 files, concatenated in this order (empty: the shipped corpus)."""
    tokenizer: str = ""
    """``text``: a Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` package); empty: bytes."""
    checkpoint_format: Literal["torch", "dcp"] = "torch"
    """``torch``: one ``torch.save`` file per stage tp rank and ZeRO slice (:mod:`hgopt.runner.checkpoint`);
    ``dcp``: ``torch.distributed.checkpoint`` with resharding on load (:mod:`hgopt.runner.dcp_checkpoint`)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only after the last step)."""
    grad_sync_precision: Precision = "native"
    """Precision of gradient all-reduces whose replicas span more than one cluster."""
    overlap_grad_sync: bool = True
    """Start each gradient bucket's all-reduce during the last microbatch's backward, as soon as its
    parameters are final (False: after that backward)."""
    grad_bucket_mb: float = 25.0
    """Bucket cap in MiB; a sync group's layers are packed in reverse order into buckets of at most this."""
    outer: OuterConfig | None = None
    """Outer synchronisation across groups of pipelines (None: every pipeline synchronous)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One direction of an inter-cluster link (after the export's ``link_scale``)."""

    src: str
    dst: str
    bytes_per_s: float
    """Per flow (one node pair) for kind ``per_flow``; the whole direction for ``shared_pipe``."""
    latency_s: float
    # emulate: the link model's kind and cap ([C4w]) for the delay mode's per-node emulation
    # (hgopt.runner.linkemu); files without them load as one shared pipe per direction
    kind: str = "shared_pipe"
    """``per_flow`` or ``shared_pipe`` (see :class:`hgopt.spec.Link`)."""
    aggregate_bytes_per_s: float | None = None
    """``per_flow`` only: the direction's cap shared by every flow (None: no cap)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NicSpec:
    """emulate: one node's NIC of a cluster (``inter_node``), shared by the node's ranks, per direction."""

    cluster: str
    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSpec:
    ranks: tuple[int, ...]
    """Global ranks of the tensor-parallel group, tp rank order; ``ranks[0]`` is the leader that sends
    and receives the stage's boundary tensors."""
    cluster: str
    mbs: int
    """Rows of every microbatch this replica processes (runner samples)."""
    offset: int
    """First row of the microbatch this replica processes."""
    group: int
    """Index of the plan's replica group this replica belongs to."""

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerStage:
    start: int
    end: int
    replicas: tuple[ReplicaSpec, ...]
    zero: int = 0
    """The plan's ZeRO level: 1 shards the optimizer state over the holders of each layer (see
    :attr:`SyncGroup.zero`, which says where the runner does it)."""
    recompute: Literal["none", "full"] = "none"
    """``full``: every layer of the stage runs under ``torch.utils.checkpoint`` (only layer inputs are
    kept for backward; the forward runs again during backward)."""

    @property
    def microbatch(self) -> int:
        return sum(r.mbs for r in self.replicas)


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """Rows ``[lo, hi)`` of a microbatch that replica ``src`` of one stage hands to replica ``dst`` of
    the next (indices into the stages' replica lists)."""

    src: int
    dst: int
    lo: int
    hi: int


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundarySpec:
    fwd: Precision = "native"
    bwd: Precision = "native"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerPipeline:
    stages: tuple[RunnerStage, ...]
    num_microbatches: int
    boundaries: tuple[BoundarySpec, ...]
    """One per pair of consecutive stages."""
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    sample_offset: int = 0
    """Global index of this pipeline's first sample in a step (pipelines are laid out one after the
    other, microbatch after microbatch)."""

    @property
    def microbatch(self) -> int:
        return self.stages[0].microbatch

    @property
    def samples(self) -> int:
        return self.microbatch * self.num_microbatches

    def pieces(self, boundary: int) -> tuple[Piece, ...]:
        """Row ranges exchanged across boundary ``boundary`` (between stage ``boundary`` and the next)."""
        a, b = self.stages[boundary].replicas, self.stages[boundary + 1].replicas
        out = []
        for i, ra in enumerate(a):
            for j, rb in enumerate(b):
                lo, hi = max(ra.offset, rb.offset), min(ra.offset + ra.mbs, rb.offset + rb.mbs)
                if lo < hi:
                    out.append(Piece(src=i, dst=j, lo=lo, hi=hi))
        return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncGroup:
    """Ranks that all-reduce (SUM) the gradients of layers ``[start, end)`` after every step.

    ``mode`` ``shard``: every member holds the same tensor-parallel shard (one group per tp rank);
    ``full``: members hold different tp degrees, so each adds its shard into a zero full-size buffer
    (replicated parameters from tp rank 0 only) and takes its slice back after the all-reduce.

    ``zero`` 1 (``shard`` mode only): ZeRO-1. The group's parameters are flattened and cut into its
    gradient buckets; member ``i`` owns the ``i``-th slice of every bucket; each bucket's gradients are
    reduce-scattered (overlapped with the last backward), each member steps the optimizer on its
    slices only (its optimizer state covers only them) and the updated slices are all-gathered back
    into every member's parameters (``hgopt.runner.zero``)."""

    start: int
    end: int
    ranks: tuple[int, ...]
    mode: Literal["shard", "full"] = "shard"
    clusters: tuple[str, ...] = ()
    zero: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    """One torchrun node: the ranks started there (local rank = position in ``ranks``)."""

    index: int
    cluster: str
    cluster_node: int
    """Index of the node inside its cluster."""
    ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    """Everything about one rank, derived from the pipelines (also written to the JSON for people)."""

    rank: int
    pipeline: int
    stage: int
    replica: int
    tp_rank: int
    cluster: str
    node: int
    local_rank: int

    def describe(self) -> str:
        return f"rank {self.rank} (cluster {self.cluster}, pipeline {self.pipeline} stage {self.stage} replica {self.replica} tp rank {self.tp_rank})"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunnerPlan:
    model: ModelConfig
    train: TrainConfig
    pipelines: tuple[RunnerPipeline, ...]
    nodes: tuple[NodeSpec, ...]
    clusters: tuple[str, ...]
    links: tuple[LinkSpec, ...] = ()
    sync_groups: tuple[SyncGroup, ...] = ()
    emulate_links: Emulation = "off"
    nics: tuple[NicSpec, ...] = ()
    """emulate: every used cluster's node NIC (empty in older files: NICs not emulated)."""
    local: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout_s: float = 120.0
    """Timeout of every collective and point-to-point wait."""
    heartbeat_timeout_s: float = 15.0
    """A rank whose heartbeat stops for this long is reported dead and the others exit."""
    device: Device = "auto"
    """``cpu`` (gloo), ``cuda`` (nccl, one GPU per rank) or ``auto`` (cuda when the rank sees a GPU);
    the runner's ``--device`` overrides it."""
    instance: str = ""
    planner: str = ""
    meta: tuple[tuple[str, str], ...] = field(default=())

    # ---- derived ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    @property
    def global_batch(self) -> int:
        return sum(p.samples for p in self.pipelines)

    def ranks(self) -> tuple[RankInfo, ...]:
        where = {r: (n.index, k) for n in self.nodes for k, r in enumerate(n.ranks)}
        out = []
        for pi, p in enumerate(self.pipelines):
            for si, s in enumerate(p.stages):
                for ri, rep in enumerate(s.replicas):
                    for t, r in enumerate(rep.ranks):
                        node, local = where[r]
                        out.append(RankInfo(rank=r, pipeline=pi, stage=si, replica=ri, tp_rank=t,
                                            cluster=rep.cluster, node=node, local_rank=local))
        return tuple(sorted(out, key=lambda x: x.rank))

    def rank_info(self, rank: int) -> RankInfo:
        info = self.ranks()
        if not 0 <= rank < len(info):
            raise ValueError(f"rank {rank} is not in this plan (ranks 0..{len(info) - 1})")
        return info[rank]

    def link(self, src: str, dst: str) -> LinkSpec | None:
        for lk in self.links:
            if lk.src == src and lk.dst == dst:
                return lk
        return None

    def boundary_names(self) -> tuple[str, ...]:
        """``p{pipeline}.b{boundary}`` for every stage boundary, the keys of the byte counters."""
        return tuple(f"p{pi}.b{k}" for pi, p in enumerate(self.pipelines) for k in range(len(p.stages) - 1))

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(data: Any, source: str = "<inline>") -> RunnerPlan:
        return _from_dict(data, source)


def load_runner_plan(path: str | Path) -> RunnerPlan:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"{p}: cannot read the runner plan: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: the runner plan is not valid JSON: {exc}") from None
    return RunnerPlan.from_dict(data, str(p))


# ---------------------------------------------------------------------------------------------
def _to_dict(rp: RunnerPlan) -> dict[str, Any]:
    m, t = rp.model, rp.train
    return {
        "format": RUNNER_PLAN_FORMAT,
        "version": RUNNER_PLAN_VERSION,
        "instance": rp.instance,
        "planner": rp.planner,
        "meta": dict(rp.meta),
        "model": {"layers": list(m.layers), "hidden": m.hidden, "heads": m.heads, "vocab": m.vocab,
                  "seq": m.seq, "ffn_mult": m.ffn_mult,
                  **({"hf_config": json.loads(m.hf_config)} if m.hf_config else {})},
        "train": {"steps": t.steps, "lr": t.lr, "seed": t.seed, "optimizer": t.optimizer, "dtype": t.dtype,
                  "data": t.data, "checkpoint_every": t.checkpoint_every,
                  **({"data_files": list(t.data_files)} if t.data_files else {}),
                  **({"tokenizer": t.tokenizer} if t.tokenizer else {}),
                  **({"checkpoint_format": t.checkpoint_format} if t.checkpoint_format != "torch" else {}),
                  "grad_sync_precision": t.grad_sync_precision, "overlap_grad_sync": t.overlap_grad_sync,
                  "grad_bucket_mb": t.grad_bucket_mb,
                  **({"outer": {"groups": [list(g) for g in t.outer.groups], "steps": t.outer.steps, "lr": t.outer.lr,
                                "momentum": t.outer.momentum, "nesterov": t.outer.nesterov,
                                "precision": t.outer.precision, "block": t.outer.block,
                                "fragments": t.outer.fragments}} if t.outer is not None else {})},
        "comm": {"emulate_links": rp.emulate_links, "local": rp.local, "master_addr": rp.master_addr,
                 "master_port": rp.master_port, "timeout_s": rp.timeout_s,
                 "heartbeat_timeout_s": rp.heartbeat_timeout_s, "device": rp.device},
        "clusters": list(rp.clusters),
        "links": [{"src": lk.src, "dst": lk.dst, "bytes_per_s": lk.bytes_per_s, "latency_s": lk.latency_s,
                   "kind": lk.kind, **({"aggregate_bytes_per_s": lk.aggregate_bytes_per_s}
                                       if lk.aggregate_bytes_per_s is not None else {})}
                  for lk in rp.links],
        **({"nics": [{"cluster": n.cluster, "bytes_per_s": n.bytes_per_s, "latency_s": n.latency_s}
                     for n in rp.nics]} if rp.nics else {}),
        "nodes": [{"index": n.index, "cluster": n.cluster, "cluster_node": n.cluster_node, "ranks": list(n.ranks)}
                  for n in rp.nodes],
        "pipelines": [_pipeline_dict(p) for p in rp.pipelines],
        "sync_groups": [{"layers": [g.start, g.end], "ranks": list(g.ranks), "mode": g.mode,
                         "clusters": list(g.clusters), "zero": g.zero} for g in rp.sync_groups],
        "ranks": [_rank_dict(rp, r) for r in rp.ranks()],
    }


def _pipeline_dict(p: RunnerPipeline) -> dict[str, Any]:
    return {
        "num_microbatches": p.num_microbatches,
        "schedule": p.schedule,
        "sample_offset": p.sample_offset,
        "boundaries": [{"fwd": b.fwd, "bwd": b.bwd} for b in p.boundaries],
        "stages": [
            {"layers": [s.start, s.end], "zero": s.zero, **({"recompute": s.recompute} if s.recompute != "none" else {}),
             "replicas": [{"ranks": list(r.ranks), "cluster": r.cluster, "mbs": r.mbs, "offset": r.offset,
                           "group": r.group} for r in s.replicas]}
            for s in p.stages
        ],
    }


def _rank_dict(rp: RunnerPlan, r: RankInfo) -> dict[str, Any]:
    """The per-rank view asked for by people reading the file; the runner derives it again."""
    p = rp.pipelines[r.pipeline]
    s = p.stages[r.stage]
    rep = s.replicas[r.replica]
    return {
        "rank": r.rank, "node": r.node, "local_rank": r.local_rank, "cluster": r.cluster,
        "pipeline": r.pipeline, "stage": r.stage, "layers": [s.start, s.end], "replica": r.replica,
        "tp_rank": r.tp_rank, "tp_group": list(rep.ranks),
        "dp_groups": [list(g.ranks) for g in rp.sync_groups if r.rank in g.ranks],
        "mbs": rep.mbs, "rows": [rep.offset, rep.offset + rep.mbs], "num_microbatches": p.num_microbatches,
        "boundary_in": _bdict(p.boundaries[r.stage - 1]) if r.stage > 0 else None,
        "boundary_out": _bdict(p.boundaries[r.stage]) if r.stage < len(p.stages) - 1 else None,
    }


def _bdict(b: BoundarySpec) -> dict[str, str]:
    return {"fwd": b.fwd, "bwd": b.bwd}


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> ValueError:
        return ValueError(f"{self.source}: {where}: {problem}")

    def obj(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, f"expected an object, got {type(v).__name__}")
        return v

    def get(self, obj: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
        if key not in obj:
            raise self.fail(f"{where}.{key}", "is required but missing")
        v = obj[key]
        if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
            raise self.fail(f"{where}.{key}", f"expected {getattr(kind, '__name__', kind)}, got {v!r}")
        return v

    def choice(self, obj: dict[str, Any], key: str, where: str, options: tuple[str, ...], default: str) -> str:
        v = obj.get(key, default)
        if v not in options:
            raise self.fail(f"{where}.{key}", f"must be one of {', '.join(options)}, got {v!r}")
        return str(v)


def _from_dict(data: Any, source: str) -> RunnerPlan:
    rd = _Reader(source)
    top = rd.obj(data, "<top>")
    if top.get("format") != RUNNER_PLAN_FORMAT or top.get("version") != RUNNER_PLAN_VERSION:
        raise rd.fail("format", f"expected format {RUNNER_PLAN_FORMAT!r} version {RUNNER_PLAN_VERSION}, got "
                                f"{top.get('format')!r} version {top.get('version')!r} (export the plan again)")
    c = rd.obj(top.get("comm"), "comm")
    plan = RunnerPlan(
        model=_read_model(rd, rd.obj(top.get("model"), "model")),
        train=_read_train(rd, rd.obj(top.get("train"), "train")),
        pipelines=tuple(_read_pipeline(rd, p, f"pipelines[{i}]") for i, p in enumerate(rd.get(top, "pipelines", "<top>", list))),
        nodes=tuple(_read_node(rd, n, f"nodes[{i}]") for i, n in enumerate(rd.get(top, "nodes", "<top>", list))),
        clusters=tuple(rd.get(top, "clusters", "<top>", list)),
        links=tuple(LinkSpec(src=lk["src"], dst=lk["dst"], bytes_per_s=float(lk["bytes_per_s"]),
                             latency_s=float(lk["latency_s"]),
                             kind=rd.choice(lk, "kind", f"links[{i}]", ("per_flow", "shared_pipe"), "shared_pipe"),
                             aggregate_bytes_per_s=(None if lk.get("aggregate_bytes_per_s") is None
                                                    else float(lk["aggregate_bytes_per_s"])))
                    for i, lk in enumerate(top.get("links", []))),
        nics=tuple(NicSpec(cluster=str(n["cluster"]), bytes_per_s=float(n["bytes_per_s"]),
                           latency_s=float(n["latency_s"])) for n in top.get("nics", [])),
        sync_groups=tuple(SyncGroup(start=g["layers"][0], end=g["layers"][1], ranks=tuple(g["ranks"]),
                                    mode=g.get("mode", "shard"), clusters=tuple(g.get("clusters", ())),
                                    zero=int(g.get("zero", 0)))
                          for g in top.get("sync_groups", [])),
        emulate_links=rd.choice(c, "emulate_links", "comm", get_args(Emulation), "off"),  # type: ignore[arg-type]
        local=bool(c.get("local", False)),
        master_addr=str(c.get("master_addr", "127.0.0.1")),
        master_port=int(c.get("master_port", 29500)),
        timeout_s=float(c.get("timeout_s", 120.0)),
        heartbeat_timeout_s=float(c.get("heartbeat_timeout_s", 15.0)),
        device=rd.choice(c, "device", "comm", get_args(Device), "auto"),  # type: ignore[arg-type]
        instance=str(top.get("instance", "")), planner=str(top.get("planner", "")),
        meta=tuple((str(k), str(v)) for k, v in rd.obj(top.get("meta", {}), "meta").items()),
    )
    check_runner_plan(plan, source)
    if "ranks" in top and top["ranks"] != [_rank_dict(plan, r) for r in plan.ranks()]:
        raise rd.fail("ranks", "the per-rank view does not match the pipelines (edit pipelines, or export again)")
    return plan


def _read_model(rd: _Reader, m: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        layers=tuple(rd.choice({"k": k}, "k", "model.layers", get_args(LayerKind), "") for k in m.get("layers", [])),
        hidden=rd.get(m, "hidden", "model", int), heads=rd.get(m, "heads", "model", int),
        vocab=rd.get(m, "vocab", "model", int), seq=rd.get(m, "seq", "model", int),
        ffn_mult=rd.get(m, "ffn_mult", "model", int),
        hf_config=json.dumps(rd.obj(m["hf_config"], "model.hf_config"), sort_keys=True, separators=(",", ":"))
        if "hf_config" in m else "",
    )


def _read_train(rd: _Reader, t: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        steps=rd.get(t, "steps", "train", int), lr=float(rd.get(t, "lr", "train", (int, float))),
        seed=rd.get(t, "seed", "train", int),
        optimizer=rd.choice(t, "optimizer", "train", ("adam", "sgd"), "adam"),  # type: ignore[arg-type]
        dtype=rd.choice(t, "dtype", "train", get_args(ComputeDtype), "float32"),  # type: ignore[arg-type]
        data=rd.choice(t, "data", "train", ("corpus", "random", "text"), "corpus"),  # type: ignore[arg-type]
        data_files=tuple(str(f) for f in t.get("data_files", [])), tokenizer=str(t.get("tokenizer", "")),
        checkpoint_format=rd.choice(t, "checkpoint_format", "train", ("torch", "dcp"), "torch"),  # type: ignore[arg-type]
        checkpoint_every=rd.get(t, "checkpoint_every", "train", int),
        grad_sync_precision=rd.choice(t, "grad_sync_precision", "train", get_args(Precision), "native"),  # type: ignore[arg-type]
        overlap_grad_sync=rd.get({"overlap_grad_sync": True, **t}, "overlap_grad_sync", "train", bool),
        grad_bucket_mb=_positive(rd, float(rd.get({"grad_bucket_mb": 25.0, **t}, "grad_bucket_mb", "train", (int, float))),
                                 "train.grad_bucket_mb"),
        outer=_read_outer(rd, t["outer"]) if t.get("outer") is not None else None,
    )


def _read_outer(rd: _Reader, o: Any) -> OuterConfig:
    o = rd.obj(o, "train.outer")
    return OuterConfig(groups=tuple(tuple(int(i) for i in g) for g in rd.get(o, "groups", "train.outer", list)),
                       steps=_positive(rd, rd.get(o, "steps", "train.outer", int), "train.outer.steps"),  # type: ignore[arg-type]
                       lr=float(rd.get(o, "lr", "train.outer", (int, float))),
                       momentum=float(rd.get(o, "momentum", "train.outer", (int, float))),
                       nesterov=rd.get(o, "nesterov", "train.outer", bool),
                       precision=rd.choice(o, "precision", "train.outer", ("native", "fp32", "bf16", "fp8", "int8"), "fp32"),
                       block=_positive(rd, rd.get(o, "block", "train.outer", int), "train.outer.block"),  # type: ignore[arg-type]
                       fragments=_positive(rd, rd.get(o, "fragments", "train.outer", int), "train.outer.fragments"))  # type: ignore[arg-type]


def _positive(rd: _Reader, v: float, where: str) -> float:
    if not 0 < v < float("inf"):
        raise rd.fail(where, f"must be > 0, got {v!r}")
    return v


def _read_node(rd: _Reader, n: Any, where: str) -> NodeSpec:
    n = rd.obj(n, where)
    return NodeSpec(index=rd.get(n, "index", where, int), cluster=rd.get(n, "cluster", where, str),
                    cluster_node=rd.get(n, "cluster_node", where, int), ranks=tuple(rd.get(n, "ranks", where, list)))


def _read_pipeline(rd: _Reader, p: Any, where: str) -> RunnerPipeline:
    p = rd.obj(p, where)
    stages = []
    for k, s in enumerate(rd.get(p, "stages", where, list)):
        sw = f"{where}.stages[{k}]"
        s = rd.obj(s, sw)
        layers = rd.get(s, "layers", sw, list)
        reps = tuple(ReplicaSpec(ranks=tuple(r["ranks"]), cluster=str(r["cluster"]), mbs=int(r["mbs"]),
                                 offset=int(r["offset"]), group=int(r.get("group", 0)))
                     for r in (rd.obj(x, f"{sw}.replicas[]") for x in rd.get(s, "replicas", sw, list)))
        zero = s.get("zero", 0)
        if zero not in (0, 1):
            raise rd.fail(f"{sw}.zero", f"must be 0 or 1, got {zero!r}")
        recompute = rd.choice(s, "recompute", sw, ("none", "full"), "none")
        stages.append(RunnerStage(start=int(layers[0]), end=int(layers[1]), replicas=reps, zero=zero,
                                  recompute=recompute))  # type: ignore[arg-type]
    bounds = tuple(
        BoundarySpec(fwd=rd.choice(b, "fwd", f"{where}.boundaries[{j}]", get_args(Precision), "native"),  # type: ignore[arg-type]
                     bwd=rd.choice(b, "bwd", f"{where}.boundaries[{j}]", get_args(Precision), "native"))  # type: ignore[arg-type]
        for j, b in enumerate(p.get("boundaries", []))
    )
    return RunnerPipeline(
        stages=tuple(stages), num_microbatches=rd.get(p, "num_microbatches", where, int), boundaries=bounds,
        schedule=rd.choice(p, "schedule", where, ("1f1b", "gpipe"), "1f1b"),  # type: ignore[arg-type]
        sample_offset=int(p.get("sample_offset", 0)),
    )


def check_runner_plan(rp: RunnerPlan, source: str = "<inline>") -> None:
    """Structural checks a hand-edited runner plan could break; raises ValueError naming the field."""
    if rp.model.hidden % rp.model.heads:
        raise ValueError(f"{source}: model.hidden: {rp.model.hidden} is not a multiple of model.heads {rp.model.heads}")
    ranks = sorted(r for n in rp.nodes for r in n.ranks)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"{source}: nodes: the nodes' ranks must be 0..N-1, each once")
    seen: list[int] = []
    offset = 0
    for pi, p in enumerate(rp.pipelines):
        if p.sample_offset != offset:
            raise ValueError(f"{source}: pipelines[{pi}].sample_offset: is {p.sample_offset}, expected {offset}")
        offset += p.samples
        seen.extend(_check_pipeline(rp.model, p, f"{source}: pipelines[{pi}]"))
    if sorted(seen) != ranks:
        raise ValueError(f"{source}: pipelines: every rank must appear in exactly one replica")
    for k, g in enumerate(rp.sync_groups):
        if g.zero not in (0, 1):
            raise ValueError(f"{source}: sync_groups[{k}].zero: must be 0 or 1, got {g.zero!r}")
        if g.zero and g.mode != "shard":
            raise ValueError(f"{source}: sync_groups[{k}].zero: ZeRO-1 needs holders of one tp degree (mode shard), "
                             f"this group is mode {g.mode}")


def _check_pipeline(m: ModelConfig, p: RunnerPipeline, w: str) -> list[int]:
    """The ranks of ``p`` after checking its stages tile the layers and its replicas the microbatch."""
    if len(p.boundaries) != len(p.stages) - 1:
        raise ValueError(f"{w}.boundaries: has {len(p.boundaries)} entries, expected {len(p.stages) - 1}")
    seen: list[int] = []
    start = 0
    for si, s in enumerate(p.stages):
        sw = f"{w}.stages[{si}]"
        if s.start != start or s.end <= s.start:
            raise ValueError(f"{sw}.layers: [{s.start}, {s.end}) does not continue at layer {start}")
        start = s.end
        row = 0
        for ri, rep in enumerate(s.replicas):
            if rep.offset != row or rep.mbs < 1:
                raise ValueError(f"{sw}.replicas[{ri}]: rows [{rep.offset}, {rep.offset + rep.mbs}) do not continue at row {row}")
            row += rep.mbs
            if (problem := m.tp_problem(rep.tp)) is not None:
                raise ValueError(f"{sw}.replicas[{ri}]: {problem}")
            seen.extend(rep.ranks)
        if s.microbatch != p.microbatch:
            raise ValueError(f"{sw}: processes {s.microbatch} rows per microbatch, stage 0 processes {p.microbatch}")
    if start != m.num_layers:
        raise ValueError(f"{w}.stages: cover layers up to {start}, the model has {m.num_layers}")
    return seen
