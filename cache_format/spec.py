"""Constants of the on-disk format (FORMAT.md is the normative text; this module is its code).

Array names, dtypes, chunk/shard shapes and codecs live here so that the writer, the reader, the
validator and the benchmark agree on one definition.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

FORMAT_VERSION = 4
"""Integer version of the on-disk layout written by this library, stored as root attribute
``format_version``. Version 4: version 3 plus a seal in every shard object binding it to its
array, its shard coordinate and its filled entries (FORMAT.md 4.8). Version 3: version 2 plus
the root attribute ``logitcache_digest`` (CRC32C of the other root attributes, checked on every
open). Version 2 (FORMAT.md): every chunk of the
committed range is stored (an absent object there is data loss,
:class:`~.errors.MissingDataError`), keys also as bytes
(``seq_key_bytes`` + ``seq_key_end``), arrays carry an ``encoding`` attribute."""

SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4})
"""Versions this library reads (and appends to, keeping their version)."""

ROOT_ATTR = "logitcache"
"""Root group attribute holding the manifest (and with it the commit point: counts, generation)."""

LOCK_NAME = ".logitcache.lock"

DIGEST_ATTR = "logitcache_digest"
"""Root attribute (version >= 3): CRC32C of the other root attributes (FORMAT.md 2.2)."""
"""Object/file next to the root ``zarr.json`` used as the writer lock (not a zarr node)."""

LogprobDtype = Literal["float16", "float32", "uint8", "uint16"]
TailDtype = Literal["float16", "float32"]
QUANTISED_DTYPES: frozenset[str] = frozenset({"uint8", "uint16"})

LOGPROB_TOLERANCE = 1e-3
"""Logprobs in (0, LOGPROB_TOLERANCE] are rounding noise, stored as 0; larger is an error."""

TAIL_TOLERANCE = 1e-3
"""Given tail masses within this distance outside [0, 1] are clipped; farther is an error."""

# Array names (all live directly under the root group; axis 0 is the append axis of each).
INPUT_IDS = "input_ids"  # [T] int32, T = total tokens
TOPK_IDS = "topk_ids"  # [R, k] int32, R = total rows = T - S
TOPK_LOGPROBS = "topk_logprobs"  # [R, k] float16 | float32 | uint8 | uint16
LOGPROB_MAX = "logprob_max"  # [R] float32, quantised dtypes only: the row max (= rank-0 logprob)
LOGPROB_STEP = "logprob_step"  # [R] float32, quantised dtypes only: quantisation step of the row
TAIL_MASS = "tail_mass"  # [R] float32 | float16
LOSS_MASK = "loss_mask"  # [R] uint8 0/1, when manifest.loss_mask: row trained on (FORMAT.md 4.6)
ENTROPY = "entropy"  # [R] float16 nats, when manifest.entropy: teacher entropy (FORMAT.md 4.9)
#: [R] float32, when manifest.actual_logprob: the logprob of the row's actual next token (4.12)
ACTUAL_LOGPROB = "actual_logprob"
ID_ORDER = "id_order"  # [vocab] int32 permutation (frequency-rank remap), when manifest.id_remap
SEQ_KEYS = "seq_keys"  # [S] string (UTF-8)
SEQ_LENGTHS = "seq_lengths"  # [S] int32, L_i >= 2 tokens
SEQ_TOKEN_START = "seq_token_start"  # [S] int64, offset of sequence i in input_ids
SEQ_ROW_START = "seq_row_start"  # [S] int64, offset of sequence i in the row arrays
SEQ_KEY_BYTES = "seq_key_bytes"  # [B] uint8, v2: UTF-8 bytes of every key, concatenated
SEQ_KEY_END = "seq_key_end"  # [S] int64, v2: end of key i in seq_key_bytes (start: end[i-1] or 0)

HIDDEN = "hidden"  # [R, d] uint16 (bfloat16 bits) | uint8 (e4m3 bits), targets="hidden" (4.10)
HIDDEN_SCALE = "hidden_scale"  # [R] float32, hidden.dtype="float8_e4m3" only: per-row scale
HEAD_WEIGHT = "head_weight"  # [V, d] uint16 (bfloat16 bits) | float32, targets="hidden" only
HEAD_BIAS = "head_bias"  # [V] float32, targets="hidden" with hidden.bias only

SEQ_ARRAYS = (SEQ_KEYS, SEQ_LENGTHS, SEQ_TOKEN_START, SEQ_ROW_START)
KEY_BYTES_ARRAYS = (SEQ_KEY_END, SEQ_KEY_BYTES)  # v2 only


@dataclass(frozen=True)
class Layout:
    """Chunk (read unit) and shard (object/write unit) lengths along axis 0, per array family, and
    codecs. Named presets: :data:`LAYOUTS` (FORMAT.md 4.7); a store records its layout in each
    array's ``zarr.json``, so readers and later writers use the store's own."""

    row_chunk: int = 2048
    row_shard: int = 65536
    token_chunk: int = 8192
    token_shard: int = 65536
    """Tokens per ``input_ids`` (and ``seq_key_bytes``) shard object: every append rewrites the
    partly filled shard whole (FORMAT.md W3), so it stays small."""
    seq_chunk: int = 16384
    seq_shard: int = 262144
    id_codec: str = "blosc-zstd1-bitshuffle"
    logprob_codec: str = "blosc-zstd1-shuffle"
    other_codec: str = "blosc-zstd5-shuffle"
    tail_codec: str = "blosc-zstd1-bitshuffle"
    """``tail_mass``'s codec: bit planes compress smaller and faster than bytes here."""
    blosc_blocks: Literal["chunk", "auto"] = "chunk"
    """``"chunk"``: blosc compresses each inner chunk as one block; ``"auto"``: blosc picks the
    block size."""

    name: str = "default"
    """Preset name recorded in the store (``logitcache_layout`` array attribute, v2) when it is
    not ``"default"``; a custom layout keeps ``"default"`` unless the caller names it."""


