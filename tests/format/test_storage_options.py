"""Storage options are one dialect (fsspec/s3fs names), normalised once at the edge
(``cache_format.store.normalize_storage_options``) and used as they are by every backend and by
the cache listing. Options given as text (``logitcache info URL -o name=value``) mean what they
say: ``-o anon=false`` keeps signed access (it used to turn anonymous access ON:
``bool("false")``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, FormatError
from logitcache.cache_format.cli import storage_options
from logitcache.cache_format.store import _obstore_options, normalize_storage_options
from logitcache.server.serving.caches import CacheRegistry


@pytest.mark.fast
def test_cli_option_values_are_typed() -> None:
    opts = storage_options(
        ["anon=false", "x=TRUE", 'client_kwargs={"region_name": "eu"}', "key=123"]
    )
    assert opts == {"anon": False, "x": True, "client_kwargs": {"region_name": "eu"}, "key": "123"}


@pytest.mark.fast
@pytest.mark.parametrize(
    ("value", "anonymous"),
    [("false", False), (False, False), ("0", False), ("true", True), (True, True)],
)
def test_anon_option_text_or_bool(value: object, anonymous: bool) -> None:
    config, _ = _obstore_options("s3", {"anon": value, "endpoint_url": "http://127.0.0.1:1"})
    assert config.get("skip_signature", False) is anonymous


@pytest.mark.fast
def test_anon_option_that_is_no_boolean_is_refused() -> None:
    with pytest.raises(FormatError, match="anon"):
        _obstore_options("s3", {"anon": "maybe"})


def test_info_with_anon_false_reads_an_s3_cache(s3_store: tuple[str, dict], tmp_path: Path) -> None:
    url, opts = s3_store
    with CacheWriter.open(url, make_manifest(), opts) as w:
        w.append(make_records(3))
    exe = Path(sys.executable).with_name("logitcache")
    argv = [str(exe), "info", url, "-o", "anon=false", "--json"]
    for name, value in opts.items():
        argv += ["-o", f"{name}={value}"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["manifest"]["num_sequences"] == 3


@pytest.mark.fast
def test_options_are_normalised_once_to_the_s3fs_dialect() -> None:
    old = {"endpoint": "http://h:1", "access_key_id": "a", "secret_access_key": "s", "anon": "no"}
    with pytest.warns(DeprecationWarning, match="use 'endpoint_url'"):
        got = normalize_storage_options("s3://b/c", {**old, "region": "eu-1"})
    assert got == {
        "endpoint_url": "http://h:1",
        "key": "a",
        "secret": "s",
        "anon": False,
        "client_kwargs": {"region_name": "eu-1"},
    }
    assert normalize_storage_options("s3://b/c", got) == got  # idempotent: the one form
    assert normalize_storage_options("gs://b/c", {"token": "x"}) == {"token": "x"}
    config, client = _obstore_options("s3", got)  # the one translation, one way
    assert config == {
        "endpoint": "http://h:1",
        "access_key_id": "a",
        "secret_access_key": "s",
        "region": "eu-1",
        "virtual_hosted_style_request": False,
    }
    assert client == {"allow_http": True}


def test_one_set_of_options_reads_and_lists_through_either_backend(
    s3_store: tuple[str, dict],
) -> None:
    url, opts = s3_store  # s3fs names plus the region shorthand
    root = url.rsplit("/", 1)[0] + "/caches"
    with CacheWriter.open(f"{root}/alpha", make_manifest(), opts) as w:
        w.append(make_records(3))
    registries = []
    for extra in ({}, {"backend": "fsspec"}):
        options = {**opts, **extra}
        assert CacheReader(f"{root}/alpha", storage_options=options).num_sequences == 3
        registries.append(CacheRegistry(root, storage_options=options))
        assert registries[-1].names() == ["alpha"]
    with CacheWriter.open(f"{root}/beta", make_manifest(), opts) as w:
        w.append(make_records(1))
    for registry in registries:  # a new cache is listed at once (no stale listing)
        assert registry.names() == ["alpha", "beta"]
    obstore_names = {
        "endpoint": opts["endpoint_url"],
        "access_key_id": opts["key"],
        "secret_access_key": opts["secret"],
        "region": opts["region"],
    }
    with pytest.warns(DeprecationWarning):
        assert CacheReader(f"{root}/alpha", storage_options=obstore_names).num_sequences == 3
