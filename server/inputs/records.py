"""Input sequences of scoring requests and jobs: reading, tokenising, checking, keying, batching.

A raw input record has ``text`` *or* token ids, and optionally an ``id``. Its sequence key is
``str(id)`` when given, else :func:`logitcache.cache_format.records.content_key` of its token ids
(so text and ids inputs that tokenise alike share a key). A sequence must hold
``2 <= L <= max_seq_len`` tokens, each in ``[0, vocab_size)``.

Job batches are a pure function of the input and two limits (:func:`batches`), so a resumed job
re-forms exactly the batches of the first run: each batch still missing a key is scored whole.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
from logitcache.cache_format.records import content_key
from logitcache.protocol import MAX_KEY_CHARS, InlineRecord, InputFile

from .. import paths
from ..errors import InvalidInputError, InvalidPathError, PayloadTooLargeError
from . import chat, jsonids
from . import files as input_files
from . import long as long_inputs

#: Most per-record problems listed in one error answer.
MAX_LISTED_ERRORS = 20

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class Limits:
    """What a sequence must satisfy: ``2 <= len <= max_seq_len`` and ids in ``[0, vocab_size)``."""

    vocab_size: int
    max_seq_len: int
    on_long: str = "reject"
    """A job's rule for a longer sequence: reject, truncate, split, skip (server/inputs/long.py)."""
    split_overlap: int = 1
    """Tokens shared by consecutive windows under ``on_long="split"`` (``1 <= O < max_seq_len``)."""
    max_text_bytes: int | None = None
    """Longest text in UTF-8 bytes, checked before tokenising (413 above); None: no limit."""


@dataclass(frozen=True)
class RawRecord:
    """One input record as read: where it came from, its id (or None), text or ids."""

    where: str
    id: str | None
    text: str | None
    input_ids: Any
    messages: Any = None
    """A chat record's messages (server/inputs/chat.py), else None."""