DEFAULT_LAYOUT = Layout()
"""Sequential-read and size-first layout: <= 260 B/position at k=100 (format bench)."""

RANDOM_ACCESS_LAYOUT = Layout(
    row_chunk=256,
    token_chunk=8192,
    id_codec="blosc-lz4-bitshuffle",
    logprob_codec="blosc-lz4-shuffle",
    name="random_access",
)
"""Random-access preset: 256-row chunks and lz4 (about 2.5-3x cheaper to decode per row than
zstd at this chunk size) for ``sequence(i)`` / ``sequences(idx)`` reads; about 320 B/position
at k=100 instead of about 258 (benchmarks/results/format.md, random access)."""

RANDOM_ACCESS_RAW_LAYOUT = replace(
    RANDOM_ACCESS_LAYOUT,
    row_chunk=64,
    token_chunk=512,
    id_codec="none",
    logprob_codec="none",
    other_codec="none",
    tail_codec="none",
    name="random_access_raw",
)
"""Point-read preset that trades bytes for CPU: every numeric array without a compressor (inner
codecs ``bytes`` LE + ``crc32c``; the row delta of FORMAT.md 4.2 kept) in 64-row chunks
(512-token ``input_ids`` chunks), so a point read decodes few extra rows; ``loss_mask`` keeps its
own codec and ``seq_keys`` zstd. About 1.9x the bytes of ``random_access`` at k=100 (FORMAT.md
4.7)."""

LAYOUTS: dict[str, Layout] = {
    "default": DEFAULT_LAYOUT,
    "random_access": RANDOM_ACCESS_LAYOUT,
    "random_access_raw": RANDOM_ACCESS_RAW_LAYOUT,
}
"""Named layout presets (FORMAT.md 4.7), chosen at write time: ``CacheWriter.open(...,
layout=LAYOUTS["random_access"])`` (or :func:`layout_named`)."""

LAYOUT_ATTR = "logitcache_layout"
"""Array attribute (v2) naming the preset a store was created with (absent: ``"default"``, a
custom layout, or a store written before presets)."""


def layout_named(name: str) -> Layout:
    """The preset called ``name`` (ValueError naming the presets if unknown)."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout preset {name!r} (presets: {sorted(LAYOUTS)})")
    return LAYOUTS[name]
