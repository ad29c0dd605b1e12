"""No orphan from a server SIGKILLed while its engine starts: the reaper (``server/engine/
reaper.py``) is armed before vLLM starts a process, so whatever the server had started by the
moment of the kill (only the watcher; the engine core just spawned; the core and the worker it
has just spawned, still importing) ends within seconds. The kill comes on a signal of the start
itself (a process appearing), not after a fixed time. The other process set, the engine core
with its worker started and the model served (after two engine restarts), is killed at the end of
``test_engine_supervisor_vllm.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from logitcache.server.engine.reaper import TAG_VAR
from server_support import VLLM_ENV, free_port, running

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: No process of the killed server's tree may be running this long after the kill.
GONE_WITHIN_S = 5.0


def _child_pids(pid: int) -> list[int]:
    """``pid``'s children, from each of its threads' ``/proc/<pid>/task/<tid>/children``."""
    out: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in children.read_text().split()]
        except OSError:
            continue
    return out


_procs: dict[int, psutil.Process] = {}


def _tree(pid: int) -> list[psutil.Process]:
    """The processes under ``pid``, read from ``/proc`` along the tree only: psutil's
    ``children(recursive=True)`` reads every process's ``stat`` on the machine (~2 ms of CPU a
    call, polled every 20 ms for the whole start). A ``psutil.Process`` is made once per pid."""
    out: list[psutil.Process] = []
    todo = _child_pids(pid)
    while todo:
        child = todo.pop()
        try:
            proc = _procs.get(child)
            if proc is None or not proc.is_running():  # a new pid, or a reused one
                proc = _procs[child] = psutil.Process(child)
        except psutil.Error:
            continue
        out.append(proc)
        todo += _child_pids(child)
    return out


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


def _names(procs: list[psutil.Process]) -> list[str]:
    """Each process's name and command line (gone ones left out)."""
    out = []
    for p in procs:
        try:
            out.append(p.name() + " " + " ".join(p.cmdline()))
        except psutil.Error:
            continue
    return out


def _has(tree: list[psutil.Process], wanted: str) -> bool:
    return any(wanted in n for n in _names(tree))


def _worker_spawned(tree: list[psutil.Process]) -> bool:
    """vLLM's engine core has spawned its worker (a process of ``multiprocessing.spawn`` under
    the engine core, still importing, or already named ``Worker``)."""
    cores = {p.pid for p in tree if _has([p], "EngineCore")}
    for p in tree:
        try:
            spawned = p.ppid() in cores and _has([p], "multiprocessing.spawn")
            if spawned or _has([p], "Worker"):
                return True
        except psutil.Error:
            continue
    return False


#: phase -> the state of the server's start at which it is killed (its process tree so far).
PHASES: dict[str, Callable[[list[psutil.Process]], bool]] = {
    "reaper-armed-before-engine-spawn": lambda tree: _has(tree, "reaper.py"),
    # spawned and still importing: vLLM names it ``EngineCore`` only once its imports are done
    "engine-core-spawned": lambda tree: (
        _has(tree, "multiprocessing.spawn") or _has(tree, "EngineCore")
    ),
    "engine-worker-spawned": _worker_spawned,
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigkill_during_engine_start_leaves_no_process(
    tiny: Any, tmp_path: Path, phase: str
) -> None:
    reached = PHASES[phase]
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
            assert time.monotonic() < deadline, f"{phase} not reached in time"
            tree = _tree(server.pid)
            seen.update((p.pid, p) for p in tree)
            if reached(tree):
                break
            time.sleep(0.02)
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        t0 = time.monotonic()
        left: list[psutil.Process] = []
        while time.monotonic() - t0 < GONE_WITHIN_S:
            left = running([*seen.values(), *_tagged(server.pid)])
            if not left:
                break
            time.sleep(0.1)
        assert left == [], f"{phase}: still running {GONE_WITHIN_S} s after the kill: " + str(
            [(p.pid, _names([p])) for p in left]
        )
    finally:
        if server.poll() is None:
            server.kill()
        for p in running([*seen.values(), *_tagged(server.pid)]):
            p.kill()
