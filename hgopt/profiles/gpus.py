"""GPU table for the analytic profile generator.

Every peak figure is the vendor's datasheet value (dense, i.e. without structured sparsity); the URL
of the datasheet is kept with the entry in ``source``. The two efficiency factors are *not* datasheet
figures: they are this project's assumption of what a well-tuned training step achieves (model FLOPs
utilisation of the matrix multiplications, fraction of peak memory bandwidth for element-wise
kernels and the optimizer step). ``intra_node_gbyte_s`` is the achievable one-direction bandwidth
between two GPUs of one node, taken as 80 % of half the datasheet's bidirectional NVLink / PCIe
figure (see docs/profiles.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

__all__ = ["GPUS", "GpuSpec", "gpu_spec"]

TFLOPS = 1e12
LINK_EFFICIENCY = 0.8
"""Fraction of the one-direction link bandwidth a ring all-reduce achieves (assumption)."""


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


def _table() -> dict[str, GpuSpec]:
    specs = (
        # H100 SXM5: FP32 67 TF, BF16/FP16 1,979 TF with sparsity = 989 dense, 80 GB HBM3 at 3.35 TB/s,
        # NVLink 900 GB/s.
        GpuSpec(name="H100-80", fp32_flops=67 * TFLOPS, fp16_flops=989 * TFLOPS, bf16_flops=989 * TFLOPS,
                memory_gb=80, memory_gbyte_s=3350, link_bidir_gbyte_s=900, link="nvlink",
                efficiency=0.45, source=_H100),
        # H200 SXM: the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
        GpuSpec(name="H200-141", fp32_flops=67 * TFLOPS, fp16_flops=989 * TFLOPS, bf16_flops=989 * TFLOPS,
                memory_gb=141, memory_gbyte_s=4800, link_bidir_gbyte_s=900, link="nvlink",
                efficiency=0.45, source=_H200),
        # A100 SXM 80 GB: FP32 19.5 TF, BF16/FP16 312 TF dense, HBM2e 2,039 GB/s, NVLink 600 GB/s.
        GpuSpec(name="A100-80", fp32_flops=19.5 * TFLOPS, fp16_flops=312 * TFLOPS, bf16_flops=312 * TFLOPS,
                memory_gb=80, memory_gbyte_s=2039, link_bidir_gbyte_s=600, link="nvlink",
                efficiency=0.5, source=_A100),
        # A100 SXM 40 GB: same compute, HBM2 1,555 GB/s.
        GpuSpec(name="A100-40", fp32_flops=19.5 * TFLOPS, fp16_flops=312 * TFLOPS, bf16_flops=312 * TFLOPS,
                memory_gb=40, memory_gbyte_s=1555, link_bidir_gbyte_s=600, link="nvlink",
                efficiency=0.5, source=_A100),
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
        # T4: FP32 8.1 TF, mixed FP16/FP32 65 TF, no BF16; 16 GB GDDR6 at 320 GB/s; PCIe Gen3 x16 32 GB/s.
        GpuSpec(name="T4", fp32_flops=8.1 * TFLOPS, fp16_flops=65 * TFLOPS, bf16_flops=None,
                memory_gb=16, memory_gbyte_s=320, link_bidir_gbyte_s=32, link="pcie",
                efficiency=0.3, source=_T4),
    )
    return {s.name: s for s in specs}


GPUS: Mapping[str, GpuSpec] = MappingProxyType(_table())
"""The table, by name (read-only); pass your own ``GpuSpec`` to the generator to use other figures."""


def gpu_spec(name: str) -> GpuSpec:
    """The table entry for ``name``; ValueError listing the known names otherwise."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU type {name!r} (known: {', '.join(sorted(GPUS))})") from None
