"""What the service modes share: the command-line prologue, the result header, the tiny teacher's
windows and engine, the server command under the packages in use, and one job runner."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, Recorder, add_csv_option, machine_line, options


def parse(
    mode: str, doc: str, argv: list[str] | None, json_default: Path | None = None, **spec: Any
) -> argparse.Namespace:
    """``argv`` parsed by ``python -m benchmarks.service <mode>`` (described by the first paragraph
    of ``doc``): the options of ``spec`` (:func:`benchmarks.harness.options`), ``--json`` (where
    the result goes) and ``--csv``."""
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.service {mode}", description=doc.split("\n\n")[0]
    )
    options(p, **spec)
    p.add_argument("--json", type=Path, default=json_default)
    add_csv_option(p)
    return p.parse_args(argv)


def recorded(mode: str, args: argparse.Namespace, **config: Any) -> tuple[dict[str, Any], Recorder]:
    """A run's result header (``when``, ``machine``, ``command``, ``args``) and its Recorder, whose
    rows carry the arguments (less ``--csv``) and ``config`` as their configuration."""
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cfg = {k: v for k, v in given.items() if k != "csv"} | config
    rec = Recorder("service", mode, csv_path=args.csv, config=cfg)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    head = {"when": when, "machine": machine_line(rec.machine), "command": rec.command}
    return head | {"args": given}, rec


def python_cmd(*args: str) -> list[str]:
    """``python ARGS`` in a subprocess that runs the project's packages this process runs: under
    ``python -m benchmarks.harness ab`` another tree's (through ``with-tree``)."""
    import logitcache.cache_format as fmt

    tree = Path(fmt.__path__[0]).parent
    if tree == ROOT:
        return [sys.executable, *args]
    return [sys.executable, "-m", "benchmarks.harness", "with-tree", str(tree), "--", *args]


def tiny_windows(length: int, count: int) -> tuple[Any, list[list[int]]]:
    """The tiny teacher (built once per machine) and ``count`` windows of exactly ``length``
    tokens from its training split; exits when the fixture holds fewer."""
    from logitcache.fixtures.tiny import build_tiny_models

    tiny = build_tiny_models()
    seqs = tiny.token_sequences("train", max_len=length, min_len=length, limit=count)
    if len(seqs) < count:
        raise SystemExit(f"only {len(seqs)} windows of {length} tokens in the fixture")
    return tiny, seqs


def tiny_engine(model: Any, max_k: int, backend: str = "transformers") -> Any:
    """An engine on ``model`` (a directory) in this process (vLLM's engine core in-process too)."""
    from logitcache.server.engine import build_engine

    options = {"vllm_mode": "inproc"} if backend == "vllm" else {}
    return build_engine(
        model=str(model), backend=backend, max_k=max_k, dtype="float32", options=options
    )


def write_jsonl(
    data_dir: Path, prompts: list[list[int]], name: str = "bench.jsonl", prefix: str = "s"
) -> Path:
    """``prompts`` as a job's input file ``data_dir/name`` (ids ``s000000``, ...)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = (
        json.dumps({"id": f"{prefix}{i:06d}", "input_ids": p}) + "\n" for i, p in enumerate(prompts)
    )
    (data_dir / name).write_text("".join(lines))
    return data_dir / name


def run_job(
    client: Any, cache: str, k: int | None = None, *, poll: float = 0.5, log: Path | None = None
) -> dict[str, Any]:
    """One job over ``bench.jsonl`` into ``cache`` (``POST /v1/jobs``, polled every ``poll`` s: a
    poll costs the server ~ms of CPU): its final state plus ``job_s`` (started to finished),
    ``tokens_per_s`` over it and ``client_wall_s``; exits (with ``log``'s tail) if it failed."""
    from tests.server_support import wait_job

    t0 = time.perf_counter()
    body = {"cache": cache, "file": {"path": "bench.jsonl"}} | ({"k": k} if k is not None else {})
    job = client.post("/v1/jobs", json=body).raise_for_status().json()
    job = wait_job(client, job["id"], timeout=3600, interval=poll)
    wall = time.perf_counter() - t0
    if job["state"] != "succeeded":
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-80:]) if log else ""
        raise SystemExit(f"job {job['state']}: {job}\nserver log (last 80 lines):\n{tail}")
    started, finished = (datetime.fromisoformat(job[x]) for x in ("started_at", "finished_at"))
    job_s = (finished - started).total_seconds()
    return {**job, "job_s": job_s, "tokens_per_s": job["tokens_total"] / job_s,
            "client_wall_s": wall}  # fmt: skip
