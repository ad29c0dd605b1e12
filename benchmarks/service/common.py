"""What the service modes share: their command-line prologue and the tiny teacher's windows."""

from __future__ import annotations

import argparse
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
