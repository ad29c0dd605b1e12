"""A real S3-compatible server for the tests: moto in server mode, in a child process.

It runs in its own process rather than as moto's in-process ``ThreadedMotoServer`` because that
imports Flask into the test process, and vLLM's in-process engine start-up scans every loaded
module's globals with ``hasattr``, which raises on Flask's context-local proxies
(``RuntimeError: Working outside of application context``). Bound to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start ``moto.server`` on a free 127.0.0.1 port; yield its endpoint URL; stop it."""
    port = _free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(timeout=2.0) as poll:  # one client: httpx.get builds one per call
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"moto server exited with {proc.returncode}: {cmd}")
                try:
                    poll.get(f"{endpoint}/moto-api/")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"moto server did not answer on {endpoint}") from None
                    time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
