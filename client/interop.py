"""Parquet interchange with other distillation trainers: axolotl's KD trainer and DistillKit.

Both peers use this project's alignment: the teacher row of position ``j`` is the distribution of
token ``j + 1`` (``cache_format/FORMAT.md``). Layouts (read from the peers' code, 2026):

axolotl (``src/axolotl/integrations/kd``: the collator and ``AxolotlKDTrainer`` read these
columns; its ``chat_template`` strategy produces them from vLLM logprobs)
    one parquet row per sequence of ``L`` tokens: ``input_ids [L]``, ``labels [L]`` (= input_ids:
    axolotl shifts labels itself), ``attention_mask [L]``, ``target_token_ids [L][k]``,
    ``target_logprobs [L][k]``, ``target_mask [L][k]`` (int). Row ``j < L - 1`` is the teacher
    row of position ``j``; the last row, rows before the teacher's coverage and unused slots are
    padding: logprob ``-1e9``, id ``0``, mask ``0``. ``target_mask`` is 0 on rows whose label is
    ignored (prompts) *with* real logprobs there; import keeps those rows (the cache is
    label-agnostic). Exported logprobs are the cached ones (not renormalised: axolotl's
    ``kd_normalize_topk`` renormalises in the loss); imported rows that axolotl already
    renormalised have tail mass 0.

DistillKit (``distillkit/sample_logits_vllm.py`` writes, ``distillkit/compression`` codes)
    a directory of ``data_<i>.parquet`` files with columns ``input_ids`` (list<uint64>, ``L``),
    ``compressed_logprobs`` and ``bytepacked_indices`` (list<list<uint8>>, ``L - 1`` rows), and
    the ``compression_config.yaml`` the capture used (``d`` = vocab size, ``k``, ``exact_k``,
    ``exact_dtype``, ``polynomial_terms``, ``term_dtype``, ``residual_bins``,
    ``delta_encoding``, ``normalize_t``). A row's logprob bytes are: the first ``exact_k`` values
    (sorted descending; deltas when ``delta_encoding``) in ``exact_dtype``, then the polynomial
    coefficients in ``term_dtype``, then residual bins; its index bytes are the ``k`` ids packed
    MSB-first with ``ceil(log2(d))`` bits each. Export writes ``exact_k = k`` (lossless at the
    chosen dtype); import decodes exact values, polynomial terms (integer powers, ``sqrt``,
    ``exp``) and delta encoding, and raw ``token_ids``/``top_values`` rows; residual bins and the
    legacy format are refused with :class:`InteropError`.

Import needs a sequence to keep one row per position: leading rows without teacher data (padding
before the teacher's coverage) are dropped with their tokens; a padded row *inside* a sequence is
an error. Rows with fewer valid slots than others (``-inf`` / ``-1e9`` padding) make the cache's
``k`` the smallest valid count; dropped slots' mass goes to the tail.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from logitcache.cache_format import SequenceRecord

__all__ = [
    "AXOLOTL_PAD_LOGPROB",
    "InteropError",
    "export_axolotl",
    "export_distillkit",
    "import_axolotl",
    "import_distillkit",
]

#: Logprob of padded slots/rows in axolotl's layout (its collator pads with the same value).
AXOLOTL_PAD_LOGPROB = -1e9
#: A logprob at or below this marks a slot without teacher data.
_MISSING = -1e8
_BATCH = 256


class InteropError(ValueError):
    """A peer file or configuration that cannot be converted (the message says why)."""


# -- shared -----------------------------------------------------------------------------------
def _pa() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow comes with the hf/server extras
        raise InteropError("parquet interop needs pyarrow: pip install 'logitcache[hf]'") from exc
    return pa, pq


def _records(url: str, storage_options: dict | None, limit: int | None) -> Iterator[SequenceRecord]:
    from logitcache.cache_format import CacheReader

    reader = CacheReader(url, storage_options)
    kind = getattr(reader.manifest, "targets", "topk")
    if kind != "topk":
        raise InteropError(f"only top-k caches export to peer formats (this one holds {kind} rows)")
    n = reader.num_sequences if limit is None or limit < 0 else min(limit, reader.num_sequences)
    for start in range(0, n, _BATCH):
        yield from reader.sequences(range(start, min(start + _BATCH, n)))


def _cache_rows(
    ids: np.ndarray, logprobs: np.ndarray, tokens: np.ndarray, name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Keep the rows with teacher data (a trailing run), sort each row descending.

    ``ids``/``logprobs`` ``[R, k]`` are the rows of ``tokens`` (row ``r`` = distribution of token
    ``r + 1 + offset`` where ``offset = L - 1 - R``). Returns ``(tokens, ids, logprobs)`` of the
    sequence cut to its covered span, or ``None`` when no row has data."""
    lp = np.asarray(logprobs, dtype=np.float64)
    valid = np.isfinite(lp) & (lp > _MISSING)
    has = np.asarray(valid.any(axis=1))
    if not has.any():
        return None
    first = int(np.argmax(has))
    if not has[first:].all():
        bad = first + int(np.argmin(has[first:]))
        raise InteropError(f"{name}: row {bad} has no teacher data inside the covered span")
    offset = len(tokens) - 1 - len(lp)
    if offset < 0:
        raise InteropError(f"{name}: {len(lp)} rows for {len(tokens)} tokens (need <= L - 1)")
    lp, ids, valid = lp[first:], np.asarray(ids, dtype=np.int64)[first:], valid[first:]
    lp = np.where(valid, lp, -np.inf)
    order = np.argsort(-lp, axis=1, kind="stable")
    lp = np.take_along_axis(lp, order, axis=1)
    ids = np.take_along_axis(ids, order, axis=1)
    return np.asarray(tokens)[offset + first :], ids, lp


