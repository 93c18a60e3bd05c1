"""Measured per-layer times of a Hugging Face architecture on this device (``hgopt profile --hf-config``:
transformers' modules as the runner builds them) against the analytic profile's FLOP model
(``hgopt.profiles.hf`` -> ``hgopt.profiles.analytic``): the analytic time of a layer is its matmul FLOPs
divided by this device's measured dense-matmul rate (a large ``torch.matmul`` in the same dtype), i.e.
efficiency 1 relative to that rate; the ratio measured / analytic is the efficiency factor the GPU
table assumes (0.45 H100, 0.5 A100, 0.4 V100) for this device.

    python bench/hf_profile_vs_analytic.py [--config instances/hf/llama-tiny/config.json] [--seq 128]
        [--mbs 1,4] [--device cpu|cuda] [--dtype float32|bfloat16]

Prints a markdown table (layer kind, mbs, measured fwd/bwd ms, analytic fwd/bwd ms, measured/analytic).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def matmul_rate(device: str, dtype: str, n: int = 1024, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul (median of ``reps``)."""
    import torch

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    times = []
    for _ in range(reps + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[2:])
    return 2.0 * n**3 / times[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "instances/hf/llama-tiny/config.json"))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", default="1,4")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from hgopt.profiles.analytic import block_forward_flops, head_forward_flops
    from hgopt.profiles.hf import hf_transformer_config, read_hf_config

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        cmd = [sys.executable, "-m", "hgopt", "profile", "--hf-config", args.config, "-o", str(out), "--seq",
               str(args.seq), "--mbs", args.mbs, "--device", args.device, "--dtype", args.dtype, "--warmup", "2",
               "--repeat", str(args.repeat), "--gpu", "measured"]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        prof = json.loads(out.read_text())
    rate = matmul_rate(args.device, args.dtype)
    tc = hf_transformer_config(read_hf_config(args.config), seq_len=args.seq)
    print(f"device {args.device} ({args.dtype}), 1 thread; dense matmul rate {rate / 1e9:.1f} GFLOP/s "
          f"(1024^3, median of 10); config {Path(args.config).relative_to(REPO) if Path(args.config).is_relative_to(REPO) else args.config}, seq {args.seq}")
    print()
    print("| layer | mbs | measured fwd ms | analytic fwd ms | measured bwd ms | analytic bwd ms | measured / analytic (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|")
    for t in prof["timings"]:
        for i, kind in ((1, "block"), (len(prof["layers"]) - 1, "head")):
            flops = block_forward_flops(tc, t["mbs"]) if kind == "block" else head_forward_flops(tc, t["mbs"])
            af, ab = flops / rate, 2 * flops / rate
            mf, mb = t["fwd"][i], t["bwd"][i]
            print(f"| {kind} | {t['mbs']} | {mf * 1e3:.2f} | {af * 1e3:.2f} | {mb * 1e3:.2f} | {ab * 1e3:.2f} | "
                  f"{(mf + mb) / (af + ab):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
