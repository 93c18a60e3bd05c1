"""GPU table for the analytic profile generator.

Every peak figure is the vendor's datasheet value (dense, i.e. without structured sparsity); the URL
of the datasheet is kept with the entry in ``source``. The two efficiency factors are *not* datasheet
figures: they are this project's assumption of what a well-tuned training step achieves (model FLOPs
utilisation of the matrix multiplications, fraction of peak memory bandwidth for element-wise
kernels and the optimizer step). ``intra_node_gbyte_s`` is the achievable one-direction bandwidth
between two GPUs of one node, taken as 80 % of half the datasheet's bidirectional NVLink / PCIe
figure (see docs/profiles.md). ``node_network_gbit_s`` is not a GPU figure either: it is the node NIC
this project assumes for a cluster of such GPUs when an instance does not say (the convention of
``instances/build_analytic_instances.py``: InfiniBand NDR 400 Gbit/s for H100/H200 nodes, HDR
200 Gbit/s for A100 nodes, 100 Gbit/s Ethernet otherwise).

An instance may declare GPUs of its own in a ``gpus:`` section (see docs/instance-format.md); they are
:class:`GpuSpec` objects like these and take precedence over the table for that instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

__all__ = ["DEFAULT_LINK_LATENCY_MS", "GPUS", "GpuSpec", "gpu_spec"]

TFLOPS = 1e12
LINK_EFFICIENCY = 0.8
"""Fraction of the one-direction link bandwidth a ring all-reduce achieves (assumption)."""
DEFAULT_LINK_LATENCY_MS = 0.005
"""Latency of the default intra- and inter-node links (5 µs, as instances/build_analytic_instances.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSpec:
    """Datasheet figures of one GPU type plus the assumed achievable fractions."""

    name: str
    fp32_flops: float
    """Peak FP32 (non-tensor) FLOP/s."""
    fp16_flops: float
    """Peak dense FP16 tensor-core FLOP/s."""
    bf16_flops: float | None
    """Peak dense BF16 tensor-core FLOP/s; ``None`` where the GPU has no BF16 tensor cores."""
    memory_gb: float
    """Device memory in GB (1e9 bytes, as the datasheets count)."""
    memory_gbyte_s: float
    """Peak memory bandwidth in GB/s."""
    link_bidir_gbyte_s: float
    """Datasheet GPU-to-GPU bandwidth inside a node (NVLink, or PCIe x16 where there is none), both
    directions together, GB/s."""
    link: str
    """``nvlink`` or ``pcie``."""
    efficiency: float
    """Achievable fraction of the peak matmul FLOP/s (assumption, not a datasheet figure)."""
    memory_efficiency: float = 0.8
    """Achievable fraction of the peak memory bandwidth (assumption)."""
    node_network_gbit_s: float = 100.0
    """Assumed NIC bandwidth of one node of such GPUs (the default ``inter_node`` of a cluster; an
    assumption, see the module docstring)."""
    source: str

    @property
    def intra_node_gbyte_s(self) -> float:
        """Achievable one-direction GPU-to-GPU bandwidth inside a node, GB/s."""
        return self.link_bidir_gbyte_s / 2.0 * LINK_EFFICIENCY

    def peak_flops(self, dtype: str) -> float | None:
        """Peak matmul FLOP/s when training in ``dtype``; ``None`` if the GPU cannot."""
        return {"fp32": self.fp32_flops, "fp16": self.fp16_flops, "bf16": self.bf16_flops}[dtype]


_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://nvdam.widen.net/s/nlpqvpcbcb/nvidia-h200-datasheet"
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/tesla-volta-v100-datasheet-letter-fnl-web.pdf"
_L40S = "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"
_T4 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"
_A10 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"
_A10G = ("NVIDIA A10 datasheet " + _A10 + " (no A10G datasheet is published; memory per AWS EC2 G5, "
         "https://aws.amazon.com/ec2/instance-types/g5/)")
_A40 = "https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf"
_L4 = "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"
_ADA = ("NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090), "
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")


def _table() -> dict[str, GpuSpec]:
    specs = (
        # H100 SXM5: FP32 67 TF, BF16/FP16 1,979 TF with sparsity = 989 dense, 80 GB HBM3 at 3.35 TB/s,
        # NVLink 900 GB/s.
        GpuSpec(name="H100-80", fp32_flops=67 * TFLOPS, fp16_flops=989 * TFLOPS, bf16_flops=989 * TFLOPS,
                memory_gb=80, memory_gbyte_s=3350, link_bidir_gbyte_s=900, link="nvlink",
                efficiency=0.45, node_network_gbit_s=400, source=_H100),
        # H100 PCIe: FP32 51 TF, BF16/FP16 1,513 TF with sparsity = 756 dense, 80 GB HBM2e at 2 TB/s,
        # PCIe Gen5 x16 128 GB/s (the NVLink bridge joins pairs only).
        GpuSpec(name="H100-PCIe", fp32_flops=51 * TFLOPS, fp16_flops=756 * TFLOPS, bf16_flops=756 * TFLOPS,
                memory_gb=80, memory_gbyte_s=2000, link_bidir_gbyte_s=128, link="pcie",
                efficiency=0.45, node_network_gbit_s=400, source=_H100),
        # H200 SXM: the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
        GpuSpec(name="H200-141", fp32_flops=67 * TFLOPS, fp16_flops=989 * TFLOPS, bf16_flops=989 * TFLOPS,
                memory_gb=141, memory_gbyte_s=4800, link_bidir_gbyte_s=900, link="nvlink",
                efficiency=0.45, node_network_gbit_s=400, source=_H200),
        # A100 SXM 80 GB: FP32 19.5 TF, BF16/FP16 312 TF dense, HBM2e 2,039 GB/s, NVLink 600 GB/s.
        GpuSpec(name="A100-80", fp32_flops=19.5 * TFLOPS, fp16_flops=312 * TFLOPS, bf16_flops=312 * TFLOPS,
                memory_gb=80, memory_gbyte_s=2039, link_bidir_gbyte_s=600, link="nvlink",
                efficiency=0.5, node_network_gbit_s=200, source=_A100),
        # A100 SXM 40 GB: same compute, HBM2 1,555 GB/s.
        GpuSpec(name="A100-40", fp32_flops=19.5 * TFLOPS, fp16_flops=312 * TFLOPS, bf16_flops=312 * TFLOPS,
                memory_gb=40, memory_gbyte_s=1555, link_bidir_gbyte_s=600, link="nvlink",
                efficiency=0.5, node_network_gbit_s=200, source=_A100),
        # V100 SXM2: FP32 15.7 TF, tensor (FP16) 125 TF, no BF16; HBM2 900 GB/s; NVLink 300 GB/s.
        GpuSpec(name="V100-16", fp32_flops=15.7 * TFLOPS, fp16_flops=125 * TFLOPS, bf16_flops=None,
                memory_gb=16, memory_gbyte_s=900, link_bidir_gbyte_s=300, link="nvlink",
                efficiency=0.4, source=_V100),
        GpuSpec(name="V100-32", fp32_flops=15.7 * TFLOPS, fp16_flops=125 * TFLOPS, bf16_flops=None,
                memory_gb=32, memory_gbyte_s=900, link_bidir_gbyte_s=300, link="nvlink",
                efficiency=0.4, source=_V100),
        # L40S: FP32 91.6 TF, BF16/FP16 tensor 362.05 TF dense (733 with sparsity), 48 GB GDDR6 at
        # 864 GB/s, no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional.
        GpuSpec(name="L40S", fp32_flops=91.6 * TFLOPS, fp16_flops=362.05 * TFLOPS, bf16_flops=362.05 * TFLOPS,
                memory_gb=48, memory_gbyte_s=864, link_bidir_gbyte_s=64, link="pcie",
                efficiency=0.4, source=_L40S),
        # A10: FP32 31.2 TF, BF16/FP16 tensor 125 TF dense, 24 GB GDDR6 at 600 GB/s, PCIe Gen4 64 GB/s.
        GpuSpec(name="A10-24", fp32_flops=31.2 * TFLOPS, fp16_flops=125 * TFLOPS, bf16_flops=125 * TFLOPS,
                memory_gb=24, memory_gbyte_s=600, link_bidir_gbyte_s=64, link="pcie",
                efficiency=0.4, source=_A10),
        # A10G (AWS G5): NVIDIA publishes no datasheet for this A10 variant. The A10 datasheet's figures
        # are used (24 GB GDDR6 at 600 GB/s as AWS states; the compute peaks are the A10's and may be
        # higher than the A10G's: declare measured figures under `gpus:` where that matters).
        GpuSpec(name="A10G", fp32_flops=31.2 * TFLOPS, fp16_flops=125 * TFLOPS, bf16_flops=125 * TFLOPS,
                memory_gb=24, memory_gbyte_s=600, link_bidir_gbyte_s=64, link="pcie",
                efficiency=0.4, source=_A10G),
        # A40: FP32 37.4 TF, BF16/FP16 tensor 149.7 TF dense (299.4 with sparsity), 48 GB GDDR6 at
        # 696 GB/s, PCIe Gen4 x16 64 GB/s (NVLink 112.5 GB/s bridges pairs only).
        GpuSpec(name="A40", fp32_flops=37.4 * TFLOPS, fp16_flops=149.7 * TFLOPS, bf16_flops=149.7 * TFLOPS,
                memory_gb=48, memory_gbyte_s=696, link_bidir_gbyte_s=64, link="pcie",
                efficiency=0.4, source=_A40),
        # L4: FP32 30.3 TF, BF16/FP16 tensor 242 TF with sparsity = 121 dense, 24 GB GDDR6 at 300 GB/s,
        # PCIe Gen4 x16 64 GB/s.
        GpuSpec(name="L4", fp32_flops=30.3 * TFLOPS, fp16_flops=121 * TFLOPS, bf16_flops=121 * TFLOPS,
                memory_gb=24, memory_gbyte_s=300, link_bidir_gbyte_s=64, link="pcie",
                efficiency=0.4, source=_L4),
        # GeForce RTX 4090: FP32 82.6 TF; FP16/BF16 tensor with FP32 accumulate 165.2 TF dense (330.4 with
        # sparsity); 24 GB GDDR6X at 1,008 GB/s; PCIe Gen4 x16 64 GB/s, no NVLink.
        GpuSpec(name="RTX-4090", fp32_flops=82.6 * TFLOPS, fp16_flops=165.2 * TFLOPS, bf16_flops=165.2 * TFLOPS,
                memory_gb=24, memory_gbyte_s=1008, link_bidir_gbyte_s=64, link="pcie",
                efficiency=0.4, source=_ADA),
        # T4: FP32 8.1 TF, mixed FP16/FP32 65 TF, no BF16; 16 GB GDDR6 at 320 GB/s; PCIe Gen3 x16 32 GB/s.
        GpuSpec(name="T4", fp32_flops=8.1 * TFLOPS, fp16_flops=65 * TFLOPS, bf16_flops=None,
                memory_gb=16, memory_gbyte_s=320, link_bidir_gbyte_s=32, link="pcie",
                efficiency=0.3, source=_T4),
    )
    return {s.name: s for s in specs}


GPUS: Mapping[str, GpuSpec] = MappingProxyType(_table())
"""The table, by name (read-only); pass your own ``GpuSpec`` to the generator to use other figures."""


def gpu_spec(name: str, table: Mapping[str, GpuSpec] | None = None) -> GpuSpec:
    """The entry for ``name`` in ``table`` (default: :data:`GPUS`); ValueError listing the known names
    otherwise."""
    table = GPUS if table is None else table
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown GPU type {name!r} (known: {', '.join(sorted(table))}; or declare it "
                         "under `gpus:` in the instance)") from None
