"""Appends store the bytes of a saved reference, object by object: the stores that
:func:`write_case` writes (``SequenceRecord`` appends and the same sequences as
``SequenceBatch`` appends, with the compiled encode and with NumPy's) must hash, every object
of them, to ``append_golden.json``: the SHA-256 of each object that the record path of the
writer stored for these sequences, saved once (``python tests/format/test_format_append_golden.py
OUT.json`` writes the digests of the tree that runs it). Commit times are fixed, so the root
``zarr.json`` and the key index runs (which hold the commit record) compare too.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

GOLDEN = Path(__file__).with_name("append_golden.json")
NOW = "2026-01-01T00:00:00+00:00"

#: case -> manifest keywords (k, vocab_size and the rest)
CASES: dict[str, dict[str, Any]] = {
    "f16_keys": {"k": 4, "vocab_size": 1000},
    "mask_extras_content": {
        "k": 3,
        "vocab_size": 500,
        "loss_mask": True,
        "entropy": True,
        "actual_logprob": True,
    },
    "f32_remap_f16tail": {
        "k": 5,
        "vocab_size": 300,
        "logprob_dtype": "float32",
        "tail_mass_dtype": "float16",
        "id_remap": True,
    },
    "uint8": {"k": 2, "vocab_size": 70000, "logprob_dtype": "uint8"},
}


def _rows(rng: np.random.Generator, rows: int, k: int, vocab: int) -> tuple[Any, Any, Any]:
    ids = np.argsort(rng.random((rows, vocab)), axis=1)[:, :k].astype(np.int32)
    logits = rng.normal(size=(rows, k)) * 2
    lp = -np.sort(-logits, axis=1) - np.log(np.exp(logits).sum(axis=1, keepdims=True) * 1.25)
    lp = lp.astype(np.float32)
    if rows:
        lp[0, 0] = 0.0  # a zero logprob and a clipped one (float16's range)
        lp[-1, -1] = -70000.0
    tail = np.clip(1 - np.exp(lp.astype(np.float64)).sum(axis=1), 0, 1).astype(np.float32)
    return ids, lp, tail


def sequences(case: str) -> list[list[dict[str, Any]]]:
    """The appends of ``case``: per append, per sequence, its fields (arrays, or ``None``)."""
    kw = CASES[case]
    k, vocab = kw["k"], min(kw["vocab_size"], 2000)
    rng = np.random.default_rng(sorted(CASES).index(case))
    appends: list[list[dict[str, Any]]] = []
    made: list[dict[str, Any]] = []
    for a, count in enumerate((70, 45, 13)):
        batch = []
        for i in range(count):
            length = 2 if i % 3 else int(rng.integers(2, 12))
            ids, lp, tail = _rows(rng, length - 1, k, vocab)
            seq: dict[str, Any] = {
                "key": f"seq-{a}-{i}" if i % 7 else f"séq-{a}-{i}-✓",
                "input_ids": rng.integers(0, vocab, length).astype(np.int32),
                "topk_ids": ids,
                "topk_logprobs": lp,
                "tail_mass": tail if i % 4 == 1 else None,
                "loss_mask": None,
                "entropy": None,
                "actual_logprob": None,
            }
            if kw.get("loss_mask") and i % 2:
                seq["loss_mask"] = (np.arange(length - 1) % 2).astype(np.uint8)
            if kw.get("entropy"):
                seq["entropy"] = rng.random(length - 1).astype(np.float32) * 3
            if kw.get("actual_logprob"):
                seq["actual_logprob"] = -rng.random(length - 1).astype(np.float32)
            if case == "mask_extras_content":
                seq["key"] = None  # content keys
            batch.append(seq)
        if made:  # sequences committed already, and one repeated within the append
            batch[5] = dict(made[3])
            batch[9] = dict(made[20])
        batch[11] = dict(batch[2])
        made += batch
        appends.append(batch)
    return appends


def write_case(url: Path, case: str, how: str = "records") -> None:
    """Write ``case``'s appends to a new store at ``url``: as ``SequenceRecord`` lists
    (``how="records"``) or as ``SequenceBatch`` es of flat arrays (``"batch"``), commit
    times fixed."""
    from unittest import mock

    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord
    from logitcache.cache_format import _writer as writer_mod

    m = Manifest(
        teacher_model="golden",
        tokenizer_fingerprint="sha256:" + "ab" * 32,
        dataset="append golden",
        **CASES[case],
    )
    with mock.patch.object(writer_mod, "utcnow", lambda: NOW):
        with CacheWriter.open(url, m, fsync=False) as w:
            for batch in sequences(case):
                w.append([SequenceRecord(**s) for s in batch] if how == "records" else flat(batch))


def flat(batch: list[dict[str, Any]]) -> Any:
    """The sequences of one append as a ``SequenceBatch`` of flat arrays (tail masses not
    given computed with ``tail_from_logprobs``, masks not given all ones)."""
    from logitcache.cache_format import SequenceBatch, tail_from_logprobs

    def col(name: str, fill: Any) -> Any:
        got = [s[name] for s in batch]
        if all(g is None for g in got):
            return None
        return np.concatenate(
            [fill(s) if g is None else g for s, g in zip(batch, got, strict=True)]
        )

    keys = [s["key"] for s in batch]
    lengths = [len(s["input_ids"]) for s in batch]
    return SequenceBatch(
        input_ids=np.concatenate([s["input_ids"] for s in batch]),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        topk_ids=np.concatenate([s["topk_ids"] for s in batch]),
        topk_logprobs=np.concatenate([s["topk_logprobs"] for s in batch]),
        keys=None if all(k is None for k in keys) else keys,
        tail_mass=col("tail_mass", lambda s: tail_from_logprobs(s["topk_logprobs"])),
        loss_mask=col("loss_mask", lambda s: np.ones(len(s["input_ids"]) - 1, np.uint8)),
        entropy=col("entropy", None),
        actual_logprob=col("actual_logprob", None),
    )


def digests(url: Path) -> dict[str, str]:
    """SHA-256 of every object of the store at ``url`` (its files), by path."""
    return {
        p.relative_to(url).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(url.rglob("*"))
        if p.is_file() and ".lock" not in p.name
    }


def main(out: str) -> None:
    import tempfile

    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            write_case(Path(tmp) / case, case)
            got[case] = digests(Path(tmp) / case)
    Path(out).write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("how", ["records", "batch"])
@pytest.mark.parametrize("fast", [True, False], ids=["compiled", "numpy"])
def test_appends_store_the_golden_bytes(tmp_path, monkeypatch, case: str, how: str, fast: bool):
    from logitcache.cache_format import _encode, fastencode

    monkeypatch.setattr(_encode, "FAST_ENCODE", fast)
    if fast:  # loaded now: small appends do not load the kernels (fastencode.wanted)
        fastencode.ready()
    want = json.loads(GOLDEN.read_text())[case]
    write_case(tmp_path / case, case, how)
    got = digests(tmp_path / case)
    assert sorted(got) == sorted(want)
    assert [p for p in want if got[p] != want[p]] == []
