"""Engine processes die with the server: a small watcher process that ends them when the
server process is gone, however it ended (SIGKILL and OOM kills included), also while the
engine is still starting.

An engine starts its processes inside :func:`armed`: the watcher (``python -S reaper.py <server
pid> <tag>``, stdlib only) is started first; while the block runs, the tag is in the
environment as :data:`TAG_VAR` (so every process started meanwhile inherits it) and the watcher
records the server's descendants every :data:`SCAN_S` seconds; after it, those processes are
handed to the watcher (:func:`protect`) and the tag removed.

When the watcher's parent changes or its stdin closes, it sends SIGTERM to every recorded
process still alive with the same start time, their descendants and every process carrying the
tag, then SIGKILL after :data:`GRACE_S` seconds. Linux only; elsewhere :func:`armed` and
:func:`protect` do nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

POLL_S = 0.2
SCAN_S = 0.25
GRACE_S = 2.0

#: Environment variable naming the server whose watcher ends a process (``<pid>:<starttime>``).
TAG_VAR = "_LOGITCACHE_OWNER"
#: Watcher commands: record the server's descendants every SCAN_S seconds, or stop doing so.
SCAN_ON, SCAN_OFF = "scan on", "scan off"

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


def _pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def descendants(pid: int) -> dict[int, int]:
    """``{pid: starttime}`` of every live descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for p in _pids():
        st = _stat(p)
        if st is not None:
            children.setdefault(st[0], []).append(p)
            starts[p] = st[1]
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


def tagged(tag: str) -> dict[int, int]:
    """``{pid: starttime}`` of the live processes whose environment has ``TAG_VAR=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    out: dict[int, int] = {}
    for p in _pids():
        try:
            env = Path(f"/proc/{p}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and (st := _stat(p)) is not None:
            out[p] = st[1]
    return out


def _own_tag() -> str:
    st = _stat(os.getpid())
    return f"{os.getpid()}:{st[1] if st else 0}"


def _start_watcher() -> subprocess.Popen[bytes]:
    """The watcher (started once, or again if it died); the caller holds ``_lock``."""
    global _watcher
    if _watcher is None or _watcher.poll() is not None:
        _watcher = subprocess.Popen(
            [sys.executable, "-S", os.path.abspath(__file__), str(os.getpid()), _own_tag()],
            stdin=subprocess.PIPE,
            close_fds=True,
        )
    return _watcher


def _send(lines: list[str]) -> None:
    with _lock:
        watcher = _start_watcher()
        assert watcher.stdin is not None
        watcher.stdin.write("".join(f"{line}\n" for line in lines).encode())
        watcher.stdin.flush()


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """Start processes that must not outlive this one inside this block (module doc)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    _send([SCAN_ON])
    before = own_descendants()
    os.environ[TAG_VAR] = _own_tag()
    try:
        yield
    finally:
        os.environ.pop(TAG_VAR, None)
        started = own_descendants()
        protect({p: t for p, t in started.items() if before.get(p) != t})
        _send([SCAN_OFF])


def protect(procs: dict[int, int]) -> None:
    """Have the watcher end ``procs`` (``{pid: starttime}``, from :func:`own_descendants`) and
    their descendants once this process is gone."""
    if not sys.platform.startswith("linux") or not procs:
        return
    _send([f"{p} {s}" for p, s in procs.items()])


def _targets(recorded: dict[int, int], tag: str) -> dict[int, int]:
    """The recorded processes still alive (same start time), the tagged ones, and all their
    descendants; never this watcher."""
    roots = {p: s for p, s in recorded.items() if (st := _stat(p)) is not None and st[1] == s}
    roots.update(tagged(tag))
    out = dict(roots)
    for pid in roots:
        out.update(descendants(pid))
    out.pop(os.getpid(), None)
    return out


def _signal(targets: dict[int, int], sig: int) -> int:
    """Send ``sig`` to the targets still alive with their start time; returns how many."""
    n = 0
    for pid, start in targets.items():
        st = _stat(pid)
        if st is None or st[1] != start:
            continue
        try:
            os.kill(pid, sig)
            n += 1
        except OSError:
            pass
    return n


def watch(parent: int, tag: str) -> None:
    """The watcher's loop (see the module docstring)."""
    recorded: dict[int, int] = {}
    buf = b""
    fd = sys.stdin.fileno()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C goes to the server
    parent_alive = True
    scanning = False
    next_scan = 0.0
    while True:
        # once the parent is gone, read what it wrote before dying (up to EOF), then act
        parent_alive = parent_alive and os.getppid() == parent
        ready, _, _ = select.select([fd], [], [], POLL_S if parent_alive else 0)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # EOF: the server exited (or closed our stdin)
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                text = line.decode()
                if text in (SCAN_ON, SCAN_OFF):
                    scanning, next_scan = text == SCAN_ON, 0.0
                    continue
                pid, start = text.split()
                recorded[int(pid)] = int(start)
        elif not parent_alive:
            break
        # after reading: a "scan off" already sent is obeyed before the next scan
        if scanning and parent_alive and time.monotonic() >= next_scan:
            scanned = descendants(parent)
            scanned.pop(os.getpid(), None)
            recorded.update(scanned)
            next_scan = time.monotonic() + SCAN_S
    targets = _targets(recorded, tag)
    if _signal(targets, signal.SIGTERM):
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(
            (st := _stat(p)) is not None and st[1] == s for p, s in targets.items()
        ):
            time.sleep(0.05)
        targets.update(_targets(recorded, tag))  # anything started meanwhile
        _signal(targets, signal.SIGKILL)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "-")
