"""``examples/on_policy.py`` as its docstring runs it (a subprocess), against the service on the
tiny teacher (transformers engine, real uvicorn), with the tiny student."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from server_support import ThreadedServer, server_settings

ROOT = Path(__file__).resolve().parents[2]


def test_on_policy_example_scores_through_the_cache(hf_engine, tiny, tmp_path) -> None:
    settings = server_settings(tmp_path, str(tiny.teacher_dir), backend="hf")
    with ThreadedServer(settings, hf_engine) as srv:
        cmd = [sys.executable, str(ROOT / "examples/on_policy.py"), "--url", srv.url]
        cmd += ["--student", str(tiny.student_dir), "--epochs", "3"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        with srv.client() as c:
            cache = c.get("/v1/caches/on-policy").json()
    print(out.stdout)
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [x["epoch"] for x in lines] == [0, 1, 2]
    assert all(np.isfinite(x["loss"]) for x in lines)
    assert lines[0]["hits"] == 0 and lines[0]["engine_s_saved"] == 0
    # the seeded student samples some sequences again: those are served from the cache
    later = lines[1:]
    assert sum(x["hits"] for x in later) > 0, lines
    for x in later:
        assert (x["engine_s_saved"] > 0) == (x["hits"] > 0), x
    misses = sum(x["sequences"] - x["hits"] for x in lines)
    assert cache["num_sequences"] == misses  # every miss stored once, no hit stored again
