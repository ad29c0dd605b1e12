"""The ``hidden`` mode of ``python -m benchmarks.loader`` (its own module for size): positions/s
that ``CacheDataLoader`` delivers from a ``targets="hidden"`` cache (FORMAT.md 4.10), bfloat16
rows of ``--dim`` values (8 KB per position at d=4096), for each ``--workers``.

The cache (built once under ``--root``): ``--positions`` rows in sequences of LogNormal(log 490,
0.9) tokens (16..8192, as the top-k cache of the other modes), each a slice of one pool of
65,536 rows of standard-normal states stored in bfloat16 with the format's default layout
(they compress to about 0.72 of ``2 d`` bytes, the tiny teacher's real states to 0.66,
FORMAT.md 4.10: the loader reads about as many bytes as from a real cache); a
vocabulary of :data:`VOCAB` (the head is stored once and not read by the loader, so its size
does not change the rates). Figures: positions/s and MB/s of hidden rows delivered to the main
process after ``2 * max(1, w)`` warm-up batches, full shuffle (``loader.SHUFFLE``) and
sequential in one process, then ``CacheDataLoader(num_workers=w, pin_memory=True)``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 4096
POOL = 65536


def build(url: str, positions: int, dim: int, seed: int = 0) -> dict[str, Any]:
    """Write the hidden benchmark cache (see the module docstring); counts and timings."""
    import numcodecs.blosc
    from logitcache.cache_format import CacheWriter, HiddenRecord, Manifest, TeacherHead

    from benchmarks.synthetic import store_bytes

    numcodecs.blosc.set_nthreads(1)
    rng = np.random.default_rng(seed)
    head = TeacherHead(rng.standard_normal((VOCAB, dim), dtype=np.float32))
    manifest = Manifest(
        teacher_model="synthetic-hidden",
        tokenizer_fingerprint="synthetic-hidden",
        vocab_size=VOCAB,
        k=1,
        targets="hidden",
        hidden=head.spec("bfloat16"),
        dataset=f"synthetic hidden states (benchmarks/loader_hidden.py, seed {seed})",
    )
    pool = rng.standard_normal((POOL, dim), dtype=np.float32)
    tokens = rng.integers(0, VOCAB, size=POOL, dtype=np.int32)
    t0 = time.perf_counter()
    rows = seqs = 0
    batch: list[HiddenRecord] = []
    with CacheWriter.open(url, manifest, head=head, fsync=False) as w:
        while rows < positions:
            n = min(int(np.clip(rng.lognormal(np.log(490), 0.9), 16, 8192)), POOL)
            o = int(rng.integers(0, POOL - n + 1))
            batch.append(HiddenRecord(f"s{seqs}", tokens[o : o + n], pool[o : o + n - 1]))
            rows, seqs = rows + n - 1, seqs + 1
            if sum(r.num_rows for r in batch) >= 65536 or rows >= positions:
                w.append(batch)
                batch = []
    nbytes = store_bytes(url)
    return {
        "sequences": seqs,
        "positions": rows,
        "dim": dim,
        "build_s": time.perf_counter() - t0,
        "store_bytes": nbytes,
        "bytes_per_position": nbytes / rows,
    }


def run(url: str, workers: list[int], seconds: float, warm: int) -> dict[str, Any]:
    """One process (sequential, full shuffle), then each worker count (full shuffle)."""
    from benchmarks.loader import loader_rate

    out: dict[str, Any] = {}
    for name, shuffle in (("sequential", False), ("full_shuffle", True)):
        out[name] = loader_rate(url, 0, seconds, pin=False, shuffle=shuffle, warm=warm)
    out["scaling"] = [loader_rate(url, w, seconds, pin=True, shuffle=True) for w in workers]
    return out


def record(rec: Any, doc: dict[str, Any], cfg: dict[str, Any], dim: int, url: str) -> None:
    """The figures of :func:`run` as Recorder rows (positions/s and MB/s of hidden rows), and
    the store's bytes per position."""
    from benchmarks.loader import SHUFFLE
    from benchmarks.synthetic import store_bytes

    bpp = store_bytes(url) / cfg["positions"]
    rec.add(f"hidden d={dim} store", "bytes_per_position", "B", bpp, config=cfg)

    cases = [(f"1 process {n}", doc[n], cfg) for n in ("sequential", "full_shuffle")]
    cases += [
        (f"{r['workers']} workers", r, cfg | SHUFFLE | {"workers": r["workers"]})
        for r in doc["scaling"]
    ]
    for case, r, c in cases:
        rec.add(f"hidden d={dim} {case}", "pos_per_s", "pos/s", r["pos_per_s"], config=c)
        mbs = r["pos_per_s"] * 2 * dim / 1e6
        rec.add(f"hidden d={dim} {case}", "hidden_MB_per_s", "MB/s", mbs, config=c)


def cache_url(root: Path, dim: int, positions: int) -> str:
    return str(root / f"hidden-d{dim}-{positions}")
