"""Importer for Metis's profile and cluster files (SamsungLabs/Metis, USENIX ATC'24, CC BY-NC 4.0).

Profile files ``DeviceType.<GPU>_tp<T>_bs<B>.json`` (one per GPU type, TP degree and batch size):

- ``execution_time.layer_compute_total_ms`` is forward + backward per layer. Metis does not split
  it; this importer uses **forward : backward = 1 : 2** (backward computes the gradients of both the
  inputs and the weights, twice the forward's FLOPs), i.e. fwd = t/3, bwd = 2t/3.
- ``execution_time.optimizer_time_ms`` is one optimizer step of the whole model; it is spread over
  the layers in proportion to their parameters.
- ``model.parameters.parameters_per_layer_bytes`` are the layers' full (tp = 1) parameter bytes in
  every file; parameters = bytes / ``bytes_per_param``.
- ``execution_memory.layer_memory_total_mb`` is a layer's peak memory per GPU (weights, gradients,
  optimizer state and activations, MB = 2^20 bytes). Activation memory per sample is its slope in
  the batch size: the least-squares slope over the profiled batch sizes at each tp (clamped at 0,
  since measured peaks are noisy), kept per tp as :class:`TpMemory`. With one batch size only, the
  slope is unknown and the importer refuses the data.
- Activation sizes at stage boundaries are not in the files: ``seq_len × hidden × dtype bytes``
  (``hidden`` must be given).

Cluster file: ``{host: {instance_type, inter_bandwidth, intra_bandwidth, memory}}`` (bandwidths in
bytes/s, memory in GB) plus a hostfile (``host gpus`` per line). Hosts with the same properties form
one cluster; Metis has one inter-node bandwidth per host and no region matrix, so a link between two
clusters gets the smaller inter-node bandwidth of the two and every cluster lies in one region.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hgopt.errors import SpecError
from hgopt.spec import DTYPE_BYTES, Bandwidth, Cluster, LayerProfile, Link, ModelProfile, TimingEntry, Topology, TpMemory

__all__ = ["FWD_SHARE", "MetisFile", "import_metis_profile", "metis_topology", "read_metis_files"]

FWD_SHARE = 1.0 / 3.0
"""Share of ``layer_compute_total_ms`` taken as forward (fwd : bwd = 1 : 2)."""
MB = 2.0**20
SOURCE = "Metis (SamsungLabs/Metis, USENIX ATC'24, CC BY-NC 4.0) profile files"
_NAME = re.compile(r"^DeviceType\.(?P<gpu>.+)_tp(?P<tp>\d+)_bs(?P<bs>\d+)\.json$")


@dataclass(frozen=True, kw_only=True, slots=True)
class MetisFile:
    """One parsed profile file."""

    path: Path
    gpu: str
    tp: int
    bs: int
    data: dict[str, Any]

    def get(self, *keys: str) -> Any:
        node: Any = self.data
        for depth, k in enumerate(keys):
            if not isinstance(node, dict) or k not in node:
                raise SpecError(str(self.path), ".".join(keys[: depth + 1]), "is required but missing")
            node = node[k]
        return node

    def per_layer(self, n: int, *keys: str) -> list[float]:
        vals = self.get(*keys)
        if not isinstance(vals, list) or len(vals) != n:
            got = len(vals) if isinstance(vals, list) else type(vals).__name__
            raise SpecError(str(self.path), ".".join(keys), f"expected {n} per-layer values, got {got}")
        return [float(v) for v in vals]


def read_metis_files(directory: str | Path, gpu: str | None = None) -> list[MetisFile]:
    """Every ``DeviceType.*`` profile file in ``directory`` (for one GPU type if given)."""
    out = []
    for p in sorted(Path(directory).glob("DeviceType.*.json")):
        m = _NAME.match(p.name)
        if m is None or (gpu is not None and m["gpu"] != gpu):
            continue
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(str(p), "<file>", f"cannot read as JSON: {exc}") from None
        out.append(MetisFile(path=p, gpu=m["gpu"], tp=int(m["tp"]), bs=int(m["bs"]), data=data))
    if not out:
        raise SpecError(str(directory), "<dir>", f"no DeviceType.{gpu or '<GPU>'}_tp<T>_bs<B>.json files")
    return out


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def _act_per_sample(files: list[MetisFile], n: int) -> tuple[float, ...]:
    """Bytes of activation per sample per layer: slope of layer memory over batch size."""
    if len({f.bs for f in files}) < 2:
        raise SpecError(str(files[0].path), "execution_memory.layer_memory_total_mb",
                        f"only batch size {files[0].bs} profiled at tp {files[0].tp}: need two to separate activation memory")
    mems = [(f.bs, f.per_layer(n, "execution_memory", "layer_memory_total_mb")) for f in files]
    return tuple(max(0.0, _slope([(bs, m[i]) for bs, m in mems])) * MB for i in range(n))


def import_metis_profile(
    directory: str | Path,
    *,
    seq_len: int,
    hidden: int,
    gpu: str | None = None,
    name: str | None = None,
    dtype: str = "fp16",
    bytes_per_param: float = 2.0,
) -> ModelProfile:
    """Metis's measurements in ``directory`` as a :class:`ModelProfile` (see the module docstring for
    every conversion). ``dtype``: the precision Metis trained in (Megatron fp16 by default)."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype must be fp32, bf16 or fp16, got {dtype!r}")
    files = read_metis_files(directory, gpu)
    first = min(files, key=lambda f: (f.tp, f.bs))
    n = int(first.get("model", "num_layers"))
    param_bytes = first.per_layer(n, "model", "parameters", "parameters_per_layer_bytes")
    params = [b / bytes_per_param for b in param_bytes]
    total = sum(params)
    tps = sorted({f.tp for f in files})
    acts = {tp: _act_per_sample([f for f in files if f.tp == tp], n) for tp in tps}
    boundary = float(seq_len * hidden * DTYPE_BYTES[dtype])
    layers = tuple(
        LayerProfile(
            name="embedding" if i == 0 else ("head" if i == n - 1 else f"block.{i - 1}"),
            kind="embedding" if i == 0 else ("head" if i == n - 1 else "block"),
            params=params[i],
            activation_bytes=boundary,
            act_mem_bytes=acts[tps[0]][i] * tps[0],
        )
        for i in range(n)
    )
    timings = []
    for f in sorted(files, key=lambda f: (f.gpu, f.tp, f.bs)):
        if int(f.get("model", "num_layers")) != n:
            raise SpecError(str(f.path), "model.num_layers", f"{f.get('model', 'num_layers')} layers, other files have {n}")
        total_ms = f.per_layer(n, "execution_time", "layer_compute_total_ms")
        opt_s = float(f.get("execution_time", "optimizer_time_ms")) / 1e3
        timings.append(
            TimingEntry(
                gpu=f.gpu, tp=f.tp, mbs=f.bs,
                fwd=tuple(t / 1e3 * FWD_SHARE for t in total_ms),
                bwd=tuple(t / 1e3 * (1.0 - FWD_SHARE) for t in total_ms),
                update=tuple(opt_s * p / total for p in params),
            )
        )
    return ModelProfile(
        name=name or str(first.get("model", "model_name")),
        dtype=dtype,  # type: ignore[arg-type]
        seq_len=seq_len,
        layers=layers,
        timings=tuple(timings),
        tp_memory=tuple(TpMemory(tp=tp, params=tuple(p / tp for p in params), act_mem_bytes=acts[tp]) for tp in tps),
        source=f"{SOURCE}; fwd:bwd = 1:2, optimizer time spread by parameters, activation memory = slope over batch size",
    )


