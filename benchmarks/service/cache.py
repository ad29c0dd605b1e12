"""Online-KD teacher traffic against the cache-serving endpoint: epochs of the same requests.

One real service (vLLM engine on the tiny teacher), ``--sequences`` windows of ``--length`` tokens
in requests of ``--batch`` prompts: **direct**, one epoch of ``POST /v1/score`` without a cache;
**served**, ``--epochs`` epochs of vLLM-shaped ``POST /v1/completions`` (``prompt_logprobs=k``,
``max_tokens=0``) through a cache (epoch 1 misses and stores, later epochs hit). Per epoch, from
``/metrics``: engine seconds and tokens, cache hits and misses, wall seconds. Goal: engine time of
epochs 2..n < 5% of epoch 1; later epochs equal epoch 1 exactly; epoch 1's top-k equals the direct
scores (exactly with ``--logprob-dtype float32``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.service.common import parse, recorded, tiny_windows
from tests.server_support import ServerProcess


def scrape(client: Any) -> dict[str, float]:
    """Engine seconds, engine tokens and cache hits/misses from ``/metrics``."""
    from logitcache.server.metrics import scraped_total

    text = client.get("/metrics").text
    return {
        "engine_s": scraped_total(text, "logitcache_engine_seconds_sum", source="score"),
        "engine_tokens": scraped_total(text, "logitcache_tokens_scored_total", source="score"),
        "hits": scraped_total(text, "logitcache_cache_hits_total"),
        "misses": scraped_total(text, "logitcache_cache_misses_total"),
    }


def rows_of_completion(choice: dict, k: int) -> list[tuple[list[int], list[float]]]:
    """(top-k ids, logprobs) per row of a vLLM ``prompt_logprobs`` list (``None`` first): the
    entries of rank ``<= k`` by rank (without the actual prompt token vLLM adds outside them)."""
    out = []
    for pos in choice["prompt_logprobs"][1:]:
        top = sorted((e for e in pos.items() if e[1]["rank"] <= k), key=lambda e: e[1]["rank"])
        out.append(([int(t) for t, _ in top], [v["logprob"] for _, v in top]))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(
        "cache", __doc__, argv, sequences=256, length=128, batch=16, k=8, epochs=3,
        logprob_dtype="float32",
    )  # fmt: skip
    tiny, seqs = tiny_windows(args.length, args.sequences + 1)
    warm, seqs = seqs[0], seqs[1:]
    batches = [seqs[i : i + args.batch] for i in range(0, len(seqs), args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            Path(tmp), api_key="cache-serve-bench", model=str(tiny.teacher_dir), k=args.k,
            dtype="float32", max_seq_len=max(256, args.length), logprob_dtype=args.logprob_dtype,
        )  # fmt: skip
        t_start = time.perf_counter()
        with (
            server,
            httpx.Client(base_url=server.url, headers=server.headers(), timeout=300) as client,
        ):
            startup_s = time.perf_counter() - t_start
            client.post("/v1/score", json={"input_ids": [warm], "k": args.k}).raise_for_status()

            def epoch(route: str, body: Any, field: str) -> tuple[dict, list]:
                """One pass over the batches: the /metrics deltas, wall seconds, answers."""
                m0, t0 = scrape(client), time.perf_counter()
                got: list[Any] = []
                for b in batches:
                    got += client.post(route, json=body(b)).raise_for_status().json()[field]
                m1 = scrape(client)
                return {x: m1[x] - m0[x] for x in m1} | {"wall_s": time.perf_counter() - t0}, got

            direct_epoch, scored = epoch(
                "/v1/score", lambda b: {"input_ids": b, "k": args.k}, "sequences"
            )
            completion = {"prompt_logprobs": args.k, "max_tokens": 0, "cache": "bench"}
            served = [
                epoch("/v1/completions", lambda b: {"prompt": b, **completion}, "choices")
                for _ in range(args.epochs)
            ]
    direct = [list(zip(s["topk_ids"], s["topk_logprobs"], strict=True)) for s in scored]
    epochs, answers = [e for e, _ in served], [[c["prompt_logprobs"] for c in a] for _, a in served]
    ids_equal = rows = rows_exact = 0
    max_abs = 0.0
    for choice, want in zip(served[0][1], direct, strict=True):
        for (ids, lps), (wids, wlps) in zip(rows_of_completion(choice, args.k), want, strict=True):
            rows += 1
            ids_equal += ids == wids
            rows_exact += ids == wids and lps == wlps
            max_abs = max(max_abs, max(abs(a - b) for a, b in zip(lps, wlps, strict=True)))
    e1 = epochs[0]["engine_s"]
    head, rec = recorded("cache", args)
    result: dict[str, Any] = head | {
        "tokens_per_epoch": sum(len(s) for s in seqs), "server_startup_s": startup_s,
        "direct_epoch": direct_epoch, "served_epochs": epochs,
        "later_over_first_engine_s": [e["engine_s"] / e1 if e1 else None for e in epochs[1:]],
        "goal_met": all(e["engine_s"] < 0.05 * e1 for e in epochs[1:]),
        "later_epochs_identical": all(a == answers[0] for a in answers[1:]),
        "vs_direct": {"rows": rows, "rows_ids_equal": ids_equal, "rows_exact": rows_exact,
                      "max_abs_logprob_diff": max_abs},
    }  # fmt: skip
    for i, ratio in enumerate(result["later_over_first_engine_s"], start=2):
        rec.add(f"epoch {i}", "engine_s_over_epoch_1", "ratio", ratio or 0.0)
    rec.add_flat("epoch 1", epochs[0])
    rec.finish(result, args.json)


if __name__ == "__main__":
    main()
