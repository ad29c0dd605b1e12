"""``CacheRegistry.lookup_reader``: a read-through lookup refreshes the kept reader only when a
commit since its snapshot may hold an asked key. This process's commits are reported by the
registry's writers (generation and keys); any other commit (another registry's, standing for
another process) refreshes it, and so does one whose keys were forgotten."""

from __future__ import annotations

import pytest
from format_support import CHILD_K, CHILD_VOCAB, make_manifest, make_records
from logitcache.cache_format import CacheReader
from logitcache.server.serving import readers
from logitcache.server.serving.caches import CacheRegistry

pytestmark = pytest.mark.fast

MANIFEST = make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB)


@pytest.fixture
def refreshes(monkeypatch) -> list[int]:
    """Counts ``CacheReader.refresh`` calls that adopted a new commit."""
    done: list[int] = []
    real = CacheReader.refresh

    def counted(self: CacheReader) -> bool:
        changed = real(self)
        done.extend([1] if changed else [])
        return changed

    monkeypatch.setattr(CacheReader, "refresh", counted)
    return done


def _append(reg: CacheRegistry, recs) -> None:
    with reg.writer("c", MANIFEST) as h:
        h.append(recs)


def test_own_commits_refresh_only_for_their_keys(tmp_path, refreshes) -> None:
    recs = make_records(6, k=CHILD_K, vocab=CHILD_VOCAB)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    _append(reg, recs[:2])
    first = reg.lookup_reader("c", {recs[0].key})
    assert recs[0].key in first
    refreshes.clear()  # the reader's open
    _append(reg, recs[2:3])
    _append(reg, recs[3:4])
    got = reg.lookup_reader("c", {recs[5].key, "absent"})
    assert got is first and refreshes == [] and recs[3].key not in got  # a miss: no refresh
    got = reg.lookup_reader("c", {recs[5].key, recs[3].key})
    assert refreshes == [1] and recs[3].key in got and recs[2].key in got
    assert reg.lookup_reader("c", {recs[2].key}) is got and refreshes == [1]  # at the root's
    reg.close()


def test_another_writers_commit_refreshes_whatever_is_asked(tmp_path, refreshes) -> None:
    recs = make_records(4, k=CHILD_K, vocab=CHILD_VOCAB)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    other = CacheRegistry(str(tmp_path), idle_s=0)  # its commits are not reported to reg
    _append(reg, recs[:1])
    reg.lookup_reader("c", set())
    refreshes.clear()
    _append(other, recs[1:2])
    _append(reg, recs[2:3])
    got = reg.lookup_reader("c", {"absent"})
    assert refreshes == [1] and recs[1].key in got and recs[2].key in got
    reg.close()
    other.close()


def test_a_forgotten_commit_refreshes(tmp_path, refreshes, monkeypatch) -> None:
    monkeypatch.setattr(readers, "KEEP_COMMITTED_KEYS", 2)
    recs = make_records(5, k=CHILD_K, vocab=CHILD_VOCAB)
    reg = CacheRegistry(str(tmp_path), idle_s=60)
    _append(reg, recs[:1])
    reg.lookup_reader("c", set())
    refreshes.clear()
    _append(reg, recs[1:3])
    _append(reg, recs[3:5])  # the commit of recs[1:3] is forgotten
    got = reg.lookup_reader("c", {"absent"})
    assert refreshes == [1] and recs[4].key in got
    reg.close()


def test_no_cache_is_not_found(tmp_path) -> None:
    from logitcache.server.errors import NotFoundError

    with pytest.raises(NotFoundError):
        CacheRegistry(str(tmp_path)).lookup_reader("c", {"k"})
