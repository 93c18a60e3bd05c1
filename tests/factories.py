"""Small instances built in code, for tests that need exact hand-computable numbers or brute force."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

from hgopt.plan import Pipeline, Plan, ReplicaGroup, Stage
from hgopt.spec import Instance, instance_from_dict

if TYPE_CHECKING:
    from hgopt.search.milp import BatchSplit


def tiny_model(
    num_layers: int = 4,
    gpus: dict[str, float] | None = None,
    tps: tuple[int, ...] = (1, 2),
    mbss: tuple[int, ...] = (1, 2, 4),
    params: float = 1e6,
    activation_bytes: float = 1e6,
    act_mem_bytes: float = 1e7,
    update_s: float = 0.001,
) -> dict[str, Any]:
    """Every layer identical; forward = base·mbs/tp seconds, backward twice that."""
    gpus = gpus or {"A": 0.01, "B": 0.02}
    return {
        "name": "tiny",
        "dtype": "fp32",
        "seq_len": 128,
        "layers": [
            {"name": f"l{i}", "kind": "block", "params": params, "activation_bytes": activation_bytes,
             "act_mem_bytes": act_mem_bytes}
            for i in range(num_layers)
        ],
        "timings": [
            {"gpu": g, "tp": tp, "mbs": mbs, "fwd": [base * mbs / tp] * num_layers,
             "bwd": [2 * base * mbs / tp] * num_layers, "update": [update_s / tp] * num_layers}
            for g, base in gpus.items() for tp in tps for mbs in mbss
        ],
    }


def tiny_topology(
    clusters: tuple[tuple[str, str, int, int, float], ...] = (("a", "A", 2, 2, 40.0), ("b", "B", 2, 2, 16.0)),
    wan_gbit_s: float = 8.0,
    wan_latency_ms: float = 10.0,
) -> dict[str, Any]:
    """clusters: (name, gpu, nodes, gpus_per_node, memory GB); each in its own region."""
    return {
        "clusters": [
            {"name": n, "region": f"r-{n}", "gpu": g, "gpu_memory_gb": mem, "nodes": nodes,
             "gpus_per_node": gpn, "intra_node": {"gbyte_s": 100}, "inter_node": {"gbit_s": 100}}
            for n, g, nodes, gpn, mem in clusters
        ],
        "links": {"default": {"gbit_s": wan_gbit_s, "latency_ms": wan_latency_ms}},
    }


def tiny_instance(global_batch: int = 8, model: dict[str, Any] | None = None,
                  topology: dict[str, Any] | None = None, name: str = "tiny",
                  precision: str = "fp32", recompute: str = "auto") -> Instance:
    return instance_from_dict(
        {
            "name": name,
            "model": model or tiny_model(),
            "topology": topology or tiny_topology(),
            "job": {"global_batch": global_batch, "seq_len": 128, "precision": precision, "recompute": recompute},
        }
    )


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers in order (layer counts of the stages
    of a brute-force enumeration)."""
    out = []
    for cuts in itertools.combinations(range(1, total), parts - 1):
        c = (0, *cuts, total)
        out.append(tuple(b - a for a, b in zip(c, c[1:])))
    return out


Layout = tuple[ReplicaGroup, str]
"""A local layout of one cluster's block: the replica group every stage of it uses and its recomputation."""


