"""The format's commands of the ``logitcache`` CLI: ``info``, ``validate``, ``repair``,
``export`` to JSON lines or wire frames (the one typer app, with the jobs and import commands, is
:mod:`logitcache.client.cli`).

Storage options for object stores come from ``--option name=value`` (repeatable), e.g.
``--option endpoint_url=http://127.0.0.1:9000 --option key=... --option secret=...``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ._reader import CacheReader

OptionList = Annotated[
    list[str] | None,
    typer.Option("--option", "-o", help="storage option name=value (repeatable)"),
]


def storage_options(pairs: list[str] | None) -> dict[str, object]:
    """``name=value`` pairs as storage options; ``true``/``false`` (any case) are booleans and a
    value starting with ``{`` is a JSON object (``client_kwargs={...}``); the rest stay strings
    (so ``-o anon=false`` means anonymous access OFF)."""
    out: dict[str, object] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise typer.BadParameter(f"expected name=value, got {pair!r}")
        name, value = pair.split("=", 1)
        parsed: object = value
        if value.strip().lower() in ("true", "false"):
            parsed = value.strip().lower() == "true"
        elif value.lstrip().startswith("{"):
            try:
                parsed = json.loads(value)
            except ValueError:
                raise typer.BadParameter(f"{name}: not a JSON object: {value!r}") from None
        out[name] = parsed
    return out


def nearest_stores(url: str, n: int = 3) -> list[str]:
    """Up to ``n`` existing local stores (directories holding a ``zarr.json``) whose names are
    closest to ``url``'s last component, looked up in the nearest existing parent directory;
    ``[]`` for object-store URLs (listing them would need requests the user did not ask for)."""
    import difflib
    from urllib.parse import urlparse

    if "://" in url and not url.startswith("file://"):
        return []
    path = Path(urlparse(url).path if url.startswith("file://") else url).expanduser().absolute()
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    try:
        names = sorted(p.name for p in parent.iterdir() if (p / "zarr.json").is_file())
    except OSError:
        return []
    ranked = difflib.get_close_matches(path.name, names, n=n, cutoff=0.0)
    return [str(parent / name) for name in ranked]


def _fail(url: str, err: BaseException) -> typer.Exit:
    """Print ``err`` as one line on stderr (with the nearest store names when there is no store
    at ``url``) and return the exit to raise (status 2): user errors get no traceback."""
    from .errors import StoreNotFoundError

    line = f"error: {err}"
    if isinstance(err, StoreNotFoundError) or not str(err):
        near = nearest_stores(url)
        line += f"; nearest stores: {', '.join(near)}" if near else "; no stores next to it"
    typer.echo(line.replace("\n", " "), err=True)
    return typer.Exit(2)


def _reader(url: str, options: dict[str, object]) -> CacheReader:
    from ._reader import CacheReader
    from .errors import FormatError

    try:
        return CacheReader(url, options)
    except FormatError as e:
        raise _fail(url, e) from None


def info(url: str, option: OptionList = None, as_json: bool = False) -> None:
    """Print the manifest, sizes and compression ratio of the store at URL."""
    from . import _rowextra
    from ._manifest import IDENTITY_FIELDS
    from .stats import LOW_COVERAGE, store_stats, tail_summary

    reader = _reader(url, storage_options(option))
    m = reader.manifest
    st = store_stats(reader.store, m)
    tail = tail_summary(reader)  # coverage: 1 - mean tail mass (sampled on large caches)
    doc = {
        "url": url,
        "manifest": m.to_attrs(),
        "bytes_by_array": st.bytes_by_array,
        "total_bytes": st.total_bytes,
        "layout": reader.layout_name,
        "bytes_per_position": round(st.bytes_per_position, 2),
        "raw_bytes_per_position": st.raw_bytes_per_position,
        "compression_ratio": round(st.compression_ratio, 3),
        "tail_mass": None
        if tail is None
        else {
            "rows_sampled": tail.rows,
            "mean": round(tail.mean_tail, 4),
            "p50": round(tail.p50, 4),
            "p90": round(tail.p90, 4),
            "p99": round(tail.p99, 4),
            "coverage": round(tail.coverage, 4),
        },
    }
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    typer.echo(f"store      {url}")
    for name in (*IDENTITY_FIELDS, "dataset", "created", "updated", "generation"):
        typer.echo(f"{name:<22} {getattr(m, name)}")
    typer.echo(f"{'sequences':<22} {m.num_sequences}")
    typer.echo(f"{'rows (positions)':<22} {m.num_rows}")
    typer.echo(f"{'tokens':<22} {m.num_tokens}")
    typer.echo(f"{'layout preset':<22} {reader.layout_name}")
    extras = [x.name for x in _rowextra.kept(m)]  # FORMAT.md 4.9, 4.12
    typer.echo(f"{'per-row arrays':<22} {', '.join(extras) or 'none'}")
    typer.echo(f"{'stored bytes':<22} {st.total_bytes}")
    typer.echo(
        f"{'bytes/position':<22} {st.bytes_per_position:.1f} "
        f"(raw int32+float16: {st.raw_bytes_per_position})"
    )
    typer.echo(f"{'compression ratio':<22} {st.compression_ratio:.2f}x")
    if tail is None and m.num_rows and getattr(m, "targets", "topk") != "topk":
        typer.echo(f"{'coverage':<22} n/a (sampled targets: rows hold importance weights)")
    if tail is not None:
        typer.echo(
            f"{'coverage':<22} {tail.coverage:.3f} mean top-{m.k} mass over {tail.rows:,} rows "
            f"(tail mass p50 {tail.p50:.3f}, p90 {tail.p90:.3f}, p99 {tail.p99:.3f})"
        )
        if tail.low:
            typer.echo(
                f"warning: the top-{m.k} holds on average {100 * tail.coverage:.1f}% of the "
                f"teacher's probability (below {LOW_COVERAGE}): top-k distillation from this "
                "cache misses much of the teacher; use a larger k or the tail mass"
            )


def validate_cmd(
    url: str,
    option: OptionList = None,
    sample: Annotated[
        float | None,
        typer.Option(help="check a seeded sample of sequences: a fraction (<1) or count"),
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of --sample")] = 0,
) -> None:
    """Check every invariant; exit status 1 if any problem is found, 2 if there is no store.
    ``--sample``: the rows and tokens of a seeded sample of sequences only (the manifest, the
    arrays' metadata and the whole sequence index are always checked)."""
    from ._validate import validate
    from .errors import StoreNotFoundError

    if sample is not None and not sample > 0:
        raise typer.BadParameter("--sample must be > 0")
    report = validate(url, storage_options(option), sample=sample, seed=seed)
    if report.codes() & {"no_store", "store_unreadable"}:
        raise _fail(url, StoreNotFoundError(f"no logitcache store at {url!r}"))
    typer.echo(str(report))
    raise typer.Exit(0 if report.ok else 1)


def repair_cmd(url: str, option: OptionList = None) -> None:
    """Rebuild a store's lost or damaged root zarr.json (the manifest) from the newest commit
    record of its key index, checked against the arrays' own metadata; exit status 2, writing
    nothing, when no record passes. A readable root is left as it is."""
    from ._repair import repair
    from .errors import FormatError

    try:
        done = repair(url, storage_options(option))
    except FormatError as e:
        raise _fail(url, e) from None
    typer.echo(f"{url}: {done.message}")
    if done.repaired:
        typer.echo(f"check it: logitcache validate {url}")


def reindex_cmd(url: str, option: OptionList = None) -> None:
    """Give a store created without a key index one (FORMAT.md 4.11: key lookups and the
    writer's duplicate check then read a few small ranges instead of hashing every key; its
    root becomes repairable by ``logitcache repair``). One commit; the rows are unchanged."""
    from ._repair import add_key_index
    from .errors import FormatError

    try:
        n = add_key_index(url, storage_options(option))
    except FormatError as e:
        raise _fail(url, e) from None
    done = "has a key index already" if n is None else f"key index of {n} sequences written"
    typer.echo(f"{url}: {done}")


def export_records(
    url: str, out: Path, options: dict[str, object], fmt: str, limit: int | None
) -> int:
    """Write the first ``limit`` (all: ``None``) sequences of the store at ``url`` to ``out`` as
    JSON lines (``fmt="jsonl"``, one record per line) or wire-codec frames (``"frames"``);
    return how many."""
    from ._wire import encode_records

    if fmt not in ("jsonl", "frames"):
        raise typer.BadParameter(f"format must be jsonl or frames, got {fmt!r}")
    reader = _reader(url, options)
    n = reader.num_sequences if limit is None else min(limit, reader.num_sequences)
    mode = "w" if fmt == "jsonl" else "wb"
    with open(out, mode) as f:
        for start in range(0, n, 256):
            recs = reader.sequences(range(start, min(start + 256, n)))
            if fmt == "frames":
                f.write(encode_records(recs))
                continue
            for r in recs:
                f.write(json.dumps(_json_record(r)) + "\n")
    return n


def _json_record(r: Any) -> dict[str, Any]:
    """A record as :func:`export_records` writes a JSON line: its top-k arrays, or a hidden
    record's ``hidden`` rows (float32, FORMAT.md 4.10)."""
    out = {"key": r.key, "input_ids": r.input_ids.tolist()}
    if hasattr(r, "hidden"):
        return {**out, "hidden": r.hidden.tolist()}
    return {
        **out,
        "topk_ids": r.topk_ids.tolist(),
        "topk_logprobs": r.topk_logprobs.tolist(),
        "tail_mass": r.tail_or_computed().tolist(),
    }
