"""``logitcache import`` and the peer formats of ``logitcache export`` (see :mod:`.interop`).

::

    logitcache export CACHE out.parquet --format parquet        # axolotl KD layout (one file)
    logitcache export CACHE outdir --format distillkit          # DistillKit offline-logit dir
    logitcache import in.parquet NEW_CACHE --format axolotl --teacher-model NAME \\
        --tokenizer /path/to/tokenizer --vocab-size 32000
    logitcache import dkdir NEW_CACHE --format distillkit --teacher-model NAME \\
        --tokenizer-fingerprint sha256:...                      # vocab size from the config's d

Bad input prints one line (``error: ...``) and exits 2 without writing a cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from .interop import (
    InteropError,
    export_axolotl,
    export_distillkit,
    import_axolotl,
    import_distillkit,
)

EXPORT_FORMATS = ("parquet", "axolotl", "distillkit")

app = typer.Typer(add_completion=False, help="Import a peer trainer's teacher-logit files.")


def export_peer(fmt: str, url: str, out: Path, options: dict[str, Any], limit: int) -> int:
    """``export --format parquet|axolotl`` (axolotl layout) or ``--format distillkit``."""
    lim = None if limit < 0 else limit
    if fmt == "distillkit":
        return export_distillkit(url, out, storage_options=options or None, limit=lim)
    return export_axolotl(url, out, storage_options=options or None, limit=lim)


def _fingerprint(tokenizer: str | None, fingerprint: str | None) -> str:
    if bool(tokenizer) == bool(fingerprint):
        raise InteropError("pass exactly one of --tokenizer and --tokenizer-fingerprint")
    if fingerprint:
        return fingerprint
    from logitcache.cache_format import tokenizer_fingerprint
    from transformers import AutoTokenizer

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer))


@app.command("import")
def import_cmd(
    src: Annotated[Path, typer.Argument(help="parquet file or directory")],
    url: Annotated[str, typer.Argument(help="new cache (local path or s3://...)")],
    fmt: Annotated[str, typer.Option("--format", help="axolotl | distillkit")],
    teacher_model: Annotated[str, typer.Option(help="teacher name recorded in the manifest")],
    tokenizer: Annotated[str | None, typer.Option(help="HF tokenizer (dir or name)")] = None,
    tokenizer_fingerprint: Annotated[str | None, typer.Option()] = None,
    vocab_size: Annotated[int | None, typer.Option(help="default: DistillKit's d")] = None,
    temperature: Annotated[float, typer.Option(help="temperature the teacher ran at")] = 1.0,
    config: Annotated[Path | None, typer.Option(help="DistillKit compression config")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o")] = None,
) -> None:
    """Write a peer's teacher top-k file(s) into a new cache."""
    try:
        if fmt not in ("axolotl", "parquet", "distillkit"):
            raise InteropError(f"--format must be axolotl or distillkit, got {fmt!r}")
        options = dict(pair.split("=", 1) for pair in option or [] if "=" in pair) or None
        fields: dict[str, Any] = {
            "teacher_model": teacher_model,
            "tokenizer_fingerprint": _fingerprint(tokenizer, tokenizer_fingerprint),
            "temperature": temperature,
            "dataset": {"imported_from": fmt, "path": str(src)},
        }
        if vocab_size is not None:
            fields["vocab_size"] = vocab_size
        if fmt == "distillkit":
            n = import_distillkit(
                src, url, manifest_fields=fields, config=config, storage_options=options
            )
        else:
            if vocab_size is None:
                raise InteropError("--vocab-size is required for the axolotl format")
            n = import_axolotl(src, url, manifest_fields=fields, storage_options=options)
    except (InteropError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"imported {n} sequences into {url}", err=True)


def main(argv: list[str]) -> int:
    """Run ``import`` with ``argv`` (its arguments); return the exit status."""
    import click

    try:
        rv = app(list(argv), standalone_mode=False, prog_name="logitcache import")
    except typer.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:  # usage errors: one line
        typer.echo(f"error: {exc.format_message()}", err=True)
        return 2
    return rv if isinstance(rv, int) else 0