def every_layout(inst: Instance, cluster: str, microbatch: int, recompute: str = "planner") -> list[Layout]:
    """Every layout the exact planner's space holds for ``cluster`` at ``microbatch``, written out
    independently of the planner: tp profiled for the cluster's GPU and dividing its node size, dp a
    divisor of the microbatch, mbs = microbatch / dp, without recomputation; then (unless
    ``job.recompute`` is off) the same layouts with full recomputation: ``recompute="all"`` every one,
    ``"planner"`` those ``intra.local_configs`` offers (it leaves out a variant where memory cannot
    bind: more compute, the same fit, never better — on tests/test_milp.py's ten instances "all"
    finds the same optima, at 7x the enumeration), ``"none"`` none."""
    from hgopt.search.intra import local_configs

    c = inst.topology.cluster(cluster)
    plain = [ReplicaGroup(cluster=cluster, tp=tp, dp=dp, mbs=microbatch // dp)
             for tp in inst.model.tps(c.gpu) if c.gpus_per_node % tp == 0
             for dp in range(1, microbatch + 1) if microbatch % dp == 0]
    out: list[Layout] = [(g, "none") for g in plain]
    if inst.job.recompute == "off" or recompute == "none":
        return out
    if recompute == "all":
        return out + [(g, "full") for g in plain]
    offered = {(cfg.tp, cfg.dp, cfg.mbs) for cfg in local_configs(inst, cluster, microbatch) if cfg.recompute}
    return out + [(g, "full") for g in plain if (g.tp, g.dp, g.mbs) in offered]


def local_pipelines(layouts: Iterable[Layout], lo: int, hi: int, budget: int) -> Iterator[tuple[Stage, ...]]:
    """Every local pipeline of layers [lo, hi) with one of ``layouts`` for all its stages, any number
    of stages that ``budget`` GPUs hold (at most one layer each at least), any partition."""
    for g, rc in layouts:
        for s in range(1, min(budget // g.gpus, hi - lo) + 1):
            for cuts in itertools.combinations(range(lo + 1, hi), s - 1):
                b = (lo, *cuts, hi)
                yield tuple(Stage(start=x, end=y, groups=(g,), zero=1, recompute=rc) for x, y in zip(b, b[1:]))


def chain_space(inst: Instance, layouts: Callable[[str, int], Iterable[Layout]] | None = None
                ) -> Iterator[tuple[BatchSplit, Pipeline]]:
    """(batch split, pipeline) for every plan of the exact planner's space with native links: k
    identical pipelines (each cluster's GPUs shared evenly by the k copies), each an ordered chain of
    distinct clusters with one contiguous block each, one layout per block (``layouts(cluster,
    microbatch)``, by default :func:`every_layout`), any partition."""
    from hgopt.search.milp import batch_splits

    layouts = layouts or (lambda c, mb: every_layout(inst, c, mb))
    L = inst.model.num_layers
    names = [c.name for c in inst.topology.clusters]
    for sp in batch_splits(inst):
        budgets = {c.name: c.num_gpus // sp.k for c in inst.topology.clusters}
        lay = {c: list(layouts(c, sp.microbatch)) for c in names}
        for r in range(1, len(names) + 1):
            for chain in itertools.permutations(names, r):
                for cuts in itertools.combinations(range(1, L), r - 1):
                    b = (0, *cuts, L)
                    blocks = [list(local_pipelines(lay[c], lo, hi, budgets[c])) for c, lo, hi in zip(chain, b, b[1:])]
                    for combo in itertools.product(*blocks):
                        yield sp, Pipeline(stages=tuple(st for blk in combo for st in blk),
                                           num_microbatches=sp.num_microbatches)


def chain_brute_force(inst: Instance, layouts: Callable[[str, int], Iterable[Layout]] | None = None) -> float:
    """Best ``evaluate`` iteration time over :func:`chain_space` (inf: no plan fits)."""
    from hgopt.cost import build_tables, evaluate

    tables = build_tables(inst)
    best = math.inf
    for sp, pipe in chain_space(inst, layouts):
        ev = evaluate(Plan(pipelines=(pipe,) * sp.k), inst, tables)
        if ev.feasible:
            best = min(best, ev.iteration_time_s)
    return best


class FakeClock:
    """A clock for ``Deadline`` tests that moves only when a test sets ``now`` (no wall-clock verdict)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RandomPipeline(NamedTuple):
    """A random 1F1B pipeline (:func:`draw_pipeline`): per stage its layers' (forward, backward/forward
    ratio), stage forward/backward times, per boundary latency and send times each way, and what the
    [C3b] bound tests compare: the exact replay at m, stage times t, fill R_0 and ``forward_share``."""

    layers: list[list[tuple[float, float]]]
    f: list[float]
    b: list[float]
    lat: list[float]
    cf: list[float]
    cb: list[float]
    rep: float
    t: list[float]
    r0: float
    rho: float
    e: float


def draw_pipeline(data: Any, S: int, m: int) -> RandomPipeline:
    """Draw (hypothesis ``data``) S stages of 1-3 layers (forward 0.01-1 s, backward 0-2.5x it) and S
    boundaries (the last unused by the replay's S − 1 sends) with latency 0-0.5 s and sends of latency
    plus 0-3 s each way; replay them at m microbatches."""
    from hypothesis import strategies as hs

    from hgopt.cost.pipeline import fill_time, forward_share, replay_stage_ends
    from hgopt.cost.schedule import stage_ops

    secs = hs.floats(0.01, 1.0)
    layers = [data.draw(hs.lists(hs.tuples(secs, hs.floats(0.0, 2.5)), min_size=1, max_size=3)) for _ in range(S)]
    f = [sum(x for x, _ in st) for st in layers]
    b = [sum(x * y for x, y in st) for st in layers]
    lat = data.draw(hs.lists(hs.floats(0.0, 0.5), min_size=S, max_size=S))
    cf = [x + data.draw(hs.floats(0.0, 3.0)) for x in lat]
    cb = [x + data.draw(hs.floats(0.0, 3.0)) for x in lat]
    rep = max(replay_stage_ends(stage_ops, "1f1b", f, b, cf, cb, m, lat, lat))
    t = [x + y for x, y in zip(f, b)]
    r0 = fill_time(t, cf[: S - 1] + [0.0], cb[: S - 1] + [0.0])
    rho, e = forward_share([x for st in layers for x, _ in st], [x * y for st in layers for x, y in st])
    return RandomPipeline(layers, f, b, lat, cf, cb, rep, t, r0, rho, e)
