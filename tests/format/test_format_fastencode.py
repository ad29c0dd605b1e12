"""cache_format/fastencode.py (issue #19): the compiled encode pass stores the numpy path's bytes
bit for bit (float16 rounding at every boundary, clip, zeros, subnormals, row deltas), refuses
exactly what rows_pass refuses, and is optional (off switch, large vocabularies, no numba)."""

from __future__ import annotations

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import SequenceRecord, fastencode
from logitcache.cache_format import _encode as encode
from logitcache.cache_format import _writer as writer
from logitcache.cache_format.quant import encode_logprobs
from logitcache.cache_format.records import rows_pass

pytestmark = pytest.mark.skipif(not fastencode.ready(), reason="numba not available")
TOL = 1e-3


def _encode(ids: np.ndarray, lp: np.ndarray, vocab: int) -> tuple[bool, np.ndarray, np.ndarray]:
    out_ids, stored = np.empty_like(ids), np.empty(ids.shape, np.uint16)
    ok = fastencode.encode_rows(ids, lp, out_ids, stored, fastencode.StampTable(vocab), TOL)
    return ok, out_ids, stored


def _boundary_values() -> np.ndarray:
    """float32 values at and around every float16 rounding boundary of [-65504 * 2, 0]: each
    negative half, the midpoints between neighbours, one float32 ulp either side of both, and
    the special cases (zeros, the clip, positives up to the tolerance, tiny negatives)."""
    halves = np.arange(0x8000, 0xFC00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mids = ((halves[:-1].astype(np.float64) + halves[1:]) / 2).astype(np.float32)
    base = np.concatenate([halves, mids]).view(np.uint32)
    near = np.concatenate([base - 1, base, base + 1]).view(np.float32)
    special = np.array(
        [0.0, -0.0, 1e-4, 5e-4, TOL, -1e-30, -1e-45, -6e-8, -5.96e-8, -2.98e-8, -3e-8,
         -65504.0, -65519.0, -65520.0, -65536.0, -1e6, -3.4e38, -6.1e-5, -6.104e-5],
        dtype=np.float32,
    )  # fmt: skip
    v = np.concatenate([near, special])
    return v[np.isfinite(v) & (v.astype(np.float64) <= TOL)]  # as rows_pass compares


def test_every_float16_boundary_rounds_as_numpy() -> None:
    lp = _boundary_values().reshape(-1, 1)  # one value per row: the stored delta is its half
    ids = np.zeros(lp.shape, np.int32)
    ok, _, stored = _encode(ids, lp, 4)
    assert ok
    want = encode_logprobs(lp, "float16")["topk_logprobs"]
    bad = np.nonzero(stored != want)[0]
    assert bad.size == 0, [(float(lp[i, 0]), hex(stored[i, 0]), hex(want[i, 0])) for i in bad[:5]]


@pytest.mark.parametrize("k", [1, 7, 20, 100, 129])
def test_random_rows_store_the_numpy_bytes(k: int) -> None:
    rng = np.random.default_rng(k)
    n, vocab = 300, 5000
    lp = -np.sort(rng.exponential(4.0, (n, k)), axis=1).astype(np.float32)
    lp[::7, 0] = 0.0  # rows led by a zero, a tiny value, a clipped tail
    lp[1::7, 0] = -1e-9
    lp[2::7, -1] = -1e5
    lp[3::7, 0] = 5e-4  # within the tolerance: stored as +0
    lp[2::7] = np.minimum.accumulate(lp[2::7], axis=1)
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)]).astype(np.int32)
    assert rows_pass(np.zeros(2, np.int32), ids, lp, None, vocab_size=vocab)
    ok, out_ids, stored = _encode(ids, lp, vocab)
    assert ok
    assert out_ids.tobytes() == ids.tobytes()
    assert stored.tobytes() == encode_logprobs(lp, "float16")["topk_logprobs"].tobytes()


def _good(n: int = 40, k: int = 8, vocab: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)]).astype(np.int32)
    lp = -np.sort(rng.exponential(2.0, (n, k)), axis=1).astype(np.float32)
    return ids, lp


