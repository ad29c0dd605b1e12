"""Engine processes die with the server: a small watcher process that ends them when the
server process is gone, however it ended (SIGKILL and OOM kills included).

vLLM's ``AsyncLLM`` runs its engine core in a child process (``fork`` or ``spawn``), and a
SIGKILLed parent runs no clean-up, so without help the engine (GiBs of weights and KV cache)
outlives the server. ``PR_SET_PDEATHSIG`` would need code in the child at start (impossible for
``spawn`` children without patching vLLM) and fires when the creating *thread* exits. Instead:

* an engine notes this process's descendants before it starts (:func:`descendants`) and hands
  the new ones to :func:`protect` after; that starts, once per server process,
  ``python -S .../reaper.py <server pid>`` (stdlib only) and sends it the processes as
  ``pid starttime`` lines on its stdin;
* the watcher polls ``getppid()`` every :data:`POLL_S` seconds; when its parent changed (the
  server is gone) or its stdin closed, it sends SIGTERM to every recorded process still alive
  with the same start time (pid reuse is never hit), and to their descendants, then SIGKILL to
  what is left after :data:`GRACE_S` seconds, and exits.

Linux only (``/proc``); elsewhere :func:`protect` does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

POLL_S = 0.2
GRACE_S = 2.0

_lock = threading.Lock()
_watcher: subprocess.Popen[bytes] | None = None


def _stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, starttime)`` of ``pid`` from ``/proc/<pid>/stat``; None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """``{pid: starttime}`` of every live descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = _stat(int(entry.name))
        if st is not None:
            children.setdefault(st[0], []).append(int(entry.name))
            starts[int(entry.name)] = st[1]
    out: dict[int, int] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p not in out and p in starts:
            out[p] = starts[p]
            todo.extend(children.get(p, []))
    return out


def own_descendants() -> dict[int, int]:
    """``{pid: starttime}`` of this process's live descendants ({} off Linux)."""
    return descendants(os.getpid()) if sys.platform.startswith("linux") else {}


def protect(procs: dict[int, int]) -> None:
    """Have the watcher end ``procs`` (``{pid: starttime}``, from :func:`own_descendants`) and
    their descendants once this process is gone."""
    global _watcher
    if not sys.platform.startswith("linux") or not procs:
        return
    with _lock:
        if _watcher is None or _watcher.poll() is not None:
            # run as a plain script: stdlib imports only, so it is watching within milliseconds
            _watcher = subprocess.Popen(
                [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid())],
                stdin=subprocess.PIPE,
                close_fds=True,
            )
        assert _watcher.stdin is not None
        _watcher.stdin.write(b"".join(f"{p} {s}\n".encode() for p, s in procs.items()))
        _watcher.stdin.flush()


def _signal_all(recorded: dict[int, int], sig: int) -> int:
    """Send ``sig`` to the recorded processes still alive (same start time) and to their
    descendants; returns how many were signalled."""
    targets: dict[int, int] = {}
    for pid, start in recorded.items():
        st = _stat(pid)
        if st is not None and st[1] == start:
            targets[pid] = start
            targets.update(descendants(pid))
    for pid in targets:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return len(targets)


def watch(parent: int) -> None:
    """The watcher's loop (see the module docstring)."""
    recorded: dict[int, int] = {}
    buf = b""
    fd = sys.stdin.fileno()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the server
    parent_alive = True
    while True:
        # once the parent is gone, read what it wrote before dying (up to EOF), then act
        parent_alive = parent_alive and os.getppid() == parent
        ready, _, _ = select.select([fd], [], [], POLL_S if parent_alive else 0)
        if not ready:
            if parent_alive:
                continue
            break
        chunk = os.read(fd, 65536)
        if not chunk:  # EOF: the server exited (or closed our stdin)
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            pid, start = line.split()
            recorded[int(pid)] = int(start)
    if _signal_all(recorded, signal.SIGTERM):
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(
            (st := _stat(p)) is not None and st[1] == s for p, s in recorded.items()
        ):
            time.sleep(0.05)
        _signal_all(recorded, signal.SIGKILL)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
