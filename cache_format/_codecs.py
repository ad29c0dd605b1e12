"""Named codec chains for the format's arrays (names are not stored: zarr writes the full codec
configuration into each array's ``zarr.json``).

Grammar: ``blosc-<cname><level>-<shuffle>`` (cname in zstd|lz4|lz4hc|zlib, shuffle in
noshuffle|shuffle|bitshuffle), ``zstd<level>``, or ``none`` (FORMAT.md 4.7's
``random_access_raw``). Every chain ends with a CRC32C of the inner chunk (FORMAT.md R7)."""

from __future__ import annotations

import re

from zarr.codecs import BloscCname, BloscCodec, BloscShuffle, Crc32cCodec, ZstdCodec

from .errors import FormatError

_BLOSC = re.compile(r"^blosc-(zstd|lz4hc|lz4|zlib|blosclz)(\d?)-(noshuffle|shuffle|bitshuffle)$")
_ZSTD = re.compile(r"^zstd(\d{1,2})$")


def compressors(name: str, typesize: int, blocksize: int = 0) -> tuple:
    """Bytes-to-bytes codecs (compressor + CRC32C) for codec ``name`` on items of ``typesize``.

    ``blocksize``: bytes per blosc block (0: blosc's automatic choice); ignored by zstd.
    """
    m = _BLOSC.match(name)
    if m:
        cname, level, shuffle = m.group(1), int(m.group(2) or 5), m.group(3)
        comp = BloscCodec(
            cname=BloscCname(cname),
            clevel=level,
            shuffle=BloscShuffle(shuffle),
            typesize=typesize,
            blocksize=blocksize,
        )
        return (comp, Crc32cCodec())
    m = _ZSTD.match(name)
    if m:
        return (ZstdCodec(level=int(m.group(1))), Crc32cCodec())
    if name == "none":
        return (Crc32cCodec(),)
    raise FormatError(f"unknown codec name {name!r}")