def _write_cache(
    url: str,
    rows: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray] | None],
    manifest_fields: dict[str, Any],
    storage_options: dict | None,
) -> int:
    """Write sequences ``(tokens, ids [L-1, k0], logprobs [L-1, k0])`` (``-inf`` = missing) to a
    new cache, skipping ``None`` and sequences under 2 tokens (:func:`_cache_rows` without
    teacher data); ``k`` = the smallest count of valid slots over all rows (two passes)."""
    from logitcache.cache_format import (
        CacheWriter,
        Manifest,
        RecordError,
        SequenceRecord,
        check_record,
    )

    seqs = [row for row in rows if row is not None and len(row[0]) >= 2]
    if not seqs:
        raise InteropError("no sequence with teacher data to import")
    k = min(int(np.isfinite(lp).sum(axis=1).min()) for _, _, lp in seqs)
    if k < 1:
        raise InteropError("a row has no valid slot")
    fields = {"logprob_dtype": "float32", **manifest_fields, "k": k}
    try:
        manifest = Manifest(**fields)
    except ValueError as exc:
        raise InteropError(f"manifest: {exc}") from exc
    records = []  # every check before the store exists: bad input writes nothing
    for i, (tokens, ids, lp) in enumerate(seqs):
        top = np.minimum(lp[:, :k], 0.0).astype(np.float32)
        tail = np.clip(1.0 - np.exp(lp[:, :k]).sum(axis=1), 0.0, 1.0).astype(np.float32)
        try:
            rec = SequenceRecord(None, tokens, ids[:, :k], top, tail)
            check_record(rec, k=k, vocab_size=manifest.vocab_size, index=i)
        except RecordError as exc:
            raise InteropError(f"sequence {i}: {exc}") from exc
        records.append(rec)
    with CacheWriter.open(url, manifest, storage_options) as writer:
        for start in range(0, len(records), _BATCH):
            writer.append(records[start : start + _BATCH])
    return len(records)


def _write_parquet(path: Path, schema: Any, rows: Iterator[tuple]) -> int:
    """Write ``rows`` (one tuple of column values each, in ``schema`` order) to one parquet
    file, ``_BATCH`` rows a row group; returns the number of rows."""
    pa, pq = _pa()
    n = 0
    with pq.ParquetWriter(str(path), schema) as writer:
        while batch := list(itertools.islice(rows, _BATCH)):
            cols = zip(schema.names, zip(*batch, strict=True), strict=True)
            writer.write_table(pa.table({name: list(c) for name, c in cols}, schema=schema))
            n += len(batch)
    return n


