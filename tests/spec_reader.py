"""A logitcache store reader written from ``cache_format/FORMAT.md`` alone.

It imports nothing from the project and nothing from zarr: JSON metadata, the shard layout
(FORMAT.md 4.5), the codecs named in the array table (section 4), the transforms (4.1-4.3) and the
commit point (R6, R8, R9) are decoded here by hand, each line citing the rule it implements.
``tests/format/test_format_spec_reader.py`` requires it to agree with the project's reader on every
array of every encoding, so the text and the bytes cannot drift apart.

Third-party decoders used: ``numcodecs.blosc`` (blosc1 frames), ``numcodecs.zstd`` (zstd frames)
and ``google_crc32c`` (CRC32C).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np
from numcodecs import blosc
from numcodecs.zstd import Zstd

EMPTY = 2**64 - 1  # 4.5: the index pair of a chunk that is not stored
DTYPES = {  # zarr v3 data types of section 4 -> little-endian numpy dtypes
    "int32": "<i4",
    "int64": "<i8",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "float16": "<f2",
    "float32": "<f4",
}
ROW_BITS = {"float16": np.uint16, "float32": np.uint32, "uint8": np.uint8, "uint16": np.uint16}


class SpecError(Exception):
    """The store breaks a rule of FORMAT.md (the message cites it)."""


def _crc_ok(frame: bytes) -> bool:
    """R7 / codec crc32c: the last 4 bytes are the CRC32C of the rest, uint32 little-endian."""
    return len(frame) >= 4 and google_crc32c.value(frame[:-4]) == int.from_bytes(
        frame[-4:], "little"
    )


def _vlen_utf8(raw: bytes) -> list[str]:
    """Section 4 codec vlen-utf8: uint32 LE count, then per item uint32 LE length + UTF-8."""
    n = int.from_bytes(raw[:4], "little")
    out, pos = [], 4
    for _ in range(n):
        size = int.from_bytes(raw[pos : pos + 4], "little")
        out.append(raw[pos + 4 : pos + 4 + size].decode("utf-8"))
        pos += 4 + size
    return out


@dataclass
class SpecArray:
    name: str
    meta: dict

    @property
    def shape(self) -> list[int]:
        return self.meta["shape"]


class SpecStore:
    """A local store, read from FORMAT.md's statements only."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        attrs = json.loads((self.root / "zarr.json").read_text())["attributes"]
        self.version = attrs["format_version"]  # 2.1
        if self.version not in (1, 2, 3, 4):
            raise SpecError(f"2.1: format_version {self.version} unknown")
        if self.version >= 3:  # 2.2: digest of the other root attributes
            body = {k: v for k, v in attrs.items() if k != "logitcache_digest"}
            text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
            if attrs.get("logitcache_digest") != f"{google_crc32c.value(text.encode()):08x}":
                raise SpecError("2.2: root attributes fail their digest")
        self.manifest = attrs["logitcache"]  # section 3
        if self.manifest["format_version"] != self.version:
            raise SpecError("3: manifest format_version differs from the root's")

    # ----------------------------------------------------------------- raw arrays (4, 4.5)
    def meta(self, name: str) -> dict:
        return json.loads((self.root / name / "zarr.json").read_text())

    def raw(self, name: str, count: int) -> np.ndarray | list[str]:
        """Entries ``[0, count)`` of array ``name`` as stored (R6: nothing past ``count``)."""
        m = self.meta(name)
        shape = m["shape"]
        if shape[0] < count:
            raise SpecError(f"R6: {name} has {shape[0]} entries, commit needs {count}")
        shard_rows = m["chunk_grid"]["configuration"]["chunk_shape"][0]
        (sharding,) = m["codecs"]  # 4: every array is sharded
        assert sharding["name"] == "sharding_indexed"
        cfg = sharding["configuration"]
        assert cfg["index_location"] == "end"  # 4.5: the index follows the chunks
        chunk_rows = cfg["chunk_shape"][0]
        inner = tuple(shape[1:])
        names = [c["name"] for c in cfg["codecs"]]
        is_str = m["data_type"] == "string"
        dtype = None if is_str else np.dtype(DTYPES[m["data_type"]])
        fill = m["fill_value"]
        n_chunks = shard_rows // chunk_rows
        out: list = []
        for s in range(math.ceil(count / shard_rows)):
            key = f"c/{s}" + "/0" * len(inner)  # 4.5: chunk-key encoding
            path = self.root / name / key
            data = path.read_bytes() if path.exists() else None
            if data is None and self.version >= 2:
                raise SpecError(f"R9: {name} shard object {key} missing")
            table = None
            if data is not None:
                index = data[-(16 * n_chunks + 4) :]
                if len(index) != 16 * n_chunks + 4 or not _crc_ok(index):
                    raise SpecError(f"R7: {name} {key} index fails its CRC32C")
                table = np.frombuffer(index[:-4], "<u8").reshape(n_chunks, 2)
                if self.version >= 4:  # 4.8: the seal before the index
                    self._check_seal(data, name, s, min(count - s * shard_rows, shard_rows), index)
            for c in range(n_chunks):
                first = s * shard_rows + c * chunk_rows
                if first >= count:
                    break
                take = min(chunk_rows, count - first)
                if table is None or int(table[c, 0]) == EMPTY:
                    if self.version >= 2:
                        raise SpecError(f"R9: {name} chunk {c} of shard {s} not stored")
                    out.append([fill] * take if is_str else np.full((take, *inner), fill, dtype))
                    continue
                off, nbytes = int(table[c, 0]), int(table[c, 1])
                frame = data[off : off + nbytes]
                if len(frame) != nbytes or not _crc_ok(frame):
                    raise SpecError(f"R7: {name} chunk {c} of shard {s} fails its CRC32C")
                body = frame[:-4]
                if names == ["vlen-utf8", "zstd", "crc32c"]:
                    out.append(_vlen_utf8(Zstd().decode(body))[:take])
                    continue
                if names == ["bytes", "crc32c"]:  # 4: no compressor
                    if len(body) != chunk_rows * math.prod(inner) * dtype.itemsize:
                        raise SpecError(f"4: {name} chunk {c} of shard {s} has the wrong size")
                    buf = body
                elif names == ["bytes", "blosc", "crc32c"]:
                    buf = blosc.decompress(body)
                elif names == ["bytes", "zstd", "crc32c"]:
                    buf = Zstd().decode(body)
                else:
                    raise SpecError(f"4: {name} codecs {names} not in the array table")
                chunk = np.frombuffer(buf, dtype).reshape(chunk_rows, *inner)  # C order
                out.append(chunk[:take])
        if is_str:
            return [x for part in out for x in part]
        if not out:
            return np.zeros((0, *inner), dtype)
        return np.concatenate(out)

    @staticmethod
    def _check_seal(data: bytes, name: str, shard: int, need: int, index: bytes) -> None:
        """4.8: the 28 bytes before the index: magic, CRC32C of the name, shard, entries, and
        the CRC32C of those 24 bytes followed by the index (with its CRC32C)."""
        seal = data[-len(index) - 28 : -len(index)]
        if len(seal) != 28 or seal[:4] != b"LCS1":
            raise SpecError(f"4.8: {name} shard {shard} has no seal")
        if google_crc32c.value(seal[:24] + index) != int.from_bytes(seal[24:], "little"):
            raise SpecError(f"4.8: {name} shard {shard} seal fails its CRC32C")
        ncrc = int.from_bytes(seal[4:8], "little")
        at, entries = int.from_bytes(seal[8:16], "little"), int.from_bytes(seal[16:24], "little")
        if ncrc != google_crc32c.value(name.encode()) or at != shard:
            raise SpecError(f"4.8: {name} shard {shard} object belongs elsewhere")
        if entries < need:
            raise SpecError(f"4.8: {name} shard {shard} holds {entries} entries, needs {need}")

    # ----------------------------------------------------------------- decoded store
    def decode(self) -> dict:
        """Every array decoded (4.1-4.3, R8, keys as bytes), keyed like the project's reader."""
        m = self.manifest
        S, R, T = m["num_sequences"], m["num_rows"], m["num_tokens"]
        out: dict = {"keys": self.raw("seq_keys", S)}
        lengths = self.raw("seq_lengths", S).astype(np.int64)
        tok, row = self.raw("seq_token_start", S), self.raw("seq_row_start", S)
        zero = np.zeros(1, np.int64)
        if not (
            np.array_equal(tok, np.concatenate([zero, np.cumsum(lengths)])[:-1])
            and np.array_equal(row, np.concatenate([zero, np.cumsum(lengths - 1)])[:-1])
            and int(lengths.sum()) == T
            and int((lengths - 1).sum()) == R
        ):
            raise SpecError("R8: the sequence index does not tile the committed counts")
        out.update(lengths=lengths, token_start=tok, row_start=row)
        out["input_ids"] = self.raw("input_ids", T)
        if m.get("targets") == "hidden":  # 4.10: hidden rows and the head, no top-k arrays
            out.update(self._hidden(m["hidden"], R, m["vocab_size"]))
            return self._key_bytes(out, S)
        ids = self.raw("topk_ids", R)
        if m.get("id_remap"):  # 4.3
            ids = self.raw("id_order", m["vocab_size"])[ids]
        out["topk_ids"] = ids
        kind = m["logprob_dtype"]
        d = self.raw("topk_logprobs", R).astype(ROW_BITS[kind])
        u = np.cumsum(d, axis=1, dtype=ROW_BITS[kind])  # 4.2: sum mod 2^b
        if kind == "float16":
            lp = u.view(np.float16).astype(np.float32)
        elif kind == "float32":
            lp = u.view(np.float32)
        else:  # 4.1: fl32(m - fl32(fl32(q) * step)), no fused multiply-add
            mx = self.raw("logprob_max", R).astype(np.float32)
            step = self.raw("logprob_step", R).astype(np.float32)
            prod = (u.astype(np.float32) * step[:, None]).astype(np.float32)
            lp = (mx[:, None] - prod).astype(np.float32)
        out["topk_logprobs"] = lp
        out["tail_mass"] = self.raw("tail_mass", R).astype(np.float32)
        if m.get("entropy"):  # 4.9: float16 nats per row
            out["entropy"] = self.raw("entropy", R).astype(np.float16)
        if m.get("actual_logprob"):  # 4.12: float32 per row
            out["actual_logprob"] = self.raw("actual_logprob", R).astype(np.float32)
        return self._key_bytes(out, S)

    def _key_bytes(self, out: dict, S: int) -> dict:
        """Keys as bytes and each array's encoding attribute (4, version >= 2)."""
        m = self.manifest
        if self.version >= 2:  # 4: keys as bytes
            ends = self.raw("seq_key_end", S)
            data = self.raw("seq_key_bytes", m["num_key_bytes"]).tobytes()
            starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            out["key_bytes_keys"] = [
                data[int(a) : int(b)].decode("utf-8") for a, b in zip(starts, ends, strict=True)
            ]
            out["key_index"] = self.key_index(out["keys"])
            out["encodings"] = {
                p.parent.name: json.loads(p.read_text())["attributes"]["logitcache_encoding"]
                for p in self.root.glob("*/zarr.json")
            }
        return out

    def _hidden(self, h: dict, R: int, V: int) -> dict:
        """4.10: ``hidden`` decoded to float32 (bfloat16: the upper half of a float32 pattern;
        e4m3: bias 7, 3 mantissa bits, subnormals ``m/8 * 2^-6``, times the row's scale), the
        head as stored, and the head digest recomputed (sha256 of weight then bias bytes)."""
        bits = self.raw("hidden", R)
        if h["dtype"] == "bfloat16":
            rows = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            e, man = (bits >> 3) & 0xF, (bits & 7).astype(np.float64)
            mag = np.where(e == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (e.astype(float) - 7))
            value = np.where(bits & 0x80, -mag, mag).astype(np.float32)
            rows = value * self.raw("hidden_scale", R).astype(np.float32)[:, None]
        weight = self.raw("head_weight", V if R else 0)
        digest = hashlib.sha256(np.ascontiguousarray(weight).tobytes())
        bias = self.raw("head_bias", V if R else 0) if h["bias"] else None
        if bias is not None:
            digest.update(np.ascontiguousarray(bias).tobytes())
        if R and "sha256:" + digest.hexdigest() != h["head_digest"]:
            raise SpecError("4.10: the head does not hash to head_digest")
        return {"hidden": rows, "head_weight": weight, "head_bias": bias}

    # ----------------------------------------------------------------- key index (4.11)
    def key_index(self, keys: list[str]) -> dict[int, int] | None:
        """4.11: every run of ``key_index`` checked (footer, fence against the manifest's
        ``crc``, blocks, record, order) and its pairs checked against the keys' hashes; the
        pairs as ``{sequence: hash}`` (``None``: the store has no key index)."""
        runs = self.manifest.get("key_index")
        if runs is None:
            return None
        crc = google_crc32c.value
        pairs: dict[int, int] = {}
        at = 0
        for run in runs:
            first, count, gen = run["first"], run["count"], run["generation"]
            if first != at:
                raise SpecError("4.11: runs do not tile [0, S) in order")
            at += count
            data = (self.root / f"seq_keys/index/{first}-{first + count}-{gen}").read_bytes()
            foot = data[-48:]
            if crc(foot[:44]) != int.from_bytes(foot[44:], "little") or foot[:4] != b"LCKI":
                raise SpecError("4.11: run footer fails its CRC32C or magic")
            f_first, f_count, f_gen, r_len = (
                int.from_bytes(foot[4 + 8 * i : 12 + 8 * i], "little") for i in range(4)
            )
            if (f_first, f_count, f_gen) != (first, count, gen):
                raise SpecError("4.11: run footer names another run")
            nb = -(-count // 4096)
            fence = data[-48 - 12 * nb : -48]
            if f"{crc(fence):08x}" != run["crc"]:
                raise SpecError("4.11: fence fails the manifest's crc")
            record = data[16 * count : 16 * count + r_len]
            if crc(record) != int.from_bytes(foot[40:44], "little"):
                raise SpecError("4.11: commit record fails its CRC32C")
            if json.loads(record)["logitcache"]["generation"] != gen:
                raise SpecError("4.11: commit record of another commit")
            for j in range(nb):
                block = data[16 * 4096 * j : 16 * min(4096 * (j + 1), count)]
                if crc(block) != int.from_bytes(
                    fence[8 * nb + 4 * j : 8 * nb + 4 * j + 4], "little"
                ):
                    raise SpecError(f"4.11: block {j} fails its CRC32C")
            ent = np.frombuffer(data[: 16 * count], dtype=[("h", "<i8"), ("s", "<i8")])
            if not (ent["h"][1:] >= ent["h"][:-1]).all():
                raise SpecError("4.11: run not sorted by hash")
            pairs.update(zip(ent["s"].tolist(), ent["h"].tolist(), strict=True))
        if at != len(keys) or sorted(pairs) != list(range(len(keys))):
            raise SpecError("4.11: the runs do not hold each sequence once")
        for i, key in enumerate(keys):
            if pairs[i] != _key_hash(key.encode("utf-8")):
                raise SpecError(f"4.11: sequence {i} holds another key's hash")
        return pairs


_M = 2**64


def _mix(x: int) -> int:
    """4.11: splitmix64's finaliser, modulo 2^64."""
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 % _M
    x ^= x >> 27
    x = x * 0x94D049BB133111EB % _M
    return x ^ (x >> 31)


def _key_hash(b: bytes) -> int:
    """4.11: the key hash of UTF-8 bytes ``b`` as int64."""
    seed = 0x9E3779B97F4A7C15
    s = sum((byte + 1) * (_mix((j + seed) % _M) | 1) for j, byte in enumerate(b)) % _M
    h = _mix(s ^ (len(b) * seed % _M))
    return h - _M if h >= 2**63 else h
