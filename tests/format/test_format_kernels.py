"""The logprob-decoding kernels (cache_format/kernels.py): the torch backend gives the same bits as
numpy's reference (cumulative sum modulo 2**bits, exact float16 widening), and a whole store reads
back identically under both backends."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from logitcache.cache_format import _kernels as kernels


@pytest.fixture
def use_backend(monkeypatch):
    def select(name: str) -> None:
        monkeypatch.setattr(kernels, "TORCH", name == "torch")
        kernels.torch_module.cache_clear()
        assert kernels.backend() == name

    yield select
    kernels.torch_module.cache_clear()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_undelta_backends_agree_with_wraparound(use_backend, dtype):
    rng = np.random.default_rng(0)
    d = rng.integers(0, np.iinfo(dtype).max, size=(300, 100), dtype=np.uint64).astype(dtype)
    want = np.cumsum(d.astype(np.uint64), axis=1) % (np.iinfo(dtype).max + 1)  # exact wrap
    got = {}
    for name in ("numpy", "torch"):
        use_backend(name)
        got[name] = kernels.row_undelta(d)
        inplace = d.copy()
        assert kernels.row_undelta(inplace, out=inplace) is inplace
        np.testing.assert_array_equal(inplace, got[name])
    np.testing.assert_array_equal(got["numpy"], want.astype(dtype))
    np.testing.assert_array_equal(got["torch"], want.astype(dtype))


def test_half_to_float_backends_agree_on_every_pattern(use_backend):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    out = {}
    for name in ("numpy", "torch"):
        use_backend(name)
        out[name] = kernels.half_to_float(h).view(np.uint32)
    nan = np.isnan(h)
    np.testing.assert_array_equal(out["numpy"][~nan], out["torch"][~nan])
    np.testing.assert_array_equal(out["numpy"][~nan], h[~nan].astype(np.float32).view(np.uint32))
    # NaN (never stored: writers reject it) stays NaN; torch may quiet a signalling payload
    assert np.isnan(out["torch"][nan].view(np.float32)).all()


def test_kernel_arguments_checked():
    with pytest.raises(ValueError, match="uint8/16/32"):
        kernels.row_undelta(np.zeros((2, 3), np.int16))
    with pytest.raises(ValueError, match="float16"):
        kernels.half_to_float(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="out must"):
        kernels.row_undelta(np.zeros((2, 3), np.uint16), out=np.zeros((3, 2), np.uint16))


@pytest.mark.subprocess
def test_store_reads_identically_under_both_backends(tmp_path):
    """End to end in fresh processes (the backend is chosen once per process: the numpy one
    forced through the module's ``TORCH`` flag before the first read)."""
    from format_support import make_manifest, make_records
    from logitcache.cache_format import CacheWriter

    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(k=7)) as w:
        w.append(make_records(20, k=7, seed=5))
    code = (
        "import sys, hashlib, numpy as np\n"
        "from logitcache.cache_format import CacheReader, _kernels as kernels\n"
        "kernels.TORCH = sys.argv[2] == 'torch'\n"
        "r = CacheReader(sys.argv[1]); b = r.rows(0, r.num_rows)\n"
        "h = r.rows(0, r.num_rows, logprob_dtype='float16').topk_logprobs\n"
        "print(kernels.backend(), hashlib.sha256(b.topk_logprobs.tobytes() + h.tobytes())"
        ".hexdigest())\n"
    )
    seen = {}
    for name in ("numpy", "torch"):
        out = subprocess.run(
            [sys.executable, "-c", code, str(url), name], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        backend, digest = out.stdout.split()
        assert backend == name
        seen[name] = digest
    assert seen["numpy"] == seen["torch"]
