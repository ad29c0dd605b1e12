"""Every zarr-python private name the format uses goes through ``cache_format/_zarr_adapter.py``:
each one still exists in the installed (pinned) zarr and does what the format relies on, and no
other module of the package imports ``zarr.core`` or reads a private zarr attribute."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numcodecs
import numpy as np
import zarr
from logitcache.cache_format import _zarr_adapter as za
from zarr.codecs import BloscCodec, ShardingCodec, ZstdCodec

PACKAGE = Path(za.__file__).parent


def test_the_pinned_zarr() -> None:
    major, minor = (int(x) for x in zarr.__version__.split(".")[:2])
    assert (major, minor) == (3, 1)  # pyproject: zarr>=3.1,<3.2


def test_sync_runs_a_coroutine_on_zarrs_loop() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert za.sync(answer()) == 42


def test_arrays_codecs_and_the_shard_index(tmp_path: Path) -> None:
    arr = zarr.create_array(
        tmp_path / "a",
        shape=(64,),
        chunks=(8,),
        shards=(32,),
        dtype="int32",
        compressors=BloscCodec(cname="zstd", clevel=1),
    )
    arr[:40] = np.arange(40, dtype=np.int32)
    aa = za.async_array(arr)
    assert isinstance(aa, zarr.AsyncArray)
    assert np.array_equal(za.sync(aa.getitem(slice(0, 40))), np.arange(40))
    md = arr.metadata
    assert isinstance(md, za.ArrayV3Metadata) and isinstance(md.chunk_grid, za.RegularChunkGrid)
    sharding = md.codecs[0]
    assert isinstance(sharding, ShardingCodec)
    blosc = za.blosc_codec(sharding.codecs[1])
    assert isinstance(blosc, numcodecs.Blosc) and blosc.cname == "zstd"
    zstd = za.zstd_codec(ZstdCodec(level=3))
    assert isinstance(zstd, numcodecs.Zstd) and zstd.level == 3
    index = za.sync(za.load_shard_index(sharding, aa.store_path / "c" / "0", (4,)))
    table = np.asarray(index.offsets_and_lengths)
    assert table.shape == (4, 2) and (table[:, 0] != 2**64 - 1).all()
    absent = za.sync(za.load_shard_index(sharding, aa.store_path / "c" / "9", (4,)))
    assert absent is None
    proto = za.default_buffer_prototype()
    assert isinstance(proto.buffer.from_bytes(b"xy"), za.Buffer)
    assert za.GroupMetadata(attributes={"a": 1}).attributes == {"a": 1}


def test_no_other_module_touches_zarr_private_api() -> None:
    """Nor does any module of the library (the server and client use the format's names)."""
    private = re.compile(r"zarr\.core|\._async_array|\._blosc_codec|\._zstd_codec|\._load_shard")
    rooms = ("cache_format", "server", "client", "protocol", "fixtures")
    for path in (p for room in rooms for p in (PACKAGE.parent / room).rglob("*.py")):
        if path.name == "_zarr_adapter.py":
            continue
        assert not private.search(path.read_text()), path.name
