"""Store validation: check every invariant of FORMAT.md §7 and report every problem found.

The validator reads the committed part of a store in blocks (bounded memory) and never stops at
the first problem: each violated rule is reported with how often it occurred and where (the first
:data:`MAX_EXAMPLES` places).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import zarr
from zarr.abc.store import Store

from . import _idmap as idmap
from . import _keyruns as keyruns
from . import hidden, spec
from ._integrity import checked_read, missing_ranges
from ._keyindex import byte_hashes, hashes_of, utf8_lengths
from ._manifest import Manifest
from ._seal import sealed
from ._zarr_adapter import async_array, sync
from .errors import FormatError, MissingDataError, PlacementError
from .layout import committed_lengths, parse_root, read_root_attrs, strict
from .quant import STORED_DTYPE, decode_logprobs
from .store import open_store

MAX_EXAMPLES = 10
BLOCK_ROWS = 65536


@dataclass
class Problem:
    """One violated rule: ``code`` (stable identifier), message, count and example locations."""

    code: str
    message: str
    count: int = 1
    where: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        loc = f" at {', '.join(self.where)}" + (" ..." if self.count > len(self.where) else "")
        return f"[{self.code}] {self.message} (x{self.count}){loc if self.where else ''}"


@dataclass
class ValidationReport:
    """Result of :func:`validate`: ``ok`` iff no problem; ``problems`` lists each rule violated."""

    url: str
    manifest: Manifest | None = None
    problems: list[Problem] = field(default_factory=list)
    checked_rows: int = 0
    checked_sequences: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, code: str, message: str, where: list[str] | None = None, count: int = 1) -> None:
        for p in self.problems:
            if p.code == code:
                p.count += count
                p.where.extend((where or [])[: max(0, MAX_EXAMPLES - len(p.where))])
                return
        self.problems.append(Problem(code, message, count, list((where or [])[:MAX_EXAMPLES])))

    def codes(self) -> set[str]:
        return {p.code for p in self.problems}

    def __str__(self) -> str:
        head = f"{self.url}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'}"
        head += f" ({self.checked_sequences} sequences, {self.checked_rows} rows checked)"
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def _flag(
    report: ValidationReport, code: str, msg: str, bad: npt.ArrayLike, base: int, unit: str = "row"
) -> None:
    """Record problem ``code`` for every True in ``bad`` (offset ``base`` in ``unit`` numbering)."""
    idx = np.flatnonzero(bad)
    if idx.size:
        report.add(
            code, msg, [f"{unit} {base + int(i)}" for i in idx[:MAX_EXAMPLES]], int(idx.size)
        )


_UNIT = {spec.INPUT_IDS: "tokens", spec.ID_ORDER: "vocab", spec.SEQ_KEY_BYTES: "bytes"}


def _unit(name: str) -> str:
    if name in spec.SEQ_ARRAYS or name == spec.SEQ_KEY_END:
        return "sequences"
    return _UNIT.get(name, "rows")


def _read(
    arrays: dict, m: Manifest, report: ValidationReport, name: str, a: int, b: int
) -> np.ndarray | None:
    """``arrays[name][a:b]``, or ``None`` after reporting why not: ``object_missing`` (absent
    shard/chunk of a version-2 store, with the exact entry ranges) or ``unreadable`` (CRC32C,
    codec, truncated object), each naming the array and the entries."""
    unit = _unit(name)
    try:
        seal = sealed(m.format_version)
        return checked_read(arrays[name], name, a, b, strict(m), seal)
    except PlacementError as e:
        report.add("placement", f"object not where it belongs: {e}", [f"{name} {unit} {a}:{b}"])
    except MissingDataError:
        try:
            gaps = sync(missing_ranges(async_array(arrays[name]), a, b))
        except Exception:
            gaps = [(a, b)]
        where = [f"{name} {unit} {x}:{y}" for x, y in gaps]
        report.add("object_missing", "stored object or chunk missing", where, len(where))
    except Exception as e:
        report.add("unreadable", f"cannot be read/decoded: {e}", [f"{name} {unit} {a}:{b}"])
    return None


def _read_spans(
    arrays: dict,
    m: Manifest,
    report: ValidationReport,
    names: list[str],
    spans: list[tuple[int, int]],
) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
    """``(b0, b1, values by name)`` of every span ``[b0, b1)`` whose ``names`` all read
    (:func:`_read` reports the others)."""
    for b0, b1 in spans:
        read = {n: _read(arrays, m, report, n, b0, b1) for n in names}
        block = {n: v for n, v in read.items() if v is not None}
        if len(block) == len(read):
            yield b0, b1, block


def _expected_dtypes(m: Manifest) -> dict[str, tuple[str, bool]]:
    d = _row_dtypes(m)
    d.update(
        {
            spec.INPUT_IDS: ("int32", False),
            spec.SEQ_KEYS: ("str", False),
            spec.SEQ_LENGTHS: ("int32", False),
            spec.SEQ_TOKEN_START: ("int64", False),
            spec.SEQ_ROW_START: ("int64", False),
        }
    )
    if m.hidden is None and m.logprob_dtype in spec.QUANTISED_DTYPES:
        d[spec.LOGPROB_MAX] = ("float32", False)
        d[spec.LOGPROB_STEP] = ("float32", False)
    if m.id_remap:
        d[spec.ID_ORDER] = ("int32", False)
    if m.loss_mask:
        d[spec.LOSS_MASK] = ("uint8", False)
    if m.entropy:
        d[spec.ENTROPY] = ("float16", False)
    if m.actual_logprob:
        d[spec.ACTUAL_LOGPROB] = ("float32", False)
    if m.format_version >= 2:
        d[spec.SEQ_KEY_END] = ("int64", False)
        d[spec.SEQ_KEY_BYTES] = ("uint8", False)
    return d


def _row_dtypes(m: Manifest) -> dict[str, tuple[str, bool]]:
    """The row arrays (and, for a hidden store, the head) with their dtypes."""
    h = m.hidden
    if h is None:
        return {
            spec.TOPK_IDS: ("int32", True),
            spec.TOPK_LOGPROBS: (STORED_DTYPE[m.logprob_dtype], True),
            spec.TAIL_MASS: (m.tail_mass_dtype, False),
        }
    d = {
        spec.HIDDEN: (hidden.STORED[h["dtype"]], True),
        spec.HEAD_WEIGHT: (hidden.STORED[h["head_dtype"]], True),
    }
    if h["dtype"] == "float8_e4m3":
        d[spec.HIDDEN_SCALE] = ("float32", False)
    if h["bias"]:
        d[spec.HEAD_BIAS] = ("float32", False)
    return d


def _open_arrays(store: Store, m: Manifest, report: ValidationReport) -> dict[str, zarr.Array]:
    need_len = committed_lengths(m)
    arrays = {}
    for name, (dtype, k_axis) in _expected_dtypes(m).items():
        try:
            a = zarr.open_array(store, path=name, mode="r")
        except Exception as e:
            report.add("array_missing", f"array {name} cannot be opened: {e}", [name])
            continue
        kind_ok = (a.dtype.kind in "OTU") if dtype == "str" else (a.dtype == np.dtype(dtype))
        if not kind_ok:
            report.add("array_dtype", f"array {name} has dtype {a.dtype}, expected {dtype}", [name])
            continue
        want_ndim = 2 if k_axis else 1
        width = m.k if m.hidden is None else m.hidden["dim"]
        if a.ndim != want_ndim or (k_axis and a.shape[1] != width):
            report.add(
                "array_shape",
                f"array {name} has shape {a.shape}, expected "
                f"{'[n, ' + str(width) + ']' if k_axis else '[n]'}",
                [name],
            )
            continue
        n = need_len[name]
        if a.shape[0] < n:
            report.add(
                "array_short", f"array {name} has {a.shape[0]} entries, commit needs {n}", [name]
            )
            continue
        arrays[name] = a
    return arrays


def _check_index(
    arrays: dict, m: Manifest, report: ValidationReport, store: Store
) -> np.ndarray | None:
    """R3, R8 over the whole sequence index, and the key index (4.11) against the keys; the
    checked lengths (``None``: not readable)."""
    s = m.num_sequences
    if not all(n in arrays for n in spec.SEQ_ARRAYS):
        return None
    read = {n: _read(arrays, m, report, n, 0, s) for n in spec.SEQ_ARRAYS}
    keys = read[spec.SEQ_KEYS]
    if keys is not None:
        hashes = _check_keys(keys.tolist(), arrays, m, report)
        runs = m.runs()
        bad = [] if runs is None else keyruns.check_runs(store, runs, hashes())
        if bad:
            report.add("key_index", "key index run does not match the keys (4.11)", bad, len(bad))
    got = {n: v for n, v in read.items() if v is not None}
    if any(n not in got for n in spec.SEQ_ARRAYS[1:]):
        return None
    lengths = got[spec.SEQ_LENGTHS].astype(np.int64)
    tok = got[spec.SEQ_TOKEN_START]
    row = got[spec.SEQ_ROW_START]
    report.checked_sequences = s
    flag = partial(_flag, report, base=0, unit="sequence")
    flag("seq_too_short", "sequence with fewer than 2 tokens", lengths < 2)
    exp_tok = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if s else lengths
    exp_row = np.concatenate([[0], np.cumsum(lengths - 1)[:-1]]) if s else lengths
    msg = "seq_token_start not the running sum of lengths (monotone, contiguous)"
    flag("token_offsets", msg, tok != exp_tok)
    flag("row_offsets", "seq_row_start not the running sum of lengths - 1", row != exp_row)
    if int(lengths.sum()) != m.num_tokens:
        report.add(
            "count_tokens", f"sum of lengths {int(lengths.sum())} != num_tokens {m.num_tokens}"
        )
    if int((lengths - 1).sum()) != m.num_rows:
        report.add(
            "count_rows",
            f"sum of lengths - 1 = {int((lengths - 1).sum())} != num_rows {m.num_rows}",
        )
        return None
    tiles = (lengths >= 2).all() and (tok == exp_tok).all() and (row == exp_row).all()
    return lengths if tiles and int(lengths.sum()) == m.num_tokens else None


def _check_keys(
    keys: list[str], arrays: dict, m: Manifest, report: ValidationReport
) -> Callable[[], np.ndarray]:
    """R3 (non-empty, unique) and, in version 2, ``seq_key_bytes``/``seq_key_end`` hold the
    same keys (``key_bytes``). Returns what gives the keys' 64-bit hashes (4.11): from the key
    bytes where they hold the keys, else from the keys."""
    if "" in keys:
        for i in (i for i, key in enumerate(keys) if not key):
            report.add("key_empty", "empty sequence key", [f"sequence {i}"])
    if len(set(keys)) != len(keys):
        seen: dict[str, int] = {}
        dups = []
        for i, key in enumerate(keys):
            if key in seen:
                dups.append(f"sequence {i} (= {seen[key]})")
            seen.setdefault(key, i)
        report.add("key_duplicate", "sequence key stored twice", dups, len(dups))
    from_keys = partial(hashes_of, keys)
    if m.format_version < 2 or not all(n in arrays for n in spec.KEY_BYTES_ARRAYS):
        return from_keys
    ends = _read(arrays, m, report, spec.SEQ_KEY_END, 0, m.num_sequences)
    raw = _read(arrays, m, report, spec.SEQ_KEY_BYTES, 0, m.num_key_bytes)
    if ends is None or raw is None:
        return from_keys
    ends = ends.astype(np.int64)
    last = int(ends[-1]) if ends.size else 0
    if last != m.num_key_bytes or (ends.size and (np.diff(ends, prepend=0) < 0).any()):
        report.add("key_bytes", "seq_key_end not non-decreasing or not ending at num_key_bytes", [])
        return from_keys
    data = raw.tobytes()
    joined = "".join(keys).encode("utf-8", "surrogatepass")
    lens = utf8_lengths(keys, joined)
    if joined == data and np.array_equal(np.cumsum(lens), ends):
        if not (lens > 0).all():
            return from_keys
        return partial(byte_hashes, raw.astype(np.uint8, copy=False), ends)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    bad = [
        f"sequence {i}"
        for i, key in enumerate(keys)
        if data[int(starts[i]) : int(ends[i])] != key.encode("utf-8", "surrogatepass")
    ]
    if bad:
        report.add("key_bytes", "seq_key_bytes differ from seq_keys", bad, len(bad))
    return from_keys


def _blocks(stop: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, stop)) for a in range(0, stop, size)]


def _split(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``spans`` (sorted, disjoint) merged where they touch and cut into pieces of ``size``."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and out[-1][1] == a and out[-1][1] - out[-1][0] < size:
            a = out.pop()[0]
        out += [(x, min(x + size, b)) for x in range(a, b, size)]
    return out


def _check_rows(
    arrays: dict, m: Manifest, report: ValidationReport, spans: list[tuple[int, int]]
) -> None:
    if m.hidden is not None:
        _check_hidden(arrays, m, report, spans)
        return
    names = [spec.TOPK_IDS, spec.TOPK_LOGPROBS, spec.TAIL_MASS]
    quant = m.logprob_dtype in spec.QUANTISED_DTYPES
    if quant:
        names += [spec.LOGPROB_MAX, spec.LOGPROB_STEP]
    if not all(n in arrays for n in names):
        return
    order = None
    if m.id_remap and m.num_rows:
        if spec.ID_ORDER not in arrays:
            return
        order = _read(arrays, m, report, spec.ID_ORDER, 0, m.vocab_size)
        if order is None:
            return
        if not idmap.is_permutation(order, m.vocab_size):
            report.add("id_order", "id_order is not a permutation of [0, vocab_size)")
            return
    for b0, b1, block in _read_spans(arrays, m, report, names, spans):
        flag = partial(_flag, report, base=b0)
        ids = block[spec.TOPK_IDS]  # ranks if remapped: same range, same distinctness
        out = ((ids < 0) | (ids >= m.vocab_size)).any(axis=1)
        flag("id_out_of_vocab", f"top-k id outside [0, {m.vocab_size})", out)
        if m.k > 1:
            srt = np.sort(ids, axis=1)
            repeated = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
            flag("id_repeated", "repeated id within a row", repeated)
        slack = np.full(b1 - b0, 1e-3 + m.k * (2e-4 if m.logprob_dtype == "float16" else 1e-6))
        if quant:
            mx, st = block[spec.LOGPROB_MAX], block[spec.LOGPROB_STEP]
            bad = ~np.isfinite(mx) | ~np.isfinite(st) | (mx > 0) | (st < 0)
            flag("quant_params", "logprob_max/step not finite, max > 0 or step < 0", bad)
            lp = decode_logprobs(block[spec.TOPK_LOGPROBS], m.logprob_dtype, mx, st)
            with np.errstate(all="ignore"):  # decoded values may be up to step/2 too high
                slack = np.expm1(np.nan_to_num(st.astype(np.float64), nan=0.0) / 2) + 2e-3
        else:
            lp = decode_logprobs(block[spec.TOPK_LOGPROBS], m.logprob_dtype)
        finite = np.isfinite(lp).all(axis=1)
        flag("logprob_nonfinite", "logprob NaN or inf", ~finite)
        flag("logprob_positive", "logprob > 0", (lp > 0).any(axis=1))
        with np.errstate(all="ignore"):
            mass = np.exp(lp.astype(np.float64)).sum(axis=1)
        over = finite & (mass > 1.0 + slack)
        flag("logprob_mass", "top-k probabilities sum to more than 1 (R2)", over)
        if m.targets == "sampled":  # FORMAT.md 4.4: importance weights sum to 1
            under = finite & (mass < 1.0 - slack)
            flag("sampled_weights", "sampled row's weights do not sum to 1 (FORMAT.md 4.4)", under)
        if m.k > 1:
            unsorted = (lp[:, 1:] > lp[:, :-1]).any(axis=1)
            flag("logprob_order", "logprobs not sorted descending", unsorted)
        tail = np.asarray(block[spec.TAIL_MASS], dtype=np.float32)
        bad = ~np.isfinite(tail) | (tail < 0) | (tail > 1)
        flag("tail_range", "tail mass outside [0, 1] or not finite", bad)
        report.checked_rows += b1 - b0


def _check_hidden(
    arrays: dict, m: Manifest, report: ValidationReport, spans: list[tuple[int, int]]
) -> None:
    """FORMAT.md 4.10: hidden rows finite (``hidden_nonfinite``), e4m3 scales finite and
    ``> 0`` (``hidden_scale``), the head's bytes hashing to ``head_digest`` (``head_digest``)."""
    h = m.hidden
    assert h is not None
    names = [n for n in (spec.HIDDEN, spec.HIDDEN_SCALE) if n in _row_dtypes(m)]
    if not all(n in arrays for n in names):
        return
    if m.num_rows and all(n in arrays for n in (spec.HEAD_WEIGHT, spec.HEAD_BIAS)[: 1 + h["bias"]]):
        w = _read(arrays, m, report, spec.HEAD_WEIGHT, 0, m.vocab_size)
        b = _read(arrays, m, report, spec.HEAD_BIAS, 0, m.vocab_size) if h["bias"] else None
        if w is not None and (b is not None or not h["bias"]):
            got = hidden.TeacherHead(w, b, dtype=h["head_dtype"]).digest()
            if got != h["head_digest"]:
                report.add("head_digest", f"head bytes hash to {got}, manifest has another")
    for b0, b1, block in _read_spans(arrays, m, report, names, spans):
        scale = block.get(spec.HIDDEN_SCALE)
        if scale is not None:
            bad = ~np.isfinite(scale) | (scale <= 0)
            _flag(report, "hidden_scale", "e4m3 row scale not finite > 0", bad, b0, "row")
            scale = np.where(bad, 1, scale)
        with np.errstate(all="ignore"):
            rows = hidden.decode_rows(block[spec.HIDDEN], h["dtype"], scale)
        bad = ~np.isfinite(rows).all(axis=1)
        _flag(report, "hidden_nonfinite", "hidden state NaN or inf", bad, b0, "row")
        report.checked_rows += b1 - b0


