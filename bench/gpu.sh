#!/usr/bin/env bash
# The GPU check, prepared for a CUDA machine (one call, about 7 minutes, at most 7.7):
#   bench/gpu.sh OUT_DIR [TOKENIZER_DIR]
# 1. the CUDA tests of the encoder (graph replays vs eager, torch.compile + graphs);
# 2. bench/gpu_bench.py on a BERT-base-sized encoder built from a config (random weights, no hub):
#    eager vs CUDA graphs per bucket and batch size in bf16 and fp16, served throughput vs the
#    offline limit, and torch.compile (inductor) compile cost and speed on a few shapes.
# Writes gpu.txt, pytest.txt, log.txt, results.json and table.md to OUT_DIR; add the figures to
# bench/RESULTS.md. TOKENIZER_DIR (a BERT vocabulary) defaults to the packaged model's.
set -uo pipefail
out=${1:?usage: bench/gpu.sh OUT_DIR [TOKENIZER_DIR]}
tok=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONPATH="server:operator:.${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -z "$tok" ]; then
  tok="$out/tokenizer"
  "$py" -c "import sys; from transformers import AutoTokenizer; from embedserve.model_source import packaged_model_dir; \
AutoTokenizer.from_pretrained(str(packaged_model_dir())).save_pretrained(sys.argv[1])" "$tok" || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
"$py" -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__)" | tee -a "$out/gpu.txt"
timeout 60 "$py" -m pytest -q -p no:cacheprovider tests/server/test_encoder.py 2>&1 | tail -30 | tee "$out/pytest.txt"
timeout 400 "$py" -m bench.gpu_bench --out "$out" --tokenizer "$tok" --phases "${PHASES:-kernels,served,inductor}" 2>&1 | tee "$out/log.txt"