# --------------------------------------------------------------------------------------------
# Cluster file
# --------------------------------------------------------------------------------------------
def _hostfile(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) < 1:
            raise SpecError(str(path), f"line {lineno}", f"expected 'HOST GPUS', got {line!r}")
        out[parts[0]] = int(parts[1])
    return out


def metis_topology(
    clusterfile: str | Path,
    hostfile: str | Path | None = None,
    *,
    gpus_per_node: int | None = None,
    region: str = "metis",
) -> Topology:
    """A Metis cluster file (+ hostfile, or one ``gpus_per_node`` for every host) as a Topology."""
    cpath = Path(clusterfile)
    try:
        hosts = json.loads(cpath.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(str(cpath), "<file>", f"cannot read as JSON: {exc}") from None
    if not isinstance(hosts, dict) or not hosts:
        raise SpecError(str(cpath), "<top>", "expected {host: {instance_type, inter_bandwidth, intra_bandwidth, memory}}")
    counts = _hostfile(Path(hostfile)) if hostfile is not None else {}
    if hostfile is None and gpus_per_node is None:
        raise ValueError("give a hostfile or gpus_per_node")
    groups: dict[tuple[str, int, float, float, float], int] = {}
    for host, spec in hosts.items():
        key = _host_key(cpath, host, spec, counts.get(host, gpus_per_node), hostfile)
        groups[key] = groups.get(key, 0) + 1
    return _topology(groups, region)


def _host_key(cpath: Path, host: str, spec: Any, gpn: int | None, hostfile: Any) -> tuple[str, int, float, float, float]:
    if gpn is None:
        raise SpecError(str(hostfile), host, "host of the cluster file is missing from the hostfile")
    if not isinstance(spec, dict):
        raise SpecError(str(cpath), host, "expected a mapping")
    vals = []
    for key in ("inter_bandwidth", "intra_bandwidth", "memory"):
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise SpecError(str(cpath), f"{host}.{key}", f"expected a positive number, got {v!r}")
        vals.append(float(v))
    gpu = spec.get("instance_type")
    if not isinstance(gpu, str) or not gpu:
        raise SpecError(str(cpath), f"{host}.instance_type", f"expected a GPU type name, got {gpu!r}")
    return (gpu, gpn, vals[0], vals[1], vals[2])


def _topology(groups: dict[tuple[str, int, float, float, float], int], region: str) -> Topology:
    clusters = []
    seen: dict[str, int] = {}
    for (gpu, gpn, inter, intra, mem), nodes in groups.items():
        seen[gpu] = seen.get(gpu, 0) + 1
        name = gpu if seen[gpu] == 1 else f"{gpu}-{seen[gpu]}"
        clusters.append(
            Cluster(
                name=name, region=region, gpu=gpu, gpu_memory_bytes=mem * 1e9, nodes=nodes, gpus_per_node=gpn,
                intra_node=Bandwidth(gbyte_s=intra / 1e9), inter_node=Bandwidth(gbyte_s=inter / 1e9),
            )
        )
    links = [
        Link(src=a.name, dst=b.name, bandwidth=Bandwidth(gbyte_s=min(a.inter_node.gbyte_s, b.inter_node.gbyte_s)))
        for a in clusters for b in clusters if a is not b
    ]
    return Topology(clusters=tuple(clusters), links=tuple(links))