#: ``(array and manifest flag, code, message, bad(values, log V))`` of the optional per-row
#: arrays: FORMAT.md 4.6 (``loss_mask`` 0 or 1), 4.9 (``entropy`` finite in ``[0, log V]`` up to
#: float16 rounding), 4.12 (``actual_logprob`` ``<= 0``, not NaN).
_VALUE_CHECKS: tuple[tuple[str, str, str, Callable[[np.ndarray, float], Any]], ...] = (
    (spec.LOSS_MASK, "loss_mask_value", "loss_mask entry not 0 or 1", lambda x, _: x > 1),
    (
        spec.ENTROPY,
        "entropy_value",
        "entropy not finite or outside [0, log V]",
        lambda e, top: ~np.isfinite(e) | (e < 0) | (e > top * (1 + 2.0**-10) + 2.0**-10),
    ),
    (
        spec.ACTUAL_LOGPROB,
        "actual_value",
        "actual_logprob NaN or above 0",
        lambda a, _: np.isnan(a) | (a > 0),
    ),
)


def _check_values(
    arrays: dict, m: Manifest, report: ValidationReport, spans: list[tuple[int, int]]
) -> None:
    """:data:`_VALUE_CHECKS` of the arrays the store keeps, over every entry of ``spans``."""
    top = float(np.log(m.vocab_size))
    for name, code, msg, bad in _VALUE_CHECKS:
        if getattr(m, name) and name in arrays:
            for b0, _, got in _read_spans(arrays, m, report, [name], spans):
                values = np.asarray(got[name], dtype=np.float32)
                _flag(report, code, msg, bad(values, top), b0, "row")


