"""Writes the analytic benchmark instances ``instances/geo-*.yaml`` and ``instances/scale-*.yaml``.

Run from the repository root: ``.venv/bin/python instances/build_analytic_instances.py``. The output
is deterministic; the YAML files are committed, this script documents how they were made.

Topology rules (documented in docs/profiles-analytic.md):

* every cluster's GPU memory, memory bandwidth and intra-node bandwidth come from the GPU table
  (:mod:`hgopt.profiles.gpus`); inter-node bandwidth (``inter_node``) is ONE NODE'S NIC, shared by the
  node's GPUs: one InfiniBand NDR 400 Gbit/s adapter per GPU for H100/H200 nodes (NVIDIA DGX H100
  datasheet: 8x ConnectX-7 400 Gb/s; Google Cloud "Network bandwidths and GPUs": A3 Ultra 8 CX-7 NICs,
  3,200 Gbit/s), one HDR 200 Gbit/s adapter per GPU for A100 nodes (NVIDIA DGX A100 datasheet: 8x
  ConnectX-6 200 Gb/s), and 100 Gbit/s per node otherwise (Google Cloud "Network bandwidths and
  GPUs": G2/N1 GPU VMs up to 100 Gbit/s per VM); 5 µs latency;
* regions are public-cloud locations; the WAN link between two regions has one-way latency
  ``5 ms + great-circle distance / (100 km/ms)`` (light in fibre covers ~200 km/ms, routes are
  roughly twice the great circle), clamped to [10, 150] ms, and a region-pair capacity that falls
  with the distance: < 1,500 km 25 Gbit/s, < 4,000 km 10, < 9,000 km 5, < 13,000 km 2, else 1
  (illustrative). Each link is ``kind: per_flow``: that capacity is the AGGREGATE cap per direction
  shared by every flow between the two regions, and one flow (one node to one node) gets at most
  ``min(capacity, 5 Gbit/s)`` (AWS, Amazon EC2 User Guide, "Amazon EC2 instance network bandwidth":
  single-flow traffic is limited to 5 Gbps outside a cluster placement group).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from hgopt.profiles.gpus import gpu_spec

HERE = Path(__file__).resolve().parent

# (latitude, longitude) of the data-centre city of each region.
REGIONS: dict[str, tuple[float, float]] = {
    "us-east": (38.9, -77.4),  # N. Virginia
    "us-central": (41.3, -95.9),  # Iowa
    "us-west": (45.6, -121.2),  # Oregon
    "ca-central": (45.5, -73.6),  # Montreal
    "sa-east": (-23.5, -46.6),  # Sao Paulo
    "eu-west": (53.3, -6.3),  # Dublin
    "eu-central": (50.1, 8.7),  # Frankfurt
    "eu-north": (59.3, 18.1),  # Stockholm
    "me-central": (25.2, 55.3),  # Dubai
    "af-south": (-33.9, 18.4),  # Cape Town
    "ap-south": (19.1, 72.9),  # Mumbai
    "ap-southeast": (1.35, 103.8),  # Singapore
    "ap-east": (22.3, 114.2),  # Hong Kong
    "ap-northeast": (35.7, 139.7),  # Tokyo
    "ap-northeast2": (37.6, 127.0),  # Seoul
    "au-southeast": (-33.9, 151.2),  # Sydney
}


def distance_km(a: str, b: str) -> float:
    """Great-circle distance between two regions (haversine, Earth radius 6,371 km)."""
    (la1, lo1), (la2, lo2) = (tuple(map(math.radians, REGIONS[r])) for r in (a, b))
    h = math.sin((la2 - la1) / 2) ** 2 + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2
    return 2 * 6371.0 * math.asin(math.sqrt(h))


def wan_link(a: str, b: str) -> dict[str, float]:
    d = distance_km(a, b)
    latency = min(max(5.0 + d / 100.0, 10.0), 150.0)
    gbit = 25.0 if d < 1500 else 10.0 if d < 4000 else 5.0 if d < 9000 else 2.0 if d < 13000 else 1.0
    return {"gbit_s": gbit, "latency_ms": round(latency, 1)}


SINGLE_FLOW_GBIT = 5.0
"""AWS, Amazon EC2 User Guide, "Amazon EC2 instance network bandwidth": single-flow (5-tuple) traffic is
limited to 5 Gbps when instances are not in the same cluster placement group."""
WAN_SOURCE = ("aggregate: illustrative region-pair capacity (distance rule of build_analytic_instances.py); "
              "per flow <= 5 Gbit/s: AWS EC2 User Guide, 'Amazon EC2 instance network bandwidth' (single-flow limit)")


def wan_pair(a: str, b: str) -> dict[str, Any]:
    """The link body between two regions: per flow min(capacity, 5 Gbit/s), aggregate = capacity."""
    w = wan_link(a, b)
    return {"kind": "per_flow",
            "per_flow": {"gbit_s": min(w["gbit_s"], SINGLE_FLOW_GBIT), "latency_ms": w["latency_ms"]},
            "aggregate": {"gbit_s": w["gbit_s"]}, "source": WAN_SOURCE}


def inter_node_gbit(gpu: str, gpus_per_node: int = 8) -> float:
    """One node's NIC bandwidth (shared by its GPUs): one 400 / 200 Gbit/s adapter per GPU on H100/H200 /
    A100 nodes (DGX H100 / DGX A100 datasheets), 100 Gbit/s per node otherwise."""
    per_gpu = 400.0 if gpu.startswith(("H100", "H200")) else 200.0 if gpu.startswith("A100") else None
    return per_gpu * gpus_per_node if per_gpu is not None else 100.0


def cluster(region: str, gpu: str, gpus: int, gpus_per_node: int = 8, zone: str = "") -> dict[str, Any]:
    """One cluster; ``zone`` names one of several clusters in a region (their WAN link: distance 0)."""
    spec = gpu_spec(gpu)
    assert gpus % gpus_per_node == 0, (region, gpu, gpus)
    return {
        "name": f"{region}{'-' + zone if zone else ''}-{gpu.lower()}",
        "region": region,
        "gpu": gpu,
        "gpu_memory_gb": spec.memory_gb,
        "memory_bandwidth_gbyte_s": spec.memory_gbyte_s,
        "nodes": gpus // gpus_per_node,
        "gpus_per_node": gpus_per_node,
        "intra_node": {"gbyte_s": round(spec.intra_node_gbyte_s, 3), "latency_ms": 0.005},
        "inter_node": {"gbit_s": inter_node_gbit(gpu, gpus_per_node), "latency_ms": 0.005},
    }


def topology(clusters: list[dict[str, Any]]) -> dict[str, Any]:
    """Every pair's WAN link. When a region holds several clusters (zones), pairs of the same two
    regions share one body, written once and merged into each pair by a YAML merge key (``<<: *id``):
    the 64-region instance stays small."""
    pairs = []
    shared = len({c["region"] for c in clusters}) < len(clusters)
    bodies: dict[tuple[str, str], dict[str, Any]] = {}
    for i, a in enumerate(clusters):
        for b in clusters[i + 1 :]:
            body = wan_pair(a["region"], b["region"])
            if shared:
                pairs.append({"src": a["name"], "dst": b["name"],
                              MERGE: bodies.setdefault(tuple(sorted((a["region"], b["region"]))), body)})
            else:
                pairs.append({"src": a["name"], "dst": b["name"], **body})
    return {"clusters": clusters, "links": {"pairs": pairs}}


MERGE = "<<"
"""YAML's merge key (PyYAML writes it quoted; ``main`` unquotes it so that loaders merge)."""


