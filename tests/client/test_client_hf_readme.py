"""README's "In a trainer" code blocks run as written, on the fixture student and a small cache.

Each block is cut from README.md between its ``<!-- name:start -->`` / ``<!-- name:end -->``
markers and executed with the names it expects (``student``, ``student_tokenizer``) bound to the
fixture student and tokenizer. Only the store location (``s3://bucket/caches/corpus-k20``, a local
cache of the fixture's held-out token sequences here), the output directory and the HF example's
``max_steps`` are substituted. The ``logitcache.client`` docstring must carry the same loop.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
S3 = "s3://bucket/caches/corpus-k20"


def _block(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- {name}:start -->\s*```python\n(.*?)```\s*<!-- {name}:end -->", text, re.S)
    assert m, f"README block {name} not found"
    return m.group(1)


@pytest.fixture(scope="module")
def setup(tiny: Any, heldout_sequences: list[list[int]], tmp_path_factory: Any) -> dict[str, Any]:
    from client_support import build_cache
    from logitcache.cache_format import tokenizer_fingerprint
    from transformers import AutoModelForCausalLM

    tok = tiny.load_tokenizer()
    vocab = AutoModelForCausalLM.from_pretrained(tiny.student_dir).config.vocab_size
    url = tmp_path_factory.mktemp("readme") / "cache"
    seqs = [np.asarray(s, dtype=np.int32) for s in heldout_sequences]
    build_cache(url, seqs, tokenizer_fingerprint=tokenizer_fingerprint(tok), vocab_size=vocab)
    return {"tokenizer": tok, "url": str(url)}


def _student(tiny: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny.student_dir, dtype=torch.float32)


def test_readme_training_loop_runs(tiny: Any, setup: dict[str, Any]) -> None:
    code = _block("trainer-loop")
    assert S3 in code
    student = _student(tiny)
    before = [p.detach().clone() for p in student.parameters()]
    ns: dict[str, Any] = {"student": student, "student_tokenizer": setup["tokenizer"]}
    exec(compile(code.replace(S3, setup["url"]), "README:trainer-loop", "exec"), ns)
    ds, state = ns["ds"], ns["state"]
    assert state["epoch"] == 1 and state["items_consumed"] == ds.num_items() >= 1
    loss = ns["loss"].detach()
    assert torch.isfinite(loss) and float(loss) > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))


def test_client_docstring_carries_the_readme_loop() -> None:
    import logitcache.client as client

    doc = textwrap.dedent(client.__doc__.split("::", 1)[1])
    code = _block("trainer-loop")
    for line in code.splitlines():
        if line.strip():
            assert line.strip() in doc, f"client docstring lacks README line: {line.strip()!r}"


@pytest.mark.slow
def test_readme_hf_trainer_example_runs(tiny: Any, setup: dict[str, Any], tmp_path: Path) -> None:
    code = _block("hf-trainer")
    assert S3 in code and "max_steps=1000" in code and '"runs/student"' in code
    code = code.replace(S3, setup["url"]).replace("max_steps=1000", "max_steps=3")
    code = code.replace('"runs/student"', repr(str(tmp_path / "run")))
    ns: dict[str, Any] = {"student": _student(tiny), "student_tokenizer": setup["tokenizer"]}
    exec(compile(code, "README:hf-trainer", "exec"), ns)
    trainer = ns["trainer"]
    assert trainer.state.global_step == 3
    final = trainer.state.log_history[-1]
    assert np.isfinite(final["train_loss"]) and final["train_loss"] > 0


@pytest.mark.slow
def test_hf_trainer_example_command_runs(tiny: Any, setup: dict[str, Any], tmp_path: Path):
    """The torchrun command of ``examples/hf_trainer.py``'s docstring, 2 CPU ranks, 2 steps."""
    import json
    import os
    import shlex
    import subprocess
    import sys

    doc = (ROOT / "examples" / "hf_trainer.py").read_text()
    lines = doc.splitlines()
    i = next(j for j, line in enumerate(lines) if "torch.distributed.run" in line)
    cmd = shlex.split(lines[i].rstrip("\\ ") + " " + lines[i + 1].strip())
    assert cmd[:3] == [".venv/bin/python", "-m", "torch.distributed.run"]
    subs = {
        "./caches/corpus-k20": setup["url"],
        "/path/to/student": str(tiny.student_dir),
        "runs/hf": str(tmp_path / "run"),
        "100": "2",
    }
    cmd = [sys.executable, *[subs.get(a, a) for a in cmd[1:]]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["world_size"] == 2
    assert summary["train_loss"] > 0
