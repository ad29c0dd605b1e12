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
    """One array of the format: ``k_axis`` is True for ``[n, k]`` arrays, else ``[n]``."""

    name: str
    dtype: str
    k_axis: bool
    chunk: int
    shard: int
    codec: str
    dims: tuple[str, ...]


def array_defs(manifest: Manifest, layout: spec.Layout = spec.DEFAULT_LAYOUT) -> list[ArrayDef]:
    """Every array a store with this manifest has, in write order (commit comes after all)."""
    lp_dtype = manifest.logprob_dtype
    rows = ("row",)
    defs = [
        ArrayDef(
            spec.TOPK_IDS,
            "int32",
            True,
            layout.row_chunk,
            layout.row_shard,
            layout.id_codec,
            ("row", "rank"),
        ),
        ArrayDef(
            spec.TOPK_LOGPROBS,
            STORED_DTYPE[lp_dtype],
            True,
            layout.row_chunk,
            layout.row_shard,
            layout.logprob_codec,
            ("row", "rank"),
        ),
    ]
    if lp_dtype in spec.QUANTISED_DTYPES:
        for name in (spec.LOGPROB_MAX, spec.LOGPROB_STEP):
            defs.append(
                ArrayDef(
                    name,
                    "float32",
                    False,
                    layout.row_chunk * 8,
                    layout.row_shard * 8,
                    layout.other_codec,
                    rows,
                )
            )
    defs += [
        ArrayDef(
            spec.TAIL_MASS,
            manifest.tail_mass_dtype,
            False,
            layout.row_chunk * 8,
            layout.row_shard * 8,
            layout.other_codec,
            rows,
        ),
        ArrayDef(
            spec.INPUT_IDS,
            "int32",
            False,
            layout.token_chunk,
            layout.token_shard,
            layout.id_codec,
            ("token",),
        ),
        ArrayDef(
            spec.SEQ_KEYS, "str", False, layout.seq_chunk, layout.seq_shard, "zstd3", ("sequence",)
        ),
        ArrayDef(
            spec.SEQ_LENGTHS,
            "int32",
            False,
            layout.seq_chunk,
            layout.seq_shard,
            layout.other_codec,
            ("sequence",),
        ),
        ArrayDef(
            spec.SEQ_TOKEN_START,
            "int64",
            False,
            layout.seq_chunk,
            layout.seq_shard,
            layout.other_codec,
            ("sequence",),
        ),
        ArrayDef(
            spec.SEQ_ROW_START,
            "int64",
            False,
            layout.seq_chunk,
            layout.seq_shard,
            layout.other_codec,
            ("sequence",),
        ),
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
    return zarr.create_array(
        store,
        name=d.name,
        shape=shape,
        dtype=dtype,
        chunks=chunks,
        shards=shards,
        compressors=compressors(d.codec, itemsize),
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
