"""A Docker engine, a Python base image and the CPU teacher image, made on this machine for the
container tests (tests/test_docker_*.py, marker ``container``).

No image registry is reachable from the test machines, so everything comes from the Debian
package mirror the machine's apt uses, the package registry (PyPI) and local disk:

* :func:`docker_engine`: the running engine if ``docker info`` answers, else ``dockerd`` started
  here (``apt-get install docker.io`` first if it is missing) without iptables or a default
  bridge (compose's own network and its published ports work without them), on ``overlay2``
  storage, or ``vfs`` where overlay mounts are refused (vfs copies the whole image for every
  build step: minutes per step for this image); stopped after;
* :func:`python_base_image`: Debian bookworm (``debootstrap --variant=minbase`` with python3,
  python3-venv and the Python headers, as in python:3.11-slim) imported as
  ``logitcache-test/python:bookworm-<hash of the package list>``, the ``PYTHON_IMAGE`` of the CPU
  Dockerfile in place of ``python:3.11-slim-bookworm``. It carries the machine's CA bundle (a
  TLS-inspecting proxy's CA, if any, is in it) so that pip inside the build reaches PyPI;
* :func:`torch_index`: the torch wheel of this venv (``pip download``: the machine's pip
  configuration finds the local wheel) served as a PEP 503 index on 127.0.0.1, the
  ``TORCH_INDEX`` build argument (the build runs with ``--network host``);
* :class:`Compose`: ``docker compose`` (v2) if the CLI has it, else Debian's ``docker-compose``.

Images are kept between runs (the engine's data root is the default ``/var/lib/docker``), so a
second run rebuilds only what changed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
DOCKERD_ARGS = ["--iptables=false", "--bridge=none"]
STORAGE_DRIVERS = ("overlay2", "vfs")
SUITE = "bookworm"
#: What the base adds to debootstrap's minimal system; python:3.11-slim carries its Python's
#: headers too (torch.compile's C++ kernels include them).
BASE_PACKAGES = "python3,python3-venv,libpython3.11-dev,ca-certificates"
BASE_IMAGE = (
    f"logitcache-test/python:{SUITE}-{hashlib.sha256(BASE_PACKAGES.encode()).hexdigest()[:8]}"
)
CPU_IMAGE = "logitcache/teacher-cpu:test"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
#: The image's service user (docker/cpu.Dockerfile's UID).
SERVICE_UID = 10001
TORCH_INDEX_PORT = 18765


def run(
    argv: list[str], *, timeout: float = 120, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; on failure raise with its output (the tail of it)."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}:\n{out}")
    return proc


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    return run(["docker", *args], timeout=timeout, check=check).stdout.strip()


def ensure_debian_packages(commands: dict[str, str]) -> None:
    """Install the Debian package of each missing command (``{command: package}``)."""
    missing = sorted({pkg for cmd, pkg in commands.items() if shutil.which(cmd) is None})
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], timeout=600, env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], timeout=900, env=env)


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return run(["docker", "info"], timeout=30, check=False).returncode == 0


@contextlib.contextmanager
def docker_engine(log_path: Path, timeout: float = 120) -> Iterator[None]:
    """A Docker engine for the duration of the block: the running one, or one started here."""
    if engine_answers():
        yield
        return
    ensure_debian_packages({"dockerd": "docker.io", "docker": "docker.io"})
    proc = None
    try:
        for driver in STORAGE_DRIVERS:
            with log_path.open("ab") as log:
                argv = ["dockerd", "--storage-driver", driver, *DOCKERD_ARGS]
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            deadline = time.monotonic() + timeout
            while not engine_answers() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            if proc.poll() is None and engine_answers():
                break
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        else:
            raise RuntimeError(f"dockerd did not start:\n{log_path.read_text()[-3000:]}")
        yield
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def image_exists(tag: str) -> bool:
    return run(["docker", "image", "inspect", tag], timeout=30, check=False).returncode == 0


def debian_mirror() -> str:
    """The Debian archive the machine's apt uses (``deb.debian.org`` if none is configured)."""
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            texts.append(path.read_text())
    for url in re.findall(r"(?:^deb\s+(?:\[[^\]]*\]\s+)?|^URIs:\s*)(\S+)", "\n".join(texts), re.M):
        if url.rstrip("/").endswith("/debian"):
            return url
    return "http://deb.debian.org/debian"


