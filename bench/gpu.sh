#!/usr/bin/env bash
# The GPU check, prepared for a CUDA machine (one call, at most ~7.3 minutes):
#   bench/gpu.sh OUT_DIR [TOKENIZER_DIR]
# 1. the CUDA tests: padded graph replays vs eager, packed rows (FlashAttention-2 varlen, fp32
#    memory-efficient varlen) vs padded rows at every stream size of the ladder, in graphs;
# 2. bench/gpu_bench.py: kernels (padded eager vs graphs, packed streams), the offline limit and
#    packed offline, then served runs while the budget lasts: 32 texts/request packed and padded,
#    infinity-emb, single-text packed with FRONTENDS 1/4/8, padded; MFU beside every figure.
# MODEL=bert-base (default: BERT-base from a config, random weights) or MODEL=minilm (the
# packaged all-MiniLM-L6-v2): one model per call. infinity-emb runs when INFINITY_PYTHON names a
# Python with it, or INFINITY_WHEELS a directory of its wheels (installed here into a venv over
# the machine's torch, offline). PHASES narrows the bench (kernels,offline,served[,inductor]).
# Writes gpu.txt, pytest.txt, log.txt, results.json and table.md to OUT_DIR; add the figures to
# bench/RESULTS.md. TOKENIZER_DIR (a BERT vocabulary) defaults to the packaged model's.
# DRY_RUN=1 runs all of it on a CPU (tiny model, small corpus, no time limit): a check of the script.
set -uo pipefail
start=$SECONDS
total=${TOTAL_S:-430}  # seconds for the whole call: 8 minutes less a margin for start and copy-back
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
[ -n "${DRY_RUN:-}" ] && total=3600
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"; } | tee "$out/gpu.txt"
"$py" -c "import torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__)" | tee -a "$out/gpu.txt"
timeout 100 "$py" -m pytest -q -p no:cacheprovider tests/server/test_encoder.py tests/server/test_packing.py \
  tests/server/test_packing_models.py 2>&1 | tail -30 | tee "$out/pytest.txt"
if [ -z "${INFINITY_PYTHON:-}" ] && [ -d "${INFINITY_WHEELS:-}" ]; then
  # Its own venv (transformers 4.57, numpy<2) over the machine's CUDA torch.
  "$py" -m venv --system-site-packages "$out/infinity-venv" \
    && timeout 90 "$out/infinity-venv/bin/pip" install -q --no-index --find-links "$INFINITY_WHEELS" "infinity-emb[server]" \
    && export INFINITY_PYTHON="$out/infinity-venv/bin/python" || echo "infinity-emb wheels did not install: skipped" | tee -a "$out/gpu.txt"
fi
left=$(( total - (SECONDS - start) - 15 ))
timeout $(( left + 10 )) "$py" -m bench.gpu_bench --out "$out" --tokenizer "$tok" --model "${MODEL:-bert-base}" \
  --budget-s "$left" --phases "${PHASES:-kernels,offline,served}" ${DRY_RUN:+--dry-run} 2>&1 | tee "$out/log.txt"