# ---- model shapes -------------------------------------------------------------------------------
GPT_1_3B = {"name": "gpt3-1.3b", "layers": 24, "hidden": 2048, "heads": 16, "vocab": 50257, "seq_len": 2048}
GPT_2_7B = {"name": "gpt-2.7b", "layers": 32, "hidden": 2560, "heads": 32, "vocab": 50257, "seq_len": 2048}
LLAMA_7B = {"name": "llama-7b", "layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096,
            "ffn": 11008, "glu": True}
LLAMA_13B = {"name": "llama-13b", "layers": 40, "hidden": 5120, "heads": 40, "vocab": 32000, "seq_len": 4096,
             "ffn": 13824, "glu": True}
LLAMA_70B = {"name": "llama-70b", "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "vocab": 32000,
             "seq_len": 4096, "ffn": 28672, "glu": True}
GPT3_175B = {"name": "gpt3-175b", "layers": 96, "hidden": 12288, "heads": 96, "vocab": 50257, "seq_len": 2048}


def instance(name: str, description: str, shape: dict[str, Any], dtype: str, clusters: list[dict[str, Any]],
             global_batch: int) -> dict[str, Any]:
    gpus = sorted({c["gpu"] for c in clusters})
    topo = topology(clusters)
    wan = [(p.get(MERGE, p)["aggregate"]["gbit_s"], p.get(MERGE, p)["per_flow"]["latency_ms"])
           for p in topo["links"]["pairs"]]
    if wan:
        description += (f" WAN {min(w[0] for w in wan):g}-{max(w[0] for w in wan):g} Gbit/s per region pair"
                        f" (at most {SINGLE_FLOW_GBIT:g} per flow), {min(w[1] for w in wan):g}-{max(w[1] for w in wan):g}"
                        " ms one way.")
    return {
        "name": name,
        "description": description,
        "model": {"generator": "analytic", **shape, "dtype": dtype, "gpus": gpus},
        "topology": topo,
        "job": {"global_batch": global_batch, "seq_len": shape["seq_len"], "precision": dtype, "optimizer": "adam"},
    }