@pytest.mark.parametrize(
    "kind", ["repeat", "negative", "vocab", "nan", "-inf", "positive", "order", "last_row"]
)
def test_it_refuses_what_rows_pass_refuses(kind: str) -> None:
    ids, lp = _good()
    if kind == "repeat":
        ids[7, 5] = ids[7, 2]
    elif kind == "negative":
        ids[3, 0] = -1
    elif kind == "vocab":
        ids[3, 7] = 64
    elif kind == "nan":
        lp[9, 4] = np.nan
    elif kind == "-inf":
        lp[9, 7] = -np.inf
    elif kind == "positive":
        lp[0, 0] = 2e-3
    elif kind == "order":
        lp[5, 6] = lp[5, 5] + 0.25
    elif kind == "last_row":
        ids[-1, -1] = ids[-1, 0]
    assert not rows_pass(np.zeros(2, np.int32), ids, lp, None, vocab_size=64)
    assert not _encode(ids, lp, 64)[0]


def test_an_id_may_repeat_across_rows_and_calls() -> None:
    """The stamp table tells rows apart: the same id in every row, call after call, passes;
    ids at both ends of the vocabulary pass."""
    table = fastencode.StampTable(10)
    ids = np.tile(np.array([0, 9, 4], np.int32), (50, 1))
    lp = np.tile(np.array([-0.1, -1.0, -2.0], np.float32), (50, 1))
    for _ in range(3):
        out = np.empty_like(ids)
        assert fastencode.encode_rows(ids, lp, out, np.empty(ids.shape, np.uint16), table, TOL)


def test_the_stamp_table_restarts_its_stamps_inside_a_call() -> None:
    """Stamps past 65535 zero the table and restart at 1 within a call (every row the same
    ids, which must not read as repeats); a record longer than the stamp range passes, and a
    repeated id after the restart still fails."""
    table = fastencode.StampTable(8)
    table.state[0] = 0xFFFF - 5
    table.seen[:] = 5  # an earlier row's stamp
    ids = np.tile(np.array([0, 7, 3, 5], np.int32), (20, 1))
    lp = np.tile(np.array([-0.1, -1.0, -2.0, -3.0], np.float32), (20, 1))
    out, stored = np.empty_like(ids), np.empty(ids.shape, np.uint16)
    assert fastencode.encode_rows(ids, lp, out, stored, table, TOL)
    assert table.state[0] == 15 and (out == ids).all()
    assert (table.seen[[0, 7, 3, 5]] == 15).all() and (table.seen[[1, 2, 4, 6]] == 0).all()
    long_ids, long_lp = np.tile(ids[:1], (70_000, 1)), np.tile(lp[:1], (70_000, 1))
    out, stored = np.empty_like(long_ids), np.empty(long_ids.shape, np.uint16)
    assert fastencode.encode_rows(long_ids, long_lp, out, stored, table, TOL)
    assert table.state[0] == (15 + 70_000 - 1) % 0xFFFF + 1
    ids[3, 2] = ids[3, 0]
    assert not fastencode.encode_rows(ids, lp, np.empty_like(ids), stored[:20], table, TOL)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = fastencode.encode_rows

    def counted(ids: np.ndarray, *a: object) -> bool:
        calls.append(ids.shape[0])
        return original(ids, *a)

    monkeypatch.setattr(fastencode, "encode_rows", counted)
    return calls


