"""The browser side and the terminal side of the real service (one uvicorn subprocess with an API
key on the tiny teacher, shared by this module): status page, login cookie, ``/docs`` with local
assets and a Bearer scheme, the start-up banner, ``logitcache jobs``, and a real headless
chromium driven by playwright (skipped, with the reason, where either is missing).
"""

from __future__ import annotations

import io
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_support import ServerProcess, wait_job

KEY = "ui-test-key"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("ui")
    # the transformers backend: a real engine of the service that starts in seconds (the
    # README test runs the vLLM one); nothing here depends on which engine scores
    srv = ServerProcess(
        work,
        api_key=KEY,
        model=str(tiny.teacher_dir),
        k=8,
        max_seq_len=256,
        backend="hf",
        job_write_fill_s=0,  # commit per batch group, so the cancel lands mid-job
    )
    srv.start()
    seqs = tiny.token_sequences("heldout", max_len=64, min_len=8, limit=6)
    with srv.client() as c:
        job = (
            c.post(
                "/v1/jobs",
                json={
                    "cache": "ui-k8",
                    "records": [{"id": f"s{i}", "input_ids": s} for i, s in enumerate(seqs)],
                },
            )
            .raise_for_status()
            .json()
        )
        wait_job(c, job["id"], timeout=240)
    yield srv
    srv.stop()