# -- axolotl ----------------------------------------------------------------------------------
def export_axolotl(
    url: str,
    out: str | Path,
    *,
    storage_options: dict | None = None,
    limit: int | None = None,
) -> int:
    """Write the cache at ``url`` as one parquet file in axolotl's KD layout (module docstring).
    Returns the number of sequences written."""
    pa = _pa()[0]
    lst = pa.list_
    schema = pa.schema(
        [
            ("input_ids", lst(pa.int64())),
            ("labels", lst(pa.int64())),
            ("attention_mask", lst(pa.int64())),
            ("target_token_ids", lst(lst(pa.int64()))),
            ("target_logprobs", lst(lst(pa.float32()))),
            ("target_mask", lst(lst(pa.int64()))),
        ]
    )

    def rows() -> Iterator[tuple]:
        for rec in _records(url, storage_options, limit):
            tokens, k = rec.input_ids.astype(np.int64).tolist(), rec.topk_ids.shape[1]
            pad, lp = [[0] * k], rec.topk_logprobs.astype(np.float32).tolist()
            ids = rec.topk_ids.astype(np.int64).tolist() + pad
            mask = [[1] * k] * (len(tokens) - 1) + pad
            yield tokens, tokens, [1] * len(tokens), ids, lp + [[AXOLOTL_PAD_LOGPROB] * k], mask

    return _write_parquet(Path(out), schema, rows())


def _parquet_files(path: str | Path) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.parquet"), key=_natural) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise InteropError(f"no parquet file at {path}")
    return files


def _natural(p: Path) -> tuple:
    stem = p.stem
    digits = "".join(ch for ch in stem if ch.isdigit())
    return (stem.rstrip("0123456789"), int(digits) if digits else -1, stem)


def _table_rows(files: list[Path], columns: list[str]) -> Iterator[dict[str, Any]]:
    _, pq = _pa()
    for f in files:
        pf = pq.ParquetFile(str(f))
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise InteropError(f"{f.name}: missing columns {missing} (has {pf.schema_arrow.names})")
        for batch in pf.iter_batches(columns=columns, batch_size=_BATCH):
            yield from batch.to_pylist()


def import_axolotl(
    path: str | Path,
    url: str,
    *,
    manifest_fields: dict[str, Any],
    storage_options: dict | None = None,
) -> int:
    """Write the axolotl-layout parquet file(s) at ``path`` (a file or a directory) to a new
    cache at ``url``; ``manifest_fields`` gives ``teacher_model``, ``tokenizer_fingerprint``,
    ``vocab_size`` (and optionally ``temperature``, ``dataset``...). Returns sequences written."""
    cols = ["input_ids", "target_token_ids", "target_logprobs", "target_mask"]

    def rows() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        for i, row in enumerate(_table_rows(_parquet_files(path), cols)):
            tokens = np.asarray(row["input_ids"], dtype=np.int64)
            ids = _rect(row["target_token_ids"], np.int64, 0, f"row {i} target_token_ids")
            lp = _rect(row["target_logprobs"], np.float64, -np.inf, f"row {i} target_logprobs")
            if ids.shape != lp.shape or len(lp) != len(tokens):
                raise InteropError(
                    f"row {i}: {len(tokens)} tokens, target ids {ids.shape}, logprobs {lp.shape}"
                )
            # the mask says which rows train (labels), not which hold data: data = logprob > pad
            yield _cache_rows(ids[:-1], lp[:-1], tokens, f"row {i}")

    return _write_cache(url, rows(), manifest_fields, storage_options)


def _rect(rows: list, dtype: npt.DTypeLike, fill: float, name: str) -> np.ndarray:
    """Ragged ``[R][<=k]`` lists as a ``[R, k]`` array padded with ``fill``."""
    width = max((len(r) for r in rows if r is not None), default=0)
    out = np.full((len(rows), width), fill, dtype=dtype)
    for j, r in enumerate(rows):
        if r:
            out[j, : len(r)] = r
    if width == 0:
        raise InteropError(f"{name}: no slot in any row")
    return out


