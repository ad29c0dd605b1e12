"""CacheRegistry on object storage: listing caches with the library's own storage options.

Regression: a top-level ``region`` (accepted by CacheWriter/CacheReader) used to reach s3fs
unchanged in ``names()``, which then failed, so ``GET /v1/caches`` answered 500 on S3.
"""

from __future__ import annotations

from format_support import make_manifest, make_records
from logitcache.cache_format import CacheWriter
from logitcache.server.serving.caches import CacheRegistry


def test_names_lists_s3_caches_with_top_level_region(s3_store) -> None:
    url, options = s3_store
    assert "region" in options
    root = url.rsplit("/", 1)[0] + "/caches"
    for name in ("beta", "alpha"):
        with CacheWriter.open(f"{root}/{name}", make_manifest(), storage_options=options) as w:
            w.append(make_records(2, seed=1))
    registry = CacheRegistry(root, storage_options=options)
    assert registry.names() == ["alpha", "beta"]
