"""Prefix sharing on a multi-response dataset (issue #17): what vLLM's prefix cache and a shared
store could save, measured.

Usage (from the repository root; builds the tiny fixture if needed)::

    .venv/bin/python benchmarks/prefix_share_bench.py --out benchmarks/results/prefix_share.json

Dataset: ``--prompts`` prompts of ``--prompt-len`` tokens (the first tokens of held-out fixture
sequences), each with ``--responses`` different responses of ``--response-len`` tokens (slices of
other held-out sequences), so ``prompts * responses`` sequences ``P + R_i``.

Measured with ``vllm.LLM`` on the tiny teacher, ``enable_prefix_caching=True`` (block size as
vLLM picks it, recorded as ``kv_block_size``; only whole blocks are shared, so the prompt must
span at least one), each sequence submitted alone, in order (so every later response of a prompt
could reuse the prompt's blocks):

1. ``prompt_logprobs = k`` (what this service asks for): ``num_cached_tokens`` per request;
   tokens computed = tokens - cached.
2. the same prompts without ``prompt_logprobs`` (``max_tokens=1``): what the prefix cache would
   skip if prompt-logprob requests could read it.
3. rows: a row's distribution depends on the tokens up to it only, so the first ``prompt_len``
   rows of every ``P + R_i`` are the same distribution; the largest difference between them
   across responses is reported (engine batch noise) and their count is what a store that
   shared prefixes would keep once.
4. bytes: the sequences are written with the project's ``CacheWriter`` (float16, k) and the
   store's bytes on disk counted; duplicated rows x bytes per row is what sharing could save.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

for key, value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(key, value)


def dataset(tiny, prompts: int, responses: int, plen: int, rlen: int) -> list[list[list[int]]]:
    """``[prompt][response] -> token ids`` (prompt + response)."""
    seqs = tiny.token_sequences("heldout", max_len=400, min_len=plen + rlen, limit=4000)
    if len(seqs) < prompts * (responses + 1):
        raise SystemExit(f"only {len(seqs)} held-out sequences of >= {plen + rlen} tokens")
    out, pool = [], iter(seqs[prompts:])
    for p in seqs[:prompts]:
        out.append(
            [list(p[:plen]) + list(next(pool)[plen : plen + rlen]) for _ in range(responses)]
        )
    return out


def dir_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("-k", "--k", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord
    from logitcache.fixtures.tiny import build_tiny_models
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tiny = build_tiny_models()
    data = dataset(tiny, args.prompts, args.responses, args.prompt_len, args.response_len)
    flat = [s for group in data for s in group]
    k = args.k
    llm = LLM(
        model=str(tiny.teacher_dir),
        dtype="float32",
        max_model_len=512,
        max_logprobs=k,
        logprobs_mode="raw_logprobs",
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=True,
        seed=0,
    )

    def run(params: SamplingParams) -> tuple[list, float]:
        t0 = time.perf_counter()
        outs = [
            llm.generate([TokensPrompt(prompt_token_ids=s)], params, use_tqdm=False)[0]
            for s in flat
        ]
        return outs, time.perf_counter() - t0

    llm.reset_prefix_cache()
    with_lp, t_lp = run(SamplingParams(max_tokens=1, prompt_logprobs=k, temperature=1.0))
    llm.reset_prefix_cache()
    plain, t_plain = run(SamplingParams(max_tokens=1, temperature=1.0))
    tokens = sum(len(s) for s in flat)
    cached_lp = sum(int(o.num_cached_tokens or 0) for o in with_lp)
    cached_plain = sum(int(o.num_cached_tokens or 0) for o in plain)

    # rows: prompt_logprobs[j + 1] is row j; top-k sorted by rank
    records, rows_of = [], []
    for s, o in zip(flat, with_lp, strict=True):
        ids = np.zeros((len(s) - 1, k), np.int32)
        lp = np.zeros((len(s) - 1, k), np.float32)
        for j, pos in enumerate(o.prompt_logprobs[1:]):
            items = sorted(pos.items(), key=lambda kv: kv[1].rank)[:k]
            ids[j] = [t for t, _ in items]
            lp[j] = [v.logprob for _, v in items]
        rows_of.append((ids, lp))
        records.append(SequenceRecord(None, np.asarray(s, np.int32), ids, lp))
    plen, shared_diff, shared_ids_equal = args.prompt_len, 0.0, True
    for g in range(args.prompts):
        base_ids, base_lp = rows_of[g * args.responses]
        for r in range(1, args.responses):
            ids, lp = rows_of[g * args.responses + r]
            shared_ids_equal &= bool(np.array_equal(ids[:plen], base_ids[:plen]))
            shared_diff = max(shared_diff, float(np.abs(lp[:plen] - base_lp[:plen]).max()))
    rows = sum(len(s) - 1 for s in flat)
    dup_rows = args.prompts * (args.responses - 1) * plen

    with tempfile.TemporaryDirectory() as tmp:
        url = Path(tmp) / "multi.zarr"
        manifest = Manifest(
            teacher_model="tiny-teacher",
            tokenizer_fingerprint="sha256:bench",
            vocab_size=tiny_vocab(tiny),
            k=k,
            dataset="prefix_share_bench",
        )
        with CacheWriter.open(url, manifest, fsync=False) as w:
            w.append(records)
        stored = dir_bytes(url)
    per_row = stored / rows
    result = {
        "bench": "prefix_share",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus (CPU vLLM)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "vllm": __import__("vllm").__version__,
        "dataset": {
            "prompts": args.prompts,
            "responses_per_prompt": args.responses,
            "prompt_len": plen,
            "response_len": args.response_len,
            "sequences": len(flat),
            "tokens": tokens,
            "rows": rows,
        },
        "k": k,
        "kv_block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
        "engine_prompt_logprobs": {
            "cached_tokens": cached_lp,
            "computed_tokens": tokens - cached_lp,
            "seconds": round(t_lp, 3),
        },
        "engine_without_prompt_logprobs": {
            "cached_tokens": cached_plain,
            "computed_tokens": tokens - cached_plain,
            "seconds": round(t_plain, 3),
        },
        "alone_tokens": tokens,
        "shared_rows": {
            "duplicated_rows": dup_rows,
            "fraction_of_rows": round(dup_rows / rows, 4),
            "top_k_ids_equal": shared_ids_equal,
            "max_abs_logprob_diff": shared_diff,
        },
        "store": {
            "bytes": stored,
            "bytes_per_row": round(per_row, 1),
            "bytes_saved_if_shared_prefix_stored_once": round(dup_rows * per_row),
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def tiny_vocab(tiny) -> int:
    cfg = json.loads((Path(tiny.teacher_dir) / "config.json").read_text())
    return int(cfg["vocab_size"])


if __name__ == "__main__":
    main()