# ---- prices (only on the instances that say so: priced()) ----------------------------------------
GPU_USD_PER_HOUR = {"H100-80": 2.99, "A100-80": 1.79, "A100-40": 1.29}
"""Illustrative per-GPU on-demand list prices: Lambda's 8-GPU on-demand instances (lambda.ai/pricing,
2025: 8x H100 SXM $2.99, 8x A100 SXM 80 GB $1.79, 8x A100 SXM 40 GB $1.29 per GPU-hour), the same in
every region."""
EGRESS_USD_PER_GB = {frozenset({"na", "eu"}): 0.05, frozenset({"na", "ap"}): 0.08, frozenset({"eu", "ap"}): 0.08}
"""Illustrative inter-continental egress per GB: Google Cloud inter-region data transfer list prices
(cloud.google.com/vpc/network-pricing, 2024; as instances/build_sailor_instances.py): North America <->
Europe $0.05, to or from Asia $0.08."""


def _continent(region: str) -> str:
    return "na" if region.startswith(("us-", "ca-")) else "eu" if region.startswith("eu-") else "ap"


def priced(inst: dict[str, Any]) -> dict[str, Any]:
    """``inst`` with ``cost_per_gpu_hour`` per cluster and ``egress_usd_per_gb`` per link (GPU_USD_PER_HOUR,
    EGRESS_USD_PER_GB) and a sentence saying so in the description."""
    region = {c["name"]: c["region"] for c in inst["topology"]["clusters"]}
    for c in inst["topology"]["clusters"]:
        c["cost_per_gpu_hour"] = GPU_USD_PER_HOUR[c["gpu"]]
    for p in inst["topology"]["links"]["pairs"]:
        p["egress_usd_per_gb"] = EGRESS_USD_PER_GB[frozenset({_continent(region[p["src"]]), _continent(region[p["dst"]])})]
    inst["description"] += (" Illustrative prices: per-GPU on-demand list prices and inter-continental egress per GB "
                            "(instances/build_analytic_instances.py names their sources).")
    return inst


