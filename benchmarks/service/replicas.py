"""Ray batch scoring: the same input with 1 and with 2 teacher replicas (tiny teacher, vLLM CPU).

One local Ray cluster (2 CPUs), two replicas started once (the 1-replica run uses the first), the
same shards and batches, one CPU (one torch thread) per replica: the ratio is what a second
replica buys (noisy on a shared machine: the load average is recorded). The two caches must be
equal array for array. Per run: wall seconds of each phase (check, score, commit) and scored
tokens per second over the score phase.
"""

from __future__ import annotations

import os
import tempfile
import time

from benchmarks.service.common import parse, recorded
from tests.server_support import VLLM_ENV


def corpus(tiny, n: int, chars: int) -> list[dict]:
    """``n`` records of about ``chars`` characters cut from the tiny corpus's training docs."""
    out: list[dict] = []
    for doc in tiny.docs("train"):
        for start in range(0, len(doc.text) - chars // 2, chars):
            out.append({"id": f"r{len(out):05d}", "text": doc.text[start : start + chars]})
            if len(out) == n:
                return out
    raise SystemExit(f"the corpus holds only {len(out)} pieces of {chars} characters")


def same_cache(a_url: str, b_url: str) -> bool:
    """Whether two caches hold the same keys and, in the same order, bit-equal sequences."""
    from logitcache.cache_format import CacheReader

    a, b = CacheReader(a_url), CacheReader(b_url)
    return a.keys == b.keys and all(
        a.sequence(i).equals(b.sequence(i))  # type: ignore[union-attr]
        for i in range(a.num_sequences)
    )


def main(argv: list[str] | None = None) -> None:
    args = parse("ray", __doc__, argv, sequences=256, chars=600, shard_size=32, k=20)
    os.environ.update(VLLM_ENV)
    from logitcache.fixtures.tiny import build_tiny_models
    from logitcache.server.batch.distributed import Plan, Replicas, init_local_ray, run_distributed
    from logitcache.server.inputs.records import RawRecord
    from logitcache.server.settings import ServerSettings

    tiny = build_tiny_models()
    raws = [RawRecord(where=f"r{i}", id=r["id"], text=r["text"], input_ids=None)
            for i, r in enumerate(corpus(tiny, args.sequences, args.chars))]  # fmt: skip
    settings = ServerSettings(
        _env_file=None, model=str(tiny.teacher_dir), k=args.k, max_seq_len=1024, backend="vllm"
    )
    t = time.perf_counter()
    init_local_ray(num_cpus=2)
    ray_start = time.perf_counter() - t
    runs = {}
    load_before = os.getloadavg()[0]
    plan = Plan(shard_size=args.shard_size, cpus_per_replica=1.0)
    with tempfile.TemporaryDirectory() as tmp, Replicas(settings, 2, plan) as started:
        print(f"2 engines up in {started.start_seconds:.1f} s")
        for replicas in (1, 2):
            run_plan = Plan(replicas=replicas, shard_size=args.shard_size)
            runs[replicas] = r = run_distributed(raws, f"{tmp}/r{replicas}", settings, run_plan,
                                                 replicas=started)  # fmt: skip
            print(f"replicas={replicas}: {r.phases} tokens={r.scored_tokens}")
        equal = same_cache(f"{tmp}/r1", f"{tmp}/r2")
    import ray  # imported by init_local_ray, after the environment it reads

    ray.shutdown()
    if not equal:
        raise SystemExit("the 1- and 2-replica caches differ")
    rows = [
        {"replicas": n, "shards": r.shards, "sequences": r.sequences, "tokens": r.scored_tokens,
         "wall_s": round(r.seconds, 2), **{f"{k}_s": v for k, v in r.phases.items()},
         "score_tok_per_s": round(r.scored_tokens / r.phases["score"], 1)}
        for n, r in runs.items()
    ]  # fmt: skip
    speedup = rows[1]["score_tok_per_s"] / rows[0]["score_tok_per_s"]
    head, rec = recorded("ray", args)
    for row in rows:
        rec.add(f"{row['replicas']} replica(s)", "score_tok_per_s", "tok/s", row["score_tok_per_s"])
    rec.add("2 vs 1 replicas", "score_speedup", "ratio", speedup)
    rec.finish(head | {
        "ray_init_s": round(ray_start, 2),
        "engines_start_s (2 in parallel)": round(started.start_seconds, 2),
        "load_average_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runs": rows, "score_speedup_2_vs_1": round(speedup, 3), "caches_byte_equal": equal,
    }, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