def python_base_image(workdir: Path) -> str:
    """:data:`BASE_IMAGE`, made with debootstrap unless the engine has it."""
    if image_exists(BASE_IMAGE):
        return BASE_IMAGE
    ensure_debian_packages({"debootstrap": "debootstrap"})
    root = workdir / "rootfs"
    include = f"--include={BASE_PACKAGES}"
    argv = ["debootstrap", "--variant=minbase", include, SUITE, str(root), debian_mirror()]
    run(["nice", "-n", "10", *argv], timeout=1200)
    try:
        shutil.copyfile(CA_BUNDLE, root / CA_BUNDLE.relative_to("/"))
        shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
        for deb in (root / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        tar = workdir / "rootfs.tar"
        with tarfile.open(tar, "w") as t:
            t.add(root, arcname=".")
        changes = [f"ENV PIP_CERT={CA_BUNDLE}", f"ENV SSL_CERT_FILE={CA_BUNDLE}", 'CMD ["python3"]']
        argv = ["docker", "import", *(a for c in changes for a in ("--change", c))]
        run([*argv, str(tar), BASE_IMAGE], timeout=600)
        tar.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return BASE_IMAGE


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def torch_index(workdir: Path) -> Iterator[str]:
    """A PEP 503 index on 127.0.0.1 holding this venv's torch wheel; yields its URL."""
    wheels = workdir / "torch-index" / "torch"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("torch-*.whl")):
        want = f"torch=={version('torch')}"
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        run([*pip, want, "-d", str(wheels)], timeout=900)
    handler = functools.partial(_Quiet, directory=str(wheels.parent))
    try:  # a fixed port: the URL is a build argument, part of the dependency layer's cache key
        server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def build_image(dockerfile: str, tag: str, log_path: Path, **build_args: str) -> float:
    """``docker build --network host`` of ``dockerfile`` (context: the repository) with the build
    arguments; returns the seconds it took (the log goes to ``log_path``)."""
    argv = ["nice", "-n", "10", "docker", "build", "--network", "host", "-f", dockerfile]
    for name, value in build_args.items():
        argv += ["--build-arg", f"{name}={value}"]
    argv += ["-t", tag, "."]
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}  # the engine's own builder: no buildx plugin
    start = time.monotonic()
    with log_path.open("a") as log:
        proc = subprocess.run(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=3600
        )
    if proc.returncode != 0:
        raise RuntimeError(f"docker build failed:\n{log_path.read_text()[-5000:]}")
    return time.monotonic() - start


def build_cpu_image(base: str, index_url: str, log_path: Path, tag: str = CPU_IMAGE) -> float:
    """docker/cpu.Dockerfile as docker/README.md builds it, with the local base and torch index."""
    return build_image(
        "docker/cpu.Dockerfile", tag, log_path, PYTHON_IMAGE=base, TORCH_INDEX=index_url
    )


def compose_command() -> list[str]:
    """``docker compose`` (v2) if the CLI has it, else Debian's ``docker-compose`` (v1)."""
    if run(["docker", "compose", "version"], timeout=30, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        ensure_debian_packages({"docker-compose": "docker-compose"})
    return ["docker-compose"]


class Compose:
    """One compose project: the repository's compose file plus overrides, an env file, and the
    caller's environment minus the variables compose would substitute."""

    def __init__(
        self,
        project: str,
        files: list[Path],
        env: dict[str, str],
        workdir: Path,
        profiles: list[str] = [],  # noqa: B006 (never mutated)
    ):
        self.project = project
        self.env_file = workdir / f"{project}.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        self.argv = [*compose_command(), "-p", project, "--env-file", str(self.env_file)]
        for f in files:
            self.argv += ["-f", str(f)]
        for p in profiles:
            self.argv += ["--profile", p]
        keep = re.compile(r"(LOGITCACHE|MINIO|VLLM|HF|COMPOSE)_")
        self.environ = {k: v for k, v in os.environ.items() if not keep.match(k)}

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        proc = run([*self.argv, *args], timeout=timeout, check=check, cwd=REPO, env=self.environ)
        return proc.stdout + proc.stderr

    def container(self, service: str) -> str:
        """The id of the service's container (``ps -q``)."""
        ids = self("ps", "-q", service).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        return json.loads(docker("inspect", self.container(service)))[0]

    def wait_healthy(self, service: str, timeout: float = 400) -> float:
        """Wait for the container's health status ``healthy``; returns the seconds waited."""
        start = time.monotonic()
        while True:
            state = self.inspect(service)["State"]
            status = state.get("Health", {}).get("Status")
            if status == "healthy":
                return time.monotonic() - start
            if not state["Running"] or time.monotonic() - start > timeout:
                logs = self("logs", "--tail", "60", service, check=False)
                raise AssertionError(f"{service} not healthy ({state}):\n{logs[-5000:]}")
            time.sleep(1)

    def volume_dir(self, name: str) -> Path:
        """Host directory of the project's named volume ``name``."""
        return Path(docker("volume", "inspect", "-f", "{{.Mountpoint}}", f"{self.project}_{name}"))

    def down(self) -> None:
        """Remove the project's containers, networks and volumes."""
        self("down", "-v", "--remove-orphans", "-t", "30", check=False)


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