def instances() -> list[dict[str, Any]]:
    return [
        priced(instance(
            "geo-3r-gpt1.3b",
            "GPT-3 XL (1.4B, 26 layers) in bf16 on three continents: H100 in N. Virginia, A100-80 in "
            "Dublin, A100-40 in Tokyo.",
            GPT_1_3B, "bf16",
            [cluster("us-east", "H100-80", 16), cluster("eu-west", "A100-80", 32), cluster("ap-northeast", "A100-40", 32)],
            512,
        )),
        instance(
            "geo-4r-llama7b",
            "LLaMA-7B (34 layers, seq 4096) in bf16 over four regions of different GPU types (H100, "
            "A100-80, L40S, A100-40), 64 GPUs each.",
            LLAMA_7B, "bf16",
            [cluster("us-east", "H100-80", 64), cluster("us-west", "A100-80", 64),
             cluster("eu-central", "L40S", 64), cluster("ap-southeast", "A100-40", 64)],
            1024,
        ),
        instance(
            "geo-5r-fp16-gpt2.7b",
            "GPT 2.7B (34 layers) in fp16 on an older fleet without bf16: V100-32, V100-16, T4, A100-40, "
            "L40S in five regions.",
            GPT_2_7B, "fp16",
            [cluster("us-central", "V100-32", 64), cluster("eu-west", "V100-16", 64),
             cluster("ap-south", "T4", 128, gpus_per_node=4), cluster("sa-east", "A100-40", 32),
             cluster("eu-north", "L40S", 32)],
            512,
        ),
        instance(
            "geo-6r-llama13b",
            "LLaMA-13B (42 layers, seq 4096) in bf16 over six regions: H100, H200, A100-80, A100-40, "
            "L40S, A10 (704 GPUs).",
            LLAMA_13B, "bf16",
            [cluster("us-east", "H100-80", 128), cluster("us-west", "H200-141", 64),
             cluster("eu-west", "A100-80", 128), cluster("eu-central", "A100-40", 128),
             cluster("ap-northeast", "L40S", 128), cluster("ap-south", "A10-24", 128, gpus_per_node=4)],
            1024,
        ),
        instance(
            "geo-8r-llama70b",
            "LLaMA-2-70B shape (82 layers, GQA, seq 4096) in bf16 over eight regions of H100, H200, "
            "A100-80, A100-40 and L40S (768 GPUs).",
            LLAMA_70B, "bf16",
            [cluster("us-east", "H100-80", 128), cluster("us-central", "H200-141", 64),
             cluster("us-west", "A100-80", 128), cluster("eu-west", "A100-40", 128),
             cluster("eu-central", "H100-80", 64), cluster("eu-north", "L40S", 96),
             cluster("ap-northeast", "A100-80", 96), cluster("ap-southeast", "L40S", 64)],
            1024,
        ),
        instance(
            "geo-3r-lowend-gpt1.3b",
            "GPT-3 XL (1.4B) in fp16 on low-end GPUs far apart (T4 in Mumbai, V100-16 in Iowa, A10 in "
            "Sao Paulo).",
            GPT_1_3B, "fp16",
            [cluster("ap-south", "T4", 64, gpus_per_node=4), cluster("us-central", "V100-16", 32),
             cluster("sa-east", "A10-24", 32, gpus_per_node=4)],
            256,
        ),
        instance(
            "scale-8r-1024-llama70b",
            "Scale test: LLaMA-2-70B shape (82 layers) in bf16 on 8 regions x 128 GPUs = 1,024 GPUs.",
            LLAMA_70B, "bf16",
            [cluster(r, g, 128) for r, g in (
                ("us-east", "H100-80"), ("us-central", "H200-141"), ("us-west", "A100-80"), ("ca-central", "A100-40"),
                ("eu-west", "L40S"), ("eu-central", "H100-80"), ("ap-northeast", "A100-80"), ("ap-southeast", "A100-40"))],
            1024,
        ),
        instance(
            "scale-16r-4096-gpt175b",
            "Scale test: GPT-3 175B (98 layers) in bf16 on 16 regions x 256 GPUs = 4,096 GPUs.",
            GPT3_175B, "bf16",
            [cluster(r, g, 256) for r, g in zip(REGIONS, SCALE_16R_GPUS)],
            1536,
        ),
        instance(
            "scale-64r-16384-gpt175b",
            "Scale test: GPT-3 175B (98 layers) in bf16 on 64 clusters x 256 GPUs = 16,384 GPUs: the 16 "
            "regions of scale-16r with four zones each (zones of one region 10 ms and 25 Gbit/s apart, by the "
            "distance rule at 0 km; every zone pair has its own region-pair capacity, as if each zone had its own "
            "WAN links).",
            GPT3_175B, "bf16",
            [cluster(r, g, 256, zone=z) for z in "abcd" for r, g in zip(REGIONS, SCALE_16R_GPUS)],
            6144,
        ),
    ]


SCALE_16R_GPUS = ("H100-80", "A100-80", "H200-141", "A100-40", "L40S", "H100-80", "A100-80", "A100-40",
                  "H200-141", "L40S", "A100-80", "H100-80", "A100-40", "H100-80", "A100-80", "L40S")
"""GPU type per region of the scale-16r instance (in REGIONS order), also the zones of scale-64r."""


def main() -> None:
    for inst in instances():
        path = HERE / f"{inst['name']}.yaml"
        text = yaml.safe_dump(inst, sort_keys=False, width=110).replace(f"'{MERGE}':", f"{MERGE}:")
        path.write_text(f"# Generated by instances/build_analytic_instances.py; edit that script, not this file.\n{text}")
        print(path.relative_to(HERE.parent))


if __name__ == "__main__":
    main()
