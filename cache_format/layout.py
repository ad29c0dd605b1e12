"""The set of zarr arrays of a store: their dtypes, shapes, chunking and codecs (FORMAT.md §3).

Shared by the writer (creation), the reader and the validator (opening and checking).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import google_crc32c
import numpy as np
import zarr
import zarr.abc.store

from . import spec
from ._codecs import compressors
from ._manifest import Manifest
from ._zarr_adapter import GroupMetadata, default_buffer_prototype
from .quant import STORED_DTYPE
from .store import get_object, put_objects


@dataclass(frozen=True)
class ArrayDef:
    """One array of the format: ``k_axis`` is True for ``[n, k]`` arrays, else ``[n]``;
    ``whole_blocks``: blosc compresses each inner chunk as one block."""

    name: str
    dtype: str
    k_axis: bool
    chunk: int
    shard: int
    codec: str
    dims: tuple[str, ...]
    whole_blocks: bool = False
    encoding: str = ""
    """Value of the array attribute ``logitcache_encoding`` (FORMAT.md §4, version >= 2)."""
    width: int = 0
    """Length of axis 1 of a ``[n, width]`` array other than ``k`` (``hidden`` and the head,
    FORMAT.md 4.10); 0: ``k``."""
    layout: str = "default"
    """Name of the :class:`~.spec.Layout` preset; recorded as the array attribute
    ``logitcache_layout`` (version >= 2) unless ``"default"`` (FORMAT.md 4.7)."""


def array_defs(manifest: Manifest, layout: spec.Layout = spec.DEFAULT_LAYOUT) -> list[ArrayDef]:
    """Every array a store with this manifest has, in write order (commit comes after all)."""
    m, lay, whole = manifest, layout, layout.blosc_blocks == "chunk"

    def rows(name: str, dtype: str, codec: str, enc: str, k_axis: bool = False) -> ArrayDef:
        n = 1 if k_axis else 8  # [n] per-row arrays: chunks of 8x the rows
        dims = ("row", "rank") if k_axis else ("row",)
        return ArrayDef(
            name, dtype, k_axis, lay.row_chunk * n, lay.row_shard * n, codec, dims, whole, enc
        )

    def per_seq(name: str, dtype: str, enc: str) -> ArrayDef:
        codec = "zstd3" if dtype == "str" else lay.other_codec
        return ArrayDef(
            name, dtype, False, lay.seq_chunk, lay.seq_shard, codec, ("sequence",), whole, enc
        )

    def per_token(name: str, dtype: str, codec: str, dim: str, enc: str) -> ArrayDef:
        return ArrayDef(
            name, dtype, False, lay.token_chunk, lay.token_shard, codec, (dim,), whole, enc
        )

    def per_vocab(name: str, dtype: str, enc: str) -> ArrayDef:
        v = m.vocab_size
        return ArrayDef(name, dtype, False, v, v, "zstd3", ("vocab",), False, enc)

    def wide(name: str, dtype_name: str, codec: str, dims: tuple[str, ...]) -> ArrayDef:
        """``[n, d]`` arrays of a hidden store (FORMAT.md 4.10): inner chunks of about
        :data:`HIDDEN_CHUNK_BYTES`, shards of 64 chunks."""
        from .hidden import STORED

        assert m.hidden is not None
        stored, d = STORED[dtype_name], m.hidden["dim"]
        chunk = _rows_for(d, np.dtype(stored).itemsize)
        return ArrayDef(name, stored, True, chunk, chunk * 64, codec, dims, whole, dtype_name, d)

    h = m.hidden
    if h is not None:
        defs = [wide(spec.HIDDEN, h["dtype"], lay.logprob_codec, ("row", "hidden"))]
        if h["dtype"] == "float8_e4m3":
            defs.append(rows(spec.HIDDEN_SCALE, "float32", lay.other_codec, "float32"))
    else:
        lp = m.logprob_dtype
        id_enc = "id_rank" if m.id_remap else "id"
        defs = [
            rows(spec.TOPK_IDS, "int32", lay.id_codec, id_enc, k_axis=True),
            rows(spec.TOPK_LOGPROBS, STORED_DTYPE[lp], lay.logprob_codec, f"{lp}_row_delta", True),
        ]
        if lp in spec.QUANTISED_DTYPES:
            defs += [
                rows(n, "float32", lay.other_codec, "float32")
                for n in (spec.LOGPROB_MAX, spec.LOGPROB_STEP)
            ]
        defs.append(rows(spec.TAIL_MASS, m.tail_mass_dtype, lay.tail_codec, m.tail_mass_dtype))
    defs.append(per_token(spec.INPUT_IDS, "int32", lay.id_codec, "token", "id"))
    if m.loss_mask:
        defs.append(rows(spec.LOSS_MASK, "uint8", "blosc-zstd5-bitshuffle", "bool_u8"))
    if m.entropy:
        defs.append(rows(spec.ENTROPY, "float16", lay.other_codec, "float16"))
    if m.actual_logprob:
        defs.append(rows(spec.ACTUAL_LOGPROB, "float32", lay.other_codec, "float32"))
    defs += [
        per_seq(spec.SEQ_KEYS, "str", "utf8"),
        per_seq(spec.SEQ_LENGTHS, "int32", "int32"),
        per_seq(spec.SEQ_TOKEN_START, "int64", "int64"),
        per_seq(spec.SEQ_ROW_START, "int64", "int64"),
    ]
    if m.format_version >= 2:
        defs.append(per_seq(spec.SEQ_KEY_END, "int64", "int64"))
        defs.append(per_token(spec.SEQ_KEY_BYTES, "uint8", lay.other_codec, "byte", "utf8_bytes"))
    if m.id_remap:
        defs.append(per_vocab(spec.ID_ORDER, "int32", "id"))
    if h is not None:  # the teacher head, written once by the first commit
        defs.append(
            wide(spec.HEAD_WEIGHT, h["head_dtype"], "blosc-zstd1-shuffle", ("vocab", "hidden"))
        )
        if h["bias"]:
            defs.append(per_vocab(spec.HEAD_BIAS, "float32", "float32"))
    if lay.name != "default":
        defs = [replace(d, layout=lay.name) for d in defs]
    return defs


HIDDEN_CHUNK_BYTES = 1 << 20
"""Target size of an inner chunk of ``hidden`` and the head before compression (1 MiB: 128 rows
at d=4096 in bfloat16); rounded down to a power of two of rows, at least 1."""


def _rows_for(width: int, itemsize: int) -> int:
    n = max(1, HIDDEN_CHUNK_BYTES // (width * itemsize))
    return 1 << (n.bit_length() - 1)


def committed_lengths(m: Manifest) -> dict[str, int]:
    """Entries of each array that the manifest's counts commit (R6): readers use ``[0, n)``."""
    out = {
        spec.TOPK_IDS: m.num_rows,
        spec.TOPK_LOGPROBS: m.num_rows,
        spec.LOGPROB_MAX: m.num_rows,
        spec.LOGPROB_STEP: m.num_rows,
        spec.TAIL_MASS: m.num_rows,
        spec.LOSS_MASK: m.num_rows,
        spec.ENTROPY: m.num_rows,
        spec.ACTUAL_LOGPROB: m.num_rows,
        spec.INPUT_IDS: m.num_tokens,
        spec.ID_ORDER: m.vocab_size if m.num_rows else 0,
        spec.HIDDEN: m.num_rows,
        spec.HIDDEN_SCALE: m.num_rows,
        spec.HEAD_WEIGHT: m.vocab_size if m.num_rows else 0,
        spec.HEAD_BIAS: m.vocab_size if m.num_rows else 0,
        spec.SEQ_KEY_BYTES: m.num_key_bytes,
        **{n: m.num_sequences for n in (*spec.SEQ_ARRAYS, spec.SEQ_KEY_END)},
    }
    return {d.name: out[d.name] for d in array_defs(m)}


