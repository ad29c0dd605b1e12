"""The set of zarr arrays of a store: their dtypes, shapes, chunking and codecs (FORMAT.md §3).

Shared by the writer (creation), the reader and the validator (opening and checking).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zarr

from . import spec
from .codecs import compressors
from .manifest import Manifest
from .quant import STORED_DTYPE


@dataclass(frozen=True)
class ArrayDef:
    """One array of the format: ``k_axis`` is True for ``[n, k]`` arrays, else ``[n]``.

    ``whole_blocks``: a blosc codec compresses each inner chunk as one block (else blosc picks
    its block size).
    """

    name: str
    dtype: str
    k_axis: bool
    chunk: int
    shard: int
    codec: str
    dims: tuple[str, ...]
    whole_blocks: bool = False


def array_defs(manifest: Manifest, layout: spec.Layout = spec.DEFAULT_LAYOUT) -> list[ArrayDef]:
    """Every array a store with this manifest has, in write order (commit comes after all)."""
    whole = layout.blosc_blocks == "chunk"
    row_chunk, row_shard = layout.row_chunk, layout.row_shard

    def rows(name: str, dtype: str, codec: str) -> ArrayDef:  # [n] per-row arrays
        return ArrayDef(name, dtype, False, row_chunk * 8, row_shard * 8, codec, ("row",), whole)

    def per_seq(name: str, dtype: str) -> ArrayDef:
        codec = "zstd3" if dtype == "str" else layout.other_codec
        return ArrayDef(
            name, dtype, False, layout.seq_chunk, layout.seq_shard, codec, ("sequence",), whole
        )

    lp_dtype = manifest.logprob_dtype
    dims2 = ("row", "rank")
    defs = [
        ArrayDef(spec.TOPK_IDS, "int32", True, row_chunk, row_shard, layout.id_codec, dims2, whole),
        ArrayDef(
            spec.TOPK_LOGPROBS,
            STORED_DTYPE[lp_dtype],
            True,
            row_chunk,
            row_shard,
            layout.logprob_codec,
            dims2,
            whole,
        ),
    ]
    if lp_dtype in spec.QUANTISED_DTYPES:
        defs += [
            rows(n, "float32", layout.other_codec) for n in (spec.LOGPROB_MAX, spec.LOGPROB_STEP)
        ]
    defs += [
        rows(spec.TAIL_MASS, manifest.tail_mass_dtype, layout.other_codec),
        ArrayDef(
            spec.INPUT_IDS,
            "int32",
            False,
            layout.token_chunk,
            layout.token_shard,
            layout.id_codec,
            ("token",),
            whole,
        ),
        per_seq(spec.SEQ_KEYS, "str"),
        per_seq(spec.SEQ_LENGTHS, "int32"),
        per_seq(spec.SEQ_TOKEN_START, "int64"),
        per_seq(spec.SEQ_ROW_START, "int64"),
    ]
    if manifest.id_remap:
        vocab = manifest.vocab_size
        defs.append(ArrayDef(spec.ID_ORDER, "int32", False, vocab, vocab, "zstd3", ("vocab",)))
    return defs


def create_array(store, d: ArrayDef, k: int) -> zarr.Array:
    """Create (overwriting) an empty array for ``d`` in ``store``."""
    shape = (0, k) if d.k_axis else (0,)
    chunks = (d.chunk, k) if d.k_axis else (d.chunk,)
    shards = (d.shard, k) if d.k_axis else (d.shard,)
    dtype = str if d.dtype == "str" else d.dtype
    itemsize = 1 if d.dtype == "str" else np.dtype(d.dtype).itemsize
    kwargs = {} if d.dtype == "str" else {"fill_value": 0}
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


INCOMPLETE_ATTR = "logitcache_incomplete"
"""Root attribute present while a store is being created (before its first commit)."""


def read_root_attrs(store) -> dict | None:
    """The root group's attributes, or ``None`` if the store has no root ``zarr.json``."""
    try:
        group = zarr.open_group(store, mode="r", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, zarr.errors.NodeTypeValidationError):
        return None
    return dict(group.attrs)


def write_root_attrs(store, attrs: dict) -> None:
    """Replace the root group's attributes with one write of the root ``zarr.json`` (the commit).

    Creates the root group if absent; never touches the arrays below it.
    """
    try:
        group = zarr.open_group(store, mode="r+", use_consolidated=False)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        zarr.create_group(store, attributes=attrs)
        return
    group.attrs.put(attrs)


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
    return Manifest.from_attrs(attrs[spec.ROOT_ATTR])


def root_attrs_for(manifest: Manifest) -> dict:
    """Root attributes that commit ``manifest``."""
    return {"format_version": spec.FORMAT_VERSION, spec.ROOT_ATTR: manifest.to_attrs()}
