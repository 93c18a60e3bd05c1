"""Input specifications: model profile, topology, job and the instance that ties them together.

Every input is validated once, here, when it is read. Errors are :class:`~hgopt.errors.SpecError`
naming the file, the dotted field path and what is wrong. Units inside the library are SI: seconds,
bytes, bytes per second. Files use friendlier units, named in the field (``gbit_s``, ``latency_ms``,
``gpu_memory_gb``).
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Mapping, get_args

from hgopt.errors import SpecError

log = logging.getLogger(__name__)

__all__ = [
    "DTYPE_BYTES",
    "LIMITS",
    "MAX_ALIAS_EXPANSION",
    "MAX_DOCUMENT_BYTES",
    "Bandwidth",
    "Cluster",
    "Instance",
    "Job",
    "LayerKind",
    "LayerProfile",
    "LINK_KINDS",
    "Link",
    "LinkKind",
    "ModelProfile",
    "Precision",
    "TimingEntry",
    "Topology",
    "TpMemory",
    "bandwidth_from_dict",
    "bandwidth_to_dict",
    "instance_from_dict",
    "job_from_dict",
    "gpu_spec_from_dict",
    "gpu_table",
    "link_to_dict",
    "load_document",
    "read_text",
    "short_repr",
    "model_profile_from_dict",
    "model_profile_to_dict",
    "topology_from_dict",
    "topology_to_dict",
]

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
TrainDtype = Literal["fp32", "bf16", "fp16"]
LayerKind = Literal["embedding", "block", "head"]
Optimizer = Literal["adam", "sgd"]

DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
GB = 1e9
GIB = 2.0**30

LIMITS: Mapping[str, float] = MappingProxyType({
    # job
    "global_batch": 2**20,  # sequences per iteration; published LLM runs use <= ~16k
    "seq_len": 2**20,  # tokens per sequence
    "workspace_gb": 10_000.0,
    # model (a profile's layer list and the analytic generator's shape)
    "layers": 4096,  # layers of a profile / blocks of the analytic generator (GPT-3: 96, LLaMA-3 405B: 126)
    "hidden": 2**18,
    "heads": 4096,
    "vocab": 2**22,
    "ffn": 2**20,
    "timings": 10_000,  # (gpu, tp, mbs) entries of a profile
    "tp": 1024,
    "mbs": 2**16,
    "layer_seconds": 1e6,  # one layer's forward/backward/update time per microbatch
    "layer_params": 1e13,
    "layer_bytes": 1e15,
    # topology
    "nodes": 100_000,  # per cluster
    "gpus_per_node": 1024,
    "gpu_memory_gb": 10_000.0,  # 10 TB per GPU (H200: 141 GB)
    "memory_bandwidth_gbyte_s": 100_000.0,
    "gbyte_s": 100_000.0,  # any link, 100 TB/s (NVLink 5: 1.8 TB/s)
    "gbit_s": 800_000.0,
    "latency_ms": 100_000.0,  # 100 s one way
    "cost_per_gpu_hour": 1e6,
    "gpu_tflops": 1e6,  # a declared GPU's peak (B200 dense FP8: 4.5e3)
})
"""Sane upper bounds of the input fields, far above any real system and far below what would make the
planner run out of memory or time. A value above its bound is refused with a SpecError naming the field
(docs/instance-format.md lists them)."""

MAX_DOCUMENT_BYTES = 256 * 2**20
"""Largest YAML/JSON file :func:`load_document` reads."""
MAX_ALIAS_EXPANSION = 1_000_000
"""Most YAML nodes that aliases (``*name``) may add when a document is expanded: the guard against
"billion laughs" documents, which PyYAML would build as shared references that explode when walked."""

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def short_repr(value: Any) -> str:
    """``repr`` bounded in size and time (nested or shared structures are elided with ``...``)."""
    return _SHORT.repr(value)


# --------------------------------------------------------------------------------------------
# Model profile
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class LayerProfile:
    """One layer of the model, sizes for one sample (one sequence) at tensor-parallel degree 1."""

    name: str
    kind: LayerKind
    params: float
    """Number of parameters of the layer."""
    activation_bytes: float
    """Bytes of the layer's output per sample (what a stage ending here sends to the next)."""
    act_mem_bytes: float
    """Activation bytes per sample kept for the backward pass."""
    flops: float | None = None
    """Forward matmul FLOPs per sample (one sequence) at tp 1; None when unknown (hfrunner)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimingEntry:
    """Measured (or generated) seconds per microbatch for every layer on one (GPU type, tp, mbs)."""

    gpu: str
    tp: int
    mbs: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    update: tuple[float, ...]
    """Optimizer-step seconds per layer (independent of mbs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TpMemory:
    """Optional per-tp sizes per GPU (one tp shard) that override ``tp=1 value / tp``."""

    tp: int
    params: tuple[float, ...]
    act_mem_bytes: tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """Per-layer costs of one model on one or more GPU types."""

    name: str
    dtype: TrainDtype
    """Precision the timings were measured in; the job must train in the same precision."""
    seq_len: int
    layers: tuple[LayerProfile, ...]
    timings: tuple[TimingEntry, ...]
    tp_memory: tuple[TpMemory, ...] = ()
    optimizer_bytes_per_param: float | None = None
    """Optimizer state + master weights per parameter; ``None``: derived from the job (see cost model)."""
    source: str = ""
    """Where the figures come from (citation)."""
    hf_config: str = ""
    """The Hugging Face ``config.json`` the profile was built from, as compact JSON (``""``: none);
    the export hands it to the runner, which builds that architecture (:mod:`hgopt.profiles.hf`)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted({t.gpu for t in self.timings}))

    def tps(self, gpu: str) -> tuple[int, ...]:
        return tuple(sorted({t.tp for t in self.timings if t.gpu == gpu}))

    def mbss(self, gpu: str, tp: int) -> tuple[int, ...]:
        return tuple(sorted(t.mbs for t in self.timings if t.gpu == gpu and t.tp == tp))

    def total_params(self) -> float:
        return float(sum(layer.params for layer in self.layers))


# --------------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Bandwidth:
    """A link's bandwidth and latency.

    Constant (``curve is None``): ``gbyte_s`` GB/s for any message. Curve (Sailor's fit): the achieved
    GB/s for a message of x bytes is ``c0·u² + c1·u + c2`` with ``u = log2(x / 1e6)``, with u clamped
    to [-10, 14] (1 kB .. 16 GB) and the result clamped to [1 % of ``gbyte_s``, ``gbyte_s``].
    """

    gbyte_s: float
    latency_s: float = 0.0
    curve: tuple[float, float, float] | None = None

    def scaled(self, factor: float) -> Bandwidth:
        """The same link with ``factor`` times the bandwidth (curve scaled too)."""
        curve = None if self.curve is None else tuple(c * factor for c in self.curve)
        return Bandwidth(gbyte_s=self.gbyte_s * factor, latency_s=self.latency_s, curve=curve)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """GPUs of one type in one region, ``nodes`` × ``gpus_per_node``."""

    name: str
    region: str
    gpu: str
    gpu_memory_bytes: float
    nodes: int
    gpus_per_node: int
    intra_node: Bandwidth
    inter_node: Bandwidth
    cost_per_gpu_hour: float | None = None
    memory_bandwidth_gbyte_s: float = 900.0
    """GPU memory (HBM/GDDR) bandwidth; prices the (de)quantisation of compressed link traffic.
    Default 900 GB/s (V100-class) when a topology does not say."""
    defaults: tuple[str, ...] = field(default=(), compare=False)
    """Fields the file left out and the GPU table (or the instance's ``gpus:``) filled in."""

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


LinkKind = Literal["per_flow", "shared_pipe"]
LINK_KINDS: tuple[str, ...] = get_args(LinkKind)


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One direction ``src -> dst`` between two clusters [C1].

    ``bandwidth`` is PER FLOW: what one node of ``src`` sending to one node of ``dst`` achieves (a
    VM-pair measurement such as Sailor's fits). ``aggregate`` is the capacity of that direction shared
    by all concurrent flows (a leased line, a region pair's cap): n concurrent flows move at most
    ``min(n · per_flow, aggregate)`` together; ``None``: no shared pipe, flows are limited only by the
    per-flow figure and the nodes' NICs (``Cluster.inter_node``). Kind ``shared_pipe`` (every legacy
    file) is one pipe for the whole direction: ``aggregate == bandwidth``."""

    src: str
    dst: str
    bandwidth: Bandwidth
    """Per flow (one node of src to one node of dst)."""
    aggregate: Bandwidth | None = None
    """Per-direction capacity shared by every flow src -> dst; None: per-node NICs only."""
    kind: LinkKind = "per_flow"
    source: str = ""
    """Where the figures come from (citation)."""
    egress_usd_per_gb: float | None = None
    """Provider's egress price for traffic src -> dst, when known."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    clusters: tuple[Cluster, ...]
    links: tuple[Link, ...]
    """One entry per ordered pair of distinct clusters."""
    _index: dict[object, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Clusters by name and links by (src, dst), the first of each (lookups in O(1): 64 clusters have
    4,032 links, and the planners look links up millions of times)."""

    def __post_init__(self) -> None:
        for c in self.clusters:
            self._index.setdefault(c.name, c)
        for link in self.links:
            self._index.setdefault((link.src, link.dst), link)

    def cluster(self, name: str) -> Cluster:
        c = self._index.get(name)
        if isinstance(c, Cluster):
            return c
        raise KeyError(name)

    def cluster_index(self, name: str) -> int:
        for i, c in enumerate(self.clusters):
            if c.name == name:
                return i
        raise KeyError(name)

    def link(self, src: str, dst: str) -> Bandwidth:
        """The PER-FLOW bandwidth of ``src -> dst`` (see :class:`Link`)."""
        return self.link_spec(src, dst).bandwidth

    def link_spec(self, src: str, dst: str) -> Link:
        """The whole link ``src -> dst``: per-flow bandwidth, aggregate cap, kind, source."""
        link = self._index.get((src, dst))
        if isinstance(link, Link):
            return link
        raise KeyError((src, dst))

    def num_gpus(self) -> int:
        return sum(c.num_gpus for c in self.clusters)


# --------------------------------------------------------------------------------------------
# Job and instance
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    global_batch: int
    """Sequences per iteration."""
    seq_len: int
    precision: TrainDtype
    optimizer: Optimizer = "adam"
    workspace_bytes: float = 1.0 * GIB
    """Per-GPU memory kept for the framework, kernels' workspace and fragmentation."""
    recompute: Literal["auto", "off"] = "auto"
    """Activation recomputation (hfrec): ``auto`` lets the planners run a stage with ``recompute: full``
    where that makes a better plan (memory binds); ``off`` never (plans without recomputation only)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Instance:
    name: str
    model: ModelProfile
    topology: Topology
    job: Job
    description: str = ""
    source: str = field(default="<inline>", compare=False)


# --------------------------------------------------------------------------------------------
# Reading: a small cursor that knows where it is, so every error names its field
# --------------------------------------------------------------------------------------------
class _At:
    def __init__(self, source: str, path: str, value: Any) -> None:
        self.source, self.path, self.value = source, path, value

    def fail(self, problem: str) -> SpecError:
        return SpecError(self.source, self.path or "<top>", problem)

    def _child(self, key: str | int, value: Any) -> _At:
        sub = f"{self.path}[{key}]" if isinstance(key, int) else (f"{self.path}.{key}" if self.path else key)
        return _At(self.source, sub, value)

    def mapping(self) -> Mapping[str, Any]:
        if not isinstance(self.value, Mapping):
            raise self.fail(f"expected a mapping, got {type(self.value).__name__}")
        return self.value

    def has(self, key: str) -> bool:
        return key in self.mapping()

    def get(self, key: str) -> _At:
        m = self.mapping()
        if key not in m:
            raise self._child(key, None).fail("is required but missing")
        return self._child(key, m[key])

    def opt(self, key: str) -> _At | None:
        m = self.mapping()
        return self._child(key, m[key]) if key in m and m[key] is not None else None

    def items(self) -> list[_At]:
        if not isinstance(self.value, list):
            raise self.fail(f"expected a list, got {type(self.value).__name__}")
        return [self._child(i, v) for i, v in enumerate(self.value)]

    def only(self, allowed: set[str]) -> None:
        unknown = sorted((set(self.mapping()) - allowed), key=str)
        if unknown:
            raise self._child(unknown[0], None).fail(
                f"unknown field (allowed: {', '.join(sorted(allowed))})"
            )

    def string(self) -> str:
        if not isinstance(self.value, str) or not self.value:
            raise self.fail(f"expected a non-empty string, got {short_repr(self.value)}")
        return self.value

    def number(self, *, minimum: float | None = None, positive: bool = False, maximum: float | None = None) -> float:
        v = self.value
        if isinstance(v, str):  # PyYAML reads 1.0e6 (no sign in the exponent) as a string
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 1e300:  # float(v) would overflow
            raise self.fail(f"expected a finite number of sane size, got {short_repr(v)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise self.fail(f"expected a finite number, got {short_repr(v)}")
        if positive and v <= 0:
            raise self.fail(f"must be > 0, got {v!r}")
        if minimum is not None and v < minimum:
            raise self.fail(f"must be >= {minimum}, got {v!r}")
        if maximum is not None and v > maximum:
            raise self.fail(f"must be <= {maximum:g} (a sane limit, see docs/instance-format.md), got {v:g}")
        return float(v)

    def integer(self, *, minimum: int = 1, maximum: float | None = None) -> int:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and math.isfinite(v) and v.is_integer():
                v = int(v)
            else:
                raise self.fail(f"expected an integer, got {short_repr(v)}")
        if v < minimum:
            raise self.fail(f"must be >= {minimum}, got {short_repr(v)}")
        if maximum is not None and v > maximum:
            raise self.fail(f"must be <= {int(maximum)} (a sane limit, see docs/instance-format.md), got {short_repr(v)}")
        return int(v)

    def limited(self, key: str, *, minimum: int = 1) -> int:
        """An integer bounded by ``LIMITS[key]``."""
        return self.integer(minimum=minimum, maximum=LIMITS[key])

    def choice(self, options: tuple[str, ...]) -> str:
        v = self.value
        if isinstance(v, (list, dict)) or v not in options:
            raise self.fail(f"must be one of {', '.join(options)}, got {short_repr(v)}")
        return str(v)

    def numbers(self, length: int | None = None, *, minimum: float = 0.0, maximum: float | None = None) -> tuple[float, ...]:
        items = self.items()
        if length is not None and len(items) != length:
            raise self.fail(f"expected {length} values, got {len(items)}")
        out = tuple(item.number(minimum=minimum, maximum=maximum) for item in items)
        if length is not None and len(out) != length:
            raise self.fail(f"expected {length} values, got {len(out)}")
        return out


def read_text(path: str | Path) -> str:
    """The UTF-8 text of a file; a missing, unreadable, oversized or non-UTF-8 file is a SpecError
    naming it."""
    p = Path(path)
    try:
        if p.is_dir():
            raise SpecError(str(p), "<file>", "is a folder, expected a file")
        size = p.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise SpecError(str(p), "<file>", f"is {size} bytes, larger than the {MAX_DOCUMENT_BYTES} bytes an input may have")
        data = p.read_bytes()
    except OSError as exc:
        raise SpecError(str(p), "<file>", f"cannot read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SpecError(str(p), "<file>", f"is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}, "
                                          f"line {line})") from None


def load_document(path: str | Path) -> Any:
    """Read a YAML or JSON file; a syntax error becomes a SpecError naming the file. YAML aliases may
    add at most :data:`MAX_ALIAS_EXPANSION` nodes (refused otherwise, naming the field that holds them)."""
    p = Path(path)
    text = read_text(p)
    kind = "JSON" if p.suffix.lower() == ".json" else "YAML"
    try:
        if kind == "JSON":
            return json.loads(text)
        return _load_yaml(text, str(p))
    except SpecError:
        raise
    except Exception as exc:  # yaml/json syntax errors of every kind (and RecursionError of deep nesting)
        raise SpecError(str(p), "<file>", f"not valid {kind}: {exc}") from None


def _load_yaml(text: str, source: str) -> Any:
    import yaml

    loader_cls = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_alias_expansion(node, source)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_alias_expansion(root: Any, source: str) -> None:
    """Refuse a YAML node graph whose aliases expand to more than MAX_ALIAS_EXPANSION extra nodes, or
    that refers to itself. Linear in the number of distinct nodes (sizes are memoised)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in _children(node))
            continue
        if key in size:
            continue
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise SpecError(source, _big_field(root, size, 0) or "<file>", "a YAML alias refers to itself (recursive document)")
            if id(child) not in size:
                stack.append((child, False))
    expanded, distinct = size[id(root)], len(size)
    if expanded - distinct > MAX_ALIAS_EXPANSION:
        raise SpecError(source, _big_field(root, size, MAX_ALIAS_EXPANSION) or "<file>",
                        f"YAML aliases expand to {expanded:.3g} nodes from {distinct} written ones (at most "
                        f"{MAX_ALIAS_EXPANSION} more are allowed): refusing an alias bomb")


def _big_field(root: Any, size: dict[int, int], limit: int) -> str:
    """The dotted path of the deepest mapping entry (or mapping in a list) whose expansion exceeds ``limit``."""
    import yaml

    path, node = "", root
    for _ in range(64):
        best: tuple[str, Any] | None = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                label = str(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                if size.get(id(v), limit + 1) > limit and (best is None or size.get(id(v), 0) > size.get(id(best[1]), 0)):
                    best = (f"{path}.{label}" if path else label, v)
        elif isinstance(node, yaml.SequenceNode) and path:
            for i, v in enumerate(node.value):
                if isinstance(v, yaml.MappingNode) and size.get(id(v), limit + 1) > limit:
                    best = (f"{path}[{i}]", v)
                    break
        if best is None:
            break
        path, node = best
    return path


# --------------------------------------------------------------------------------------------
# Model profile <-> dict
# --------------------------------------------------------------------------------------------
def model_profile_from_dict(data: Any, source: str = "<inline>", path: str = "") -> ModelProfile:
    """Validate and build a :class:`ModelProfile` from its JSON/YAML form."""
    at = _At(source, path, data)
    at.only({"name", "dtype", "seq_len", "layers", "timings", "tp_memory", "optimizer_bytes_per_param", "source", "version",
             "hf_config"})
    name = at.get("name").string()
    dtype = at.get("dtype").choice(get_args(TrainDtype))
    seq_len = at.get("seq_len").limited("seq_len")
    layer_items = at.get("layers").items()
    if len(layer_items) > LIMITS["layers"]:
        raise at.get("layers").fail(f"lists {len(layer_items)} layers, more than the sane limit of {int(LIMITS['layers'])}")
    layers = tuple(_layer(item) for item in layer_items)
    if not layers:
        raise at.get("layers").fail("must list at least one layer")
    n = len(layers)
    timing_items = at.get("timings").items()
    if len(timing_items) > LIMITS["timings"]:
        raise at.get("timings").fail(f"lists {len(timing_items)} entries, more than the sane limit of {int(LIMITS['timings'])}")
    timings = tuple(_timing(item, layers) for item in timing_items)
    if not timings:
        raise at.get("timings").fail("must hold at least one (gpu, tp, mbs) entry")
    seen: set[tuple[str, int, int]] = set()
    for item, t in zip(at.get("timings").items(), timings):
        key = (t.gpu, t.tp, t.mbs)
        if key in seen:
            raise item.fail(f"duplicate entry for gpu={t.gpu} tp={t.tp} mbs={t.mbs}")
        seen.add(key)
    tp_memory: tuple[TpMemory, ...] = ()
    if (tm := at.opt("tp_memory")) is not None:
        tp_memory = tuple(
            TpMemory(
                tp=item.get("tp").limited("tp"),
                params=item.get("params").numbers(n, maximum=LIMITS["layer_params"]),
                act_mem_bytes=item.get("act_mem_bytes").numbers(n, maximum=LIMITS["layer_bytes"]),
            )
            for item in tm.items()
        )
    opt_bytes = None
    if (ob := at.opt("optimizer_bytes_per_param")) is not None:
        opt_bytes = ob.number(minimum=0.0, maximum=1e3)
    src = at.opt("source")
    return ModelProfile(
        name=name,
        dtype=dtype,  # type: ignore[arg-type]
        seq_len=seq_len,
        layers=layers,
        timings=timings,
        tp_memory=tp_memory,
        optimizer_bytes_per_param=opt_bytes,
        source=src.string() if src and src.value != "" else "",
        hf_config=_hf_config(at.opt("hf_config")),
    )


def _hf_config(at: _At | None) -> str:
    """An embedded Hugging Face config (an object) as compact JSON (hfrunner)."""
    if at is None:
        return ""
    return json.dumps(dict(at.mapping()), sort_keys=True, separators=(",", ":"))


def _layer(at: _At) -> LayerProfile:
    at.only({"name", "kind", "params", "activation_bytes", "act_mem_bytes", "flops"})
    fl = at.opt("flops")
    return LayerProfile(
        flops=fl.number(minimum=0.0) if fl is not None else None,
        name=at.get("name").string(),
        kind=at.get("kind").choice(get_args(LayerKind)),  # type: ignore[arg-type]
        params=at.get("params").number(minimum=0.0, maximum=LIMITS["layer_params"]),
        activation_bytes=at.get("activation_bytes").number(positive=True, maximum=LIMITS["layer_bytes"]),
        act_mem_bytes=at.get("act_mem_bytes").number(minimum=0.0, maximum=LIMITS["layer_bytes"]),
    )


def _timing(at: _At, layers: tuple[LayerProfile, ...]) -> TimingEntry:
    at.only({"gpu", "tp", "mbs", "fwd", "bwd", "update"})
    n, top = len(layers), LIMITS["layer_seconds"]
    entry = TimingEntry(
        gpu=at.get("gpu").string(),
        tp=at.get("tp").limited("tp"),
        mbs=at.get("mbs").limited("mbs"),
        fwd=at.get("fwd").numbers(n, maximum=top),
        bwd=at.get("bwd").numbers(n, maximum=top),
        update=at.get("update").numbers(n, maximum=top),
    )
    for i, (f, b) in enumerate(zip(entry.fwd, entry.bwd)):
        if f + b <= 0:
            raise at.get("fwd").fail(
                f"layer {i} ({layers[i].name}) has zero forward and backward time: every layer must take some time"
            )
    return entry


def model_profile_to_dict(p: ModelProfile) -> dict[str, Any]:
    out: dict[str, Any] = {
        "version": 1,
        "name": p.name,
        "dtype": p.dtype,
        "seq_len": p.seq_len,
        "source": p.source,
        "layers": [
            {
                "name": layer.name,
                "kind": layer.kind,
                "params": layer.params,
                "activation_bytes": layer.activation_bytes,
                "act_mem_bytes": layer.act_mem_bytes,
                **({"flops": layer.flops} if layer.flops is not None else {}),
            }
            for layer in p.layers
        ],
        "timings": [
            {"gpu": t.gpu, "tp": t.tp, "mbs": t.mbs, "fwd": list(t.fwd), "bwd": list(t.bwd), "update": list(t.update)}
            for t in p.timings
        ],
    }
    if p.tp_memory:
        out["tp_memory"] = [
            {"tp": m.tp, "params": list(m.params), "act_mem_bytes": list(m.act_mem_bytes)} for m in p.tp_memory
        ]
    if p.optimizer_bytes_per_param is not None:
        out["optimizer_bytes_per_param"] = p.optimizer_bytes_per_param
    if p.hf_config:
        out["hf_config"] = json.loads(p.hf_config)
    return out


# --------------------------------------------------------------------------------------------
# Topology <-> dict
# --------------------------------------------------------------------------------------------
_BW_KEYS = {"gbit_s", "gbyte_s", "curve", "max_gbyte_s", "latency_ms"}


def bandwidth_from_dict(at_or_data: Any, source: str = "<inline>", path: str = "") -> Bandwidth:
    """``{gbit_s: 10, latency_ms: 40}``, ``{gbyte_s: 2.4}`` or ``{curve: [c0,c1,c2], max_gbyte_s: 2.5}``."""
    at = at_or_data if isinstance(at_or_data, _At) else _At(source, path, at_or_data)
    at.only(_BW_KEYS)
    given = [k for k in ("gbit_s", "gbyte_s", "curve") if at.has(k)]
    if len(given) != 1:
        raise at.fail("give exactly one of gbit_s, gbyte_s or curve (+ max_gbyte_s)")
    latency = at.opt("latency_ms")
    latency_s = latency.number(minimum=0.0, maximum=LIMITS["latency_ms"]) / 1e3 if latency else 0.0
    if given[0] == "curve":
        curve = at.get("curve").numbers(3, minimum=-math.inf)
        top = at.get("max_gbyte_s").number(positive=True, maximum=LIMITS["gbyte_s"])
        return Bandwidth(gbyte_s=top, latency_s=latency_s, curve=curve)  # type: ignore[arg-type]
    if at.has("max_gbyte_s"):
        raise at.get("max_gbyte_s").fail("only allowed together with curve")
    if given[0] == "gbit_s":
        return Bandwidth(gbyte_s=at.get("gbit_s").number(positive=True, maximum=LIMITS["gbit_s"]) / 8.0, latency_s=latency_s)
    return Bandwidth(gbyte_s=at.get("gbyte_s").number(positive=True, maximum=LIMITS["gbyte_s"]), latency_s=latency_s)


def bandwidth_to_dict(b: Bandwidth) -> dict[str, Any]:
    out: dict[str, Any] = {"latency_ms": b.latency_s * 1e3}
    if b.curve is None:
        out["gbyte_s"] = b.gbyte_s
    else:
        out["curve"] = list(b.curve)
        out["max_gbyte_s"] = b.gbyte_s
    return out


_CLUSTER_KEYS = {
    "name", "region", "gpu", "gpu_memory_gb", "nodes", "gpus_per_node", "intra_node", "inter_node",
    "cost_per_gpu_hour", "memory_bandwidth_gbyte_s",
}


def _gpu_defaults(at: _At, gpus: Mapping[str, Any] | None) -> dict[str, Any]:
    """The cluster fields left out of ``at`` that the entry of its GPU type supplies: ``gpu_memory_gb``
    (the datasheet memory), ``intra_node`` (achievable one-direction NVLink/PCIe GB/s) and
    ``inter_node`` (the assumed node NIC); see :mod:`hgopt.profiles.gpus`. Empty for an unknown GPU."""
    from hgopt.profiles.gpus import DEFAULT_LINK_LATENCY_MS, GPUS

    m = at.mapping()
    if not isinstance(m.get("gpu"), str):
        return {}
    spec = (gpus if gpus is not None else GPUS).get(m["gpu"])
    if spec is None:
        return {}
    filled = {
        "gpu_memory_gb": spec.memory_gb,
        "intra_node": {"gbyte_s": spec.intra_node_gbyte_s, "latency_ms": DEFAULT_LINK_LATENCY_MS},
        "inter_node": {"gbit_s": spec.node_network_gbit_s, "latency_ms": DEFAULT_LINK_LATENCY_MS},
    }
    return {k: v for k, v in filled.items() if m.get(k) is None}


def _cluster(at: _At, gpus: Mapping[str, Any] | None = None) -> Cluster:
    at.only(_CLUSTER_KEYS)
    filled = _gpu_defaults(at, gpus)
    if filled:
        at = _At(at.source, at.path, {**at.mapping(), **filled})
    cost = at.opt("cost_per_gpu_hour")
    return Cluster(
        name=at.get("name").string(),
        region=at.get("region").string(),
        gpu=at.get("gpu").string(),
        gpu_memory_bytes=at.get("gpu_memory_gb").number(positive=True, maximum=LIMITS["gpu_memory_gb"]) * GB,
        nodes=at.get("nodes").limited("nodes"),
        gpus_per_node=at.get("gpus_per_node").limited("gpus_per_node"),
        intra_node=bandwidth_from_dict(at.get("intra_node")),
        inter_node=bandwidth_from_dict(at.get("inter_node")),
        defaults=tuple(filled),
        cost_per_gpu_hour=cost.number(minimum=0.0, maximum=LIMITS["cost_per_gpu_hour"]) if cost else None,
        memory_bandwidth_gbyte_s=mbw.number(positive=True, maximum=LIMITS["memory_bandwidth_gbyte_s"])
        if (mbw := at.opt("memory_bandwidth_gbyte_s")) else 900.0,
    )


_LINK_KEYS = {"kind", "per_flow", "aggregate", "source", "egress_usd_per_gb"}
_PIPE_NOTE = ("gives a bandwidth without `kind`: read as the legacy meaning, ONE SHARED PIPE per direction "
              "(per-flow bandwidth = aggregate cap = that figure, every flow between the two clusters shares "
              "it); write `kind: per_flow` with `per_flow:` (and optional `aggregate:`) to state per-flow links")


def _link_body(at: _At, src: str, dst: str, note: bool = False) -> Link:
    """One link body (of a pair, ``default`` or ``same_region``) -> :class:`Link` ``src -> dst``.

    ``{kind: per_flow, per_flow: {gbit_s|gbyte_s|curve.., latency_ms}, aggregate: {gbit_s|gbyte_s}}``:
    per-flow bandwidth (one node to one node) and optional per-direction cap shared by all flows.
    ``{kind: shared_pipe, gbit_s: .., latency_ms: ..}``: one pipe per direction. A body with bandwidth
    keys and no ``kind`` (every file written before the link model had kinds) is a shared pipe; a note
    is logged naming the file and field."""
    m = at.mapping()
    at.only(_LINK_KEYS | _BW_KEYS)
    kind_at = at.opt("kind")
    kind = kind_at.choice(LINK_KINDS) if kind_at else ("per_flow" if "per_flow" in m else "shared_pipe")
    bw_keys = sorted(k for k in m if k in _BW_KEYS)
    source = at.opt("source")
    src_text = source.string() if source else ""
    egress = at.opt("egress_usd_per_gb")
    price = egress.number(minimum=0.0) if egress else None
    if kind == "per_flow":
        if bw_keys:
            raise at.get(bw_keys[0]).fail("a per_flow link gives its bandwidth under `per_flow:` (per flow) "
                                          "and an optional cap under `aggregate:`")
        per_flow = bandwidth_from_dict(at.get("per_flow"))
        aggregate = None
        if (agg := at.opt("aggregate")) is not None:
            agg.only({"gbit_s", "gbyte_s"})
            given = [k for k in ("gbit_s", "gbyte_s") if agg.has(k)]
            if len(given) != 1:
                raise agg.fail("give exactly one of gbit_s or gbyte_s (the cap per direction shared by all flows; "
                               "latency belongs to per_flow)")
            value = agg.get(given[0]).number(positive=True, maximum=LIMITS[given[0]])
            aggregate = Bandwidth(gbyte_s=value / 8.0 if given[0] == "gbit_s" else value)
        return Link(src=src, dst=dst, bandwidth=per_flow, aggregate=aggregate, kind="per_flow",
                    source=src_text, egress_usd_per_gb=price)
    for key in ("per_flow", "aggregate"):
        if key in m:
            raise at.get(key).fail("only with kind: per_flow (a shared_pipe gives one bandwidth: gbit_s, gbyte_s or curve)")
    if not bw_keys:
        raise at.fail("give a bandwidth: `kind: per_flow` with `per_flow: {gbit_s: .., latency_ms: ..}`, "
                      "or a shared pipe's gbit_s / gbyte_s / curve")
    pipe = bandwidth_from_dict(_At(at.source, at.path, {k: v for k, v in m.items() if k in _BW_KEYS}))
    if kind_at is None and note:
        log.info("%s: %s %s", at.source, at.path or "<top>", _PIPE_NOTE)
    return Link(src=src, dst=dst, bandwidth=pipe, aggregate=pipe, kind="shared_pipe", source=src_text,
                egress_usd_per_gb=price)


def _nic_link(a: Cluster, b: Cluster) -> Link:
    """Default between two clusters of one region (zone): per flow at the slower node NIC, no shared pipe."""
    nic = min((a.inter_node, b.inter_node), key=lambda bw: bw.gbyte_s)
    return Link(src=a.name, dst=b.name, bandwidth=nic, aggregate=None, kind="per_flow",
                source=f"default for clusters in one region ({a.region}): the slower node NIC (inter_node), "
                       "no shared pipe")


def topology_from_dict(data: Any, source: str = "<inline>", path: str = "", gpus: Mapping[str, Any] | None = None) -> Topology:
    """Clusters plus links. ``links`` holds ``pairs`` (symmetric unless ``directed: true``) and
    optional ``same_region`` / ``default`` link bodies for the pairs not listed (see :func:`_link_body`
    for a body). A pair of clusters in one region with no entry defaults to per-flow links at the
    slower node NIC with no shared pipe."""
    at = _At(source, path, data)
    at.only({"clusters", "links"})
    items = at.get("clusters").items()
    if not items:
        raise at.get("clusters").fail("must list at least one cluster")
    clusters = tuple(_cluster(item, gpus) for item in items)  # gpus: the GPU table for defaults (cli-input)
    names = [c.name for c in clusters]
    for i, (item, c) in enumerate(zip(items, clusters)):
        if c.name in names[:i]:
            raise item.get("name").fail(f"duplicate cluster name {c.name!r} (also clusters[{names.index(c.name)}])")
    explicit: dict[tuple[str, str], _At] = {}
    same_region: _At | None = None
    default: _At | None = None
    if (links := at.opt("links")) is not None:
        links.only({"pairs", "same_region", "default"})
        same_region = links.opt("same_region")
        default = links.opt("default")
        for body in (same_region, default):
            if body is not None:
                _link_body(body, names[0], names[0], note=True)  # validate even when no pair uses it
        pairs = links.opt("pairs")
        for item in pairs.items() if pairs else []:
            src = item.get("src").string()
            dst = item.get("dst").string()
            for end, key in ((src, "src"), (dst, "dst")):
                if end not in names:
                    raise item.get(key).fail(f"unknown cluster {end!r} (clusters: {', '.join(names)})")
            if src == dst:
                raise item.get("dst").fail("a link joins two different clusters")
            directed = item.opt("directed")
            body = _At(item.source, item.path, {k: v for k, v in item.mapping().items() if k not in {"src", "dst", "directed"}})
            _link_body(body, src, dst, note=True)  # validate here, so errors name this pair
            explicit[(src, dst)] = body
            if not (directed and directed.value is True):
                explicit.setdefault((dst, src), body)
    out: list[Link] = []
    by_name = {c.name: c for c in clusters}
    for a in names:
        for b in names:
            if a == b:
                continue
            body = explicit.get((a, b))
            same = by_name[a].region == by_name[b].region
            if body is None and same:
                body = same_region
            if body is None and not same:
                body = default
            if body is None and same:
                out.append(_nic_link(by_name[a], by_name[b]))
                continue
            if body is None:
                raise SpecError(source, f"{path + '.' if path else ''}links", f"no bandwidth for link {a} -> {b}: list the pair or give links.default")
            out.append(_link_body(body, a, b))
    return Topology(clusters=clusters, links=tuple(out))


def link_to_dict(link: Link) -> dict[str, Any]:
    """A link body in the current format (explicit ``kind``)."""
    out: dict[str, Any] = {"kind": link.kind}
    if link.kind == "shared_pipe":
        out.update(bandwidth_to_dict(link.bandwidth))
    else:
        out["per_flow"] = bandwidth_to_dict(link.bandwidth)
        if link.aggregate is not None:
            out["aggregate"] = {"gbyte_s": link.aggregate.gbyte_s}
    if link.source:
        out["source"] = link.source
    if link.egress_usd_per_gb is not None:
        out["egress_usd_per_gb"] = link.egress_usd_per_gb
    return out


def topology_to_dict(t: Topology) -> dict[str, Any]:
    return {
        "clusters": [
            {
                "name": c.name,
                "region": c.region,
                "gpu": c.gpu,
                "gpu_memory_gb": c.gpu_memory_bytes / GB,
                "nodes": c.nodes,
                "gpus_per_node": c.gpus_per_node,
                "intra_node": bandwidth_to_dict(c.intra_node),
                "inter_node": bandwidth_to_dict(c.inter_node),
                **({"cost_per_gpu_hour": c.cost_per_gpu_hour} if c.cost_per_gpu_hour is not None else {}),
                "memory_bandwidth_gbyte_s": c.memory_bandwidth_gbyte_s,
            }
            for c in t.clusters
        ],
        "links": {
            "pairs": [{"src": link.src, "dst": link.dst, "directed": True, **link_to_dict(link)} for link in t.links]
        },
    }


# --------------------------------------------------------------------------------------------
# Job and instance
# --------------------------------------------------------------------------------------------
def job_from_dict(data: Any, source: str = "<inline>", path: str = "") -> Job:
    at = _At(source, path, data)
    at.only({"global_batch", "seq_len", "precision", "optimizer", "workspace_gb", "recompute"})
    ws = at.opt("workspace_gb")
    opt = at.opt("optimizer")
    rc = at.opt("recompute")
    return Job(
        global_batch=at.get("global_batch").limited("global_batch"),
        seq_len=at.get("seq_len").limited("seq_len"),
        precision=at.get("precision").choice(get_args(TrainDtype)),  # type: ignore[arg-type]
        optimizer=opt.choice(get_args(Optimizer)) if opt else "adam",  # type: ignore[arg-type]
        workspace_bytes=ws.number(minimum=0.0, maximum=LIMITS["workspace_gb"]) * GB if ws else 1.0 * GIB,
        recompute=_recompute_choice(rc),
    )


def _recompute_choice(at: _At | None) -> Literal["auto", "off"]:
    """``job.recompute``: auto or off (YAML reads a bare ``off`` as false, ``on`` as true: both taken)."""
    if at is None:
        return "auto"
    if isinstance(at.value, bool):
        return "auto" if at.value else "off"
    return "off" if at.choice(("auto", "off")) == "off" else "auto"


def instance_from_dict(data: Any, source: str = "<inline>", base_dir: Path | None = None) -> Instance:
    """Build an instance; ``model``/``topology``/``job`` are inline mappings or paths to files
    (relative to ``base_dir``). A ``model`` mapping with a ``generator`` key is built by
    :func:`hgopt.profiles.generate` (analytic or importer) instead of being read literally."""
    at = _At(source, "", data)
    at.only({"name", "description", "gpus", "model", "topology", "job"})
    name = at.get("name").string()
    desc = at.opt("description")
    gpus = gpu_table(at.opt("gpus"))
    model = _part(at.get("model"), base_dir, lambda d, src, path: _model_part(d, src, path, gpus))
    topology = _part(at.get("topology"), base_dir, lambda d, src, path: topology_from_dict(d, src, path, gpus))
    job = _part(at.get("job"), base_dir, job_from_dict)
    inst = Instance(
        name=name,
        model=model,
        topology=topology,
        job=job,
        description=desc.string() if desc else "",
        source=source,
    )
    _check_consistency(inst, at)
    return inst


def _model_part(data: Any, source: str, path: str, gpus: Mapping[str, Any] | None = None) -> ModelProfile:
    if isinstance(data, Mapping) and ("generator" in data or isinstance(data.get("hf_config"), str)):
        from hgopt.profiles import generate

        return generate(data, source, path, gpus=gpus)
    return model_profile_from_dict(data, source, path)


_GPU_KEYS = {
    "name", "fp32_tflops", "fp16_tflops", "bf16_tflops", "memory_gb", "memory_gbyte_s", "link_bidir_gbyte_s",
    "link", "efficiency", "memory_efficiency", "node_network_gbit_s", "source",
}


def gpu_spec_from_dict(at_or_data: Any, source: str = "<inline>", path: str = "") -> Any:
    """One GPU of an instance's ``gpus:`` section -> :class:`hgopt.profiles.gpus.GpuSpec`.

    ``{name, fp32_tflops, fp16_tflops, bf16_tflops (omit: no BF16), memory_gb, memory_gbyte_s,
    link_bidir_gbyte_s, link (nvlink | pcie | ...), efficiency, memory_efficiency (default 0.8),
    node_network_gbit_s (default 100), source}``: peaks dense (no sparsity), the two efficiencies are
    the achievable fractions of the peaks the analytic generator assumes; ``source`` cites the figures."""
    from hgopt.profiles.gpus import TFLOPS, GpuSpec

    at = at_or_data if isinstance(at_or_data, _At) else _At(source, path, at_or_data)
    at.only(_GPU_KEYS)
    flops = LIMITS["gpu_tflops"]
    bf16 = at.opt("bf16_tflops")
    mem_eff = at.opt("memory_efficiency")
    nic = at.opt("node_network_gbit_s")
    return GpuSpec(
        name=at.get("name").string(),
        fp32_flops=at.get("fp32_tflops").number(positive=True, maximum=flops) * TFLOPS,
        fp16_flops=at.get("fp16_tflops").number(positive=True, maximum=flops) * TFLOPS,
        bf16_flops=bf16.number(positive=True, maximum=flops) * TFLOPS if bf16 else None,
        memory_gb=at.get("memory_gb").number(positive=True, maximum=LIMITS["gpu_memory_gb"]),
        memory_gbyte_s=at.get("memory_gbyte_s").number(positive=True, maximum=LIMITS["memory_bandwidth_gbyte_s"]),
        link_bidir_gbyte_s=at.get("link_bidir_gbyte_s").number(positive=True, maximum=LIMITS["gbyte_s"]),
        link=at.get("link").string(),
        efficiency=_fraction(at.get("efficiency")),
        memory_efficiency=_fraction(mem_eff) if mem_eff else 0.8,
        node_network_gbit_s=nic.number(positive=True, maximum=LIMITS["gbit_s"]) if nic else 100.0,
        source=at.get("source").string(),
    )


def _fraction(at: _At) -> float:
    v = at.number(positive=True)
    if v > 1:
        raise at.fail(f"is a fraction of the peak, must be in (0, 1], got {v:g}")
    return v


def gpu_table(at: _At | None) -> Mapping[str, Any]:
    """The GPU table of an instance: :data:`hgopt.profiles.gpus.GPUS` plus (overriding) the GPUs its
    ``gpus:`` section declares."""
    from hgopt.profiles.gpus import GPUS

    if at is None:
        return GPUS
    table = dict(GPUS)
    seen: set[str] = set()
    for item in at.items():
        spec = gpu_spec_from_dict(item)
        if spec.name in seen:
            raise item.get("name").fail(f"GPU {spec.name!r} is declared twice")
        seen.add(spec.name)
        table[spec.name] = spec
    return MappingProxyType(table)


def _part(at: _At, base_dir: Path | None, build: Any) -> Any:
    if isinstance(at.value, str):
        p = Path(at.string())
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        if not p.exists():
            raise at.fail(f"file {p} does not exist")
        if p.is_dir():
            raise at.fail(f"{p} is a folder: give the file of the {at.path} (YAML or JSON) or an inline mapping")
        return build(load_document(p), str(p), "")
    if not isinstance(at.value, Mapping):
        raise at.fail(f"expected a file name or a mapping, got {short_repr(at.value)}")
    return build(at.value, at.source, at.path)


def _check_consistency(inst: Instance, at: _At) -> None:
    m, job = inst.model, inst.job
    if job.precision != m.dtype:
        raise at.get("job").fail(
            f"precision {job.precision!r} differs from the model profile's dtype {m.dtype!r} (timings were measured in {m.dtype})"
        )
    if job.seq_len != m.seq_len:
        raise at.get("job").fail(f"seq_len {job.seq_len} differs from the model profile's seq_len {m.seq_len}")
    profiled = set(m.gpu_types())
    for i, c in enumerate(inst.topology.clusters):
        if c.gpu not in profiled:
            raise SpecError(
                at.source,
                f"topology.clusters[{i}].gpu",
                f"GPU type {c.gpu!r} has no timings in model profile {m.name!r} (profiled: {', '.join(sorted(profiled))})",
            )
