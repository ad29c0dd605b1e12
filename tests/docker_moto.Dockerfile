# An S3-compatible server image for the `s3` profile's test (tests/docker_compose.s3-moto.yml):
# moto in server mode, on the same local Python base as the teacher image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv && pip install "moto[server]>=5.2"
USER nobody
