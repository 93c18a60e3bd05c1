"""Importer for the measured data published with Sailor (eth-easl/sailor, SOSP'25, MIT licence).

Layout under ``root`` (files of the eth-easl/sailor repository; docs/sources.md states their content):

- ``profiles/<MODEL>/<GPU>/profile.json``: ``{mbs: {tp: {layer: [fwd_s, bwd_s, update_s]}}}``;
- ``llm_info.json``: ``{MODEL: {tp: {layer: {params_floats, act_output_bytes, act_mem_bytes, ...}}}}``,
  fp32 sizes for one sequence;
- ``simulations/configs/training_config_*.json``: sequence length, hidden size, global batch;
- ``simulations/configs/basic_cluster_config.json``: GPUs per VM and memory per GPU type;
- ``providers/multizone_bandwidths.json`` (same GPU type), ``multizone_bandwidths_het.json`` (mixed):
  ``[src_zone][src_gpu][n][dst_zone][dst_gpu][n] = [[c0, c1, c2], max_bytes_per_s]``;
- ``providers/intra_node_bandwidths.json``: ``[gpu][n] = [[c0, c1, c2], max_bytes_per_s]``.

Sailor's fits give GB/s = c0·u² + c1·u + c2 with u = log2(bytes / 1e6); they become
``Bandwidth(curve=(c0, c1, c2), gbyte_s=max/1e9)`` (latency is inside the fit, so 0).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from hgopt.errors import SpecError
from hgopt.spec import Bandwidth, Cluster, LayerProfile, Link, ModelProfile, TimingEntry, Topology, TpMemory

__all__ = [
    "SailorCluster",
    "curve_bandwidth",
    "import_sailor_profile",
    "sailor_cluster_name",
    "sailor_topology",
    "training_config",
]

log = logging.getLogger(__name__)
DEFAULT_SEQ_LEN = 2048
MEMORY_GBYTE_S: Mapping[str, float] = MappingProxyType({
    "A100-40": 1555.0,  # NVIDIA A100 datasheet (40 GB SXM, HBM2)
    "A100-80": 2039.0,  # NVIDIA A100 datasheet (80 GB SXM, HBM2e)
    "V100-16": 900.0,  # NVIDIA V100 datasheet (SXM2)
    "GH-96": 4000.0,  # NVIDIA GH200 Grace Hopper datasheet (96 GB HBM3, 4 TB/s)
    "RTX-2080": 448.0,  # NVIDIA GeForce RTX 2080 specifications
    "RTX-3090": 936.0,  # NVIDIA GeForce RTX 3090 specifications
    "Titan-RTX": 672.0,  # NVIDIA TITAN RTX specifications
})
"""GPU memory bandwidth of Sailor's GPU types (vendor specifications), for
``Cluster.memory_bandwidth_gbyte_s``; Sailor's data does not record it."""
SOURCE = "Sailor (eth-easl/sailor, SOSP'25, MIT licence): measured on Google Cloud"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise SpecError(str(path), "<file>", f"cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SpecError(str(path), "<file>", f"not valid JSON: {exc}") from None


def _keyed(mapping: Any, key: str, source: Path, where: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        have = ", ".join(sorted(mapping)) if isinstance(mapping, dict) else type(mapping).__name__
        raise SpecError(str(source), where, f"no entry {key!r} (present: {have})")
    return mapping[key]


# --------------------------------------------------------------------------------------------
# Model profiles
# --------------------------------------------------------------------------------------------
def training_config(root: Path, model: str) -> dict[str, Any] | None:
    """Sailor's ``training_config_*.json`` whose ``model`` is ``model``, or None."""
    for p in sorted((root / "simulations" / "configs").glob("training_config_*.json")):
        data = _read_json(p)
        if isinstance(data, dict) and data.get("model") == model:
            return data
    return None


def import_sailor_profile(
    root: str | Path, model: str, gpus: Sequence[str] | None = None, *, seq_len: int | None = None
) -> ModelProfile:
    """Sailor's measurements of ``model`` on ``gpus`` (default: every profiled GPU type) as a
    :class:`ModelProfile` (fp32). Layer 0 is the embedding, the last the head, the rest blocks.
    Refuses, with a :class:`SpecError`, a profile whose layer count differs from ``llm_info.json``
    or whose sizes contradict the training configuration. ``seq_len``: for models without a training
    configuration (default 2048)."""
    root = Path(root)
    info_path = root / "llm_info.json"
    info = _keyed(_read_json(info_path), model, info_path, "<top>")
    tp1 = _keyed(info, "1", info_path, model)
    n = len(tp1)
    seq_len = _seq_len(root, model, tp1, info_path, seq_len)
    gpu_names = list(gpus) if gpus is not None else sorted(p.name for p in (root / "profiles" / model).iterdir() if p.is_dir())
    if not gpu_names:
        raise SpecError(str(root / "profiles" / model), "<dir>", "no GPU profiles")
    timings = [t for g in gpu_names for t in _timings(root / "profiles" / model / g / "profile.json", g, n)]
    return ModelProfile(
        name=model,
        dtype="fp32",
        seq_len=seq_len,
        layers=_layers(tp1, n, info_path, model),
        timings=tuple(timings),
        tp_memory=tuple(
            TpMemory(
                tp=int(tp),
                params=tuple(float(_layer(per, i, n, info_path, f"{model}.{tp}")["params_floats"]) for i in range(n)),
                act_mem_bytes=tuple(float(_layer(per, i, n, info_path, f"{model}.{tp}")["act_mem_bytes"]) for i in range(n)),
            )
            for tp, per in sorted(info.items(), key=lambda kv: int(kv[0]))
            if tp != "1"
        ),
        source=f"{SOURCE}; profiles/{model}/<GPU>/profile.json + llm_info.json",
    )


def _layer(per_layer: Any, i: int, n: int, source: Path, where: str) -> dict[str, Any]:
    if not isinstance(per_layer, dict) or len(per_layer) != n:
        got = len(per_layer) if isinstance(per_layer, dict) else 0
        raise SpecError(str(source), where, f"has {got} layers, expected {n}")
    return _keyed(per_layer, str(i), source, where)


def _layers(tp1: dict[str, Any], n: int, source: Path, model: str) -> tuple[LayerProfile, ...]:
    out = []
    for i in range(n):
        row = _layer(tp1, i, n, source, f"{model}.1")
        kind = "embedding" if i == 0 else ("head" if i == n - 1 else "block")
        out.append(
            LayerProfile(
                name=kind if kind != "block" else f"block.{i - 1}",
                kind=kind,
                params=float(row["params_floats"]),
                activation_bytes=float(row["act_output_bytes"]),
                act_mem_bytes=float(row["act_mem_bytes"]),
            )
        )
    return tuple(out)


def _seq_len(root: Path, model: str, tp1: dict[str, Any], source: Path, given: int | None) -> int:
    """From the model's training config (checked against llm_info: a block's output is s×h floats),
    else ``given``, else 2048."""
    cfg = training_config(root, model)
    if cfg is None:
        seq = given or DEFAULT_SEQ_LEN
        log.debug("no training config for %s: sequence length %d", model, seq)
        return seq
    seq, hidden = int(cfg["sequence_length"]), int(cfg["hidden_size"])
    if given is not None and given != seq:
        raise ValueError(f"seq_len {given} contradicts Sailor's training config for {model} (sequence_length {seq})")
    block_out = float(tp1["1"]["act_output_floats"]) if "1" in tp1 else seq * hidden
    if block_out != seq * hidden:
        raise SpecError(
            str(source), f"{model}.1.1.act_output_floats",
            f"{block_out:.0f} floats, but the training config says sequence {seq} x hidden {hidden} = {seq * hidden}",
        )
    return seq


def _timings(path: Path, gpu: str, n: int) -> list[TimingEntry]:
    data = _read_json(path)
    if not isinstance(data, dict) or not data:
        raise SpecError(str(path), "<top>", "expected {mbs: {tp: {layer: [fwd, bwd, update]}}}")
    out = []
    for mbs, by_tp in sorted(data.items(), key=lambda kv: int(kv[0])):
        for tp, rows in sorted(by_tp.items(), key=lambda kv: int(kv[0])):
            if len(rows) != n:
                raise SpecError(
                    str(path), f"{mbs}.{tp}",
                    f"has {len(rows)} layers, but llm_info.json gives the model {n} layers: "
                    "this profile belongs to another model (refusing it)",
                )
            vals = [rows[str(i)] for i in range(n)]
            out.append(
                TimingEntry(
                    gpu=gpu, tp=int(tp), mbs=int(mbs),
                    fwd=tuple(float(v[0]) for v in vals),
                    bwd=tuple(float(v[1]) for v in vals),
                    update=tuple(float(v[2]) for v in vals),
                )
            )
    return out


# --------------------------------------------------------------------------------------------
# Bandwidths and topologies
# --------------------------------------------------------------------------------------------
def curve_bandwidth(entry: Any, source: Path, where: str) -> Bandwidth:
    """``[[c0, c1, c2], max_bytes_per_s]`` -> Bandwidth with the quadratic fit (GB/s)."""
    try:
        (c0, c1, c2), top = entry
        return Bandwidth(gbyte_s=float(top) / 1e9, latency_s=0.0, curve=(float(c0), float(c1), float(c2)))
    except (TypeError, ValueError):
        raise SpecError(str(source), where, f"expected [[c0, c1, c2], max_bytes_per_s], got {entry!r}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class SailorCluster:
    """``count`` GPUs of type ``gpu`` in Google Cloud zone ``zone``, ``gpus_per_vm`` per VM (default:
    Sailor's basic_cluster_config.json; its bandwidth fits exist for 1, 2, 4 and, for RTX types, 8)."""

    zone: str
    gpu: str
    count: int
    gpus_per_vm: int | None = None


def sailor_cluster_name(c: SailorCluster) -> str:
    return f"{c.gpu}@{c.zone}"


def _lookup(table: Any, keys: Sequence[str], source: Path) -> Any:
    node = table
    for depth, k in enumerate(keys):
        node = _keyed(node, k, source, ".".join(keys[:depth]) or "<top>")
    return node


def sailor_topology(root: str | Path, clusters: Sequence[SailorCluster]) -> Topology:
    """Clusters of Sailor's GPU types in Sailor's zones, with Sailor's measured bandwidth curves.

    Inside a cluster: ``intra_node`` from intra_node_bandwidths.json at the GPUs per VM,
    ``inter_node`` the same-zone curve of that GPU type at its GPUs per VM. Between clusters: the
    zone-to-zone curve (multizone_bandwidths.json for one GPU type, *_het.json for two). GPUs per VM
    (unless given) and memory come from basic_cluster_config.json. The region of a cluster is its zone.
    Note that :class:`Bandwidth` clamps a fit to its measured maximum (Sailor's ``max_bytes_per_s``)."""
    root = Path(root)
    prov = root / "providers"
    cfg_path = root / "simulations" / "configs" / "basic_cluster_config.json"
    homo_path, het_path = prov / "multizone_bandwidths.json", prov / "multizone_bandwidths_het.json"
    intra_path = prov / "intra_node_bandwidths.json"
    cfg, homo, het, intra = (_read_json(p) for p in (cfg_path, homo_path, het_path, intra_path))
    if not clusters:
        raise ValueError("clusters must list at least one (zone, gpu, count)")
    names = [sailor_cluster_name(c) for c in clusters]
    if len(set(names)) != len(names):
        raise ValueError(f"clusters repeat a (zone, gpu) pair: {names}")
    gpn = {sailor_cluster_name(c): c.gpus_per_vm or int(_lookup(cfg, [c.gpu, "gpus_per_node"], cfg_path)) for c in clusters}
    built = [_cluster(c, gpn[sailor_cluster_name(c)], cfg, cfg_path, homo, homo_path, intra, intra_path) for c in clusters]
    links = []
    for a in clusters:
        for b in clusters:
            if a is b:
                continue
            table, path = (homo, homo_path) if a.gpu == b.gpu else (het, het_path)
            na, nb = gpn[sailor_cluster_name(a)], gpn[sailor_cluster_name(b)]
            keys = [a.zone, a.gpu, str(na), b.zone, b.gpu, str(nb)]
            bw = curve_bandwidth(_lookup(table, keys, path), path, ".".join(keys))
            links.append(Link(src=sailor_cluster_name(a), dst=sailor_cluster_name(b), bandwidth=bw))
    return Topology(clusters=tuple(built), links=tuple(links))


def _cluster(
    c: SailorCluster, gpn: int, cfg: Any, cfg_path: Path, homo: Any, homo_path: Path, intra: Any, intra_path: Path
) -> Cluster:
    if c.count < 1 or c.count % gpn:
        raise ValueError(f"count {c.count} of {c.gpu} in {c.zone} must be a positive multiple of its {gpn} GPUs per VM")
    keys = [c.zone, c.gpu, str(gpn), c.zone, c.gpu, str(gpn)]
    inter = curve_bandwidth(_lookup(homo, keys, homo_path), homo_path, ".".join(keys))
    # One GPU per VM has no intra-node traffic (and Sailor no fit for it): reuse the inter-node curve.
    intra = inter if gpn == 1 else curve_bandwidth(_lookup(intra, [c.gpu, str(gpn)], intra_path), intra_path, f"{c.gpu}.{gpn}")
    return Cluster(
        name=sailor_cluster_name(c),
        region=c.zone,
        gpu=c.gpu,
        gpu_memory_bytes=float(_lookup(cfg, [c.gpu, "mem_per_gpu"], cfg_path)),
        nodes=c.count // gpn,
        gpus_per_node=gpn,
        intra_node=intra,
        inter_node=inter,
        memory_bandwidth_gbyte_s=MEMORY_GBYTE_S.get(c.gpu, 900.0),
    )
