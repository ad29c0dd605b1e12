"""Engine processes die with the server (issue #18): after a SIGKILL of the server, the watcher
of ``server/engine/reaper.py`` ends every process the engine started within a few seconds. Here
on child Python programs standing in for the server; a real server with vLLM's engine running
is SIGKILLed at the end of ``test_engine_supervisor_vllm.py`` (its one server start serves both
checks), one killed during the engine's start in ``test_engine_reaper_startup.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from logitcache.server.engine.reaper import GRACE_S

#: The brief's bound: no engine process left this long after the kill.
GONE_WITHIN_S = 5.0


def _alive(pid: int) -> bool:
    """Running (a zombie holds no memory and counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_gone(pids: list[int], timeout: float) -> tuple[list[int], float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        left = [p for p in pids if _alive(p)]
        if not left:
            return [], time.monotonic() - t0
        time.sleep(0.05)
    return [p for p in pids if _alive(p)], time.monotonic() - t0


_FAKE_SERVER = """
import subprocess, sys, time
from logitcache.server.engine import reaper
before = reaper.own_descendants()
procs = [subprocess.Popen(["sleep", "300"]), subprocess.Popen(["sh", "-c", "sleep 301 & wait"])]
time.sleep(0.3)
new = {p: t for p, t in reaper.own_descendants().items() if before.get(p) != t}
reaper.protect(new)
print(" ".join(map(str, sorted(new))), flush=True)
time.sleep(300)
"""


@pytest.mark.subprocess  # a child Python program, SIGKILLed
def test_children_handed_to_the_reaper_die_with_a_sigkilled_parent() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVER], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3  # sleep, sh, and sh's sleep (a grandchild)
        time.sleep(0.5)
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        left, waited = _wait_gone(pids, GONE_WITHIN_S)
        assert left == [], f"still running {GONE_WITHIN_S} s after the kill: {left}"
    finally:
        for p in [parent.pid]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


_ARMED_SERVER = """
import subprocess, sys, time
from logitcache.server.engine import reaper
with reaper.armed():  # as the engine starts vLLM's processes
    # a daemon that left the tree at once (its parent exited): only the tag finds it
    subprocess.run(["sh", "-c", "sleep 302 & echo $!"], stdout=sys.stdout)
    sys.stdout.flush()
    print(subprocess.Popen(["sleep", "303"]).pid, flush=True)
    if sys.argv[1] == "inside":
        print(-1, flush=True)
        time.sleep(300)  # killed in the start-up window
print(subprocess.Popen(["sleep", "304"]).pid, flush=True)  # not the engine's: left alone
time.sleep(300)
"""


@pytest.mark.subprocess  # a child Python program, SIGKILLed
@pytest.mark.parametrize("when", ["inside", "after"])
def test_armed_reaper_ends_what_started_in_the_block_only(when: str) -> None:
    """Children started inside ``reaper.armed()`` end with a SIGKILLed parent, also when it is
    killed inside the block before the watcher could see them, including one already orphaned
    (ppid 1); a child started after the block is not the engine's and is left alone."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _ARMED_SERVER, when], stdout=subprocess.PIPE, text=True
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = [int(parent.stdout.readline()) for _ in range(3)]
        engine, late = pids[:2], pids[2]
        assert all(_alive(p) for p in engine)
        assert (late == -1) == (when == "inside")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        left, _ = _wait_gone(engine, GONE_WITHIN_S)
        assert left == [], f"still running {GONE_WITHIN_S} s after the kill: {left}"
        if when == "after":
            time.sleep(GRACE_S + 1.0)
            assert _alive(late), "a child started after the block was ended"
    finally:
        for p in pids:
            if p > 0 and _alive(p):
                os.kill(p, signal.SIGKILL)