def strict(m: Manifest) -> bool:
    """Whether an absent chunk in the committed range is data loss (version >= 2, rule R9)
    rather than fill value (version 1 stored no chunk equal to the fill value)."""
    return m.format_version >= 2


ENCODING_ATTR = "logitcache_encoding"
"""Array attribute (version >= 2) naming how the stored values decode (FORMAT.md §4)."""


def create_array(
    store: zarr.abc.store.Store, d: ArrayDef, k: int, version: int = spec.FORMAT_VERSION
) -> zarr.Array:
    """Create (overwriting) an empty array for ``d`` in ``store`` (of a store of ``version``)."""
    k = d.width or k
    shape = (0, k) if d.k_axis else (0,)
    chunks = (d.chunk, k) if d.k_axis else (d.chunk,)
    shards = (d.shard, k) if d.k_axis else (d.shard,)
    dtype = str if d.dtype == "str" else d.dtype
    itemsize = 1 if d.dtype == "str" else np.dtype(d.dtype).itemsize
    kwargs: dict = {} if d.dtype == "str" else {"fill_value": 0}
    if version >= 2:
        kwargs["attributes"] = {ENCODING_ATTR: d.encoding}
        if d.layout != "default":
            kwargs["attributes"][spec.LAYOUT_ATTR] = d.layout
    block = d.chunk * (k if d.k_axis else 1) * itemsize if d.whole_blocks else 0
    return zarr.create_array(
        store,
        name=d.name,
        shape=shape,
        dtype=dtype,
        chunks=chunks,
        shards=shards,
        compressors=compressors(d.codec, itemsize, blocksize=block),
        dimension_names=list(d.dims),
        overwrite=True,
        **kwargs,
    )


ROOT_METADATA = "zarr.json"
"""The root group's metadata document: the store's commit point (FORMAT.md §5)."""

INCOMPLETE_ATTR = "logitcache_incomplete"
"""Root attribute present while a store is being created (before its first commit)."""


def read_root_attrs(store: zarr.abc.store.Store) -> dict | None:
    """The root group's attributes, or ``None`` if the store has no root ``zarr.json``: a zarr v3
    group's document is read and parsed directly (one ``get``), anything else goes through zarr's
    ``open_group``."""
    doc = _root_document(store)
    if doc is not None:
        return dict(doc.get("attributes") or {})
    try:
        group = zarr.open_group(store, mode="r", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError):
        return None
    return dict(group.attrs)


