"""job_cpu_bench --direct-io (issue #19): the O_DIRECT prototype of the store's object write
leaves the same object bytes, fsynced and renamed over the key, its directory marked for the
barrier; small objects and exclusive writes take the store's own path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from logitcache.cache_format.store import DurableLocalStore
from test_job_cpu_breakdown import _bench
from zarr.core.buffer import default_buffer_prototype


def test_direct_io_writes_the_same_object(tmp_path: Path) -> None:
    bench = _bench()
    seen: list[int] = []
    original = DurableLocalStore._put_durable

    def counted(self: DurableLocalStore, path: Path, value: object, exclusive: bool) -> None:
        seen.append(len(value.as_buffer_like()))  # type: ignore[attr-defined]
        original(self, path, value, exclusive)

    put = bench.direct_io_put(counted)
    store = DurableLocalStore(tmp_path)
    (tmp_path / "a").mkdir()
    proto = default_buffer_prototype().buffer
    big = np.random.default_rng(0).integers(0, 255, 200_003, dtype=np.uint8)
    for name, data in (("big", big), ("small", big[:100])):
        put(store, tmp_path / "a" / name, proto.from_array_like(data), False)
        assert (tmp_path / "a" / name).read_bytes() == data.tobytes()
    assert seen == [100]  # only the small one went the store's way
    assert store._dirty == {tmp_path / "a"}
    assert not list((tmp_path / "a").glob("*.partial"))
    put(store, tmp_path / "a" / "x", proto.from_array_like(big), True)
    assert seen == [100, big.size]
