"""Inputs and store states that gave a 500, each now a typed 4xx that writes nothing; and a
property test (hypothesis) over header values and numeric request fields: never a 5xx.

In-process app on the fake engine (the fast tier): a 23-digit ``Range``, a ``.jsonl.gz`` that is
not gzip, a JSONL line over the limit (refused while read, memory bounded), a
``proposal_temperature`` at float edges, a plain zarr group named as a cache, a store on a
read-only file system (a real read-only bind mount), a record the writer refuses (no empty cache
left behind), and ``/v1/completions`` token ids as strict as ``/v1/score``'s.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asgi_support import LiveApp, Reply, asgi_request
from engine_support import FakeEngine, app_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.fast

JSON = {"content-type": "application/json"}


class App(LiveApp):
    """:class:`LiveApp` over ``root`` (fake engine by default) with JSON bodies."""

    def __init__(self, root: Path, engine: Any = None, **overrides: Any) -> None:
        self.root = root
        super().__init__(app_settings(root, **overrides), engine or FakeEngine())

    def send(
        self, method: str, target: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Reply:
        data = (
            body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        )
        hdrs = {**(JSON if body is not None else {}), **(headers or {})}
        return self.request(method, target, hdrs, data)

    def caches(self) -> list[str]:
        return sorted(p.name for p in (self.root / "caches").iterdir())

    def jobs(self) -> int:
        return int(self.app.state.services.jobs.store.count())


@pytest.fixture
def app(tmp_path: Path) -> Iterator[App]:
    a = App(tmp_path)
    yield a
    a.close()


def _code(reply: tuple[int, dict[str, str], bytes]) -> tuple[int, str]:
    status, _, body = reply
    return status, json.loads(body)["error"]["code"]


def test_range_with_a_huge_number_is_416(app: App) -> None:
    assert app.send("POST", "/v1/score", {"input_ids": [[1, 2, 3]], "cache": "c"})[0] == 200
    for value in ("bytes=99999999999999999999999-", "bytes=0-99999999999999999999999",
                  "bytes=-99999999999999999999999", f"bytes={2**63}-{2**64}"):  # fmt: skip
        got = app.send("GET", "/v1/caches/c/store/zarr.json", headers={"range": value})
        assert _code(got) == (416, "range_not_satisfiable"), (value, got)
        assert app.send("HEAD", "/v1/caches/c/store/zarr.json", headers={"range": value})[0] == 416
    size = len((app.root / "caches" / "c" / "zarr.json").read_bytes())
    got = app.send("GET", "/v1/caches/c/store/zarr.json", headers={"range": f"bytes={size + 5}-"})
    assert got[0] == 416


def test_a_gz_that_is_not_gzip_is_422_and_writes_nothing(app: App) -> None:
    (app.root / "data" / "plain.jsonl.gz").write_text(json.dumps({"text": "hi there"}) + "\n")
    got = app.send("POST", "/v1/jobs", {"cache": "gz", "file": {"path": "plain.jsonl.gz"}})
    assert got[0] == 422, got
    assert "plain.jsonl.gz" in json.loads(got[2])["error"]["message"]
    assert app.jobs() == 0 and "gz" not in app.caches()


def test_a_long_jsonl_line_is_refused_while_read(app: App, tmp_path: Path) -> None:
    """A 64 MB single-line record in a 64 KB gzip is refused after at most the line limit is
    read: the reader's memory peak stays far below the line (the whole line was read before)."""
    from logitcache.protocol import InputFile
    from logitcache.server.inputs import records as inputs

    big = app.root / "data" / "one-line.jsonl.gz"
    with gzip.open(big, "wb", compresslevel=1) as f:
        f.write(b'{"text": "' + b"a" * (64 << 20) + b'"}\n')
    got = app.send("POST", "/v1/jobs", {"cache": "long", "file": {"path": big.name}})
    assert got[0] in (413, 422), got
    assert "longer than the limit" in json.loads(got[2])["error"]["message"]
    assert app.jobs() == 0 and "long" not in app.caches()
    limits = app.app.state.services.scoring.limits
    limit = inputs.line_limit(limits)
    assert limit is not None and limit < (8 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(inputs.PayloadTooLargeError):
            spec = InputFile(path=big.name)
            list(inputs.raw_records(file=spec, records=None, data_dir=app.root / "data",
                                    max_line_bytes=limit))  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * limit, peak


@pytest.mark.parametrize("tau", [1e-320, 5e-324, 0.0, -1.0, 1e-4, 1e4, 1e308])
def test_proposal_temperature_outside_its_range_is_422(app: App, tau: float) -> None:
    body = {
        "input_ids": [[1, 2, 3, 4]],
        "targets": "sampled",
        "sampling": {"proposal_temperature": tau},
    }
    assert _code(app.send("POST", "/v1/score", body)) == (422, "invalid_request")
    got = app.send("POST", "/v1/score", {**body, "cache": "tau"})
    assert got[0] == 422 and "tau" not in app.caches()


@pytest.mark.parametrize("tau", [1e-3, 0.5, 1e3])
def test_proposal_temperature_at_its_edges_gives_finite_rows(app: App, tau: float) -> None:
    body = {"input_ids": [[1, 2, 3, 4]], "targets": "sampled",
            "sampling": {"proposal_temperature": tau, "draws": 8}}  # fmt: skip
    status, _, data = app.send("POST", "/v1/score", body)
    assert status == 200, data[:300]
    rows = json.loads(data)["sequences"][0]["topk_logprobs"]
    assert all(math.isfinite(x) for row in rows for x in row)


def test_a_plain_zarr_group_is_not_a_cache(app: App) -> None:
    import zarr

    folder = app.root / "caches" / "grp"
    zarr.open_group(str(folder), mode="w", zarr_format=3, attributes={"mine": 1})
    before = sorted(p.name for p in folder.rglob("*"))
    for body in ({"input_ids": [[1, 2, 3]], "cache": "grp"},
                 {"input_ids": [[1, 2, 3]], "cache": "grp", "targets": "sampled"}):  # fmt: skip
        assert _code(app.send("POST", "/v1/score", body)) == (409, "not_a_cache")
    assert _code(app.send("POST", "/v1/jobs", {"cache": "grp", "records": [{"text": "hi"}]})) == (
        409,
        "not_a_cache",
    )
    assert sorted(p.name for p in folder.rglob("*")) == before
    assert app.engine.calls == [] and app.jobs() == 0


def test_a_read_only_store_is_409_before_engine_work_and_still_serves_hits(app: App) -> None:
    seq = {"input_ids": [[1, 2, 3, 4]], "cache": "ro"}
    assert app.send("POST", "/v1/score", seq)[0] == 200  # made while writable
    app.app.state.services.caches.close()  # no writer kept open from before the mount
    calls = len(app.engine.calls)
    root = app.root / "caches"
    if subprocess.run(["mount", "--bind", str(root), str(root)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here (needs CAP_SYS_ADMIN)")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(root)], check=True)
        for body in ({"input_ids": [[1, 2, 9]], "cache": "ro"},
                     {"input_ids": [[1, 2, 9]], "cache": "new"}):  # fmt: skip
            assert _code(app.send("POST", "/v1/score", body)) == (409, "store_read_only")
        job = {"cache": "ro", "records": [{"input_ids": [1, 5, 6]}]}
        assert _code(app.send("POST", "/v1/jobs", job)) == (409, "store_read_only")
        assert len(app.engine.calls) == calls and app.jobs() == 0
        status, _, data = app.send("POST", "/v1/score", seq)  # a hit: read, nothing to write
        assert status == 200 and json.loads(data)["hits"] == 1, data[:300]
    finally:
        subprocess.run(["umount", "-l", str(root)], check=True)
    assert app.caches() == ["ro"]


def test_stored_metadata_is_served_without_server_paths(tmp_path: Path) -> None:
    """A teacher given as a folder is recorded with its absolute path in the manifest; the
    store route serves ``zarr.json`` with it cut to the folder's name (ranges included), and
    the format's reader opens the cache over HTTP from those bytes."""
    import dataclasses

    from logitcache.cache_format import CacheReader
    from server_support import ThreadedServer

    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, model_id="/srv/private/models/tiny-teacher")
    settings = app_settings(tmp_path)
    with ThreadedServer(settings, engine) as srv, srv.client() as c:
        assert (
            c.post("/v1/score", json={"input_ids": [[1, 2, 3, 4]], "cache": "m"}).status_code == 200
        )
        stored = (tmp_path / "caches" / "m" / "zarr.json").read_bytes()
        assert b"/srv/private/models" in stored  # what the server keeps for itself
        base = f"{srv.url}/v1/caches/m/store"
        served = c.get(f"{base}/zarr.json").content
        assert b"/srv/private" not in served and b'"tiny-teacher"' in served
        part = c.get(f"{base}/zarr.json", headers={"range": "bytes=5-24"})
        assert (part.status_code, part.content) == (206, served[5:25])
        assert c.head(f"{base}/zarr.json").headers["content-length"] == str(len(served))
        reader = CacheReader(base)
        assert reader.num_sequences == 1 and reader.manifest.teacher_model == "tiny-teacher"


class _BadRows(FakeEngine):
    """Sampled rows with a NaN weight: what the writer refuses (``invalid_record``)."""

    async def _generate_sampled(
        self, prompts: Any, keys: Any, targets: Any, temperature: float
    ) -> list[Any]:
        out = await super()._generate_sampled(prompts, keys, targets, temperature)
        for s in out:
            s.topk_logprobs[0, 0] = np.nan
        return out


def test_a_rejected_record_leaves_no_cache(tmp_path: Path) -> None:
    a = App(tmp_path, engine=_BadRows())
    try:
        body = {"input_ids": [[1, 2, 3, 4]], "cache": "pinned", "targets": "sampled"}
        status, _, data = a.send("POST", "/v1/score", body)
        assert 400 <= status < 500, data[:300]
        assert a.caches() == []
    finally:
        a.close()


@pytest.mark.parametrize("prompt", [[1, 2.0, 3], [1, "2", 3], [1, True, 3], [[1, 2.0, 3]],
                                    [1, -2, 3], [1, 2**40, 3]])  # fmt: skip
def test_completions_token_ids_are_strict(app: App, prompt: list) -> None:
    body = {"prompt": prompt, "prompt_logprobs": 2, "max_tokens": 1}
    assert _code(app.send("POST", "/v1/completions", body)) == (422, "invalid_request")
    for field, value in (("prompt_logprobs", 2.0), ("prompt_logprobs", True), ("n", 1.0)):
        bad = {"prompt": [1, 2, 3], "prompt_logprobs": 2, "max_tokens": 1, field: value}
        assert _code(app.send("POST", "/v1/completions", bad)) == (422, "invalid_request")
    ok = {"prompt": [1, 2, 3], "prompt_logprobs": 2, "max_tokens": 1}
    assert app.send("POST", "/v1/completions", ok)[0] == 200


# ------------------------------------------------------------------------------ property


#: Numbers at the edges: subnormals, signed zeros, inf, nan, huge ints, bools, numeric strings.
EDGE_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([5e-324, 1e-320, -0.0, 1e308, 2**63, 2**64, 10**30, -(2**63) - 1]),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.booleans(),
    st.from_regex(r"-?[0-9]{1,30}(\.[0-9]{0,5})?", fullmatch=True),
)
#: Where a number goes in a request: (method, target, body with ``X`` for the number).
NUMERIC_FIELDS = [
    ("POST", "/v1/score", {"input_ids": [[1, 2, 3]], "k": "X"}),
    ("POST", "/v1/score", {"input_ids": [[1, 2, "X"]]}),
    ("POST", "/v1/score", {"input_ids": [[1, 2, 3]], "targets": "sampled",
                           "sampling": {"proposal_temperature": "X"}}),
    ("POST", "/v1/score", {"input_ids": [[1, 2, 3]], "targets": "sampled",
                           "sampling": {"draws": "X"}}),
    ("POST", "/v1/score", {"input_ids": [[1, 2, 3]], "targets": "sampled",
                           "sampling": {"seed": "X", "head": 2, "draws": 2}}),
    ("POST", "/v1/score", {"input_ids": [[1, 2, 3]], "targets": "sampled",
                           "sampling": {"head": "X"}}),
    ("POST", "/v1/jobs", {"cache": "j", "records": [{"input_ids": [1, 2, 3]}],
                          "split_overlap": "X", "on_long": "split"}),
    ("POST", "/v1/jobs", {"cache": "j", "records": [{"id": "X", "input_ids": [1, 2, 3]}]}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "prompt_logprobs": "X", "max_tokens": 1}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "prompt_logprobs": 2, "max_tokens": "X"}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "prompt_logprobs": 2, "n": "X"}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "prompt_logprobs": 2, "temperature": "X"}),
    ("GET", "/v1/caches/c/sequences?start=X", None),
    ("GET", "/v1/caches/c/rows?start=0&stop=X", None),
    ("GET", "/v1/caches/c/lengths?start=X&stop=X", None),
    ("GET", "/v1/jobs?limit=X&offset=X", None),
    ("GET", "/?refresh=X&jobs_offset=X", None),
]  # fmt: skip