# -- DistillKit -------------------------------------------------------------------------------
#: Stored logit dtype -> (numpy little-endian dtype, or "bf16" for bfloat16 bit patterns; bytes).
_DTYPES: dict[str, tuple[str, int]] = {
    "float16": ("<f2", 2),
    "bfloat16": ("bf16", 2),
    "float32": ("<f4", 4),
    "float64": ("<f8", 8),
}


def _index_bits(d: int) -> int:
    return max(1, math.ceil(math.log2(d)))


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """``[..., n]`` non-negative ints -> ``[..., ceil(n * bits / 8)]`` uint8, MSB first."""
    v = np.asarray(values, dtype=np.uint64)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint64)
    stream = ((v[..., None] >> shifts) & np.uint64(1)).astype(np.uint8)
    stream = stream.reshape(*v.shape[:-1], -1)
    return np.packbits(stream, axis=-1)


def unpack_bits(data: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits` (``n`` values per row)."""
    stream = np.unpackbits(np.asarray(data, dtype=np.uint8), axis=-1)[..., : n * bits]
    stream = stream.reshape(*stream.shape[:-1], n, bits).astype(np.int64)
    weights = np.int64(1) << np.arange(bits - 1, -1, -1, dtype=np.int64)
    return (stream * weights).sum(axis=-1)


def _from_bytes(data: np.ndarray, dtype: str, n: int) -> np.ndarray:
    kind, width = _DTYPES[dtype]
    raw = np.ascontiguousarray(data[..., : n * width], dtype=np.uint8)
    if kind == "bf16":
        u = raw.view("<u2").astype(np.uint32) << 16
        return u.view(np.float32).astype(np.float64)
    return raw.view(np.dtype(kind)).astype(np.float64)


def _terms(terms: list, n: int, normalize_t: bool) -> np.ndarray:
    pts = np.linspace(0.0, 1.0, n) if normalize_t else np.arange(n, dtype=np.float64)
    cols = []
    for t in terms:
        if isinstance(t, int) and not isinstance(t, bool):
            cols.append(pts**t)
        elif t in ("sqrt", "exp"):
            cols.append(getattr(np, t)(pts))
        else:
            raise InteropError(f"unknown polynomial term {t!r}")
    return np.stack(cols, axis=-1)


def _config(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise InteropError(f"no DistillKit compression config at {path}")
    cfg = yaml.safe_load(path.read_text()) or {}
    cfg = cfg.get("logprob_compressor", cfg)
    for need in ("d", "k", "exact_k"):
        if need not in cfg:
            raise InteropError(f"{path.name}: missing {need!r}")
    if cfg.get("residual_bins"):
        raise InteropError("DistillKit residual_bins are not supported by import (exact/poly only)")
    for key in ("exact_dtype", "term_dtype"):
        if cfg.get(key, "float32") not in _DTYPES:
            raise InteropError(f"{path.name}: unsupported {key} {cfg.get(key)!r}")
    return cfg


def decode_distillkit_row(
    logprob_bytes: np.ndarray, index_bytes: np.ndarray, cfg: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [R, k], logprobs [R, k])`` of one sequence's DistillKit rows (module docstring)."""
    k, exact_k = int(cfg["k"]), int(cfg["exact_k"])
    exact_dtype, term_dtype = cfg.get("exact_dtype", "float32"), cfg.get("term_dtype", "float32")
    data = np.asarray(logprob_bytes, dtype=np.uint8)
    exact = _from_bytes(data, exact_dtype, exact_k)
    rest = data[..., exact_k * _DTYPES[exact_dtype][1] :]
    terms = cfg.get("polynomial_terms") or []
    approx_n = k - exact_k
    if approx_n and not terms:
        raise InteropError("exact_k < k without polynomial_terms needs residual bins (refused)")
    if approx_n:
        coeffs = _from_bytes(rest, term_dtype, len(terms))
        X = _terms(terms, approx_n, bool(cfg.get("normalize_t", False)))
        approx = coeffs @ X.T
        lp = np.concatenate([exact, approx], axis=-1)
    else:
        lp = exact
    if cfg.get("delta_encoding", True):
        lp = np.cumsum(lp, axis=-1)
    ids = unpack_bits(index_bytes, _index_bits(int(cfg["d"])), k)
    return ids, lp


def export_distillkit(
    url: str,
    out_dir: str | Path,
    *,
    storage_options: dict | None = None,
    limit: int | None = None,
) -> int:
    """Write the cache as a DistillKit offline-logit directory (``data_0.parquet`` and
    ``compression_config.yaml`` with ``exact_k = k``: float32 logprobs, no delta encoding).
    Returns the sequences written."""
    import yaml
    from logitcache.cache_format import CacheReader

    pa = _pa()[0]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = CacheReader(url, storage_options).manifest
    d, k = int(manifest.vocab_size), int(manifest.k)
    cfg = {
        "d": d,
        "k": k,
        "exact_k": k,
        "exact_dtype": "float32",
        "polynomial_terms": [],
        "term_dtype": "float32",
        "residual_bins": [],
        "delta_encoding": False,
        "error_diffusion": False,
        "normalize_t": False,
    }
    (out / "compression_config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=True))
    u8 = pa.list_(pa.list_(pa.uint8()))
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.uint64())),
            ("compressed_logprobs", u8),
            ("bytepacked_indices", u8),
        ]
    )
    bits = _index_bits(d)

    def rows() -> Iterator[tuple]:
        for rec in _records(url, storage_options, limit):
            lp = np.ascontiguousarray(rec.topk_logprobs, dtype="<f4")
            tokens = rec.input_ids.astype(np.uint64).tolist()
            yield (
                tokens,
                lp.view(np.uint8).reshape(len(lp), 4 * lp.shape[1]).tolist(),
                pack_bits(rec.topk_ids, bits).tolist(),
            )

    return _write_parquet(out / "data_0.parquet", schema, rows())


def import_distillkit(
    path: str | Path,
    url: str,
    *,
    manifest_fields: dict[str, Any],
    config: str | Path | None = None,
    storage_options: dict | None = None,
) -> int:
    """Write a DistillKit offline-logit directory (or one parquet file; ``config`` defaults to
    ``compression_config.yaml`` beside it) to a new cache at ``url``. ``vocab_size`` defaults to
    the config's ``d``. Returns the sequences written."""
    p = Path(path)
    files = _parquet_files(p)
    base = p if p.is_dir() else p.parent
    _, pq = _pa()
    names = pq.ParquetFile(str(files[0])).schema_arrow.names
    if "packed_indices" in names:
        raise InteropError("DistillKit's legacy compressed format is not supported by import")
    if {"token_ids", "top_values"} <= set(names):
        cols, cfg = ["input_ids", "token_ids", "top_values"], None
    else:
        cols = ["input_ids", "compressed_logprobs", "bytepacked_indices"]
        cfg = _config(Path(config) if config else base / "compression_config.yaml")
    fields = dict(manifest_fields)
    if cfg is not None:
        fields.setdefault("vocab_size", int(cfg["d"]))

    def rows() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        for i, row in enumerate(_table_rows(files, cols)):
            tokens = np.asarray(row["input_ids"], dtype=np.int64)
            if cfg is None:
                ids = _rect(row["token_ids"], np.int64, 0, f"row {i} token_ids")
                lp = _rect(row["top_values"], np.float64, -np.inf, f"row {i} top_values")
            else:
                if not row["compressed_logprobs"]:
                    continue
                lp_bytes = np.asarray(row["compressed_logprobs"], dtype=np.uint8)
                ix_bytes = np.asarray(row["bytepacked_indices"], dtype=np.uint8)
                ids, lp = decode_distillkit_row(lp_bytes, ix_bytes, cfg)
            yield _cache_rows(ids, lp, tokens, f"row {i}")

    return _write_cache(url, rows(), fields, storage_options)