def _check_tokens(
    arrays: dict, m: Manifest, report: ValidationReport, spans: list[tuple[int, int]]
) -> None:
    if spec.INPUT_IDS not in arrays:
        return
    for b0, _, got in _read_spans(arrays, m, report, [spec.INPUT_IDS], spans):
        tok = got[spec.INPUT_IDS]
        bad = (tok < 0) | (tok >= m.vocab_size)
        _flag(
            report, "token_out_of_vocab", f"input id outside [0, {m.vocab_size})", bad, b0, "token"
        )


def _sample(
    lengths: np.ndarray, sample: float, seed: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The row and token spans of a seeded sample of sequences: ``sample < 1`` a fraction of
    them, else a count (at least one sequence of a non-empty store)."""
    s = lengths.size
    n = min(s, max(1, round(sample * s)) if sample < 1 else int(sample)) if s else 0
    pick = np.sort(np.random.default_rng(seed).choice(s, size=n, replace=False))
    tok = np.concatenate([[0], np.cumsum(lengths)])
    row = tok - np.arange(s + 1)
    rows = [(int(row[i]), int(row[i + 1])) for i in pick]
    return _split(rows, BLOCK_ROWS), _split(
        [(int(tok[i]), int(tok[i + 1])) for i in pick], BLOCK_ROWS * 16
    )


def validate(
    url: str | Path,
    storage_options: dict[str, Any] | None = None,
    *,
    sample: float | None = None,
    seed: int = 0,
) -> ValidationReport:
    """Check every FORMAT.md invariant of the committed part of the store at ``url``.

    ``sample``: check the rows and tokens of a seeded sample of the sequences only (a fraction
    if below 1, else a count; ``seed`` picks them); the manifest, the arrays' metadata and the
    whole sequence index are always checked. Without it every committed entry is read."""
    if sample is not None and not sample > 0:
        raise ValueError(f"sample must be > 0 (a fraction below 1 or a count), got {sample}")
    report = ValidationReport(url=str(url))
    try:
        handle = open_store(url, storage_options, read_only=True)
        attrs = read_root_attrs(handle.zstore)
    except Exception as e:
        report.add("store_unreadable", f"cannot open store: {e}")
        return report
    if attrs is None:
        report.add("no_store", "no zarr root group (zarr.json) at this URL")
        return report
    try:
        m = parse_root(attrs)
    except FormatError as e:
        report.add("manifest", str(e))
        return report
    report.manifest = m
    arrays = _open_arrays(handle.zstore, m, report)
    lengths = _guard(report, _check_index, arrays, m, report, handle.zstore)
    rows, tokens = _blocks(m.num_rows, BLOCK_ROWS), _blocks(m.num_tokens, BLOCK_ROWS * 16)
    masks = _blocks(m.num_rows, BLOCK_ROWS * 16)
    if sample is not None and lengths is not None:
        rows, tokens = _sample(lengths, sample, seed)
        masks = rows
    _guard(report, _check_rows, arrays, m, report, rows)
    _guard(report, _check_values, arrays, m, report, masks)
    _guard(report, _check_tokens, arrays, m, report, tokens)
    return report


def _guard(report: ValidationReport, check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)``; a safety net: every check reports, none may crash validate."""
    try:
        return check(*args)
    except Exception as e:
        report.add("unreadable", f"{check.__name__} failed on damaged data: {e!r}")
        return None
