"""Write ``ddp_distill.py``'s synthetic cache with a process pool (same records, faster).

``ddp_distill.make_cache`` generates and appends batch after batch in one process; at the issue's
size (vocab 128256, k 100, >= 20M positions) that is minutes of one core. Here a pool generates
the same batches (``synthetic_records(spec, first, count, teacher)``, seeded by ``first``, with
the same batch boundaries) while the main process appends them, in order, through one
``CacheWriter``. The manifest is the one ``make_cache`` writes, so ``ddp_distill``'s coverage
check (each sequence starts with its index in base ``vocab``) applies unchanged.

    python benchmarks/ddp_gpu_cache.py --url /tmp/ddp/cache --vocab 128256 --k 100 \
        --num-sequences 20480 --min-len 1025 --max-len 1025 --procs 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_distill as dd  # noqa: E402

_TEACHER: tuple[Any, Any] | None = None
_SPEC: dd.CacheSpec | None = None


def _init(spec: dd.CacheSpec) -> None:
    global _TEACHER, _SPEC
    _SPEC, _TEACHER = spec, dd.bigram_teacher(spec.vocab, spec.k, spec.seed)


def _batch(first_count: tuple[int, int]) -> list[Any]:
    if _SPEC is None or _TEACHER is None:
        raise RuntimeError("worker not initialised (_init sets the spec and teacher)")
    return dd.synthetic_records(_SPEC, first_count[0], first_count[1], _TEACHER)


def write(url: str, spec: dd.CacheSpec, procs: int, batch: int = 512) -> dict[str, Any]:
    """Write (or finish) the cache at ``url``; return counts and seconds."""
    from logitcache.cache_format import CacheReader, CacheWriter, Manifest

    digits = dd.header_digits(spec.num_sequences, spec.vocab)
    if spec.min_len < digits + 1 or spec.max_len < spec.min_len:
        raise ValueError(f"need {digits + 1} <= min_len <= max_len, got {spec}")
    manifest = Manifest(
        teacher_model=f"synthetic-bigram-v{spec.vocab}-k{spec.k}-seed{spec.seed}",
        tokenizer_fingerprint=dd.SYNTHETIC_TOKENIZER,
        vocab_size=spec.vocab,
        k=spec.k,
        logprob_dtype=spec.logprob_dtype,
        dataset={"synthetic": asdict(spec)},
    )
    t0 = time.perf_counter()
    t_append = 0.0
    added = 0
    with CacheWriter.open(url, manifest) as writer:
        todo = [
            (first, min(batch, spec.num_sequences - first))
            for first in range(0, spec.num_sequences, batch)
            if not writer.contains(f"seq-{min(first + batch, spec.num_sequences) - 1:09d}")
        ]
        with mp.get_context("fork").Pool(procs, initializer=_init, initargs=(spec,)) as pool:
            for records in pool.imap(_batch, todo):
                t1 = time.perf_counter()
                added += writer.append(records)
                t_append += time.perf_counter() - t1
                print(f"[cache] {added} sequences added", file=sys.stderr, flush=True)
    reader = CacheReader(url)
    return {
        "url": url,
        "added": added,
        "num_sequences": reader.num_sequences,
        "num_rows": reader.num_rows,
        "seconds": round(time.perf_counter() - t0, 2),
        "append_seconds": round(t_append, 2),
        "procs": procs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--json", default="")
    for f in fields(dd.CacheSpec):
        kind = {"int": int, "str": str}[str(f.type)]
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = vars(parser.parse_args())
    url, procs, out = args.pop("url"), args.pop("procs"), args.pop("json")
    result = write(url, dd.CacheSpec(**args), procs)
    print(json.dumps(result))
    if out:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
