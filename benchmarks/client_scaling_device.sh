#!/usr/bin/env bash
# benchmarks/client_scaling.py on a box where the project is not installed (the device H200 box):
# the pure-Python/manylinux wheels in .whl-data (zarr, numcodecs, pydantic, fastapi, uvicorn, ...)
# go to /tmp/site, the logitcache namespace is made of symlinks to the repository's folders.
# Usage: bash benchmarks/client_scaling_device.sh OUTDIR [client_scaling.py options...]
set -euo pipefail
out="$1"
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl-data/*.whl
mkdir -p /tmp/lcpkg/logitcache "$out"
for d in cache_format client server fixtures protocol; do ln -sfn "$PWD/$d" "/tmp/lcpkg/logitcache/$d"; done
export PYTHONPATH="/tmp/site:/tmp/lcpkg:$PWD/tests" PYTHONUNBUFFERED=1
nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.used --format=csv || true
python3 -c "import torch, zarr, fastapi, logitcache.client; print(torch.__version__, zarr.__version__)"
python3 benchmarks/client_scaling.py --json "$out/client_scaling.json" \
    --plot "$out/client_scaling.png" "$@" 2>&1 | tee "$out/client_scaling_log.txt"
