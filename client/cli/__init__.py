"""The ``logitcache`` command line (one typer app, entry point :func:`main`).

::

    logitcache info STORE [--json]          # manifest, sizes, compression, coverage
    logitcache info --versions              # library versions and the optional paths that run
    logitcache validate STORE               # every invariant (exit 1 on a problem)
    logitcache export STORE OUT --format jsonl|frames|parquet|distillkit
    logitcache import SRC NEW_STORE --format axolotl|distillkit ...
    logitcache jobs submit|list|show|watch|cancel ...   # the teacher service's batch jobs

The store commands are the format's (:mod:`logitcache.cache_format.cli`), ``import`` and the
peer formats of ``export`` are :mod:`.interop`'s, ``jobs`` is :mod:`.jobs`. A user error (bad
input, no store, an HTTP or connection error) prints one line ``logitcache: error: ...`` on
stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Literal, TextIO

import typer
from logitcache.cache_format import cli as format_cli
from typer.core import TyperGroup

from ..errors import ClientError, TeacherHTTPError
from . import jobs
from .errors import CliError
from .interop import PEER_FORMATS, export_peer, import_cmd
from .versions import versions_report

__all__ = ["CliError", "app", "main"]


def _describe(exc: Exception) -> str:
    """One line for a user error (HTTP status and the server's message, or the transport)."""
    if isinstance(exc, TeacherHTTPError):
        return f"{exc.method} {exc.url}: HTTP {exc.status_code}: {exc.detail}"
    return str(exc)


class _OneLineErrors(TyperGroup):
    """The app's group: a :class:`CliError` or client error raised by any command is printed as
    one line ``logitcache: error: ...`` on stderr, exit status 2."""

    # typer hands a typer.Context; the base class names its private click parent
    def invoke(self, ctx: typer.Context) -> object:  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (CliError, ClientError) as exc:
            typer.echo(f"logitcache: error: {_describe(exc)}".replace("\n", " "), err=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    help="Inspect, validate, export and import logitcache stores; run the service's batch jobs.",
)


ExportFormat = Literal["jsonl", "frames", "parquet", "axolotl", "distillkit"]


@app.command()
def info(
    url: Annotated[str | None, typer.Argument(help="the store (path or URL)")] = None,
    option: format_cli.OptionList = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    versions: Annotated[
        bool, typer.Option("--versions", help="library versions and the optional paths that run")
    ] = False,
) -> None:
    """Print the manifest, sizes and compression ratio of the store at URL (``--versions``:
    the libraries and which optional compiled paths run)."""
    if versions:
        typer.echo(versions_report())
    if url is not None:
        format_cli.info(url, option, as_json)
    elif not versions:
        raise CliError("give a store URL (or --versions)")


app.command("validate")(format_cli.validate_cmd)
app.command("repair")(format_cli.repair_cmd)
app.command("reindex")(format_cli.reindex_cmd)


@app.command()
def export(
    url: str,
    out: Path,
    option: format_cli.OptionList = None,
    fmt: Annotated[
        ExportFormat,
        typer.Option(
            "--format", help="jsonl | frames (wire codec) | parquet (axolotl) | distillkit"
        ),
    ] = "jsonl",
    limit: Annotated[int, typer.Option(help="export the first N sequences only (-1: all)")] = -1,
) -> None:
    """Export sequences to JSON lines (one record per line) or wire-codec frames; or for a peer
    trainer: ``parquet`` (axolotl's KD layout) or ``distillkit`` (a DistillKit logit directory)."""
    options = format_cli.storage_options(option)
    first = None if limit < 0 else limit
    if fmt in PEER_FORMATS:
        n = export_peer(fmt, url, out, options, first)
    else:
        n = format_cli.export_records(url, out, options, fmt, first)
    typer.echo(f"exported {n} sequences to {out}", err=True)


app.command("import")(import_cmd)
app.add_typer(jobs.app, name="jobs")


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``), its output to ``out`` (default
    stdout); return the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    redirect = contextlib.redirect_stdout(out) if out is not None else contextlib.nullcontext()
    try:
        with redirect:
            rv = app(args, standalone_mode=False, prog_name="logitcache")
    except typer.Exit as exc:
        return exc.exit_code
    except typer.TyperException as exc:  # a usage error (bad flag or value)
        typer.echo(f"logitcache: error: {exc.format_message()}".replace("\n", " "), err=True)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        return 130
    return rv if isinstance(rv, int) else 0