def _put(template: Any, value: Any) -> Any:
    if template == "X":
        return value
    if isinstance(template, dict):
        return {k: _put(v, value) for k, v in template.items()}
    if isinstance(template, list):
        return [_put(v, value) for v in template]
    return template


@pytest.fixture(scope="module")
def prop_app(tmp_path_factory) -> Iterator[App]:
    a = App(tmp_path_factory.mktemp("edges-prop"))
    assert (
        a.send("POST", "/v1/score", {"input_ids": [[1, 2, 3, 4], [1, 5]], "cache": "c"})[0] == 200
    )
    yield a
    a.close()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(where=st.sampled_from(NUMERIC_FIELDS), value=EDGE_NUMBERS)
def test_numeric_fields_at_their_edges_never_give_a_5xx(prop_app: App, where, value) -> None:
    method, target, template = where
    if template is None:
        text = str(value).lower() if not isinstance(value, float) else repr(value)
        status, _, data = prop_app.send(method, target.replace("X", text))
    else:
        body = json.dumps(_put(template, value)).encode()  # NaN/Infinity as Python writes them
        status, _, data = prop_app.send(method, target, body)
    assert status < 500, (where, value, data[:300])


HEADER_VALUES = st.one_of(
    st.from_regex(r"bytes=[0-9]{0,30}-[0-9]{0,30}", fullmatch=True),
    st.from_regex(r"bytes=-?[0-9]{0,25}(,[0-9]{0,5}-[0-9]{0,5}){0,3}", fullmatch=True),
    st.from_regex(r"-?[0-9]{1,30}", fullmatch=True),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    header=st.sampled_from(["range", "content-length"]),
    value=HEADER_VALUES,
    method=st.sampled_from(["GET", "HEAD", "POST"]),
)
def test_range_and_content_length_values_never_give_a_5xx(
    prop_app: App, header: str, value: str, method: str
) -> None:
    target = "/v1/caches/c/store/zarr.json" if method != "POST" else "/v1/score"
    body = json.dumps({"input_ids": [[1, 2, 3]]}).encode() if method == "POST" else b""
    hdrs = {**JSON, header: value}
    status, _, data = prop_app.loop.run_until_complete(_raw(prop_app, method, target, hdrs, body))
    assert status < 500, (header, value, data[:300])


async def _raw(a: App, method: str, target: str, headers: dict[str, str], body: bytes) -> Any:
    """``asgi_request`` with the ``content-length`` header as given (not the body's)."""
    given_length = headers.pop("content-length", None)
    if given_length is None:
        return await asgi_request(a.app, method, target, headers, body)
    app = a.app

    async def with_length(scope: Any, receive: Any, send: Any) -> None:
        hdrs = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        hdrs.append((b"content-length", given_length.encode("latin-1")))
        await app({**scope, "headers": hdrs}, receive, send)

    return await asgi_request(with_length, method, target, headers, body)
