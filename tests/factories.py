"""Small instances built in code, for tests that need exact hand-computable numbers or brute force."""

from __future__ import annotations

import itertools
from typing import Any

from hgopt.spec import Instance, instance_from_dict


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
                  precision: str = "fp32") -> Instance:
    return instance_from_dict(
        {
            "name": name,
            "model": model or tiny_model(),
            "topology": topology or tiny_topology(),
            "job": {"global_batch": global_batch, "seq_len": 128, "precision": precision},
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
