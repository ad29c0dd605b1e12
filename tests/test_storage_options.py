"""Storage options given as text (``logitcache info URL -o name=value``) mean what they say:
``-o anon=false`` keeps signed access (it used to turn anonymous access ON: ``bool("false")``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import format_support
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheWriter, FormatError
from logitcache.cache_format.cli import _options
from logitcache.cache_format.store import _obstore_options

s3_endpoint = format_support.s3_endpoint
s3_store = format_support.s3_store


@pytest.mark.fast
def test_cli_option_values_are_typed() -> None:
    opts = _options(["anon=false", "x=TRUE", 'client_kwargs={"region_name": "eu"}', "key=123"])
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
