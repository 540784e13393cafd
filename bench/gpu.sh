#!/usr/bin/env bash
# The GPU check, prepared for a CUDA machine (one call, < 8 minutes):
#   bench/gpu.sh OUT_DIR
# A BERT-base-sized encoder built from a config (random weights, no hub): eager vs torch.compile
# (mode reduce-overhead → CUDA graphs) per bucket and batch size in fp16 and bf16, and served
# throughput (embedserve, static shapes + CUDA graphs) vs the offline limit. Writes table.md and
# results.json to OUT_DIR; add the figures to bench/RESULTS.md.
set -euo pipefail
out=${1:?usage: bench/gpu.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
timeout 450 "$py" -m bench.gpu_bench --out "$out" 2>&1 | tee "$out/log.txt"
