"""Teacher identity: the weights' content hash and the engine dtype are part of it, defined once
(``cache_format/identity.py``) and compared by one function; a cache made by another teacher
is a 409 and nothing is written (issue #18, "silent teacher mixing")."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, in_process
from logitcache.cache_format import CacheReader, Manifest
from logitcache.cache_format.identity import teacher_diff
from logitcache.server.engine import EngineInfo
from logitcache.server.engine.identity import local_revision, teacher_identity, weights_hash


def _write_safetensors(path: Path, seed: int, shape: tuple[int, ...] = (64, 32)) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(shape).astype(np.float32)}, str(path))


@pytest.mark.fast
@pytest.mark.parametrize("shape", [(64, 32), (1024, 1536)], ids=["whole-file", "sampled"])
def test_weights_hash_sees_weights_replaced_in_place(tmp_path: Path, shape: tuple) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 64}')
    f = tmp_path / "model.safetensors"
    _write_safetensors(f, seed=0, shape=shape)
    size, rev, before = (
        f.stat().st_size,
        local_revision(str(tmp_path), None),
        weights_hash(str(tmp_path)),
    )
    assert before is not None and before.startswith("sha256:")
    _write_safetensors(f, seed=1, shape=shape)  # same path, same shapes, same size
    assert f.stat().st_size == size
    assert local_revision(str(tmp_path), None) == rev  # what the identity saw before: blind
    after = weights_hash(str(tmp_path))
    assert after != before
    os.utime(f, ns=(1, 1))  # a new mtime with the same content: recomputed, same value
    assert weights_hash(str(tmp_path)) == after
    _write_safetensors(f, seed=0, shape=shape)
    assert weights_hash(str(tmp_path)) == before


@pytest.mark.fast
def test_weights_hash_is_none_without_local_weights(tmp_path: Path) -> None:
    assert weights_hash(str(tmp_path)) is None
    assert weights_hash("no-such-org/no-such-model-xyz") is None


def _info(**kw: Any) -> EngineInfo:
    base = dict(
        model_id="t",
        revision="r",
        vocab_size=50,
        max_k=5,
        tokenizer_fingerprint="fp",
        weights_hash="sha256:a",
        dtype="bfloat16",
    )
    return EngineInfo(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.fast
def test_one_identity_for_engine_info_and_manifest() -> None:
    from logitcache.server.caches import expected_manifest

    info = _info()
    m = expected_manifest(info, k=5, logprob_dtype="float16")
    assert teacher_identity(m) == teacher_identity(info)
    assert m.extra["teacher"] == {"weights_hash": "sha256:a", "dtype": "bfloat16"}
    restored = Manifest.from_attrs(m.to_attrs())  # survives the store's JSON
    assert teacher_diff(teacher_identity(restored), teacher_identity(info)) == {}
    for change in ({"weights_hash": "sha256:b"}, {"dtype": "float32"}, {"temperature": 2.0}):
        diff = teacher_diff(teacher_identity(m), teacher_identity(_info(**change)))
        assert list(diff) == list(change), diff
    # a cache written before the weights/dtype were recorded: those two are not compared
    old = m.model_copy(update={"extra": {}})
    assert teacher_diff(teacher_identity(old), teacher_identity(_info(dtype="float16"))) == {}
    assert teacher_diff(teacher_identity(old), teacher_identity(_info(revision="x"))) != {}


@pytest.mark.fast
def test_the_identity_fields_are_defined_once() -> None:
    """The cache identity starts with the teacher's fields, and the dataset's config fingerprint
    reads the cache identity of any source's manifest (duck-typed ones too) from that list."""
    from types import SimpleNamespace

    from logitcache.cache_format import IDENTITY_FIELDS
    from logitcache.cache_format.identity import TEACHER_EXTRA_FIELDS, TEACHER_FIELDS
    from logitcache.client.dataset import _identity
    from logitcache.server.caches import expected_manifest

    assert IDENTITY_FIELDS[: len(TEACHER_FIELDS)] == TEACHER_FIELDS
    m = expected_manifest(_info(), k=5, logprob_dtype="float16")
    assert set(teacher_identity(m)) == {*TEACHER_FIELDS, *TEACHER_EXTRA_FIELDS}
    assert _identity(m) == m.identity()
    assert _identity(SimpleNamespace(**dict(m))) == m.identity()


async def _score(client: Any, cache: str, seqs: list[list[int]], k: int = 5) -> Any:
    return await client.post("/v1/score", json={"input_ids": seqs, "k": k, "cache": cache})


@pytest.mark.fast
def test_fake_teacher_with_other_weights_or_dtype_gets_409_and_writes_nothing(
    tmp_path: Path,
) -> None:
    settings = app_settings(tmp_path)
    seqs = [[1, 5, 9, 20], [1, 7, 7, 7, 30]]

    async def run() -> None:
        async with in_process(settings, FakeEngine(weights_hash="sha256:old")) as c:
            r = await _score(c, "c", seqs)
            assert r.status_code == 200, r.text
        for other in (FakeEngine(weights_hash="sha256:new"), FakeEngine(dtype="bfloat16")):
            async with in_process(settings, other) as c:
                r = await _score(c, "c", [[1, 2, 3]])
                assert r.status_code == 409, r.text
                body = r.json()
                assert "conflict" in r.text, body
                field = "weights_hash" if other.info.weights_hash != "sha256:old" else "dtype"
                assert field in r.text, body
        async with in_process(settings, FakeEngine(weights_hash="sha256:old")) as c:
            assert (await _score(c, "c", [[1, 2, 3]])).status_code == 200

    asyncio.run(run())
    reader = CacheReader(tmp_path / "caches" / "c")
    assert reader.num_sequences == 3  # the two refused requests wrote nothing


def test_real_teacher_weights_replaced_in_place_is_409(tmp_path: Path, tiny: Any) -> None:
    """The probe's case: the weights file is overwritten (same path, same shapes) and the server
    restarted; scoring into the cache made before is refused (the old identity let it through:
    logprob -3.76 before vs -2.61 after for the same sequence)."""
    import torch
    from logitcache.server.engine import build_engine
    from safetensors.torch import load_file, save_file

    model = tmp_path / "teacher"
    shutil.copytree(tiny.teacher_dir, model)
    settings = app_settings(tmp_path, model=str(model), backend="hf", dtype="float32", k=5)
    seq = tiny.token_sequences("heldout", max_len=24, min_len=8, limit=1)

    async def score_with_fresh_engine() -> tuple[int, Any, Any]:
        engine = build_engine(settings)
        try:
            async with in_process(settings, engine) as c:
                r = await _score(c, "c", seq)
                return r.status_code, r.json(), engine.info
        finally:
            await engine.aclose()

    status, body, info_before = asyncio.run(score_with_fresh_engine())
    assert status == 200, body
    (weights,) = model.glob("*.safetensors")
    size = weights.stat().st_size
    tensors = load_file(str(weights))
    gen = torch.Generator().manual_seed(0)
    save_file(
        {n: t + 0.05 * torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in tensors.items()},
        str(weights),
        metadata={"format": "pt"},
    )
    assert weights.stat().st_size == size
    status, body, info_after = asyncio.run(score_with_fresh_engine())
    assert info_after.revision == info_before.revision  # shapes and config unchanged
    assert info_after.weights_hash != info_before.weights_hash
    assert status == 409, body
    assert "weights_hash" in str(body)
    assert CacheReader(tmp_path / "caches" / "c").num_sequences == 1
