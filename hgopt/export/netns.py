"""Link emulation on one Linux machine with network namespaces: one namespace per cluster, a veth pair
per pair of clusters shaped with ``tc tbf`` to the link's bandwidth in each direction. Latency is not
added here (``netem`` is missing on the machines this was built on); the runner delays the delivery of
cross-cluster messages instead.

Addressing: link ``k`` between clusters ``i < j`` is 10.99.k.0/30 (``i`` .1, ``j`` .2). A namespace's
*primary* address is its address on its first link; every other namespace gets a host route to it over
their direct link, so gloo (bound with ``GLOO_SOCKET_IFNAME`` to the first link) reaches every peer over
the right shaped link, and ranks of the same cluster talk locally, unshaped. Pure Python (``ip``/``tc``
through subprocess): no torch.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass

from hgopt.export.runner_plan import RunnerPlan

__all__ = ["NetnsLayout", "available", "layout", "setup", "teardown"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Veth:
    name: str
    peer: str
    ns: int
    peer_ns: int
    addr: str
    peer_addr: str
    bytes_per_s: float
    """Shaping of traffic leaving ``name`` (towards ``peer_ns``)."""
    peer_bytes_per_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class NetnsLayout:
    namespaces: tuple[str, ...]
    """Namespace of each cluster, in ``RunnerPlan.clusters`` order."""
    primary_ifname: tuple[str, ...]
    primary_addr: tuple[str, ...]
    veths: tuple[_Veth, ...]

    def namespace_of(self, rp: RunnerPlan, cluster: str) -> str:
        return self.namespaces[rp.clusters.index(cluster)]

    def addr_of(self, rp: RunnerPlan, cluster: str) -> str:
        return self.primary_addr[rp.clusters.index(cluster)]

    def ifname_of(self, rp: RunnerPlan, cluster: str) -> str:
        return self.primary_ifname[rp.clusters.index(cluster)]


def available() -> bool:
    """Root with ``ip`` and ``tc`` and a kernel that lets us create a namespace."""
    if not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = "hgopt-probe"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def layout(rp: RunnerPlan, tag: str | None = None) -> NetnsLayout:
    """Names and addresses for ``rp`` (deterministic; ``tag`` defaults to the plan's master port so two
    runs on one machine do not collide)."""
    tag = tag or str(rp.master_port)
    n = len(rp.clusters)
    names = tuple(f"hg{tag}c{i}" for i in range(n))
    veths, first = [], [None] * n  # type: list[_Veth]  # first link of each namespace
    k = 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = rp.link(rp.clusters[i], rp.clusters[j]), rp.link(rp.clusters[j], rp.clusters[i])
            assert a is not None and b is not None, "export writes every ordered pair of used clusters"
            v = _Veth(name=f"v{tag}-{i}-{j}", peer=f"v{tag}-{j}-{i}", ns=i, peer_ns=j, addr=f"10.99.{k}.1",
                      peer_addr=f"10.99.{k}.2", bytes_per_s=a.bytes_per_s, peer_bytes_per_s=b.bytes_per_s)
            veths.append(v)
            first[i] = first[i] or (v.name, v.addr)  # type: ignore[assignment]
            first[j] = first[j] or (v.peer, v.peer_addr)  # type: ignore[assignment]
            k += 1
    if k > 255:
        raise ValueError(f"link emulation supports up to 23 clusters, the plan uses {n}")
    return NetnsLayout(
        namespaces=names,
        primary_ifname=tuple(f[0] if f else "lo" for f in first),  # type: ignore[index]
        primary_addr=tuple(f[1] if f else "127.0.0.1" for f in first),  # type: ignore[index]
        veths=tuple(veths),
    )


def _ip(*args: str) -> None:
    res = subprocess.run(list(args), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {res.stderr.strip()}")


def setup(rp: RunnerPlan, lay: NetnsLayout) -> None:
    """Create the namespaces, links, routes and shaping (removes leftovers of the same layout first)."""
    teardown(lay)
    try:
        for ns in lay.namespaces:
            _ip("ip", "netns", "add", ns)
            _ip("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _ip("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
        for v in lay.veths:
            _add_veth(lay, v)
        for v in lay.veths:  # host routes to the peers' primary addresses over the direct link
            for ns, dev, gw, other in ((v.ns, v.name, v.peer_addr, v.peer_ns), (v.peer_ns, v.peer, v.addr, v.ns)):
                dst = lay.primary_addr[other]
                if dst != gw:
                    _ip("ip", "netns", "exec", lay.namespaces[ns], "ip", "route", "add", f"{dst}/32", "via", gw, "dev", dev)
    except Exception:
        teardown(lay)
        raise
    log.info("link emulation: namespaces %s, %d shaped links", ", ".join(lay.namespaces), len(lay.veths))


def _add_veth(lay: NetnsLayout, v: _Veth) -> None:
    _ip("ip", "link", "add", v.name, "type", "veth", "peer", "name", v.peer)
    for dev, ns, addr, rate in ((v.name, v.ns, v.addr, v.bytes_per_s), (v.peer, v.peer_ns, v.peer_addr, v.peer_bytes_per_s)):
        name = lay.namespaces[ns]
        _ip("ip", "link", "set", dev, "netns", name)
        _ip("ip", "netns", "exec", name, "ip", "addr", "add", f"{addr}/30", "dev", dev)
        _ip("ip", "netns", "exec", name, "ip", "link", "set", dev, "up")
        bits = max(int(rate * 8), 8000)
        burst = max(int(rate / 1000), 2 * 1514)  # 1 ms of traffic, at least two full frames
        limit = max(int(rate * 2), 4 * 1024 * 1024)  # queue up to 2 s of traffic instead of dropping
        _ip("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
            "burst", str(burst), "limit", str(limit))


def teardown(lay: NetnsLayout) -> None:
    """Delete the namespaces (their veths go with them). Never fails."""
    for ns in lay.namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m hgopt.runner.netns up|down PLAN``: create or remove the namespaces of an exported plan
    (for the per-node torchrun scripts; the local launcher does this itself)."""
    import argparse

    from hgopt.export.runner_plan import load_runner_plan

    ap = argparse.ArgumentParser(prog="python -m hgopt.runner.netns", description="create (up) or remove (down) "
                                 "the network namespaces that emulate an exported plan's links")
    ap.add_argument("action", choices=("up", "down"))
    ap.add_argument("plan", help="runner plan (plan.json written by hgopt export)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rp = load_runner_plan(args.plan)
    lay = layout(rp)
    if args.action == "down":
        teardown(lay)
        return 0
    if not available():
        raise SystemExit("network namespaces need root and the ip/tc tools")
    setup(rp, lay)
    for c in rp.clusters:
        print(f"cluster {c}: namespace {lay.namespace_of(rp, c)}, address {lay.addr_of(rp, c)} ({lay.ifname_of(rp, c)})")
    return 0
