"""Stock zarr-python newer than the pinned 3.1.x (zarr >= 3.2 needs Python >= 3.12, the project
runs on 3.11) lists a closed store with no warning and reads every array to the values the pinned
zarr reads. Runs when ``LOGITCACHE_ZARR_NEWEST_PYTHON`` names a Python >= 3.12 interpreter with
that zarr installed, e.g. ``python3.12 -m venv /tmp/z && /tmp/z/bin/pip install zarr==3.4.2``
then ``LOGITCACHE_ZARR_NEWEST_PYTHON=/tmp/z/bin/python``; skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import zarr
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheWriter, Layout

PYTHON = os.environ.get("LOGITCACHE_ZARR_NEWEST_PYTHON", "")
TINY = Layout(row_chunk=4, row_shard=16, token_chunk=8, token_shard=32, seq_chunk=2, seq_shard=8)

SCRIPT = r"""
import json, sys, warnings
import numpy as np, zarr
warnings.simplefilter("error")
g = zarr.open_group(sys.argv[1], mode="r")
names = sorted(n for n, _ in g.members())
out = {"version": zarr.__version__, "names": names}
for n in names:
    a = g[n]
    v = a[:]
    out[n] = [str(x) for x in v] if a.dtype.kind in "OTU" else np.asarray(v).tolist()
print(json.dumps(out))
"""


@pytest.mark.skipif(not PYTHON, reason="LOGITCACHE_ZARR_NEWEST_PYTHON not set")
def test_newest_zarr_lists_and_reads_a_closed_store(tmp_path):
    url = tmp_path / "c"
    with CacheWriter.open(
        url, make_manifest(logprob_dtype="uint8", id_remap=True), layout=TINY
    ) as w:
        w.append(make_records(4, seed=1))
        w.append(make_records(3, seed=2, prefix="t"))
    res = subprocess.run([PYTHON, "-c", SCRIPT, str(url)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout)
    assert tuple(int(x) for x in got["version"].split(".")[:2]) > (3, 1), got["version"]
    g = zarr.open_group(url, mode="r")
    assert got["names"] == sorted(n for n, _ in g.members())
    for n in got["names"]:
        want = g[n][:]
        if want.dtype.kind in "OTU":
            assert got[n] == [str(x) for x in want], n
        else:
            assert np.array_equal(np.asarray(got[n], dtype=want.dtype), want), n
