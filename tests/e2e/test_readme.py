"""The README's quick start, run as printed.

The block between ``<!-- quickstart:begin -->`` and ``<!-- quickstart:end -->`` is extracted and
run by ``bash -e`` in a fresh directory (``.venv`` linked to this checkout's), against the tiny
fixture teacher and a real ``logitcache-server`` subprocess, in an environment without the
test suite's vLLM variables (the block exports what it needs). The one change: ``localhost:8000``
becomes a free port, and ``LOGITCACHE_PORT``/``LOGITCACHE_URL`` (documented settings of the
server and of ``logitcache jobs``) point there, so the test never collides with a service on 8000.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from server_support import VLLM_ENV

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def quickstart_block(text: str) -> str:
    """The bash code of the README's quick-start block."""
    m = re.search(
        r"<!-- quickstart:begin -->\s*```bash\n(.*?)```\s*<!-- quickstart:end -->", text, re.S
    )
    assert m, "README has no quickstart block"
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_readme_setup_commands_come_first() -> None:
    """The two set-up commands open the README, before the quick start."""
    text = README.read_text()
    first = re.search(r"```bash\n(.*?)```", text, re.S)
    assert first is not None
    lines = [ln.split("#")[0].strip() for ln in first.group(1).strip().splitlines()]
    assert lines == [
        "bash scripts/install.sh && .venv/bin/python examples/distill.py",
        ".venv/bin/python -m pytest -q",
    ]
    assert text.index("scripts/install.sh") < text.index("quickstart:begin")


@pytest.mark.slow  # about 2 minutes on 2 cores (a real server start and a job)
def test_readme_quickstart_runs_as_printed(tiny, tmp_path: Path) -> None:
    script = quickstart_block(README.read_text())
    assert "content-type: application/json" in script
    assert "--k " not in script  # one spelling of top-k: -k
    port = _free_port()
    script = script.replace("localhost:8000", f"localhost:{port}")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    # the caller's environment without what the README sets itself (or must not inherit)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in VLLM_ENV and not k.startswith(("LOGITCACHE_", "VLLM_"))
    }
    env.update(LOGITCACHE_PORT=str(port), LOGITCACHE_URL=f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        try:  # the backgrounded server, if the script died before `kill %1`
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wall = time.monotonic() - t0
    (tmp_path / "quickstart.log").write_text(out)
    assert proc.returncode == 0, f"quick start failed (rc {proc.returncode}):\n{out[-6000:]}"
    # 1: the fixture printed its teacher directory
    assert re.search(r"^teacher\s+/\S+/teacher", out, re.M), out[-3000:]
    # 3: the banner, before the job
    assert "logitcache teacher service ready" in out
    assert f"http://127.0.0.1:{port}/docs" in out
    assert "max seq length" in out
    # 4: the job was accepted and watched to success
    assert '"state":"queued"' in out.replace(" ", "") or '"state":"running"' in out.replace(
        " ", ""
    ), out[-3000:]
    assert re.search(r"succeeded\s+quickstart-k20\s+3/3 seqs", out), out[-3000:]
    # 5: info shows the 3 sequences; validate passed; the cache is on disk
    assert re.search(r"sequences\s+3\b", out), out[-3000:]
    cov = re.search(r"^coverage\s+([0-9.]+) mean top-20 mass over (\d+) rows", out, re.M)
    assert cov, out[-3000:]
    if float(cov.group(1)) < 0.9:  # the tiny teacher is high-entropy: info says so
        assert "warning: the top-20 holds on average" in out
    assert (tmp_path / "caches" / "quickstart-k20" / "zarr.json").is_file()
    assert (tmp_path / "data" / "corpus.jsonl").is_file()
    assert "Traceback" not in out, out[-6000:]
    print(f"quick start wall {wall:.1f} s")


@pytest.mark.parametrize("bad", ["--k 20"])
def test_k_spelling_in_docs(bad: str) -> None:
    """Docs spell top-k ``-k`` for the service CLIs (``--k`` is refused by them)."""
    for doc in [README, ROOT / "docs" / "SCALING.md"]:
        text = doc.read_text()
        for line in text.splitlines():
            if "logitcache-server" in line or "distributed" in line or "--model" in line:
                assert bad not in line, f"{doc.name}: {line}"
