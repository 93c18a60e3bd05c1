"""Plan + instance -> runner plan: rank placement on the topology's nodes, replica row ranges,
gradient-sync groups and emulated links. Pure Python; never imports torch."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from functools import reduce
from pathlib import Path
from typing import Literal

from hgopt.cost.tables import bandwidth_bytes_per_s
from hgopt.export.runner_plan import (
    BoundarySpec,
    Device,
    Emulation,
    LinkSpec,
    NicSpec,
    ModelConfig,
    NodeSpec,
    OuterConfig,
    ReplicaSpec,
    RunnerPipeline,
    RunnerPlan,
    RunnerStage,
    SyncGroup,
    TrainConfig,
    check_runner_plan,
)
from hgopt.plan import Plan, ReplicaGroup, validate
from hgopt.spec import Instance

__all__ = ["ExportOptions", "build_runner_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportOptions:
    """Settings of ``hgopt export`` that are not in the plan. Defaults give a model small enough to
    train on a laptop CPU."""

    hidden: int = 64
    heads: int = 4
    vocab: int = 256
    seq: int = 32
    """Tokens per sample of the runner (not the instance's sequence length)."""
    steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    optimizer: Literal["adam", "sgd"] | None = None
    """``None``: the instance job's optimizer."""
    dtype: Literal["float32", "float64", "bfloat16"] | None = None
    """Runner compute dtype; ``None``: ``bfloat16`` (bf16 compute, fp32 masters) when the instance's job
    trains in bf16, else ``float32``."""
    data: Literal["corpus", "random", "text"] = "corpus"
    data_files: tuple[str, ...] = ()
    """``text`` data: local files (absolute paths are written; empty: the shipped corpus)."""
    tokenizer: str = ""
    """``text`` data: a ``tokenizer.json``; empty: bytes."""
    checkpoint_format: Literal["torch", "dcp"] = "torch"
    mbs_unit: int | None = None
    """Runner samples per unit of the greatest common divisor of the plan's microbatch sizes
    (``None``: the plan's sizes as they are). Keeps the ratios between replicas."""
    microbatches: int | None = None
    """Microbatches per pipeline (``None``: the plan's counts)."""
    checkpoint_every: int = 0
    local: bool = False
    emulate_links: Emulation = "off"
    link_scale: float = 1.0
    """Multiplies every emulated inter-cluster bandwidth (latency unchanged)."""
    master_addr: str = ""
    """Rendezvous host (node 0); empty: ``127.0.0.1`` with ``local``, else taken from $MASTER_ADDR."""
    master_port: int = 29500
    timeout_s: float = 120.0
    heartbeat_timeout_s: float = 15.0
    device: Device = "auto"
    """Where the ranks compute: ``cpu`` (gloo), ``cuda`` (nccl) or ``auto`` (cuda when available)."""


def build_runner_plan(plan: Plan, instance: Instance, opts: ExportOptions) -> RunnerPlan:
    """The runner plan for ``plan`` on ``instance``; raises ValueError for an invalid plan or option."""
    _check_inputs(plan, instance, opts)
    model = _model_config(instance, opts)
    train = TrainConfig(steps=opts.steps, lr=opts.lr, seed=opts.seed,
                        optimizer=opts.optimizer or instance.job.optimizer, dtype=_dtype(instance, opts), data=opts.data,
                        checkpoint_every=opts.checkpoint_every, grad_sync_precision=plan.grad_sync_precision,
                        overlap_grad_sync=plan.overlap_grad_sync, grad_bucket_mb=plan.grad_bucket_mb,
                        data_files=tuple(str(Path(f).resolve()) for f in opts.data_files),
                        tokenizer=str(Path(opts.tokenizer).resolve()) if opts.tokenizer else "",
                        checkpoint_format=opts.checkpoint_format)
    slots = _place(plan, instance)
    nodes = _nodes(slots, instance)
    rank_of = _rank_of(slots, nodes)
    pipelines = _pipelines(plan, opts, rank_of)
    rp = RunnerPlan(
        model=model, train=train, pipelines=pipelines, nodes=nodes,
        clusters=tuple(c.name for c in instance.topology.clusters if any(n.cluster == c.name for n in nodes)),
        emulate_links=opts.emulate_links, local=opts.local,
        master_addr=opts.master_addr or ("127.0.0.1" if opts.local else ""), master_port=opts.master_port,
        timeout_s=opts.timeout_s, heartbeat_timeout_s=opts.heartbeat_timeout_s, device=opts.device,
        instance=instance.name, planner=plan.planner, meta=plan.meta,
    )
    rp = replace(rp, links=_links(rp, instance, opts), nics=_nics(rp, instance, opts), sync_groups=_sync_groups(rp))
    if plan.outer is not None:  # issue #15 (diloco): gradients synchronised inside each group only
        rp = _with_outer(rp, plan)
    check_runner_plan(rp, "<export>")
    return rp


def _dtype(instance: Instance, opts: ExportOptions) -> str:
    if opts.dtype is not None:
        return opts.dtype
    return "bfloat16" if instance.job.precision == "bf16" else "float32"


def _model_config(instance: Instance, opts: ExportOptions) -> ModelConfig:
    """The runner's model: the instance's Hugging Face architecture when its profile carries one
    (``--hidden/--heads/--vocab`` then do not apply), else the runner's GPT decoder of the options."""
    kinds = tuple(layer.kind for layer in instance.model.layers)
    text = instance.model.hf_config
    if not text:
        return ModelConfig(layers=kinds, hidden=opts.hidden, heads=opts.heads, vocab=opts.vocab, seq=opts.seq)
    cfg = json.loads(text)
    gpt2 = cfg.get("model_type") == "gpt2"
    hidden, heads = cfg["n_embd" if gpt2 else "hidden_size"], cfg["n_head" if gpt2 else "num_attention_heads"]
    blocks = cfg["n_layer" if gpt2 else "num_hidden_layers"]
    if kinds.count("block") != blocks:
        raise ValueError(f"the instance's model has {kinds.count('block')} blocks, its Hugging Face config {blocks}")
    positions = cfg.get("n_positions" if gpt2 else "max_position_embeddings")
    if isinstance(positions, int) and opts.seq > positions:
        raise ValueError(f"--seq {opts.seq} exceeds the model's {positions} positions")
    if opts.data in ("corpus", "text") and not opts.tokenizer and cfg["vocab_size"] < 256:
        raise ValueError(f"the model's vocabulary ({cfg['vocab_size']}) is too small for byte-level text (needs 256); "
                         "use --data random")
    log.info("runner model: the instance's Hugging Face architecture (%s, hidden %d, %d heads); --hidden/--heads/--vocab "
             "do not apply", cfg.get("model_type"), hidden, heads)
    return ModelConfig(layers=kinds, hidden=hidden, heads=heads, vocab=cfg["vocab_size"], seq=opts.seq, hf_config=text)


# ---- checks ---------------------------------------------------------------------------------
def _check_inputs(plan: Plan, instance: Instance, opts: ExportOptions) -> None:
    problems = validate(plan, instance)
    if problems:
        raise ValueError("the plan is not valid for this instance: " + "; ".join(str(p) for p in problems))
    for name, v in (("--hidden", opts.hidden), ("--heads", opts.heads), ("--vocab", opts.vocab),
                    ("--seq", opts.seq), ("--steps", opts.steps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if opts.hidden % opts.heads:
        raise ValueError(f"--hidden {opts.hidden} must be a multiple of --heads {opts.heads}")
    if opts.data in ("corpus", "text") and not opts.tokenizer and opts.vocab < 256 and not instance.model.hf_config:
        raise ValueError(f"--vocab {opts.vocab} is too small for byte-level text (needs 256); or use --data random")
    for pi, p in enumerate(plan.pipelines):
        for s in p.stages:
            for g in s.groups:
                if opts.heads % g.tp and not instance.model.hf_config:
                    raise ValueError(f"--heads {opts.heads} is not divisible by tp {g.tp} of pipeline {pi}; choose a multiple")
    if (opts.data_files or opts.tokenizer) and opts.data != "text":
        raise ValueError("--data-file and --tokenizer need --data text")
    for f in (*opts.data_files, *([opts.tokenizer] if opts.tokenizer else [])):
        if not Path(f).is_file():
            raise ValueError(f"{f}: no such file")
    if opts.mbs_unit is not None and opts.mbs_unit < 1:
        raise ValueError(f"--mbs-unit must be >= 1, got {opts.mbs_unit}")
    if opts.microbatches is not None and opts.microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {opts.microbatches}")
    if opts.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {opts.checkpoint_every}")
    if not (math.isfinite(opts.link_scale) and opts.link_scale > 0):
        raise ValueError(f"--link-scale must be > 0, got {opts.link_scale}")
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise ValueError(f"--lr must be > 0, got {opts.lr}")
    check_comm_options(opts)


MIN_HEARTBEAT_TIMEOUT_S = 2.0
"""Four beats of the runner's watchdog (hgopt/runner/watchdog.py beats every 0.5 s): a shorter timeout
declares healthy ranks dead."""


def check_comm_options(opts: ExportOptions) -> None:
    """The communication settings of ``hgopt export`` (ValueError naming the option)."""
    if not (math.isfinite(opts.timeout_s) and opts.timeout_s > 0):
        raise ValueError(f"--timeout must be > 0 seconds, got {opts.timeout_s}")
    if not (math.isfinite(opts.heartbeat_timeout_s) and opts.heartbeat_timeout_s >= MIN_HEARTBEAT_TIMEOUT_S):
        raise ValueError(f"--heartbeat-timeout must be >= {MIN_HEARTBEAT_TIMEOUT_S} seconds (the runner's heartbeat "
                         f"beats every 0.5 s), got {opts.heartbeat_timeout_s}")
    if not (1 <= opts.master_port <= 65535 or (opts.local and opts.master_port == 0)):
        raise ValueError(f"--master-port must be a TCP port in 1..65535 (0 = any free port, with --local only), "
                         f"got {opts.master_port}")


# ---- placement ------------------------------------------------------------------------------
_Key = tuple[int, int, int, int, int]
"""(pipeline, stage, group, replica within group, tp rank)."""


def _place(plan: Plan, instance: Instance) -> dict[_Key, tuple[str, int, int]]:
    """Each GPU of the plan -> (cluster, node, GPU slot). A tensor-parallel group never straddles nodes:
    inside each cluster the widest groups are placed first, and a group that would not fit in the rest
    of a node starts on the next one."""
    wanted: dict[str, list[tuple[int, _Key]]] = {}
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            for gi, g in enumerate(s.groups):
                for d in range(g.dp):
                    wanted.setdefault(g.cluster, []).append((g.tp, (pi, si, gi, d, 0)))
    out: dict[_Key, tuple[str, int, int]] = {}
    for name, reps in wanted.items():
        c = instance.topology.cluster(name)
        node, slot = 0, 0
        for tp, key in sorted(reps, key=lambda x: -x[0]):  # stable: plan order among equal tp
            if slot + tp > c.gpus_per_node:
                node, slot = node + 1, 0
            if node >= c.nodes:
                raise ValueError(f"cannot place the plan's tensor-parallel groups on cluster {name} "
                                 f"({c.nodes} nodes x {c.gpus_per_node} GPUs) without splitting a group across nodes")
            for t in range(tp):
                out[key[:4] + (t,)] = (name, node, slot + t)
            slot += tp
    return out


def _nodes(slots: dict[_Key, tuple[str, int, int]], instance: Instance) -> tuple[NodeSpec, ...]:
    """Nodes that hold at least one rank, in topology order; ranks numbered node after node."""
    used = sorted({(instance.topology.cluster_index(c), c, n) for c, n, _ in slots.values()})
    out, rank = [], 0
    for index, (_, cluster, node) in enumerate(used):
        count = sum(1 for c, n, _ in slots.values() if (c, n) == (cluster, node))
        out.append(NodeSpec(index=index, cluster=cluster, cluster_node=node, ranks=tuple(range(rank, rank + count))))
        rank += count
    return tuple(out)


def _rank_of(slots: dict[_Key, tuple[str, int, int]], nodes: tuple[NodeSpec, ...]) -> dict[_Key, int]:
    """Ranks inside a node follow the GPU slot order."""
    out: dict[_Key, int] = {}
    for n in nodes:
        keys = sorted((k for k, v in slots.items() if v[:2] == (n.cluster, n.cluster_node)), key=lambda k: slots[k][2])
        out.update(zip(keys, n.ranks))
    return out


def _pipelines(plan: Plan, opts: ExportOptions, rank_of: dict[_Key, int]) -> tuple[RunnerPipeline, ...]:
    unit = reduce(math.gcd, (g.mbs for p in plan.pipelines for s in p.stages for g in s.groups))
    out, sample_offset = [], 0
    for pi, p in enumerate(plan.pipelines):
        stages = []
        for si, s in enumerate(p.stages):
            reps, row = [], 0
            for gi, g in enumerate(s.groups):
                mbs = _runner_mbs(g, unit, opts)
                for d in range(g.dp):
                    ranks = tuple(rank_of[(pi, si, gi, d, t)] for t in range(g.tp))
                    reps.append(ReplicaSpec(ranks=ranks, cluster=g.cluster, mbs=mbs, offset=row, group=gi))
                    row += mbs
            stages.append(RunnerStage(start=s.start, end=s.end, replicas=tuple(reps), zero=s.zero, recompute=s.recompute))
        bounds = tuple(BoundarySpec(fwd=p.boundary(k).fwd, bwd=p.boundary(k).bwd) for k in range(len(p.stages) - 1))
        rp = RunnerPipeline(stages=tuple(stages), num_microbatches=opts.microbatches or p.num_microbatches,
                            boundaries=bounds, schedule=p.schedule, sample_offset=sample_offset)
        sample_offset += rp.samples
        out.append(rp)
    return tuple(out)


def _runner_mbs(g: ReplicaGroup, unit: int, opts: ExportOptions) -> int:
    return g.mbs if opts.mbs_unit is None else g.mbs // unit * opts.mbs_unit


# ---- links and gradient-sync groups -----------------------------------------------------------
def _links(rp: RunnerPlan, instance: Instance, opts: ExportOptions) -> tuple[LinkSpec, ...]:
    """Every ordered pair of used clusters. The bandwidth is the topology's achieved rate for one
    microbatch of the runner's activations (curve links depend on message size), times ``link_scale``;
    the link's kind and aggregate cap go with it.

    What the emulation implements: ``delay`` (:mod:`hgopt.runner.linkemu`) the link model itself, a
    per-flow queue per node pair, an aggregate cap per direction, one pipe per direction for a
    ``shared_pipe`` link and every node's NIC (:func:`_nics`); ``netns`` one tbf-shaped veth per
    cluster pair and direction (a shared pipe at the per-flow rate) and nothing inside a cluster. With
    ``netns`` a ``per_flow`` link whose clusters use several nodes (flows between different node pairs
    run in parallel in ``evaluate`` and ``simulate``) and a cluster whose plan uses several nodes
    (inter-node traffic priced at ``inter_node``, carried at loopback speed) get a warning."""
    message = _message_bytes(rp, instance, opts)
    used_nodes = {c: len({n.cluster_node for n in rp.nodes if n.cluster == c}) for c in rp.clusters}
    out, parallel = [], []
    for a in rp.clusters:
        for b in rp.clusters:
            if a != b:
                spec = instance.topology.link_spec(a, b)
                bw = spec.bandwidth
                agg = None
                if spec.kind == "per_flow" and spec.aggregate is not None:
                    agg = bandwidth_bytes_per_s(spec.aggregate, message) * opts.link_scale
                out.append(LinkSpec(src=a, dst=b, bytes_per_s=bandwidth_bytes_per_s(bw, message) * opts.link_scale,
                                    latency_s=bw.latency_s, kind=spec.kind, aggregate_bytes_per_s=agg))
                if spec.kind == "per_flow" and spec.aggregate != spec.bandwidth and used_nodes[a] * used_nodes[b] > 1:
                    parallel.append(f"{a}->{b}")
    if parallel and opts.emulate_links in ("netns", "auto"):
        log.warning("link emulation %s shapes one shared pipe per cluster pair and direction at the per-flow rate "
                    "(netns; the delay mode emulates per-flow links): the links %s are per_flow and the plan uses "
                    "several node pairs on them, whose flows evaluate and simulate run in parallel: emulated steps "
                    "where such flows overlap are slower than predicted", opts.emulate_links, ", ".join(parallel))
    # validation3: netns shapes nothing inside a cluster (its ranks share one namespace)
    multi = [c for c in rp.clusters if used_nodes[c] > 1]
    if multi and opts.emulate_links in ("netns", "auto"):
        log.warning("link emulation %s shapes only the links between clusters (netns; the delay mode emulates "
                    "node NICs); inside %s the plan uses several nodes, whose traffic evaluate and simulate price at "
                    "the cluster's inter_node figure (each node's NIC shared by its GPUs) and the emulation carries "
                    "unshaped (this host's loopback)", opts.emulate_links, ", ".join(multi))
    return tuple(out)


def _message_bytes(rp: RunnerPlan, instance: Instance, opts: ExportOptions) -> float:
    """Bytes of one microbatch of the runner's activations (the message size curve links are read at)."""
    itemsize = {"float64": 8, "bfloat16": 2}.get(_dtype(instance, opts), 4)
    return max(p.microbatch for p in rp.pipelines) * opts.seq * opts.hidden * itemsize


def _nics(rp: RunnerPlan, instance: Instance, opts: ExportOptions) -> tuple[NicSpec, ...]:
    """emulate: every used cluster's node NIC (``inter_node`` at one microbatch's message size; not
    scaled by ``link_scale``, which scales the links between clusters)."""
    message = _message_bytes(rp, instance, opts)
    out = []
    for c in rp.clusters:
        bw = instance.topology.cluster(c).inter_node
        out.append(NicSpec(cluster=c, bytes_per_s=bandwidth_bytes_per_s(bw, message), latency_s=bw.latency_s))
    return tuple(out)


def _sync_groups(rp: RunnerPlan) -> tuple[SyncGroup, ...]:
    """Layers are cut at every stage start of every pipeline; each piece's holders (replicas of all
    pipelines) all-reduce its gradients. Adjacent pieces with the same holders are merged.

    ZeRO-1: a group shards the optimizer state over its members when every holder's stage asks for
    ``zero 1`` and the holders share one tp degree (one group per tp rank, so each member shards the
    same tp shard). Otherwise its holders keep full copies, which is logged at INFO."""
    cuts = sorted({s.start for p in rp.pipelines for s in p.stages} | {rp.model.num_layers})
    merged: list[tuple[int, int, tuple[tuple[ReplicaSpec, int], ...]]] = []
    for lo, hi in zip(cuts, cuts[1:]):
        holders = tuple((rep, s.zero) for p in rp.pipelines for s in p.stages if s.start <= lo and hi <= s.end
                        for rep in s.replicas)
        if merged and merged[-1][2] == holders:
            merged[-1] = (merged[-1][0], hi, holders)
        else:
            merged.append((lo, hi, holders))
    out = []
    for lo, hi, held in merged:
        holders = tuple(h for h, _ in held)
        if len(holders) < 2:
            continue
        clusters = tuple(dict.fromkeys(h.cluster for h in holders))
        tps = {h.tp for h in holders}
        zero = _zero_level(lo, hi, held, tps)
        if len(tps) == 1:
            out.extend(SyncGroup(start=lo, end=hi, ranks=tuple(h.ranks[t] for h in holders), mode="shard",
                                 clusters=clusters, zero=zero) for t in range(tps.pop()))
        else:
            out.append(SyncGroup(start=lo, end=hi, ranks=tuple(sorted(r for h in holders for r in h.ranks)),
                                 mode="full", clusters=clusters))
    return tuple(out)


def _with_outer(rp: RunnerPlan, plan: Plan) -> RunnerPlan:
    """issue #15: the plan's outer synchronisation in the train config; gradient-sync groups built per group
    of pipelines (the groups exchange parameter deltas every H steps instead, :mod:`hgopt.runner.outer`)."""
    o = plan.outer
    assert o is not None
    if o.overlap:
        raise ValueError("outer.overlap: the runner runs the outer exchange blocking; export the plan with "
                         "overlap false (the kernel prices both)")
    if rp.train.dtype == "bfloat16":
        raise ValueError("outer: the runner's outer step does not update bf16 master weights yet; export with "
                         "--dtype float32 or float64")
    sync = tuple(sg for g in o.groups for sg in _sync_groups(replace(rp, pipelines=tuple(rp.pipelines[i] for i in g))))
    outer = OuterConfig(groups=o.groups, steps=o.steps, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov,
                        precision=o.precision, block=o.block, fragments=o.fragments)
    return replace(rp, sync_groups=sync, train=replace(rp.train, outer=outer))


def _zero_level(lo: int, hi: int, held: tuple[tuple[ReplicaSpec, int], ...], tps: set[int]) -> int:
    """1 when layers ``[lo, hi)`` can have their optimizer state sharded over their holders."""
    asked = [z for _, z in held]
    if not any(asked):
        return 0
    if not all(asked):
        log.info("zero 1: layers [%d, %d) are also held by stages without zero 1: every holder keeps the full "
                 "optimizer state of these layers", lo, hi)
        return 0
    if len(tps) > 1:
        log.info("zero 1: layers [%d, %d) are held with different tp degrees (%s): their holders keep the full "
                 "optimizer state (sharding needs one tp degree)", lo, hi, ", ".join(str(t) for t in sorted(tps)))
        return 0
    return 1