def _login(c: httpx.Client) -> None:
    r = c.post("/login", data={"key": KEY}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    assert "HttpOnly" in r.headers["set-cookie"] and "SameSite=strict" in r.headers["set-cookie"]


def test_status_page_behind_login(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.get("/")
        assert r.status_code == 200 and 'name="key"' in r.text and "Engine" not in r.text
        css = c.get("/ui/static/status.css")  # the pages' stylesheet is public
        assert css.status_code == 200 and "text/css" in css.headers["content-type"]
        assert c.get("/v1/jobs").status_code == 401
        bad = c.post("/login", data={"key": "wrong"}, follow_redirects=False)
        assert bad.status_code == 401 and "Wrong API key" in bad.text
        _login(c)
        page = c.get("/").text
        model = Path(str(server.settings["model"]))
        assert "ready" in page and model.name in page
        assert str(model.parent) not in page  # no server path on the page (issue #18)
        job_row = re.search(r'<tr class="job".*?</tr>', page, re.S)
        assert job_row and "succeeded" in job_row.group(0) and "100.0%" in job_row.group(0)
        cache_row = re.search(r'<tr class="cache" data-cache="ui-k8">.*?</tr>', page, re.S)
        assert cache_row, page
        cells = re.findall(r"<td[^>]*>(.*?)</td>", cache_row.group(0), re.S)
        assert cells[1] == "8" and cells[2] == "6"  # k, sequences
        cov = float(re.match(r"(?:<span[^>]*>)?([0-9.]+)", cells[6]).group(1))
        assert 0.0 < cov < 1.0
        # the cookie reads the JSON API, but never writes
        assert c.get("/v1/jobs").status_code == 200
        w = c.post("/v1/jobs", json={"cache": "x", "records": [{"input_ids": [1, 2]}]})
        assert w.status_code == 401
        c.post("/logout", follow_redirects=False)
        c.cookies.clear()
        assert 'name="key"' in c.get("/").text
    # a bearer header works for the page too (curl users)
    r = httpx.get(f"{server.url}/", headers=server.headers(), timeout=60)
    assert "Jobs" in r.text and 'name="key"' not in r.text


def test_status_page_coverage_matches_cache(server: ServerProcess) -> None:
    """The page's coverage is 1 - mean tail mass of the cache (every row: it is small)."""
    from logitcache.cache_format import CacheReader

    reader = CacheReader(str(Path(server.settings["store_root"]) / "ui-k8"))
    rows = reader.rows(0, reader.num_rows)
    want = 1.0 - float(rows.tail_mass.mean())
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as c:
        page = c.get("/").text
        jobs = c.get("/v1/jobs").json()["jobs"]
    job = next(j for j in jobs if j["cache"] == "ui-k8")
    assert job["coverage"] == pytest.approx(want, abs=1e-3)  # live figure of the job's rows
    job_row = re.search(rf'<tr class="job" data-job="{job["id"]}">.*?</tr>', page, re.S).group(0)
    assert f"{job['coverage']:.3f}" in job_row
    cache_row = re.search(r'<tr class="cache" data-cache="ui-k8">.*?</tr>', page, re.S).group(0)
    got = float(re.search(r'class="cov">(?:<span[^>]*>)?([0-9.]+)', cache_row).group(1))
    assert got == pytest.approx(want, abs=1e-3)
    assert f"({reader.num_rows:,} rows)" in cache_row
    if want < 0.9:
        assert "(low)" in cache_row


def test_docs_local_assets_and_bearer_scheme(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:  # no key: docs are public
        docs = c.get("/docs")
        assert docs.status_code == 200
        srcs = re.findall(r'(?:src|href)="([^"]+)"', docs.text)
        assert srcs and all(s.startswith("/ui/static/") for s in srcs), srcs
        for s in srcs:
            r = c.get(s)
            assert r.status_code == 200 and len(r.content) > 1000
        assert c.get("/ui/static/index.html").status_code == 404  # only the listed assets
        schema = c.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's API key (--api-key / LOGITCACHE_API_KEY)",
    }
    assert schema["security"] == [{"bearerAuth": []}]
    assert schema["paths"]["/health"]["get"]["security"] == []
    assert "/" not in schema["paths"] and "/login" not in schema["paths"]


def test_startup_banner(server: ServerProcess) -> None:
    log = server.log()
    assert "logitcache teacher service ready" in log
    assert f"URL             {server.url}" in log
    assert f"{server.url}/docs" in log
    store = str(Path(server.settings["store_root"]))
    assert re.search(rf"store root\s+{re.escape(store)}", log)
    assert re.search(r"data dir\s+\S+/data", log)
    assert re.search(r"k\s+8 \(requests may ask up to \d+\)", log)
    m = re.search(r"max seq length\s+(\d+) tokens", log)
    assert m and int(m.group(1)) <= 256
    assert "API key         required" in log


def test_jobs_cli_list_watch_cancel(server: ServerProcess, tiny) -> None:
    from logitcache.client.cli import main

    base = ["jobs", "--url", server.url, "--api-key", KEY]
    out = io.StringIO()
    assert main([*base, "list"], out=out) == 0
    assert re.search(r"succeeded\s+ui-k8\s+6/6 seqs\s+100.0%", out.getvalue()), out.getvalue()
    out = io.StringIO()
    assert main([*base, "watch"], out=out) == 0  # newest job, already done
    assert re.search(r"succeeded\s+ui-k8\s+6/6 seqs\s+100.0%", out.getvalue()), out.getvalue()
    # a job far too large to finish within the test's next two requests, cancelled
    base_seqs = tiny.token_sequences("heldout", max_len=200, min_len=100, limit=50)
    v = tiny.vocab_size  # ids shifted within [1, v): 1000 distinct sequences
    seqs = [[(t + i) % (v - 1) + 1 for t in s] for i in range(20) for s in base_seqs]
    with server.client() as c:
        job = (
            c.post(
                "/v1/jobs", json={"cache": "ui-cancel", "records": [{"input_ids": s} for s in seqs]}
            )
            .raise_for_status()
            .json()
        )
        out = io.StringIO()
        assert main([*base, "cancel", job["id"]], out=out) == 0
        assert out.getvalue().startswith("cancel requested: " + job["id"])
        out = io.StringIO()
        assert main([*base, "watch", job["id"], "--interval", "0.2"], out=out) == 1
        assert "cancelled" in out.getvalue()
        assert c.get(f"/v1/jobs/{job['id']}").json()["state"] == "cancelled"
    out = io.StringIO()
    assert main([*base, "show", "nope"], out=out) == 2
    assert (
        main(["jobs", "--url", server.url, "list"], out=io.StringIO()) == 2
    )  # no key: 401, one line


def test_jobs_cli_errors_are_one_line(server: ServerProcess, capsys) -> None:
    from logitcache.client.cli import main

    assert main(["jobs", "--url", server.url, "--api-key", KEY, "show", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HTTP 404" in err and "Traceback" not in err


def _browser_or_skip():
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    return sync_playwright


@pytest.mark.slow  # a real chromium on 2 loaded cores: ~20 s
def test_browser_login_status_and_docs(server: ServerProcess) -> None:
    """A real headless chromium: sign in, read the status page, open /docs; nothing leaves the
    host (every request the page makes goes to the service)."""
    sync_playwright = _browser_or_skip()
    requested: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.on("request", lambda r: requested.append(r.url))
            page.goto(f"{server.url}/?refresh=0")
            page.fill("#key", "wrong")
            page.click("button[type=submit]")
            assert page.locator("#login-error").inner_text() == "Wrong API key."
            page.fill("#key", KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("#jobs")
            row = page.locator('tr.cache[data-cache="ui-k8"]')
            assert row.count() == 1
            assert "ui-k8" in page.locator("#jobs").inner_text()
            assert "ready" in page.locator("#engine").inner_text()
            bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert bg == "rgb(250, 250, 250)"  # static/status.css applied
            # the JSON API answers the browser (cookie, GET)
            body = page.goto(f"{server.url}/v1/jobs").text()
            assert any(j["cache"] == "ui-k8" for j in json.loads(body)["jobs"])
            page.goto(f"{server.url}/docs")
            page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            assert "logitcache teacher service" in page.locator(".info .title").inner_text()
            assert page.locator("button.authorize").count() == 1
            page.locator("button.authorize").click()
            page.wait_for_selector("text=bearerAuth")
        finally:
            browser.close()
    outside = [u for u in requested if not u.startswith(server.url) and not u.startswith("data:")]
    assert not outside, outside
    assert any(u.endswith("/ui/static/swagger-ui-bundle.js") for u in requested)


CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_job_inputs_split_duplicates_chat(server: ServerProcess, tiny) -> None:
    """on_long=split windows, a duplicate counted, a chat record rendered with the job's template:
    through the real service into a real cache, counts in the job status and on the page."""
    from logitcache.cache_format import CacheReader
    from logitcache.server.inputs.long import windows

    max_len = int(re.search(r"max seq length\s+(\d+) tokens", server.log()).group(1))
    parts = tiny.token_sequences("heldout", max_len=200, min_len=150, limit=6)
    long = [t for p in parts for t in p][: 2 * max_len + 40]
    short = parts[0][:50]
    msgs = [{"role": "user", "content": "Return the sum."}, {"role": "assistant", "content": "a+b"}]
    records = [
        {"id": "long", "input_ids": long},
        {"input_ids": short},
        {"input_ids": short},
        {"id": "chat", "messages": msgs},
    ]
    with server.client() as c:
        refused = c.post("/v1/jobs", json={"cache": "ui-inputs", "records": records})
        assert refused.status_code in (413, 422) and "exceed" in refused.text  # reject: default
        job = (
            c.post(
                "/v1/jobs",
                json={
                    "cache": "ui-inputs",
                    "records": records,
                    "on_long": "split",
                    "chat_template": CHAT_TEMPLATE,
                },
            )
            .raise_for_status()
            .json()
        )
        done = wait_job(c, job["id"], timeout=240)
        assert done["state"] == "succeeded", done
        spans = windows(len(long), max_len, 1)
        assert done["input"] == {
            "records": 4,
            "sequences": len(spans) + 2,
            "duplicates": 1,
            "skipped": 0,
            "truncated": 0,
            "split": 1,
            "windows": len(spans),
        }
        assert done["sequences_total"] == len(spans) + 2
        listed = [j for j in c.get("/v1/jobs").json()["jobs"] if j["id"] == job["id"]][0]
        assert listed["input"]["duplicates"] == 1
        page = c.get("/?refresh=0").text
    row = re.search(rf'<tr class="job" data-job="{job["id"]}">.*?</tr>', page, re.S).group(0)
    assert "1 duplicate(s) dropped" in row
    reader = CacheReader(str(Path(server.settings["store_root"]) / "ui-inputs"))
    for i, (a, b) in enumerate(spans):
        assert reader.get(f"long#w{i}").input_ids.tolist() == long[a:b]
    rows = sum(reader.get(f"long#w{i}").num_rows for i in range(len(spans)))
    assert rows == len(long) - 1  # overlap 1: every position of the record scored once
    tok = tiny.load_tokenizer()
    text = "<s>user: Return the sum.\n<s>assistant: a+b\n"
    assert reader.get("chat").input_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
