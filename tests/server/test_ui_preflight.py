"""``logitcache-server`` fails fast, in one line, before any engine loads (server/preflight.py).

Each case runs the real entry point in a subprocess and checks: exit status 2, exactly one line
on stderr naming the problem, no traceback, and nothing loaded (it returns in seconds; a model
load would take far longer). The model directory here is a stub holding only ``config.json``:
preflight checks its shape, and every case fails before the engine would read it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_support import VLLM_ENV


def _run(args: list[str], cwd: Path) -> tuple[int, str, float]:
    env = {**os.environ, **VLLM_ENV}
    env.pop("LOGITCACHE_API_KEY", None)
    env.pop("LOGITCACHE_MODEL", None)
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "logitcache.server", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stderr, time.monotonic() - t0


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "teacher"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return d


def _listening_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


def _cases(tmp: Path, model: Path, port: int) -> list[tuple[list[str], str]]:
    afile = tmp / "afile"
    afile.write_text("x")
    return [
        ([], "no model given: pass --model"),
        (["--model", str(tmp / "nope" / "teacher")], "does not exist"),
        (["--model", "org/not-a-model"], "HF_HUB_OFFLINE is set"),
        (["--model", str(tmp)], "is not a model directory (no config.json"),
        (["--model", str(afile)], "is a file, not a model directory"),
        (["--model", str(model), "--store-root", str(afile / "caches")], "store root"),
        (["--model", str(model), "--state-dir", str(afile / "state")], "state directory"),
        (["--model", str(model), "--port", str(port)], f"port {port} on 127.0.0.1 is already"),
    ]


def test_preflight_checks(tmp_path: Path, model_dir: Path) -> None:
    """Every check, in-process (each message names the problem)."""
    from logitcache.server import preflight
    from logitcache.server.settings import load_settings

    sock, port = _listening_port()
    try:
        for args, expected in _cases(tmp_path, model_dir, port):
            if "--store-root" not in args and "--state-dir" not in args:
                args = [*args, "--store-root", str(tmp_path / "c"), "--state-dir", str(tmp_path)]
            settings = load_settings(args)
            with pytest.raises(preflight.PreflightError, match=re.escape(expected)):
                preflight.check(settings)
        ok = load_settings(["--model", str(model_dir), "--store-root", str(tmp_path / "c2")])
        preflight.check(ok.model_copy(update={"port": 0, "state_dir": tmp_path / "s2"}))
        assert (tmp_path / "c2").is_dir() and not list((tmp_path / "c2").iterdir())
    finally:
        sock.close()


@pytest.mark.subprocess
def test_cli_prints_one_line_and_exits_2(tmp_path: Path, model_dir: Path) -> None:
    """Through the real entry point: exit 2, one stderr line, no traceback, no engine load."""
    sock, port = _listening_port()
    try:
        for args, expected in [
            ([], "no model given: pass --model"),
            (["--model", str(model_dir), "--port", str(port)], f"port {port} on 127.0.0.1 is"),
        ]:
            args = [*args, "--store-root", str(tmp_path / "c"), "--state-dir", str(tmp_path)]
            rc, err, wall = _run(args, tmp_path)
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1, (args, err)
            assert lines[0].startswith("logitcache-server: error: ") and expected in lines[0]
            assert "Traceback" not in err and wall < 60
    finally:
        sock.close()


@pytest.mark.subprocess
def test_top_k_flag_is_one_spelling(tmp_path: Path, model_dir: Path) -> None:
    """``-k`` is the flag; ``--k`` (and any other abbreviation) is refused, not guessed."""
    rc, err, _ = _run(["--model", str(model_dir), "--k", "20"], tmp_path)
    assert rc == 2 and "unrecognized arguments: --k 20" in err
    rc, err, _ = _run(["--model", str(model_dir), "--store", "x"], tmp_path)
    assert rc == 2 and "unrecognized arguments: --store x" in err


def test_distributed_cli_refuses_double_dash_k(tmp_path: Path, capsys) -> None:
    """``--k 20`` used to be read as ``--keep-staging`` plus a stray ``20``: now refused by name."""
    from logitcache.server.batch.distributed import main

    with pytest.raises(SystemExit) as stop:
        main(["--input", "a.jsonl", "--cache", str(tmp_path / "c"), "--k", "20"])
    assert stop.value.code == 2
    assert "unrecognized arguments: --k 20" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_distributed_cli_checks_the_model_before_ray(tmp_path: Path, capsys) -> None:
    """A missing --model ends logitcache-distributed in one JSON line, before Ray starts."""
    from logitcache.server.batch.distributed import main

    rc = main(["--input", "x.jsonl", "--cache", str(tmp_path / "c"), "--model", "/nope/teacher"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert json.loads(err[0]) == {
        "error": "invalid_model",
        "message": "model path '/nope/teacher' does not exist",
    }
    assert not (tmp_path / "c").exists()
