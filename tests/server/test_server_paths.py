"""Hostile keys and paths, as a class, against every route and input that takes one.

One table of store keys (``GET``/``HEAD /v1/caches/{name}/store/{key}``, plain, with ``Range``,
with the API key and with the read-only login cookie) and one table of job input paths
(``POST /v1/jobs`` ``file.path``, including dataset folders whose ``state.json`` or whose
``*.parquet``/``*.arrow`` members point elsewhere) are each run twice: against the in-process
ASGI app (requests built as uvicorn builds them, raw path and all) and against the real app
under real uvicorn (raw request lines over a socket: no client normalises the path). Every
hostile entry answers 404 or 422 in the JSON error shape, nothing outside the root is ever sent
back (the files outside hold a marker the bodies are searched for), and nothing is written
(no cache folder, no job row). Links that stay inside their root keep working.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from asgi_support import LiveApp, Reply
from engine_support import FakeEngine, app_settings
from server_support import ThreadedServer

pytestmark = pytest.mark.fast

KEY = "paths-key"
SECRET = "SECRET-OUTSIDE-THE-ROOT"
AUTH = {"authorization": f"Bearer {KEY}"}

#: (label, path after ``/v1/caches/``) of store requests that must never answer a file.
HOSTILE_STORE = [
    ("absolute key (//)", "good/store//proc/self/environ"),
    ("absolute key, encoded slashes", "good/store/%2F%2Fproc%2Fself%2Fenviron"),
    ("absolute key, one encoded slash", "good/store/%2Fproc/self/environ"),
    ("absolute key to a file outside", "good/store/{outside}/secret.txt"),
    ("dot segments", "good/store/../../../../../../proc/self/environ"),
    ("encoded dot segments", "good/store/%2E%2E/%2E%2E/%2E%2E/%2E%2E/proc/self/environ"),
    ("dot segments, encoded slashes", "good/store/..%2F..%2F..%2F..%2F..%2Fproc%2Fself%2Fenviron"),
    ("dot segments to the store root", "good/store/../other/zarr.json"),
    ("empty segment", "good/store/topk_ids//zarr.json"),
    ("trailing slash", "good/store/zarr.json/"),
    ("single dot segment", "good/store/./zarr.json"),
    ("NUL", "good/store/zarr.json%00"),
    ("NUL inside a segment", "good/store/zarr%00.json"),
    ("backslashes", "good/store/..%5C..%5C..%5Cproc%5Cself%5Cenviron"),
    ("long segment", "good/store/" + "a" * 300),
    ("many segments", "good/store/" + "/".join(["a"] * 40)),
    ("writer lock", "good/store/.logitcache.lock"),
    ("link out of the cache", "good/store/escape"),
    ("link to a folder outside", "good/store/escdir/secret.txt"),
    ("cache folder linked outside", "linked/store/secret.txt"),
    ("cache folder linked outside, its zarr.json", "linked/store/zarr.json"),
    ("cache name absolute", "%2F{outside}/store/secret.txt"),
    ("cache name dot dot", "../store/zarr.json"),
    ("cache name encoded dot dot", "..%2F..%2F{outside_name}/store/secret.txt"),
    ("cache name single dot", "./store/good/zarr.json"),
    ("cache name NUL", "good%00/store/zarr.json"),
]

#: Store requests that must keep working: (label, path after ``/v1/caches/``, file under root).
ALLOWED_STORE = [
    ("root object", "good/store/zarr.json", "good/zarr.json"),
    ("link inside the cache", "good/store/inlink", "good/zarr.json"),
]

#: (label, ``file.path``) of job inputs that must be refused with nothing read or written.
HOSTILE_INPUTS = [
    ("absolute", "/proc/self/environ"),
    ("absolute file outside", "{outside}/secret.jsonl"),
    ("dot dot", "../outside/secret.jsonl"),
    ("dot dot inside", "sub/../good.jsonl"),
    ("the data directory itself", "."),
    ("single dot segment", "./good.jsonl"),
    ("empty segment", "sub//good.jsonl"),
    ("trailing slash", "good.jsonl/"),
    ("backslash", "..\\outside\\secret.jsonl"),
    ("control character", "good\x01.jsonl"),
    ("long segment", "a" * 300 + ".jsonl"),
    ("link out", "link_out.jsonl"),
    ("folder linked out", "dir_out"),
    ("state.json naming an absolute file", "ds_state_abs"),
    ("state.json naming ../", "ds_state_up"),
    ("state.json naming a link out", "ds_state_member_link"),
    ("state.json linked out", "ds_state_link"),
    ("state.json naming the folder", "ds_state_dot"),
    ("parquet member linked out", "ds_parquet_link"),
    ("arrow member linked out", "ds_arrow_link"),
]

#: Job inputs that must keep working (links that stay inside the data directory).
ALLOWED_INPUTS = [
    ("plain file", "good.jsonl"),
    ("link inside", "inlink.jsonl"),
    ("parquet member linked inside", "ds_parquet_inlink"),
]


# ------------------------------------------------------------------------------ the world


def _arrow_stream(path: Path, texts: list[str]) -> None:
    table = pa.table({"text": texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)


def _state(folder: Path, *names: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names]})
    )


def build_world(tmp: Path) -> dict[str, str]:
    """A root (caches, data, state) and, beside it, files that must never be served."""
    out = tmp / "outside"
    out.mkdir()
    (out / "secret.txt").write_text(SECRET)
    (out / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                               "attributes": {"x": SECRET}}))  # fmt: skip
    (out / "secret.jsonl").write_text(json.dumps({"text": SECRET}) + "\n")
    pq.write_table(pa.table({"text": [SECRET]}), out / "secret.parquet")
    _arrow_stream(out / "secret.arrow", [SECRET])
    _state(out / "state_dir", "data.arrow")
    root = tmp / "root"
    data = root / "data"
    data.mkdir(parents=True)
    (data / "good.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (data / "sub").mkdir()
    (data / "inlink.jsonl").symlink_to(data / "good.jsonl")
    (data / "link_out.jsonl").symlink_to(out / "secret.jsonl")
    (data / "dir_out").symlink_to(out)
    (data / "pq").mkdir()
    pq.write_table(pa.table({"text": ["inside"]}), data / "pq" / "good.parquet")
    _state(data / "ds_state_abs", str(out / "secret.arrow"))
    _state(data / "ds_state_up", "../../../outside/secret.arrow")
    _state(data / "ds_state_member_link", "data.arrow")
    (data / "ds_state_member_link" / "data.arrow").symlink_to(out / "secret.arrow")
    (data / "ds_state_link").mkdir()
    _arrow_stream(data / "ds_state_link" / "data.arrow", ["inside"])
    (data / "ds_state_link" / "state.json").symlink_to(out / "state_dir" / "state.json")
    _state(data / "ds_state_dot", ".")
    (data / "ds_parquet_link").mkdir()
    pq.write_table(pa.table({"text": ["inside"]}), data / "ds_parquet_link" / "a.parquet")
    (data / "ds_parquet_link" / "b.parquet").symlink_to(out / "secret.parquet")
    (data / "ds_arrow_link").mkdir()
    (data / "ds_arrow_link" / "a.arrow").symlink_to(out / "secret.arrow")
    (data / "ds_parquet_inlink").mkdir()
    (data / "ds_parquet_inlink" / "a.parquet").symlink_to(data / "pq" / "good.parquet")
    return {"outside": str(out).lstrip("/"), "outside_name": out.name}


def decorate_caches(root: Path) -> None:
    """Links inside the store of the cache ``good`` (made by a first request) and a cache
    folder that is a link out of the store root."""
    good = root / "caches" / "good"
    out = root.parent / "outside"
    (good / "escape").symlink_to(out / "secret.txt")
    (good / "escdir").symlink_to(out)
    (good / "inlink").symlink_to(good / "zarr.json")
    (root / "caches" / "linked").symlink_to(out)


# ------------------------------------------------------------------------------ transports

Send = Callable[[str, str, dict[str, str], bytes], Reply]


def _socket(port: int) -> Send:
    def send(method: str, target: str, headers: dict[str, str], body: bytes) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.putrequest(method, target, skip_accept_encoding=True)  # sent as written
            for k, v in {**headers, "content-length": str(len(body))}.items():
                conn.putheader(k, v)
            conn.endheaders(body or None)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    return send


class World:
    """The app over one root, reachable by ``send`` (in-process ASGI or real uvicorn)."""

    def __init__(self, tmp: Path, names: dict[str, str], send: Send, app: Any) -> None:
        self.tmp, self.names, self.send, self.app = tmp, names, send, app
        self.root = tmp / "root"

    def target(self, template: str) -> str:
        return template.format(**self.names)

    def cookie(self) -> str:
        status, headers, _ = self.send(
            "POST", "/login", {"content-type": "application/x-www-form-urlencoded"},
            f"key={KEY}".encode(),
        )  # fmt: skip
        assert status == 303, status
        return headers["set-cookie"].split(";")[0]

    def jobs(self) -> int:
        return int(self.app.state.services.jobs.store.count())


def _setup(tmp: Path) -> tuple[Any, dict[str, str]]:
    names = build_world(tmp)
    return app_settings(tmp / "root", api_key=KEY), names


def _first_cache(send: Send, root: Path) -> None:
    body = json.dumps({"input_ids": [[1, 5, 9, 20]], "k": 3, "cache": "good"}).encode()
    status, _, text = send("POST", "/v1/score", {**AUTH, "content-type": "application/json"}, body)
    assert status == 200, text[:300]
    decorate_caches(root)


@pytest.fixture(scope="module", params=["asgi", "uvicorn"])
def world(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"paths-{request.param}")
    settings, names = _setup(tmp)
    if request.param == "uvicorn":
        with ThreadedServer(settings, FakeEngine(), api_key=KEY) as srv:
            w = World(tmp, names, _socket(srv.port), srv.app)
            _first_cache(w.send, w.root)
            yield w
        return
    live = LiveApp(settings, FakeEngine())
    try:
        w = World(tmp, names, live.request, live.app)
        _first_cache(w.send, w.root)
        yield w
    finally:
        live.close()


# ------------------------------------------------------------------------------ the tables


def _assert_refused(status: int, headers: dict[str, str], body: bytes, method: str) -> None:
    assert status in (404, 422), (status, body[:300])
    assert SECRET.encode() not in body
    if method == "GET":
        err = json.loads(body)["error"]
        assert err["code"] in ("not_found", "invalid_path", "invalid_cache_name"), err
    assert "content-range" not in headers


#: (credential, method, Range) of each hostile store request.
VARIANTS = [("key", "GET", None), ("key", "HEAD", None), ("key", "GET", "bytes=0-99"),
            ("cookie", "GET", None), ("cookie", "HEAD", "bytes=-5")]  # fmt: skip


@pytest.mark.parametrize("label,template", HOSTILE_STORE, ids=[x[0] for x in HOSTILE_STORE])
def test_hostile_store_keys_never_leave_the_cache(world, label, template) -> None:
    cookie = world.cookie()
    for credential, method, range_ in VARIANTS:
        headers = dict(AUTH) if credential == "key" else {"cookie": cookie}
        if range_:
            headers["range"] = range_
        target = "/v1/caches/" + world.target(template)
        status, got, body = world.send(method, target, headers, b"")
        _assert_refused(status, got, body, method)


@pytest.mark.parametrize("label,template,under", ALLOWED_STORE, ids=[x[0] for x in ALLOWED_STORE])
def test_store_keys_inside_the_cache_are_served(world, label, template, under) -> None:
    want = (world.root / "caches" / under).read_bytes()
    status, _, body = world.send("GET", "/v1/caches/" + world.target(template), AUTH, b"")
    assert (status, body) == (200, want)
    status, headers, body = world.send(
        "GET", "/v1/caches/" + world.target(template), {**AUTH, "range": "bytes=0-9"}, b""
    )
    assert (status, body, headers["content-range"]) == (206, want[:10], "bytes 0-9/*")


def _submit(world: World, path: str) -> Reply:
    body = json.dumps({"cache": "from-input", "file": {"path": path}}).encode()
    return world.send("POST", "/v1/jobs", {**AUTH, "content-type": "application/json"}, body)


@pytest.mark.parametrize("label,template", HOSTILE_INPUTS, ids=[x[0] for x in HOSTILE_INPUTS])
def test_hostile_input_paths_are_refused_and_write_nothing(world, label, template) -> None:
    before = world.jobs()
    status, _, body = _submit(world, world.target(template))
    assert status == 422, body[:400]
    err = json.loads(body)["error"]
    assert err["code"] in ("invalid_path", "invalid_request"), err
    assert SECRET not in err["message"] and str(world.tmp) not in err["message"]
    assert world.jobs() == before
    assert not (world.root / "caches" / "from-input").exists()


@pytest.mark.parametrize("label,path", ALLOWED_INPUTS, ids=[x[0] for x in ALLOWED_INPUTS])
def test_input_links_inside_the_data_directory_are_read(world, label, path) -> None:
    status, _, body = _submit(world, path)
    assert status == 201, body[:400]


def test_the_table_covers_every_keyed_route() -> None:
    """Every route whose path takes a key or path parameter is one the tables above exercise
    (a new one must be added to them): the cache-name routes share the name check, the store
    route the key check."""
    from logitcache.server.app import create_app
    from logitcache.server.settings import ServerSettings

    app = create_app(ServerSettings(model="fake", store_root=os.devnull + "-unused"))
    templated = sorted(
        {getattr(r, "path", "") for r in app.routes if "{" in getattr(r, "path", "")}
    )
    covered = {"/v1/caches/{name}/store/{key:path}", "/ui/static/{name}", "/v1/jobs/{job_id}",
               "/v1/jobs/{job_id}/cancel"}  # fmt: skip
    for path in templated:
        assert path in covered or path.startswith("/v1/caches/{name}"), path
