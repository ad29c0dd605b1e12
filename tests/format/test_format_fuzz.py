"""Property (hypothesis): damage never turns into silently wrong values (issue #11, FORMAT.md R7,
R9, R6).

Random small caches (three encodings, tiny multi-shard layout) are damaged at random: a byte
flipped, an object truncated or deleted, anywhere in the store (chunk data, shard indexes, array
and root ``zarr.json``). Then every read (both read paths: sequences, rows, tokens, keys) either
returns exactly what was written or raises a typed :class:`FormatError`; ``validate`` never
raises, and whenever a read failed it reports at least one problem.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from format_support import make_manifest, make_records
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logitcache.cache_format import CacheReader, CacheWriter, FormatError, Layout, validate
from logitcache.cache_format import _reader as reader_mod

TINY = Layout(row_chunk=4, row_shard=16, token_chunk=8, token_shard=32, seq_chunk=2, seq_shard=8)
CONFIGS = {
    "float16": dict(),
    "uint8_remap": dict(logprob_dtype="uint8", id_remap=True),
    "float32_f16tail": dict(logprob_dtype="float32", tail_mass_dtype="float16"),
}


@pytest.fixture(scope="module")
def caches():
    """name -> (store path, sorted object keys, expected values per sequence)."""
    root = Path(tempfile.mkdtemp(prefix="lc-fuzz-"))
    out = {}
    for seed, (name, over) in enumerate(CONFIGS.items()):
        recs = make_records(9, k=3, vocab=50, seed=seed, min_len=2, max_len=9)
        path = root / name
        with CacheWriter.open(path, make_manifest(k=3, vocab_size=50, **over), layout=TINY) as w:
            w.append(recs[:5])
            w.append(recs[5:])
        r = CacheReader(path)
        expected = [r.sequence(i) for i in range(r.num_sequences)]
        objects = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
        out[name] = (path, objects, expected)
    yield out
    shutil.rmtree(root)


def _damage(path: Path, key: str, action: str, where: float, mask: int) -> None:
    f = path / key
    data = bytearray(f.read_bytes())
    if action == "delete":
        f.unlink()
    elif action == "truncate":
        f.write_bytes(bytes(data[: int(where * len(data))]))
    elif data:
        i = min(int(where * len(data)), len(data) - 1)
        data[i] ^= mask
        f.write_bytes(bytes(data))


def _same(got, want) -> bool:
    return (
        got.key == want.key
        and np.array_equal(got.input_ids, want.input_ids)
        and np.array_equal(got.topk_ids, want.topk_ids)
        and np.array_equal(got.topk_logprobs.view(np.uint32), want.topk_logprobs.view(np.uint32))
        and np.array_equal(got.tail_mass.view(np.uint32), want.tail_mass.view(np.uint32))
    )


def _read_everything(path: Path, expected: list, decoder: str) -> bool:
    """Every read returns the written values or raises FormatError; True if any raised."""
    try:
        r = CacheReader(path, decoder=decoder)
    except FormatError:
        return True
    failed = False
    try:  # keys are read when used (FORMAT.md D1): a damaged seq_keys raises here
        assert r.keys == [e.key for e in expected]
        assert all(r.index_of(e.key) == i for i, e in enumerate(expected))
    except FormatError:
        failed = True
    for i, want in enumerate(expected):
        try:
            assert _same(r.sequence(i), want), f"sequence {i} differs"
        except FormatError:
            failed = True
    try:
        block = r.rows(0, r.num_rows)
        assert np.array_equal(block.topk_ids, np.concatenate([e.topk_ids for e in expected]))
        lp = np.concatenate([e.topk_logprobs for e in expected])
        assert np.array_equal(block.topk_logprobs, lp)
    except FormatError:
        failed = True
    try:
        toks = r.tokens(0, r.num_tokens)
        assert np.array_equal(toks, np.concatenate([e.input_ids for e in expected]))
    except FormatError:
        failed = True
    return failed


@settings(
    max_examples=35,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    damage=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=10**6),
            st.sampled_from(["flip", "flip", "flip", "truncate", "delete"]),
            st.floats(min_value=0.0, max_value=0.999),
            st.integers(min_value=1, max_value=255),
        ),
        min_size=1,
        max_size=2,
    ),
)
def test_damage_is_never_silent(caches, name, damage):
    src, objects, expected = caches[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c"
        shutil.copytree(src, path)
        for pick, action, where, mask in damage:
            key = objects[pick % len(objects)]
            if (path / key).exists():
                _damage(path, key, action, where, mask)
        with mock.patch.object(reader_mod, "_RETRIES", 1):
            failed = _read_everything(path, expected, "numba")
            failed |= _read_everything(path, expected, "numpy")
        report = validate(path)
        if failed:
            assert not report.ok, f"reads failed but validate passed: {damage}"
