"""Build the golden caches under ``tests/golden/v<FORMAT_VERSION>/`` (run once per format version).

Each cache is written by the library's own writer at the format version current when this
script ran, and beside it ``<name>.expected.npz`` holds what the reader returned then: per
sequence the key, tokens, ids, float32 logprobs and tail mass (concatenated, with lengths).
``tests/format/test_format_golden.py`` reads every committed golden cache with today's reader and
requires exactly these values: a later format version must keep reading old stores.

Usage (from the repo root): ``.venv/bin/python tests/golden/make_golden.py`` (refuses to
overwrite an existing version folder; delete it first if you really mean to rebuild it).
``GOLDEN_FORMAT_MODULE=pkg.cache_format`` (with ``pkg`` on ``PYTHONPATH``) builds them with
another copy of the format code, e.g. an older version's ``cache_format`` folder from git
(``git archive <commit> cache_format``): its modules import each other relatively only.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FMT = importlib.import_module(os.environ.get("GOLDEN_FORMAT_MODULE", "logitcache.cache_format"))


def records(seed: int, n: int, k: int, vocab: int, extreme: bool):
    """Deterministic valid records; ``extreme`` puts values below -65504 in the last ranks."""
    SequenceRecord = FMT.SequenceRecord

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(2, 12))
        rows = length - 1
        ids = rng.integers(0, vocab, size=length, dtype=np.int32)
        topk = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(rows)])
        logits = rng.normal(size=(rows, k)) * 2
        lp = -np.sort(-logits, axis=1) - np.log(np.exp(logits).sum(axis=1, keepdims=True) * 1.25)
        lp = lp.astype(np.float32)
        if extreme and rows > 1:
            lp[1, -1] = -7.0e4  # below the float16 range
            lp[0, :] = np.log(0.2)  # a row of ties (zero quantisation spread), mass 0.8
        tail = np.clip(1 - np.exp(lp.astype(np.float64)).sum(axis=1), 0, 1).astype(np.float32)
        key = f"g{seed}-{i}" if i % 3 else None  # some content keys
        out.append(SequenceRecord(key, ids, topk.astype(np.int32), lp, tail))
    return out


def build(root: Path) -> dict:
    CacheReader, CacheWriter, Layout, Manifest = (
        FMT.CacheReader,
        FMT.CacheWriter,
        FMT.Layout,
        FMT.Manifest,
    )

    tiny = Layout(
        row_chunk=4, row_shard=16, token_chunk=8, token_shard=32, seq_chunk=2, seq_shard=8
    )
    configs = {
        # name: (manifest overrides, layout, seed, sequences per append, appends)
        "float16": (dict(), None, 1, 6, 2),
        "float32_remap_tiny": (dict(logprob_dtype="float32", id_remap=True), tiny, 2, 5, 3),
        "uint8_f16tail_tiny": (
            dict(logprob_dtype="uint8", tail_mass_dtype="float16"),
            tiny,
            3,
            7,
            2,
        ),
    }
    k, vocab = 4, 64
    made = {}
    for name, (over, layout, seed, per, appends) in configs.items():
        m = Manifest(
            teacher_model="golden-teacher",
            teacher_revision="r1",
            tokenizer_fingerprint="sha256:" + "cd" * 32,
            vocab_size=vocab,
            k=k,
            dataset="golden",
            **over,
        )
        recs = records(seed, per * appends, k, vocab, extreme=True)
        path = root / name
        with CacheWriter.open(path, m, layout=layout, fsync=False) as w:
            for a in range(appends):
                w.append(recs[a * per : (a + 1) * per])
        lock = path / ".logitcache.lock"
        if lock.exists():
            lock.unlink()  # the lock is not part of a store (a 0-byte file in old versions)
        r = CacheReader(path)
        seqs = [r.sequence(i) for i in range(r.num_sequences)]
        np.savez_compressed(
            root / f"{name}.expected.npz",
            keys=np.array(r.keys),
            lengths=np.array([len(s.input_ids) for s in seqs], dtype=np.int32),
            input_ids=np.concatenate([s.input_ids for s in seqs]),
            topk_ids=np.concatenate([s.topk_ids for s in seqs]),
            topk_logprobs=np.concatenate([s.topk_logprobs for s in seqs]),
            tail_mass=np.concatenate([s.tail_mass for s in seqs]),
        )
        made[name] = r.manifest.to_attrs()
    return made


def main() -> int:
    FORMAT_VERSION = FMT.FORMAT_VERSION

    root = HERE / f"v{FORMAT_VERSION}"
    if root.exists():
        print(f"{root} exists; delete it to rebuild", file=sys.stderr)
        return 1
    root.mkdir(parents=True)
    try:
        made = build(root)
    except BaseException:
        shutil.rmtree(root)
        raise
    (root / "README.md").write_text(
        f"Golden caches of format version {FORMAT_VERSION}, written by "
        f"`tests/golden/make_golden.py` with the format code `{FMT.__name__}`; never edit or "
        "rebuild them: "
        "`tests/format/test_format_golden.py` requires every later version "
        "to read them to the values in `*.expected.npz`.\n"
    )
    print(json.dumps({n: m["num_sequences"] for n, m in made.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
