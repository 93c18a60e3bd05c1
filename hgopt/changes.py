"""Changes to an instance's resources (``hgopt replan --change``): GPUs lost or gained in a cluster, a
link's bandwidth changed, a cluster dropped. Parsed from short strings, applied to an
:class:`~hgopt.spec.Instance` to give the changed instance. Pure; no plan in sight.

Forms (one per ``--change``):

- ``cluster=NAME:-16`` / ``cluster=NAME:+8``: the cluster loses / gains that many GPUs, in whole nodes
  (a multiple of its ``gpus_per_node``); a cluster left with 0 GPUs is dropped.
- ``drop=NAME``: the cluster and every link from or to it are gone.
- ``link=A>B:2Gbit`` (one direction), ``link=A<>B:2Gbit`` (both): the link's PER-FLOW bandwidth becomes
  that figure (units ``Gbit``, ``Mbit``, ``GB``, ``MB``, per second) and its aggregate cap, when it has
  one, scales by the same factor (a constant link: per flow = the figure; a curve: scaled so that its
  cap is the figure); ``link=A>B:x0.5``: both scaled by 0.5. Latency is unchanged.

Every malformed or impossible change is a ValueError naming the change and what is wrong (exit 2 in
the CLI)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from hgopt.spec import Instance, Link, Topology

__all__ = ["Change", "apply_changes", "describe_change", "parse_change"]

ChangeKind = Literal["cluster", "drop", "link"]
_UNITS = {"gbit": 1e9 / 8, "mbit": 1e6 / 8, "gb": 1e9, "mb": 1e6}
"""Bytes per second of one unit (Gbit/s, Mbit/s, GB/s, MB/s)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Change:
    kind: ChangeKind
    cluster: str = ""
    """``cluster`` / ``drop``: the cluster; ``link``: the source cluster."""
    gpus: int = 0
    """``cluster``: GPUs gained (> 0) or lost (< 0)."""
    dst: str = ""
    both: bool = False
    """``link``: also ``dst -> cluster``."""
    bytes_per_s: float | None = None
    """``link``: the new per-flow bandwidth (None: ``factor``)."""
    factor: float | None = None
    text: str = ""
    """As the user wrote it."""


def _bad(text: str, problem: str) -> ValueError:
    return ValueError(f"--change {text!r}: {problem}")


def parse_change(text: str) -> Change:
    """One ``--change`` string; ValueError naming it and what is wrong."""
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or key not in ("cluster", "drop", "link"):
        raise _bad(text, "expected cluster=NAME:+N|-N, drop=NAME or link=A>B:BANDWIDTH (A<>B for both directions)")
    if key == "drop":
        if not value:
            raise _bad(text, "drop= needs a cluster name")
        return Change(kind="drop", cluster=value, text=text)
    name, sep, amount = value.rpartition(":")
    if not sep or not name:
        raise _bad(text, f"expected {key}=NAME:AMOUNT" if key == "cluster" else "expected link=A>B:BANDWIDTH")
    if key == "cluster":
        if not re.fullmatch(r"[+-]\d+", amount.strip()):
            raise _bad(text, f"the GPU count must be signed (+8 or -16), got {amount!r}")
        n = int(amount)
        if n == 0:
            raise _bad(text, "a change of 0 GPUs changes nothing")
        return Change(kind="cluster", cluster=name.strip(), gpus=n, text=text)
    both = "<>" in name
    src, sep, dst = name.partition("<>" if both else ">")
    if not sep or not src.strip() or not dst.strip():
        raise _bad(text, f"expected a link A>B or A<>B, got {name!r}")
    if src.strip() == dst.strip():
        raise _bad(text, "a link joins two different clusters")
    amount = amount.strip()
    m = re.fullmatch(r"x(\d+(?:\.\d*)?|\.\d+)", amount)
    if m:
        factor = float(m.group(1))
        if not factor > 0:
            raise _bad(text, f"the scale factor must be > 0, got {amount!r}")
        return Change(kind="link", cluster=src.strip(), dst=dst.strip(), both=both, factor=factor, text=text)
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+?)(?:/s|ps)?", amount)
    if not m or m.group(2).lower() not in _UNITS:
        raise _bad(text, f"expected a bandwidth such as 2Gbit, 500Mbit, 1.5GB (per second) or a factor x0.5, "
                         f"got {amount!r}")
    bps = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not bps > 0:
        raise _bad(text, f"the bandwidth must be > 0, got {amount!r}")
    return Change(kind="link", cluster=src.strip(), dst=dst.strip(), both=both, bytes_per_s=bps, text=text)


