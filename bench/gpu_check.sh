#!/usr/bin/env bash
# GPU check of the Hugging Face runner path (issue 12, point 8), at most ~8 minutes on one GPU.
# NOT RUN YET: no GPU was lent to the task that wrote it. Run from the repository root:
#     bash bench/gpu_check.sh [OUT_DIR]            (default OUT_DIR: ${OUT:-/tmp/hgopt-gpu-check})
# Needs: torch with CUDA, transformers (pip install -e '.[runner,hf]'). Writes OUT_DIR/gpu_check.md.
#  1. a single-GPU bf16 run (cuda, nccl) of the Llama-shaped instance hf-llama-tiny-2r as ONE stage
#     (all 4 layers, mbs 8), 20 steps, mixed precision (bf16 weights, fp32 masters): loss must fall;
#  2. `hgopt profile --hf-config` on CUDA in bf16 of a Llama-shaped 1B-class config (hidden 2048, 16 heads,
#     8 KV heads, SwiGLU 5632, 4 layers, vocab 32000, seq 1024), mbs 1 and 4;
#  3. measured per-layer times against the analytic profile of the same config on the table's H100-80
#     (efficiency 0.45) and H200-141 entries: measured / analytic per layer and the implied efficiency.
set -euo pipefail
OUT_DIR=${1:-${OUT:-/tmp/hgopt-gpu-check}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python}
export PYTHONPATH=${PYTHONPATH:-$PWD}
log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$OUT_DIR/log.txt"; }

log "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo 'nvidia-smi failed')"
timeout 60 $PY -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA'; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT_DIR/log.txt"

# ---- 1. single-GPU bf16 stage --------------------------------------------------------------------------
cat > "$OUT_DIR/one_stage_plan.json" <<'JSON'
{"version": 1, "planner": "manual", "instance": "hf-llama-tiny-2r",
 "pipelines": [{"num_microbatches": 1, "schedule": "1f1b",
   "stages": [{"layers": [0, 4], "groups": [{"cluster": "us-a100-80", "tp": 1, "dp": 1, "mbs": 8}]}]}]}
JSON
log "1. export + run: one stage, bf16 mixed precision, cuda"
timeout 60 $PY -m hgopt export "$OUT_DIR/one_stage_plan.json" --instance hf-llama-tiny-2r -o "$OUT_DIR/run1" \
    --local --device cuda --dtype bfloat16 --steps 20 --lr 3e-3 --data text --seq 64 --master-port 0 | tee -a "$OUT_DIR/log.txt"
timeout 180 $PY -m hgopt.runner --plan "$OUT_DIR/run1/plan.json" --device cuda 2>&1 | tail -25 | tee -a "$OUT_DIR/log.txt"
$PY - "$OUT_DIR" <<'PYEOF' | tee -a "$OUT_DIR/gpu_check.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(l) for l in (out / "run1/run/metrics.jsonl").read_text().splitlines()]
print("## 1. single-GPU bf16 stage (hf-llama-tiny-2r, 4 layers, mbs 8, seq 64, 20 steps)\n")
print(f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}; median step "
      f"{sorted(r['time_s'] for r in rows[2:])[len(rows[2:]) // 2] * 1e3:.1f} ms; falls: {rows[-1]['loss'] < rows[0]['loss']}\n")
PYEOF

# ---- 2. profile a 1B-class Llama-shaped config on CUDA in bf16 -------------------------------------------
mkdir -p "$OUT_DIR/llama-1b-shape"
cat > "$OUT_DIR/llama-1b-shape/config.json" <<'JSON'
{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
 "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 2048,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false}
JSON
log "2. hgopt profile --hf-config on cuda, bf16"
timeout 240 $PY -m hgopt profile --hf-config "$OUT_DIR/llama-1b-shape/config.json" -o "$OUT_DIR/measured.json" \
    --device cuda --dtype bfloat16 --seq 1024 --mbs 1,4 --tp 1 --warmup 3 --repeat 10 --gpu measured | tee -a "$OUT_DIR/log.txt"

# ---- 3. measured vs analytic -----------------------------------------------------------------------------
log "3. analytic profile of the same config"
timeout 60 $PY -m hgopt model import "$OUT_DIR/llama-1b-shape/config.json" -o "$OUT_DIR/analytic.json" \
    --gpus H100-80,H200-141 --seq-len 1024 --dtype bf16 --tps 1 --mbss 1,4 | tee -a "$OUT_DIR/log.txt"
$PY - "$OUT_DIR" <<'PYEOF' | tee -a "$OUT_DIR/gpu_check.md"
import json, sys
from pathlib import Path
from hgopt.profiles.gpus import gpu_spec
out = Path(sys.argv[1])
meas, ana = json.loads((out / "measured.json").read_text()), json.loads((out / "analytic.json").read_text())
kinds = [l["kind"] for l in meas["layers"]]
print("## 2./3. measured (hgopt profile --hf-config, cuda, bf16) vs analytic, Llama-shaped hidden 2048, seq 1024\n")
print("| gpu entry (efficiency) | layer | mbs | measured fwd+bwd ms | analytic fwd+bwd ms | measured / analytic | implied efficiency |")
print("|---|---|---|---|---|---|---|")
for a in ana["timings"]:
    eff = gpu_spec(a["gpu"]).efficiency
    m = next(t for t in meas["timings"] if t["mbs"] == a["mbs"] and t["tp"] == a["tp"])
    for i in (1, len(kinds) - 1):
        mt, at = m["fwd"][i] + m["bwd"][i], a["fwd"][i] + a["bwd"][i]
        print(f"| {a['gpu']} ({eff}) | {kinds[i]} | {a['mbs']} | {mt * 1e3:.3f} | {at * 1e3:.3f} | {mt / at:.2f} | {eff * at / mt:.2f} |")
PYEOF
log "done: $OUT_DIR/gpu_check.md"
