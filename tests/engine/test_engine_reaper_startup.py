"""No orphan from a server SIGKILLed while its engine starts: the reaper (``server/engine/
reaper.py``) is armed before vLLM starts a process, so whatever the server had started by the
moment of the kill (only the watcher, the engine core just spawned, loading the model, profiling
memory) ends within seconds. A kill of a ready server is
``test_engine_reaper.py::test_readme_started_server_sigkilled_leaves_no_engine_process``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from logitcache.server.engine.reaper import TAG_VAR
from server_support import VLLM_ENV, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: No process of the killed server's tree may be running this long after the kill.
GONE_WITHIN_S = 5.0


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _tagged(server_pid: int) -> list[psutil.Process]:
    """Processes carrying the server's reaper tag (its children, wherever they are now)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_VAR, "").startswith(f"{server_pid}:"):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _names(procs: list[psutil.Process]) -> list[str]:
    """Each process's name and command line (gone ones left out)."""
    out = []
    for p in procs:
        try:
            out.append(p.name() + " " + " ".join(p.cmdline()))
        except psutil.Error:
            continue
    return out


#: phase -> (a process that must exist at the kill, seconds to wait after it appeared). vLLM's
#: engine core loads the model and profiles memory in the seconds after it appears (in a worker
#: process of its own on some runs).
PHASES: dict[str, tuple[str, float]] = {
    "reaper-armed-before-engine-spawn": ("reaper.py", 0.0),
    "engine-core-spawned": ("EngineCore", 0.0),
    "engine-core-loading": ("EngineCore", 5.0),
    "engine-core-profiling": ("EngineCore", 12.0),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigkill_during_engine_start_leaves_no_process(
    tiny: Any, tmp_path: Path, phase: str
) -> None:
    wanted, after_s = PHASES[phase]
    exe = Path(sys.executable).with_name("logitcache-server")
    argv = [str(exe), "--model", str(tiny.teacher_dir), "-k", "8", "--port", str(free_port())]
    argv += ["--store-root", str(tmp_path / "caches"), "--data-dir", str(tmp_path / "data")]
    argv += ["--state-dir", str(tmp_path / "state")]
    (tmp_path / "data").mkdir()
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {wanted} in time"
            tree = _tree(server.pid)
            seen.update((p.pid, p) for p in tree)
            if any(wanted in n for n in _names(tree)):
                break
            time.sleep(0.02)
        end = time.monotonic() + after_s
        while time.monotonic() < end:
            seen.update((p.pid, p) for p in _tree(server.pid))
            time.sleep(0.05)
        seen.update((p.pid, p) for p in _tree(server.pid))
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        t0 = time.monotonic()
        left: list[psutil.Process] = []
        while time.monotonic() - t0 < GONE_WITHIN_S:
            left = _running([*seen.values(), *_tagged(server.pid)])
            if not left:
                break
            time.sleep(0.1)
        assert left == [], f"{phase}: still running {GONE_WITHIN_S} s after the kill: " + str(
            [(p.pid, _names([p])) for p in left]
        )
    finally:
        if server.poll() is None:
            server.kill()
        for p in _running([*seen.values(), *_tagged(server.pid)]):
            p.kill()