def _cluster_names(topo: Topology) -> str:
    return ", ".join(c.name for c in topo.clusters)


def _apply(inst: Instance, ch: Change) -> Instance:
    topo = inst.topology
    names = {c.name for c in topo.clusters}
    for name in (ch.cluster, *([ch.dst] if ch.kind == "link" else [])):
        if name not in names:
            raise _bad(ch.text, f"unknown cluster {name!r} (clusters now: {_cluster_names(topo)})")
    if ch.kind == "drop":
        return _drop(inst, ch.cluster, ch)
    if ch.kind == "cluster":
        c = topo.cluster(ch.cluster)
        if ch.gpus % c.gpus_per_node:
            raise _bad(ch.text, f"{c.name} has {c.gpus_per_node} GPUs per node: GPUs come and go in whole nodes "
                                f"(a multiple of {c.gpus_per_node})")
        nodes = c.nodes + ch.gpus // c.gpus_per_node
        if nodes < 0:
            raise _bad(ch.text, f"{c.name} has {c.num_gpus} GPUs, cannot lose {-ch.gpus}")
        if nodes == 0:
            return _drop(inst, c.name, ch)
        new = dataclasses.replace(c, nodes=nodes)
        return dataclasses.replace(inst, topology=dataclasses.replace(
            topo, clusters=tuple(new if x.name == c.name else x for x in topo.clusters)))
    pairs = {(ch.cluster, ch.dst)} | ({(ch.dst, ch.cluster)} if ch.both else set())
    links = []
    for lk in topo.links:
        if (lk.src, lk.dst) in pairs:
            lk = _scaled(lk, ch.factor if ch.factor is not None else ch.bytes_per_s / (lk.bandwidth.gbyte_s * 1e9))  # type: ignore[operator]
        links.append(lk)
    return dataclasses.replace(inst, topology=dataclasses.replace(topo, links=tuple(links)))


def _scaled(lk: Link, factor: float) -> Link:
    return dataclasses.replace(lk, bandwidth=lk.bandwidth.scaled(factor),
                               aggregate=None if lk.aggregate is None else lk.aggregate.scaled(factor))


def _drop(inst: Instance, name: str, ch: Change) -> Instance:
    topo = inst.topology
    clusters = tuple(c for c in topo.clusters if c.name != name)
    if not clusters:
        raise _bad(ch.text, f"{name} is the last cluster: nothing would be left to train on")
    links = tuple(lk for lk in topo.links if name not in (lk.src, lk.dst))
    return dataclasses.replace(inst, topology=Topology(clusters=clusters, links=links))


def apply_changes(instance: Instance, changes: list[Change] | tuple[Change, ...]) -> Instance:
    """``instance`` with every change applied in order (named ``<name>+changed``)."""
    out = instance
    for ch in changes:
        out = _apply(out, ch)
    return dataclasses.replace(out, name=f"{instance.name}+changed") if changes else out


def describe_change(ch: Change, before: Instance) -> str:
    """One line: what the change does to ``before`` (the instance it applies to)."""
    topo = before.topology
    if ch.kind == "drop":
        return f"drop cluster {ch.cluster} ({topo.cluster(ch.cluster).num_gpus} GPUs)"
    if ch.kind == "cluster":
        c = topo.cluster(ch.cluster)
        return f"cluster {c.name}: {c.num_gpus} -> {c.num_gpus + ch.gpus} GPUs"
    lk = topo.link_spec(ch.cluster, ch.dst)
    new = _apply(before, ch).topology.link_spec(ch.cluster, ch.dst)
    arrow = "<>" if ch.both else ">"
    return (f"link {ch.cluster}{arrow}{ch.dst}: per flow {lk.bandwidth.gbyte_s * 8:.4g} -> "
            f"{new.bandwidth.gbyte_s * 8:.4g} Gbit/s"
            + ("" if lk.aggregate is None or new.aggregate is None else
               f", aggregate {lk.aggregate.gbyte_s * 8:.4g} -> {new.aggregate.gbyte_s * 8:.4g} Gbit/s"))
