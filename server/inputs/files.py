"""Job input files as real datasets come: gzip JSONL, Parquet or Arrow files, and directories of
them in the layouts Hugging Face ``datasets`` writes.

Accepted under the data directory: ``*.jsonl`` / ``*.ndjson`` / ``*.json`` (optionally ``.gz``),
``*.parquet`` / ``*.pq``, ``*.arrow``, a ``Dataset.save_to_disk`` folder (read in the order
``state.json`` lists) or any folder of ``*.parquet`` files (sorted path order). A
``DatasetDict`` folder is refused with the names of its splits. Records are read in a fixed
order; every file read must lie inside the data directory with links followed (:mod:`..paths`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .. import paths
from ..errors import InvalidInputError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow",)


def _name(path: Path) -> str:
    """The file name without a trailing ``.gz``, lower-cased."""
    name = path.name.lower()
    return name[:-3] if name.endswith(".gz") else name


def detect_format(path: Path, rel: str, root: Path) -> str:
    """``jsonl``, ``parquet`` or ``arrow`` for a file or directory (InvalidInputError: unknown)."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise InvalidInputError(
                f"{rel!r} is a DatasetDict: give one split's directory ({', '.join(splits)})"
            )
        if (path / "state.json").is_file() or any(path.glob("*.arrow")):
            return "arrow"
        if next(_files(path, PARQUET_SUFFIXES, root, rel), None) is not None:
            return "parquet"
        raise InvalidInputError(f"directory {rel!r} holds no .parquet or .arrow files")
    name = _name(path)
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(ARROW_SUFFIXES):
        return "arrow"
    raise InvalidInputError(f"cannot tell the format of {rel!r}: set format")


def _files(directory: Path, suffixes: tuple[str, ...], root: Path, rel: str) -> Iterator[Path]:
    """The data files under ``directory`` in sorted order (hidden and ``_`` parts skipped),
    each checked to lie inside ``root`` with links followed."""
    for p in sorted(directory.rglob("*")):
        rel_parts = p.relative_to(directory).parts
        if (
            p.name.lower().endswith(suffixes)
            and not any(part.startswith((".", "_")) for part in rel_parts)
            and p.is_file()
        ):
            shown = "/".join((rel, *rel_parts))
            paths.contained(root, p, "input file", shown=shown)
            yield p


def data_files(path: Path, fmt: str, root: Path, rel: str) -> list[Path]:
    """The files of an input, in reading order (one file, or a directory's files), each inside
    the data directory ``root`` (see the module docstring); ``rel``: the input's path."""
    if not path.is_dir():
        return [path]
    if fmt == "arrow":
        state = path / "state.json"
        if state.is_file():
            paths.contained(root, state, "input file", shown=f"{rel}/state.json")
            try:
                listed = json.loads(state.read_text())["_data_files"]
                names = [f["filename"] for f in listed]
            except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
                raise InvalidInputError(f"{rel}/state.json: unreadable ({e})") from None
            what = f"{rel}/state.json entry"
            return [paths.resolve_under(root, str(n), what, base=path) for n in names]
        return list(_files(path, ARROW_SUFFIXES, root, rel))
    if fmt == "parquet":
        return list(_files(path, PARQUET_SUFFIXES, root, rel))
    raise InvalidInputError(f"a directory input must hold parquet or arrow files, not {fmt}")


def _below(f: Path, folder: Path) -> str:
    """``f`` relative to ``folder`` when it lies there, else its name (a linked member)."""
    return str(f.relative_to(folder)) if f.is_relative_to(folder) else f.name


def open_text(path: Path) -> IO[bytes]:
    """A binary reader of a (possibly gzip-compressed) text file."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return path.open("rb")


def arrow_batches(path: Path, columns: list[str] | None, rel: str) -> Iterator[Any]:
    """Record batches of an Arrow IPC stream (what ``datasets`` writes) or IPC file."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        with pa.memory_map(str(path), "r") as source:
            try:
                reader: Any = ipc.open_stream(source)
                batches = iter(reader)
            except pa.ArrowInvalid:
                source.seek(0)
                f = ipc.open_file(source)
                batches = (f.get_batch(i) for i in range(f.num_record_batches))
            for b in batches:
                yield b.select(columns) if columns is not None else b
    except (pa.ArrowInvalid, OSError) as e:
        raise InvalidInputError(f"{rel}: not a readable Arrow file ({e})") from None


def arrow_schema_names(path: Path, rel: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        with pa.memory_map(str(path), "r") as source:
            try:
                return list(ipc.open_stream(source).schema.names)
            except pa.ArrowInvalid:
                source.seek(0)
                return list(ipc.open_file(source).schema.names)
    except (pa.ArrowInvalid, OSError) as e:
        raise InvalidInputError(f"{rel}: not a readable Arrow file ({e})") from None


def table_rows(
    path: Path,
    fmt: str,
    rel: str,
    wanted: tuple[str, ...],
    need_one_of: tuple[str, ...],
    root: Path,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row dict)`` of a Parquet/Arrow file or directory under ``root``, ``wanted``
    columns only; every file must have one of ``need_one_of``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = data_files(path, fmt, root, rel)
    if not files:
        raise InvalidInputError(f"{rel!r} holds no {fmt} files")
    for f in files:
        row = 0
        label = rel if f == path else f"{rel}/{_below(f, path)}"
        if fmt == "parquet":
            try:
                pf = pq.ParquetFile(f)
            except (pa.ArrowInvalid, OSError) as e:
                raise InvalidInputError(f"{label}: not a readable Parquet file ({e})") from None
            names = set(pf.schema_arrow.names)
        else:
            names = set(arrow_schema_names(f, label))
        if not names & set(need_one_of):
            raise InvalidInputError(
                f"{label}: no column {' or '.join(map(repr, need_one_of))} (has {sorted(names)})"
            )
        cols = [c for c in wanted if c in names]
        batches = (
            pf.iter_batches(batch_size=4096, columns=cols)
            if fmt == "parquet"
            else arrow_batches(f, cols, label)
        )
        for batch in batches:
            for obj in batch.to_pylist():
                yield f"{label} row {row}", obj
                row += 1