def test_the_writer_uses_it_for_float16_and_not_past_max_vocab(
    spy: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = make_manifest(k=6, vocab_size=50)
    recs = make_records(4, k=6, vocab=50, seed=5)
    fast = writer.encode_batch(recs, m)
    assert spy == [sum(r.num_rows for r in recs)]  # one call over the batch's rows
    monkeypatch.setattr(fastencode, "MAX_VOCAB", 49)
    slow = writer.encode_batch(recs, m)
    assert len(spy) == 1
    assert fast is not None and slow is not None
    for name, a in slow.arrays.items():
        assert fast.arrays[name].tobytes() == a.tobytes(), name
    writer.encode_batch(recs, make_manifest(k=6, vocab_size=50, logprob_dtype="float32"))
    assert len(spy) == 1


def test_records_without_tails_get_the_computed_tail(spy: list[int]) -> None:
    m = make_manifest(k=6, vocab_size=50)
    recs = make_records(3, k=6, vocab=50, seed=6)
    bare = [SequenceRecord(r.key, r.input_ids, r.topk_ids, r.topk_logprobs) for r in recs]
    got = writer.encode_batch(bare, m)
    assert spy and got is not None
    want = np.concatenate([r.tail_or_computed() for r in bare])
    assert got.arrays["tail_mass"].tobytes() == want.tobytes()


def test_no_numba_and_a_failed_compile_leave_the_numpy_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from logitcache.cache_format import _numba

    for name in ("_kernel", "_tail", "_sums", "_merge"):  # restored after the test
        monkeypatch.setattr(fastencode, name, getattr(fastencode, name))
    monkeypatch.setattr(fastencode, "_state", "unknown")
    monkeypatch.setattr(_numba, "AVAILABLE", False)
    assert not fastencode.ready()
    monkeypatch.setattr(fastencode, "_state", "unknown")
    monkeypatch.setattr(_numba, "AVAILABLE", True)

    def broken() -> None:
        raise ImportError("no numba")

    monkeypatch.setattr(fastencode, "_merge_check", broken)  # one failing check: all numpy
    assert not fastencode.ready()
    assert fastencode._kernel is None and fastencode._tail is None and fastencode._sums is None
    m = make_manifest(k=6, vocab_size=50)
    assert writer.encode_batch(make_records(2, k=6, vocab=50, seed=7), m) is not None


def test_llvmlite_survives_a_scan_of_every_module() -> None:
    """vLLM's CPU platform runs ``vars(value).get("kernel")`` over every module's values with a
    ``__dict__`` at each engine start: llvmlite's library wrapper (imported with numba) used to
    hand back a C-function wrapper for ``__dict__`` and break it (harden_llvmlite)."""
    import sys

    from llvmlite.binding import ffi

    fastencode.harden_llvmlite()
    assert not hasattr(ffi.lib, "__dict__")
    mods = [m for n, m in list(sys.modules.items()) if n.split(".")[0] in ("llvmlite", "numba")]
    for module in mods:  # vLLM 0.32's scan, over llvmlite's and numba's modules
        for value in list(getattr(module, "__dict__", {}).values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")
    assert ffi.lib.LLVMPY_GetVersionInfo is not None  # its functions still resolve


def test_rows_of_a_wider_buffer_are_read_in_place() -> None:
    """Columns 1..k of an ``[n, k + 1]`` buffer (the vLLM hook's rows, issue #19) encode as
    their C-ordered copy does and are refused as it is; column 0 and the buffer past the view
    are never read (a NaN and a repeated id there pass)."""
    n, k, vocab = 50, 9, 64
    rng = np.random.default_rng(11)
    full_ids = np.stack([rng.choice(vocab, k + 1, replace=False) for _ in range(n)]).astype(
        np.int32
    )
    full_lp = -np.sort(rng.exponential(2.0, (n, k + 1)), axis=1).astype(np.float32)
    full_ids[:, 0] = full_ids[:, 1]  # outside the view: a repeat that must not count
    full_lp[:, 0] = np.nan
    ids, lp = full_ids[:, 1:], full_lp[:, 1:]
    assert not ids.flags.c_contiguous and fastencode.parent_rows(ids).shape == (n, k + 1)
    ok, out_ids, stored = _encode(ids, lp, vocab)
    want_ok, want_ids, want_stored = _encode(
        np.ascontiguousarray(ids), np.ascontiguousarray(lp), vocab
    )
    assert ok and want_ok
    assert out_ids.tobytes() == want_ids.tobytes() and stored.tobytes() == want_stored.tobytes()
    narrow_ids, narrow_lp = full_ids[:, 1:5], full_lp[:, 1:5]  # rows further apart than k
    ok, out_ids, stored = _encode(narrow_ids, narrow_lp, vocab)
    assert ok and out_ids.tobytes() == np.ascontiguousarray(narrow_ids).tobytes()
    assert stored.tobytes() == encode_logprobs(narrow_lp, "float16")["topk_logprobs"].tobytes()
    full_ids[-1, -1] = full_ids[-1, 1]  # the last value of the view: refused
    assert not _encode(ids, lp, vocab)[0]
    full_ids[-1, -1] = full_ids[-1, 0] = vocab + 5  # still a repeat, and out of range
    assert not _encode(ids, lp, vocab)[0]
    with pytest.raises(ValueError, match="contiguous"):
        fastencode.parent_rows(full_ids[:, ::2])


def test_read_only_and_writable_rows_share_one_specialisation() -> None:
    """The kernels see every input read-only: rows that arrive writable (a fresh array), read
    only (a view of an engine's buffer, ``as_strided(..., writeable=False)``), C-ordered or as
    rows of a wider buffer run the specialisations ``ready`` made, and none is compiled inside
    an append (a compile there is ~1 CPU-s in the job's encode stage on a machine whose numba
    cache lacks it)."""
    from logitcache.cache_format import _encodekernels as ek

    kernels = (ek.encode_rows, ek.tail_rest, ek.row_sums)
    before = [list(f.signatures) for f in kernels]
    rng = np.random.default_rng(5)
    n, k, vocab = 40, 12, 100
    full_ids = np.stack([rng.choice(vocab, k + 1, replace=False) for _ in range(n)]).astype(
        np.int32
    )
    full_lp = -np.sort(rng.exponential(2.0, (n, k + 1)), axis=1).astype(np.float32)
    for cols in (slice(1, None), slice(0, k)):
        for writeable in (True, False):
            ids, lp = full_ids.copy()[:, cols], full_lp.copy()[:, cols]
            c_ids, c_lp = ids.copy(), lp.copy()
            for a in (ids, lp, c_ids, c_lp):
                a.flags.writeable = writeable
            for i, x in ((ids, lp), (c_ids, c_lp)):
                assert _encode(i, x, vocab)[0]
                assert fastencode.tail_rows(x) is not None
    assert [list(f.signatures) for f in kernels] == before


def test_the_writer_stores_row_views_as_their_copies() -> None:
    """Records holding row views (rows_array keeps them) store the bytes of C-ordered copies,
    through the compiled pass and the numpy path."""
    from logitcache.cache_format.records import rows_array

    m = make_manifest(k=6, vocab_size=50)
    recs = make_records(5, k=6, vocab=50, seed=9)
    viewed = []
    for r in recs:
        wide_ids = np.zeros((r.num_rows, 8), np.int32)
        wide_lp = np.full((r.num_rows, 8), np.nan, np.float32)
        wide_ids[:, 1:7], wide_lp[:, 1:7] = r.topk_ids, r.topk_logprobs
        v = SequenceRecord(r.key, r.input_ids, wide_ids[:, 1:7], wide_lp[:, 1:7], r.tail_mass)
        assert np.shares_memory(v.topk_ids, wide_ids) and np.shares_memory(v.topk_logprobs, wide_lp)
        viewed.append(v)
    assert rows_array(wide_ids[:, ::2], np.int32).flags.c_contiguous  # not rows: copied
    assert rows_array(wide_ids[:, 1:7], np.int64).flags.c_contiguous  # another dtype: copied
    want = writer.encode_batch(recs, m)
    fast = writer.encode_batch(viewed, m)
    assert want is not None and fast is not None
    for name, a in want.arrays.items():
        assert fast.arrays[name].tobytes() == a.tobytes(), name
    slow_m = make_manifest(k=6, vocab_size=50, logprob_dtype="float32")
    want, slow = writer.encode_batch(recs, slow_m), writer.encode_batch(viewed, slow_m)
    assert want is not None and slow is not None
    for name, a in want.arrays.items():
        assert slow.arrays[name].tobytes() == a.tobytes(), name
    one = encode.encode_record(viewed[0], m)
    assert one.arrays["topk_ids"].flags.c_contiguous


def _run_probe(code: str, *args: str) -> str:
    """The standard output of ``python -c code args...`` in a fresh process at the repository
    root (it must succeed)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, check=True, cwd=root, capture_output=True, text=True).stdout


def _kernel_cache_stats() -> tuple[int, int]:
    """``(cache hits, cache misses)`` of the kernel's specialisations in a fresh process."""
    probe = "; ".join(
        [
            "from logitcache.cache_format import fastencode, _encodekernels as ek",
            "assert fastencode.ready()",
            "st = ek.encode_rows.stats",
            "print(sum(st.cache_hits.values()), len(st.cache_misses))",
        ]
    )
    hits, misses = _run_probe(probe).split()
    return int(hits), int(misses)


@pytest.mark.subprocess
def test_the_kernel_is_cached_on_disk() -> None:
    """The kernel is a module-level numba function (cache_format/_encodekernels.py): a second
    process loads both its specialisations (``ready`` compiles them: C-ordered ids, and rows of
    a wider buffer) from numba's on-disk cache instead of compiling them (~1 s of CPU). Defined
    inside a function, it was compiled again in every process and added a cache entry each time
    (its closure's pickled bytes, part of numba's cache key, differ between processes)."""
    _kernel_cache_stats()  # fills the cache if it is empty
    assert _kernel_cache_stats() == (2, 0)


def test_appends_reuse_the_encode_outputs(tmp_path, monkeypatch) -> None:
    """An append's compiled encode writes into arrays kept from the appends before (no fresh
    pages per append, issue #19); every append still stores its own rows."""
    from logitcache.cache_format import CacheReader, CacheWriter

    monkeypatch.setattr(fastencode, "_outputs", [])
    m = make_manifest(k=6, vocab_size=50)
    recs = make_records(12, k=6, vocab=50, seed=4)
    taken: list[tuple[int, int]] = []  # (buffer address, rows) per append
    real = fastencode.Outputs.take

    def spy(self: fastencode.Outputs, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids, stored = real(self, rows, k)
        taken.append((ids.__array_interface__["data"][0], rows))
        return ids, stored

    monkeypatch.setattr(fastencode.Outputs, "take", spy)
    with CacheWriter.open(tmp_path / "c", m) as w:
        for a in range(0, 12, 3):
            w.append(recs[a : a + 3])
    assert len(taken) == 4 and len({addr for addr, _ in taken}) == 1, taken
    assert len(fastencode._outputs) == 1  # back in the pool
    r = CacheReader(tmp_path / "c")
    for got, want in zip(r.sequences(range(12)), recs, strict=True):
        assert np.array_equal(got.topk_ids, want.topk_ids)
        assert (
            got.topk_logprobs.tobytes()
            == want.topk_logprobs.astype(np.float16).astype(np.float32).tobytes()
        )


def test_outputs_grow_and_large_ones_are_not_kept(monkeypatch) -> None:
    monkeypatch.setattr(fastencode, "KEEP_VALUES", 1 << 20)
    out = fastencode.Outputs()
    ids, stored = out.take(10, 7)
    assert ids.shape == stored.shape == (10, 7) and ids.dtype == np.int32
    assert stored.dtype == np.uint16 and np.shares_memory(out.take(3, 5)[0], ids)  # reused
    big = out.take(1000, 100)[0]  # 100K values: grown, kept
    assert not np.shares_memory(big, ids) and np.shares_memory(out.take(2, 2)[0], big)
    huge = out.take(1100, 1000)[0]  # past KEEP_VALUES: arrays of its own; the kept ones stay
    assert not np.shares_memory(huge, big) and np.shares_memory(out.take(2, 2)[0], big)
    with fastencode.outputs() as a, fastencode.outputs() as b:  # concurrent appends
        assert a is not b


def test_rows_with_rare_values_at_both_ends_store_the_numpy_bytes() -> None:
    """Zeros, tiny and clipped values (half's non-normal cases) are a prefix and a suffix of a
    sorted row, and only they take the exact path (a confident teacher's top-1 near 0 is common)."""
    rng = np.random.default_rng(11)
    n, k, vocab = 200, 40, 5000
    lp = -np.sort(rng.exponential(4.0, (n, k)), axis=1).astype(np.float32)
    lp[:, :3] = np.array([5e-4, 0.0, -3e-6], np.float32)  # a rare prefix of three
    lp[::2, 3] = -6.1e-5  # just past the subnormal halves: a fourth rare value in half the rows
    lp[1::3, -4:] = np.array([-7e4, -1e5, -3e5, -1e7], np.float32)  # a clipped suffix
    lp[5::9, :] = -1e-7  # whole rows of rare values
    lp = np.minimum.accumulate(np.minimum(lp, np.float32(TOL)), axis=1)
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)]).astype(np.int32)
    ok, _, stored = _encode(ids, lp, vocab)
    assert ok
    assert stored.tobytes() == encode_logprobs(lp, "float16")["topk_logprobs"].tobytes()
    bad = lp.copy()
    bad[7, 20] = 0.0  # a rare value out of order: refused
    assert not _encode(ids, bad, vocab)[0]


