"""What the service modes share: their command-line prologue, the tiny teacher's windows and
engine, and one job runner (inputs as JSONL, ``POST /v1/jobs``, wait, rate)."""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import Recorder, add_csv_option, machine_line


def mode_parser(mode: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.service <mode>``, described by the first paragraph of
    the mode's docstring ``doc``; :func:`parse` adds the options every mode has."""
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.service {mode}", description=doc.split("\n\n")[0]
    )


def parse(
    parser: argparse.ArgumentParser, argv: list[str] | None, json_default: Path | None = None
) -> argparse.Namespace:
    """``argv`` parsed after adding ``--json`` (where the run's result goes) and ``--csv``."""
    parser.add_argument("--json", type=Path, default=json_default)
    add_csv_option(parser)
    return parser.parse_args(argv)


def recorded(mode: str, args: argparse.Namespace) -> tuple[dict[str, Any], Recorder]:
    """A finished run's result header (``when``, ``machine``, ``args``) and its Recorder, whose
    rows carry the arguments (less ``--csv``) as their configuration."""
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cfg = {k: v for k, v in given.items() if k != "csv"}
    rec = Recorder("service", mode, csv_path=args.csv, config=cfg)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    return {"when": when, "machine": machine_line(rec.machine), "args": given}, rec


def tiny_windows(length: int, count: int) -> tuple[Any, list[list[int]]]:
    """The tiny teacher (built once per machine) and ``count`` windows of exactly ``length``
    tokens from its training split; exits when the fixture holds fewer."""
    from logitcache.fixtures.tiny import build_tiny_models

    tiny = build_tiny_models()
    seqs = tiny.token_sequences("train", max_len=length, min_len=length, limit=count)
    if len(seqs) < count:
        raise SystemExit(f"only {len(seqs)} windows of {length} tokens in the fixture")
    return tiny, seqs


def tiny_engine(tiny: Any, backend: str, max_k: int) -> Any:
    """An engine on the tiny teacher in this process (vLLM's engine core in-process too)."""
    from logitcache.server.engine import build_engine

    options = {"vllm_mode": "inproc"} if backend == "vllm" else {}
    return build_engine(
        model=str(tiny.teacher_dir), backend=backend, max_k=max_k, dtype="float32", options=options
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