#: The root document's fields besides ``attributes``, as this library writes them.
_ROOT_FIELDS = {"zarr_format": 3, "node_type": "group", "consolidated_metadata": None}


def _check_root_fields(doc: object) -> None:
    """Raise :class:`~.errors.CorruptStoreError` when a root document whose attributes carry the
    manifest digest (this library's root) has zarr fields other than a v3 group's: the digest
    covers the attributes only, so a damaged field name or value is caught here."""
    from .errors import CorruptStoreError

    if not isinstance(doc, dict):
        return
    attrs = doc.get("attributes")
    if not isinstance(attrs, dict) or spec.DIGEST_ATTR not in attrs:
        return
    fields = {k: v for k, v in doc.items() if k != "attributes"}
    if {"consolidated_metadata": None, **fields} != _ROOT_FIELDS:
        raise CorruptStoreError(
            f"root zarr.json: fields {sorted(fields)} are not a zarr v3 group's "
            f"(zarr_format 3, node_type 'group'): the document was changed or damaged"
        )


def _root_document(store: zarr.abc.store.Store) -> dict | None:
    """The root ``zarr.json`` parsed, if it is a zarr v3 group's without consolidated metadata
    (what this library writes); else ``None``."""
    try:
        if isinstance(store, zarr.storage.LocalStore):  # read here: no trip through zarr's loop
            raw = (Path(store.root) / ROOT_METADATA).read_bytes()
        else:
            got = get_object(store, ROOT_METADATA)
            if got is None:
                return None
            raw = got
    except (FileNotFoundError, NotADirectoryError):  # no root (or no store folder)
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    _check_root_fields(doc)
    if (
        not isinstance(doc, dict)
        or any(doc.get(k) != v for k, v in _ROOT_FIELDS.items())
        or not isinstance(doc.get("attributes", {}), dict)
    ):
        return None
    return doc


def write_root_attrs(store: zarr.abc.store.Store, attrs: dict) -> None:
    """Replace the root group's attributes with one write of the root ``zarr.json`` (the commit),
    encoded by zarr's ``GroupMetadata``; creates the root group if absent, never touches the
    arrays."""
    doc = GroupMetadata(attributes=attrs).to_buffer_dict(default_buffer_prototype())
    put_objects(store, [(ROOT_METADATA, doc[ROOT_METADATA].to_bytes())])


def parse_root(attrs: dict) -> Manifest:
    """Version check then manifest parse of root attributes (typed errors)."""
    from .errors import StoreNotFoundError, UnsupportedVersionError

    if spec.ROOT_ATTR not in attrs:
        raise StoreNotFoundError("store has no committed logitcache manifest")
    version = attrs.get("format_version")
    if version not in spec.SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"format_version {version!r} not supported (this library reads "
            f"{sorted(spec.SUPPORTED_VERSIONS)})"
        )
    if version >= 3:
        check_root_digest(attrs)
    m = Manifest.from_attrs(attrs[spec.ROOT_ATTR])
    if m.format_version != version:
        from .errors import ManifestError

        raise ManifestError(
            f"manifest format_version {m.format_version} differs from the root's {version}"
        )
    return m


def root_attrs_for(manifest: Manifest) -> dict:
    """Root attributes that commit ``manifest`` (at the store's own version; from version 3 with
    the digest of the others, FORMAT.md 2.2)."""
    attrs = {"format_version": manifest.format_version, spec.ROOT_ATTR: manifest.to_attrs()}
    if manifest.format_version >= 3:
        attrs[spec.DIGEST_ATTR] = root_digest(attrs)
    return attrs


def root_digest(attrs: dict) -> str:
    """CRC32C (8 lowercase hex digits) of the root attributes other than the digest, as canonical
    JSON: keys sorted, separators ``,`` and ``:``, ASCII only (FORMAT.md 2.2)."""
    body = {k: v for k, v in attrs.items() if k != spec.DIGEST_ATTR}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{google_crc32c.value(text.encode('ascii')):08x}"


def resealed_root_attrs(stored: dict, edited: dict) -> dict:
    """``edited`` (root attributes derived from ``stored``, e.g. with server paths cut) carrying
    a digest of its own when ``stored`` carried a valid one; when ``stored``'s digest is absent
    or wrong, ``edited`` keeps it as it was, so a reader still sees the damage."""
    digest = stored.get(spec.DIGEST_ATTR)
    if digest is None or digest != root_digest(stored):
        return edited
    return {**edited, spec.DIGEST_ATTR: root_digest(edited)}


def check_root_digest(attrs: dict) -> None:
    """Raise :class:`~.errors.ChecksumError` unless ``attrs`` carry their own digest."""
    from .errors import ChecksumError

    stored = attrs.get(spec.DIGEST_ATTR)
    if stored != root_digest(attrs):
        raise ChecksumError(
            f"root zarr.json: manifest digest {spec.DIGEST_ATTR} is {stored!r}, the attributes "
            f"hash to {root_digest(attrs)!r}: the manifest was changed or damaged"
        )