def test_kernels_load_once_numpy_has_encoded_enough(
    spy: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the kernels are loaded, appends take the numpy path (the same bytes) until the
    values they encoded reach LOAD_AFTER_VALUES; the append that reaches it loads them
    (``ready``) and takes the compiled pass, as every append after it does."""
    m = make_manifest(k=6, vocab_size=50)
    recs = make_records(4, k=6, vocab=50, seed=5)
    values = sum(r.num_rows for r in recs) * 6
    want = writer.encode_batch(recs, m)
    monkeypatch.setattr(fastencode, "_state", "unknown")
    monkeypatch.setattr(fastencode, "_numpy_values", 0)
    monkeypatch.setattr(fastencode, "LOAD_AFTER_VALUES", 2 * values + 1)
    got = [writer.encode_batch(recs, m) for _ in range(2)]
    assert spy == [values // 6] and fastencode._state == "unknown"  # only the first (ready)
    assert fastencode._numpy_values == 2 * values
    got.append(writer.encode_batch(recs, m))  # reaches it: loads, then compiled
    got.append(writer.encode_batch(recs, m))
    assert fastencode._state == "ready" and spy[-2:] == [values // 6] * 2  # after ready's check
    assert fastencode._numpy_values == 3 * values  # counted while not loaded, not after
    assert want is not None
    for g in got:
        assert g is not None
        for name, a in want.arrays.items():
            assert g.arrays[name].tobytes() == a.tobytes(), name


@pytest.mark.subprocess
def test_a_small_writer_imports_neither_numba_nor_torch(tmp_path) -> None:
    """A process that writes a few short sequences (less than LOAD_AFTER_VALUES top-k values)
    encodes, hashes its keys and merges its key-index runs with numpy: numba's import and first
    kernel (~0.35 CPU-s) and torch's import (~1.1 CPU-s) would cost more than the whole write."""
    probe = "\n".join(
        [
            "import sys, numpy as np",
            "from logitcache.cache_format import CacheWriter, Manifest, SequenceBatch",
            "m = Manifest(teacher_model='t', tokenizer_fingerprint='t', vocab_size=100, k=4,"
            " dataset='d')",
            "rng = np.random.default_rng(0)",
            "lp = np.ascontiguousarray(-np.sort(rng.random((1000, 4)), axis=1)).astype('f4')",
            "ids = np.tile(np.arange(4, dtype=np.int32), (1000, 1))",
            "with CacheWriter.open(sys.argv[1], m, fsync=False) as w:",
            "    for a in range(0, 4000, 1000):",
            "        keys = [f'doc-{i:06d}' for i in range(a, a + 1000)]",
            "        toks = np.ones(2000, np.int32)",
            "        w.append(SequenceBatch(toks, np.arange(0, 2001, 2), ids, lp, keys))",
            "print(sorted({'numba', 'torch'} & set(sys.modules)))",
        ]
    )
    assert _run_probe(probe, str(tmp_path / "c")).split() == ["[]"]
