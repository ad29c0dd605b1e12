"""A cache's writer kept open between jobs (issue #19): ``CacheRegistry`` keeps the writer of a
cache open for ``idle_s`` after its last user, so the next job into the cache neither opens a new
writer (which reads every committed key) nor finds its arrays unopened. What must still hold:

* a kept writer taken up again sees what other writers and processes committed meanwhile
  (:meth:`CacheWriter.refresh`): its users skip those keys and nothing is stored twice;
* a store removed or made again meanwhile gets a new writer, whose keys are that store's;
* idle writers are closed after ``idle_s``, past ``keep_idle``, on ``close()`` (the server's
  shutdown, checked through the app's lifespan) and on ``close_writer``;
* SIGKILL of a process holding a kept writer, in the middle of the next job's appends, loses
  nothing committed, and the cache resumes without duplicates or holes.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from format_support import CHILD_K, CHILD_VOCAB, make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, validate
from logitcache.cache_format.errors import ManifestMismatchError
from logitcache.server.serving.caches import CacheRegistry

SUPPORT = str(Path(__file__).resolve().parents[1] / "format_support.py")
MANIFEST = make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB)


def _records(n: int, seed: int = 7, prefix: str = "s"):
    return make_records(n, k=CHILD_K, vocab=CHILD_VOCAB, seed=seed, prefix=prefix)


def _other_process_appends(url: Path, n: int, seed: int = 7, prefix: str = "s") -> None:
    """Another process appends ``_records(n, seed, prefix)`` (5 per append) and exits."""
    cmd = [sys.executable, SUPPORT, "append", str(url), "{}", str(n), "5", str(seed)]
    cmd += ["-1", "0", "60", prefix]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _keys(url: Path) -> list[str]:
    keys = CacheReader(url).keys
    assert len(keys) == len(set(keys)), "a key is stored twice"
    return keys


def _use(reg: CacheRegistry, recs, name: str = "c") -> CacheWriter:
    """One job-like use: append ``recs``; returns the writer it used."""
    with reg.writer(name, MANIFEST) as h:
        h.append(recs)
        return h._entry.writer


def test_the_writer_is_kept_between_uses_and_closed_at_once_without_keeping(tmp_path) -> None:
    recs = _records(12)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    first = _use(reg, recs[:6])
    assert reg.open_writers() == {"c": 0}  # idle, kept open
    second = _use(reg, recs[6:])
    assert second is first and not first._closed
    reg.close()
    assert first._closed and reg.open_writers() == {}
    old = CacheRegistry(str(tmp_path / "old"), idle_s=0)  # the behaviour before session 10
    w = _use(old, recs[:3])
    assert w._closed and old.open_writers() == {}


def test_a_kept_writer_sees_another_process_commits_and_stores_nothing_twice(tmp_path) -> None:
    recs = _records(20)  # the same keys and rows as the other process's (same seed, prefix)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    url = Path(reg.url("c"))
    first = _use(reg, recs[:10])
    _other_process_appends(url, 15)  # commits s10..s14 (s0..s9 are there already)
    with reg.writer("c", MANIFEST) as h:
        assert h._entry.writer is first  # kept, not opened again
        assert h.missing([r.key for r in recs]) == [r.key for r in recs[15:]]
        assert h.append(recs) == 5  # only the 5 nobody committed
    assert _keys(url) == [r.key for r in recs]
    got = CacheReader(url)
    assert np.array_equal(got.sequence(12).topk_ids, recs[12].topk_ids)
    assert validate(url).ok
    reg.close()


def test_appends_between_two_kept_writers_of_two_registries_interleave(tmp_path) -> None:
    recs = _records(24)
    a, b = CacheRegistry(str(tmp_path), idle_s=60), CacheRegistry(str(tmp_path), idle_s=60)
    for i in range(0, 24, 4):  # a and b take turns, each keeping its writer, overlapping keys
        reg = a if i % 8 == 0 else b
        _use(reg, recs[max(i - 2, 0) : i + 4])
    assert _keys(Path(a.url("c"))) == [r.key for r in recs]
    assert validate(Path(a.url("c"))).ok
    a.close()
    b.close()


@pytest.mark.parametrize("again", [False, True])
def test_a_store_removed_or_made_again_gets_a_new_writer(tmp_path, again: bool) -> None:
    recs = _records(10)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    url = Path(reg.url("c"))
    first = _use(reg, recs[:6])
    shutil.rmtree(url)
    if again:  # another process makes a new store there, with other keys
        _other_process_appends(url, 5, seed=3, prefix="n")
    second = _use(reg, recs[:8])  # all 8 are new to this store: the old keys must not count
    assert second is not first and first._closed
    want = [f"n{i}" for i in range(5)] if again else []
    assert _keys(url) == want + [r.key for r in recs[:8]]
    assert validate(url).ok
    reg.close()


def test_refresh_loads_the_keys_committed_since_and_refuses_another_store(tmp_path) -> None:
    recs = _records(12)
    url = tmp_path / "c"
    w = CacheWriter.open(url, MANIFEST)
    w.append(recs[:4])
    other = CacheWriter.open(url, MANIFEST)
    other.append(recs[:9])
    other.close()
    assert not w.contains(recs[6].key)
    assert w.refresh() and w.contains(recs[6].key) and w.num_sequences == 9
    assert w.append(recs) == 3
    shutil.rmtree(url)
    assert not w.refresh()  # gone
    CacheWriter.open(url, MANIFEST).close()  # made again: empty, created anew
    assert not w.refresh() and w.num_sequences == 12  # refused: nothing changed
    w.close()


def test_idle_writers_expire_and_only_keep_idle_are_kept(tmp_path) -> None:
    recs = _records(6)
    # idle_s outlasts three writer opens on a loaded machine, so only keep_idle closes "a"
    reg = CacheRegistry(str(tmp_path), idle_s=2.0, keep_idle=2)
    ws = [_use(reg, recs[:2], name) for name in ("a", "b", "c")]
    assert sorted(reg.open_writers()) == ["b", "c"] and ws[0]._closed  # a: least recent
    deadline = time.monotonic() + 10
    while reg.open_writers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reg.open_writers() == {} and all(w._closed for w in ws)
    reg.close()


def test_an_earlier_idle_periods_timer_does_not_close_a_writer_idle_again(tmp_path) -> None:
    recs = _records(4)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    w = _use(reg, recs[:2])
    entry = reg._writers["c"]
    first_since = entry.idle_since
    assert first_since is not None
    _use(reg, recs[2:])  # taken up and left again: a new idle period, a new timer
    assert entry.idle_since != first_since
    reg._expire("c", entry, first_since)  # the first period's timer firing late
    assert not w._closed and reg.open_writers() == {"c": 0}
    reg._expire("c", entry, entry.idle_since)  # the current period's
    assert w._closed and reg.open_writers() == {}
    reg.close()


def test_close_writer_closes_an_idle_one_only(tmp_path) -> None:
    recs = _records(4)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    w = _use(reg, recs[:2])
    with reg.writer("c", MANIFEST) as h:
        assert not reg.close_writer("c")  # in use
        h.append(recs[2:])
    assert reg.close_writer("c") and w._closed and reg.open_writers() == {}
    assert not reg.close_writer("c")
    reg.close()


def test_a_kept_writer_with_another_identity_is_reopened_and_refused(tmp_path) -> None:
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    w = _use(reg, _records(2))
    other = make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB, teacher_revision="r2")
    with pytest.raises(ManifestMismatchError), reg.writer("c", other):
        pass
    assert w._closed and reg.open_writers() == {}  # as a fresh open would: the store's error
    reg.close()


def test_uses_after_close_are_not_kept(tmp_path) -> None:
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    reg.close()
    w = _use(reg, _records(2))
    assert w._closed and reg.open_writers() == {}


# --------------------------------------------------------------------------- the service


def test_jobs_share_the_kept_writer_and_the_shutdown_closes_it(tmp_path) -> None:
    """Two jobs into one cache through the app (the fake engine): the second reuses the first's
    writer, skips the keys another writer committed in between (the engine scores only the
    rest), and the app's shutdown closes the kept writer."""
    import asyncio

    import httpx
    from engine_support import FakeEngine, app_settings, fake_logprobs
    from logitcache.protocol import TERMINAL_JOB_STATES
    from logitcache.server.app import create_app

    k, rng = 8, np.random.default_rng(0)
    engine = FakeEngine(vocab_size=300, max_k=k)
    prompts = [rng.integers(0, 300, 24).tolist() for _ in range(30)]
    scored: list[int] = []
    generate = engine._generate

    async def counted(ps, kk, t):
        scored.extend(prompts.index(list(p)) for p in ps)
        return await generate(ps, kk, t)

    engine._generate = counted
    settings = app_settings(tmp_path, k=k, job_batch_sequences=4, log_level="warning")
    for name, ids in (("one", range(10)), ("two", range(30))):
        lines = [json.dumps({"id": f"s{i}", "input_ids": prompts[i]}) for i in ids]
        (tmp_path / "data" / f"{name}.jsonl").write_text("\n".join(lines))
    url = tmp_path / "caches" / "c"
    app = create_app(settings, engine=engine)

    async def job(c: httpx.AsyncClient, file: str) -> None:
        r = await c.post("/v1/jobs", json={"cache": "c", "file": {"path": file}})
        assert r.status_code == 201, r.text
        state = r.json()["state"]
        while state not in TERMINAL_JOB_STATES:
            await asyncio.sleep(0.02)
            state = (await c.get(f"/v1/jobs/{r.json()['id']}")).json()["state"]
        assert state == "succeeded"

    async def run() -> CacheWriter:
        async with app.router.lifespan_context(app):
            caches = app.state.services.caches
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                await job(c, "one.jsonl")
                assert caches.open_writers() == {"c": 0}
                kept = caches._writers["c"].writer
                other = CacheWriter.open(url, CacheReader(url).manifest)  # s10..s19, its own rows
                other.append(
                    [
                        _record(f"s{i}", prompts[i], fake_logprobs(prompts[i], 300), k)
                        for i in range(10, 20)
                    ]
                )
                other.close()
                scored.clear()
                await job(c, "two.jsonl")
                assert caches._writers["c"].writer is kept
                assert sorted(scored) == list(range(20, 30))  # s0..s19 were committed
        assert kept._closed and caches.open_writers() == {}
        return kept

    asyncio.run(run())
    assert _keys(url) == [f"s{i}" for i in range(30)]
    assert validate(url).ok


