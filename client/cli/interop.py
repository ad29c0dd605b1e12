"""``logitcache import`` and the peer formats of ``logitcache export`` (see :mod:`..interop`).

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
from typing import Annotated, Literal, get_args

import typer

from .errors import CliError

#: Peer trainers' files: what ``import`` reads and the ``export --format`` values that write them
#: (the rest are the format's own).
PeerFormat = Literal["parquet", "axolotl", "distillkit"]
PEER_FORMATS: tuple[str, ...] = get_args(PeerFormat)


def export_peer(
    fmt: str, url: str, out: Path, options: dict[str, object], limit: int | None
) -> int:
    """``export --format parquet|axolotl`` (axolotl layout) or ``--format distillkit``."""
    from logitcache.client.interop import export_axolotl, export_distillkit

    export = export_distillkit if fmt == "distillkit" else export_axolotl
    return export(url, out, storage_options=options or None, limit=limit)


def _fingerprint(tokenizer: str | None, fingerprint: str | None) -> str:
    if bool(tokenizer) == bool(fingerprint):
        raise CliError("pass exactly one of --tokenizer and --tokenizer-fingerprint")
    if fingerprint:
        return fingerprint
    from logitcache.cache_format import tokenizer_fingerprint
    from transformers import AutoTokenizer

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer))


def import_cmd(
    src: Annotated[Path, typer.Argument(help="parquet file or directory")],
    url: Annotated[str, typer.Argument(help="new cache (local path or s3://...)")],
    fmt: Annotated[PeerFormat, typer.Option("--format", help="axolotl | distillkit")],
    teacher_model: Annotated[str, typer.Option(help="teacher name recorded in the manifest")],
    tokenizer: Annotated[str | None, typer.Option(help="HF tokenizer (dir or name)")] = None,
    tokenizer_fingerprint: Annotated[str | None, typer.Option()] = None,
    vocab_size: Annotated[int | None, typer.Option(help="default: DistillKit's d")] = None,
    temperature: Annotated[float, typer.Option(help="temperature the teacher ran at")] = 1.0,
    config: Annotated[Path | None, typer.Option(help="DistillKit compression config")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o")] = None,
) -> None:
    """Write a peer trainer's teacher top-k files (axolotl parquet, DistillKit) into a new
    cache."""
    from logitcache.cache_format.cli import storage_options
    from logitcache.client.interop import InteropError, import_axolotl, import_distillkit

    options = storage_options(option) or None
    fields: dict[str, object] = {
        "teacher_model": teacher_model,
        "tokenizer_fingerprint": _fingerprint(tokenizer, tokenizer_fingerprint),
        "temperature": temperature,
        "dataset": {"imported_from": fmt, "path": str(src)},
    }
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    try:
        if fmt == "distillkit":
            n = import_distillkit(
                src, url, manifest_fields=fields, config=config, storage_options=options
            )
        else:
            if vocab_size is None:
                raise CliError("--vocab-size is required for the axolotl format")
            n = import_axolotl(src, url, manifest_fields=fields, storage_options=options)
    except (InteropError, ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    typer.echo(f"imported {n} sequences into {url}", err=True)