@dataclass(frozen=True)
class Sequence:
    """A checked input sequence: its key, ``[L]`` int32 token ids and a chat record's row loss
    mask (uint8 ``[L-1]``, else None)."""

    key: str
    input_ids: np.ndarray
    loss_mask: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def check_ids(ids: object, limits: Limits, where: str) -> np.ndarray:
    """``ids`` as an int32 array after the length and vocabulary checks (InvalidInputError)."""
    if isinstance(ids, np.ndarray):
        arr = ids
    elif isinstance(ids, list | tuple):
        # plain ints only (what JSON gives; no bool, whose type is not int) are checked by one
        # C-level pass and converted straight to int32 instead of a Python check per token
        # (~0.3 CPU-us/position, paid at submit and again at run). A value outside int32 is
        # outside every vocabulary.
        plain = set(map(type, ids)) <= {int}
        if not plain and not all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidInputError(f"{where}: token ids must be a list of integers")
        try:
            arr = np.asarray(ids, dtype=np.int32 if plain else np.int64)
        except OverflowError:
            raise InvalidInputError(
                f"{where}: a token id is outside the teacher's vocabulary [0, {limits.vocab_size})"
            ) from None
    else:
        raise InvalidInputError(f"{where}: token ids must be a list of integers")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidInputError(f"{where}: token ids must be a 1-D list of integers")
    n = int(arr.shape[0])
    if n < 2:
        raise InvalidInputError(f"{where}: a sequence needs at least 2 tokens, got {n}")
    if n > limits.max_seq_len:
        raise PayloadTooLargeError(
            f"{where}: {n} tokens exceed the server's max sequence length {limits.max_seq_len}"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= limits.vocab_size:
        bad = int(arr[(arr < 0) | (arr >= limits.vocab_size)][0])
        raise InvalidInputError(
            f"{where}: token id {bad} outside the teacher's vocabulary [0, {limits.vocab_size})"
        )
    return np.ascontiguousarray(arr, dtype=np.int32)


def to_sequence(raw: RawRecord, tokenize: Tokenize, limits: Limits) -> Sequence:
    """Tokenise (if text), check and key one raw record."""
    if sum(x is not None for x in (raw.text, raw.input_ids, raw.messages)) != 1:
        what = "text or token ids" if raw.messages is None else "text, token ids or messages"
        raise InvalidInputError(f"{raw.where}: give exactly one of {what}")
    mask = None
    if raw.messages is not None:  # a chat record: rendered with the chat template
        ids, mask = chat.chat_ids_and_mask(tokenize, raw.messages, raw.where)
    elif raw.text is not None:
        if not isinstance(raw.text, str):
            raise InvalidInputError(f"{raw.where}: text must be a string")
        ids: Any = tokenize(check_text(raw.text, limits, raw.where))
    else:
        ids = raw.input_ids
    arr = check_ids(ids, limits, raw.where)
    key = raw.id if raw.id is not None else content_key(arr)
    return Sequence(key=key, input_ids=arr, loss_mask=mask)


def check_text(text: str, limits: Limits, where: str) -> str:
    """``text`` if it is valid Unicode (no lone surrogate) and within ``max_text_bytes`` UTF-8
    bytes; checked before tokenising (a huge text never reaches the tokenizer)."""
    if limits.max_text_bytes is not None and len(text) > limits.max_text_bytes:
        raise PayloadTooLargeError(
            f"{where}: text of {len(text)}+ characters exceeds the limit of "
            f"{limits.max_text_bytes} bytes per text"
        )
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidInputError(
            f"{where}: text is not valid Unicode (lone surrogate at index {e.start})"
        ) from None
    if limits.max_text_bytes is not None and size > limits.max_text_bytes:
        raise PayloadTooLargeError(
            f"{where}: text of {size} bytes exceeds the limit of {limits.max_text_bytes} bytes"
        )
    return text


def check_key(key: str, where: str) -> str:
    """``key`` if it is a usable sequence key: 1-512 characters of valid Unicode, no NUL."""
    if not key:
        raise InvalidInputError(f"{where}: id is empty")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidInputError(f"{where}: id of {len(key)} characters exceeds {MAX_KEY_CHARS}")
    if "\x00" in key:
        raise InvalidInputError(f"{where}: id contains a NUL character")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(f"{where}: id is not valid Unicode (lone surrogate)") from None
    return key


def fit_sequences(
    raw: RawRecord,
    tokenize: Tokenize,
    limits: Limits,
    counts: long_inputs.InputCounts | None = None,
) -> list[Sequence]:
    """``raw`` as the sequences a job scores under ``limits.on_long`` (:mod:`.long`)."""
    if limits.on_long == "reject":
        return [to_sequence(raw, tokenize, limits)]
    whole = to_sequence(raw, tokenize, replace(limits, max_seq_len=2**62))
    n, m = whole.length, limits.max_seq_len
    if n <= m:
        return [whole]
    counts = counts if counts is not None else long_inputs.InputCounts()
    if limits.on_long == "skip":
        counts.skipped += 1
        return []
    if limits.on_long == "truncate":
        counts.truncated += 1
        ids = np.ascontiguousarray(whole.input_ids[:m])
        key = raw.id if raw.id is not None else content_key(ids)
        return [Sequence(key=key, input_ids=ids, loss_mask=_rows(whole.loss_mask, 0, m))]
    spans = long_inputs.windows(n, m, limits.split_overlap)
    counts.split += 1
    counts.windows += len(spans)
    return [
        Sequence(
            key=long_inputs.window_key(whole.key, i),
            input_ids=np.ascontiguousarray(whole.input_ids[a:b]),
            loss_mask=_rows(whole.loss_mask, a, b),
        )
        for i, (a, b) in enumerate(spans)
    ]


def _rows(mask: np.ndarray | None, a: int, b: int) -> np.ndarray | None:
    """The loss mask of tokens ``[a, b)``: rows ``a .. b-2`` (row ``j`` predicts token ``j+1``)."""
    return None if mask is None else np.ascontiguousarray(mask[a : b - 1])


def job_limits(limits: Limits, on_long: str, split_overlap: int) -> Limits:
    """``limits`` with a job's long-sequence rule (InvalidInputError for an impossible overlap)."""
    if on_long == "split" and not 1 <= split_overlap < limits.max_seq_len:
        raise InvalidInputError(
            f"split_overlap must be in [1, {limits.max_seq_len}) (the max sequence length), "
            f"got {split_overlap}"
        )
    return replace(limits, on_long=on_long, split_overlap=split_overlap)


def _id_of(value: object, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidInputError(f"{where}: id must be a string or an integer")
    return check_key(str(value), where)


# --- sources -------------------------------------------------------------------------------


def resolve_input_path(data_dir: Path, rel: str) -> Path:
    """The existing file or directory ``rel`` inside ``data_dir`` (links followed)."""
    path = paths.resolve_under(data_dir, rel, "input path")
    if not (path.is_file() or path.is_dir()):
        raise InvalidPathError(f"input file {rel!r} does not exist in the data directory")
    return path


def input_format(spec: InputFile, path: Path, data_dir: Path) -> str:
    if spec.format is not None:
        return spec.format
    return input_files.detect_format(path, spec.path, data_dir)  # .gz, .arrow, directories


def _from_mapping(obj: object, spec: InputFile, where: str) -> RawRecord:
    if not isinstance(obj, dict):
        raise InvalidInputError(f"{where}: expected an object")
    return RawRecord(
        where=where,
        id=_id_of(obj.get(spec.id_field), where),
        text=obj.get(spec.text_field),
        input_ids=obj.get(spec.ids_field),
        messages=obj.get(spec.messages_field),
    )


def line_limit(limits: Limits) -> int | None:
    """Longest JSONL line read (bytes) for ``limits`` (an escaped text of ``max_text_bytes``,
    ``max_seq_len`` ids and 64 KiB); None without a text limit."""
    if limits.max_text_bytes is None:
        return None
    return 6 * limits.max_text_bytes + 12 * limits.max_seq_len + (64 << 10)


def _lines(f: Any, limit: int | None, rel: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of a binary reader, a line over ``limit`` a 413 before it is read
    whole; an unreadable file a 422."""
    lineno = 0
    try:
        while line := (f.readline() if limit is None else f.readline(limit + 1)):
            lineno += 1
            if limit is not None and len(line) > limit:
                raise PayloadTooLargeError(
                    f"{rel}:{lineno}: line longer than the limit of {limit} bytes "
                    "(set by max_text_bytes and max_seq_len)"
                )
            yield lineno, line
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise InvalidInputError(
            f"{rel}:{lineno + 1}: unreadable ({type(e).__name__}: {e})"
        ) from None


class InputDigest:
    """:func:`input_digest` of a job's input, computed from the bytes its reading reads (one
    pass over a JSONL file: :func:`raw_records` feeds it); for other inputs it reads them."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.fed = False

    def feed(self, data: bytes) -> None:
        self.hash.update(data)

    def value(
        self, *, file: InputFile | None, records: list[InlineRecord] | None, data_dir: Path
    ) -> str:
        if self.fed:
            return "sha256:" + self.hash.hexdigest()
        return input_digest(file=file, records=records, data_dir=data_dir)


class _Hashed(io.RawIOBase):
    """A raw binary file whose bytes, as they are read, also go to an :class:`InputDigest`."""

    def __init__(self, raw: io.RawIOBase, digest: InputDigest):
        self._raw = raw
        self._digest = digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        n = self._raw.readinto(buffer) or 0
        self._digest.feed(memoryview(buffer)[:n])
        return n


@contextmanager
def _jsonl_lines(path: Path, digest: InputDigest | None) -> Iterator[IO[bytes]]:
    """The lines of a JSONL file, plain or ``.gz``; with ``digest``, its bytes (as stored) are
    fed to it, the rest of the file too once the lines are read."""
    if digest is None:
        with input_files.open_text(path) as f:
            yield f
        return
    digest.feed(b".\0")  # input_digest's name of a one-file input
    with path.open("rb", buffering=0) as raw:
        hashed = io.BufferedReader(_Hashed(raw, digest), 1 << 20)
        gz = path.name.lower().endswith(".gz")
        with gzip.GzipFile(fileobj=hashed, mode="rb") if gz else nullcontext(hashed) as f:
            yield f
        while hashed.read(1 << 20):  # bytes after the last line (or gzip member)
            pass
    digest.fed = True


def _read_jsonl(
    path: Path,
    spec: InputFile,
    digest: InputDigest | None = None,
    max_line_bytes: int | None = None,
) -> Iterator[RawRecord]:
    wanted = (spec.id_field, spec.text_field, spec.ids_field, spec.messages_field)
    fast = jsonids.ready()  # ids straight to int32, else json.loads' own reading
    with _jsonl_lines(path, digest) as f:
        for lineno, line in _lines(f, max_line_bytes, spec.path):
            if not line.strip():
                continue
            where = f"{spec.path}:{lineno}"
            obj = jsonids.fields(line, wanted, spec.ids_field) if fast else None
            if obj is not None:
                yield _from_mapping(obj, spec, where)
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InvalidInputError(f"{where}: not valid UTF-8 (byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise InvalidInputError(f"{where}: invalid JSON ({e.msg})") from None
            except RecursionError:
                raise InvalidInputError(f"{where}: JSON nested too deeply") from None
            yield _from_mapping(obj, spec, where)


def _read_table(path: Path, spec: InputFile, fmt: str, data_dir: Path) -> Iterator[RawRecord]:
    """Parquet or Arrow records, from a file or a directory of files (:mod:`.files`)."""
    wanted = (spec.id_field, spec.text_field, spec.ids_field, spec.messages_field)
    need = (spec.text_field, spec.ids_field, spec.messages_field)
    for where, obj in input_files.table_rows(path, fmt, spec.path, wanted, need, data_dir):
        yield _from_mapping(obj, spec, where)


def raw_records(
    *,
    file: InputFile | None,
    records: list[InlineRecord] | None,
    data_dir: Path,
    digest: InputDigest | None = None,
    max_line_bytes: int | None = None,
) -> Iterator[RawRecord]:
    """The raw records of a job's input, in order; a JSONL file's bytes also go to ``digest``."""
    if records is not None:
        for i, r in enumerate(records):
            where = f"records[{i}]"
            yield RawRecord(
                where=where,
                id=_id_of(r.id, where),
                text=r.text,
                input_ids=r.input_ids,
                messages=r.messages,
            )
        return
    if file is None:
        raise InvalidInputError("a job needs a file or records")
    path = resolve_input_path(data_dir, file.path)
    fmt = input_format(file, path, data_dir)
    if fmt == "jsonl":
        if path.is_dir():
            raise InvalidInputError(f"{file.path!r} is a directory: jsonl input is one file")
        yield from _read_jsonl(path, file, digest, max_line_bytes)
    else:
        yield from _read_table(path, file, fmt, data_dir)


def input_digest(
    *, file: InputFile | None, records: list[InlineRecord] | None, data_dir: Path
) -> str:
    """SHA-256 of the input (file bytes, or the inline records' JSON): detects a changed file."""
    h = hashlib.sha256()
    if records is not None:
        h.update(json.dumps([r.model_dump() for r in records], sort_keys=True).encode())
    elif file is not None:
        path = resolve_input_path(data_dir, file.path)
        for f_path in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if not f_path.is_file():
                continue
            rel = f_path.relative_to(path)
            paths.contained(data_dir, f_path, "input file", shown=f"{file.path}/{rel}")
            h.update(str(rel).encode() + b"\0")
            with f_path.open("rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return "sha256:" + h.hexdigest()


def sequences(
    raws: Iterable[RawRecord],
    tokenize: Tokenize,
    limits: Limits,
    counts: long_inputs.InputCounts | None = None,
) -> Iterator[Sequence]:
    """Checked, keyed sequences in input order (repeated content keys dropped); raises at the
    first bad record or explicit id used twice."""
    seen: set[str] = set()
    for raw in raws:
        for seq in fit_sequences(raw, tokenize, limits, counts):
            if seq.key in seen:
                if raw.id is not None:
                    raise InvalidInputError(f"{raw.where}: id {raw.id!r} appears more than once")
                if counts is not None:
                    counts.duplicates += 1
                continue
            seen.add(seq.key)
            yield seq


def valid_records(
    raws: Iterable[RawRecord],
    tokenize: Tokenize,
    limits: Limits,
    errors: list[str],
    counts: long_inputs.InputCounts | None = None,
) -> Iterator[tuple[RawRecord, Sequence]]:
    """The valid, first-seen records of ``raws`` with their sequences, in input order, the
    problems going to ``errors`` (up to :data:`MAX_LISTED_ERRORS`; a source failing while read
    ends the walk); a file outside the data directory raises at once."""
    seen: set[str] = set()
    it = iter(raws)
    while True:
        try:
            raw = next(it)
        except StopIteration:
            return
        except InvalidPathError:  # a file outside the data directory: refused as such
            raise
        except (InvalidInputError, PayloadTooLargeError) as e:  # unreadable source: stop here
            errors.append(e.message)
            return
        if counts is not None:
            counts.records += 1
        try:
            seqs = fit_sequences(raw, tokenize, limits, counts)
        except (InvalidInputError, PayloadTooLargeError) as e:
            errors.append(e.message)
            if len(errors) >= MAX_LISTED_ERRORS:
                return
            continue
        for seq in seqs:
            if seq.key in seen:
                if raw.id is not None:
                    errors.append(f"{raw.where}: id {raw.id!r} appears more than once")
                    break
                if counts is not None:
                    counts.duplicates += 1
                continue
            seen.add(seq.key)
            if counts is not None:
                counts.sequences += 1
            yield raw, seq


@dataclass(frozen=True)
class InputSummary:
    sequences: int
    tokens: int
    counts: long_inputs.InputCounts = field(default_factory=long_inputs.InputCounts)


def scan(
    raws: Iterable[RawRecord],
    tokenize: Tokenize,
    limits: Limits,
    keep: list[Sequence] | None = None,
    keep_tokens: int = 0,
) -> InputSummary:
    """Check every record before a job is accepted: :class:`InvalidInputError` listing the
    problems, or for empty input. With ``keep``, the checked sequences are kept while they hold at
    most ``keep_tokens`` tokens (else ``keep`` ends empty)."""
    n = tokens = 0
    errors: list[str] = []
    counts = long_inputs.InputCounts()
    for _raw, seq in valid_records(raws, tokenize, limits, errors, counts):
        n += 1
        tokens += seq.length
        if keep is not None:
            if tokens <= keep_tokens:
                keep.append(seq)
            elif keep:
                keep.clear()
    if errors:
        raise InvalidInputError(
            f"the input has {len(errors)}{'+' if len(errors) >= MAX_LISTED_ERRORS else ''} "
            f"invalid record(s); first: {errors[0]}",
            detail=errors,
        )
    if n == 0:
        why = f" ({counts.skipped} skipped as too long)" if counts.skipped else ""
        raise InvalidInputError(f"the input holds no sequence{why}")
    return InputSummary(sequences=n, tokens=tokens, counts=counts)


def batches(
    seqs: Iterable[Sequence], *, max_sequences: int, max_tokens: int
) -> Iterator[list[Sequence]]:
    """Consecutive batches of at most ``max_sequences`` sequences and ``max_tokens`` tokens (a
    longer single sequence forms its own batch)."""
    batch: list[Sequence] = []
    tokens = 0
    for s in seqs:
        if batch and (len(batch) >= max_sequences or tokens + s.length > max_tokens):
            yield batch
            batch, tokens = [], 0
        batch.append(s)
        tokens += s.length
    if batch:
        yield batch