def _record(key: str, ids: list[int], lp: np.ndarray, k: int):
    """The record of ``ids`` whose rows are the top-``k`` of ``lp`` ([L-1, V] logprobs)."""
    from logitcache.cache_format import SequenceRecord

    top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    val = np.take_along_axis(lp, top, axis=1).astype(np.float32)
    actual = lp[np.arange(len(ids) - 1), ids[1:]].astype(np.float32)  # FORMAT.md 4.12
    return SequenceRecord(
        key, np.asarray(ids, np.int32), top.astype(np.int32), val, actual_logprob=actual
    )


# --------------------------------------------------------------------------- SIGKILL


def child_registry(argv: list[str]) -> None:
    """`ROOT N`: a first use appends s0..s9 and leaves the writer kept; a second use of the same
    (kept) writer appends the rest 3 at a time, printing the committed count after each, until
    killed."""
    root, n = argv[0], int(argv[1])
    reg = CacheRegistry(root, idle_s=600)
    recs = _records(n)
    first = _use(reg, recs[:10])
    print("FIRST 10", flush=True)
    with reg.writer("c", MANIFEST) as h:
        assert h._entry.writer is first
        for i in range(10, n, 3):
            h.append(recs[i : i + 3])
            print(f"COMMITTED {first.num_sequences}", flush=True)
            time.sleep(0.05)
    print("DONE", flush=True)


def test_sigkill_in_the_next_job_of_a_kept_writer_loses_nothing_committed(tmp_path) -> None:
    n = 60
    cmd = [sys.executable, __file__, str(tmp_path), str(n)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    committed = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("COMMITTED"):
            committed = int(line.split()[1])
            if committed >= 22:  # a few appends into the second use
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    url = tmp_path / "c"
    recs = _records(n)
    keys = _keys(url)
    assert len(keys) >= committed and keys == [r.key for r in recs[: len(keys)]]
    r = CacheReader(url)
    for i in (0, 9, committed - 1):
        assert np.array_equal(r.sequence(i).topk_ids, recs[i].topk_ids)
    assert validate(url).ok
    reg = CacheRegistry(str(tmp_path), idle_s=60)  # the next process resumes
    _use(reg, recs)
    assert _keys(url) == [r.key for r in recs]
    assert validate(url).ok
    reg.close()


if __name__ == "__main__":
    child_registry(sys.argv[1:])
