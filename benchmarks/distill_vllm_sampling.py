"""Cost of sampled targets in the vLLM backend: full-vocabulary prompt logprobs vs top-k scoring.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 \\
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python benchmarks/distill_vllm_sampling.py

vLLM exposes the teacher's distribution at prompt positions only through ``prompt_logprobs``
(the top ``n`` logprobs per position, plus the prompt token's). Sampled targets need the whole
distribution, so the mechanism measured here is ``prompt_logprobs = V`` (``max_logprobs = V``,
flat output): per position the engine returns all ``V`` logprobs, which are scattered into a
dense ``[L-1, V]`` block *per sequence* and sampled with the estimator of
:mod:`logitcache.cache_format.sampling` (same seed/key rule as every producer). The baseline is
what the service does today: ``prompt_logprobs = k``.

One in-process engine (``LLM``, enforce_eager, raw logprobs, the engine's settings) scores the
same held-out sequences both ways, repeated and interleaved (top-k, full, top-k, full, ...) so
that the shared machine's load hits both alike; reported: median wall per round, tokens/s, the
ratio, and a check that the sampled rows built from vLLM's full logprobs equal those built from
the PyTorch teacher's for the same seed and key (up to float rounding of the logprobs, which can
move a draw that lands within rounding of a CDF step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def dense_rows(flat: Any, length: int, vocab: int) -> np.ndarray:
    """``[L-1, V]`` float32 logprobs from a full-vocabulary ``FlatLogprobs`` (position 0 is
    ``None`` in vLLM; every later position lists the prompt token then all ``V`` ids)."""
    out = np.full((length - 1, vocab), -np.inf, dtype=np.float32)
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    lps = np.asarray(flat.logprobs, dtype=np.float32)
    for j in range(1, length):
        s, e = flat.start_indices[j], flat.end_indices[j]
        out[j - 1, ids[s:e]] = lps[s:e]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--draws", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/distill_vllm.json")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from logitcache.cache_format.sampling import sample_rows, uniforms
    from logitcache.fixtures.tiny import build_tiny_models
    from transformers import LlamaForCausalLM
    from vllm import LLM, SamplingParams, TokensPrompt

    torch.set_num_threads(1)
    tiny = build_tiny_models()
    vocab = tiny.vocab_size
    seqs = tiny.token_sequences("heldout", max_len=args.seq_len, min_len=16, limit=args.sequences)
    tokens = sum(len(s) for s in seqs)
    llm = LLM(
        model=str(tiny.teacher_dir),
        dtype="float32",
        max_seq_len=max(256, args.seq_len),
        max_logprobs=vocab,
        logprobs_mode="raw_logprobs",
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=s) for s in seqs]

    def params(n: int) -> Any:
        return SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=n, detokenize=False, flat_logprobs=True
        )

    def topk_round() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params(args.k), use_tqdm=False)
        return time.perf_counter() - t0

    last: dict[str, Any] = {}

    def full_round() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params(vocab), use_tqdm=False)
        rows = []
        for i, (s, out) in enumerate(zip(seqs, outs, strict=True)):
            lp = torch.from_numpy(dense_rows(out.prompt_logprobs, len(s), vocab))
            rows.append(sample_rows(lp, uniforms(0, f"s{i}", len(s) - 1, args.draws)))
        last["rows"] = rows
        return time.perf_counter() - t0

    topk_round()  # warm-up
    full_round()
    t_topk, t_full = [], []
    for _ in range(args.rounds):
        t_topk.append(topk_round())
        t_full.append(full_round())
    # the same rows from the PyTorch teacher
    teacher = LlamaForCausalLM.from_pretrained(str(tiny.teacher_dir)).float().eval()
    same, total = 0, 0
    with torch.no_grad():
        for i, s in enumerate(seqs):
            z = teacher(input_ids=torch.as_tensor(s)[None]).logits[0, :-1].float()
            ref = sample_rows(
                torch.log_softmax(z, -1), uniforms(0, f"s{i}", len(s) - 1, args.draws)
            )
            got = last["rows"][i]
            same += int((ref[0] == got[0]).all(axis=1).sum())
            total += len(s) - 1
    med_k, med_f = statistics.median(t_topk), statistics.median(t_full)
    result = {
        "command": "python benchmarks/distill_vllm_sampling.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores (shared), vLLM CPU",
        "sequences": len(seqs),
        "tokens": tokens,
        "vocab": vocab,
        "k": args.k,
        "draws": args.draws,
        "rounds_topk_s": t_topk,
        "rounds_full_sampled_s": t_full,
        "topk_tokens_per_s": tokens / med_k,
        "full_sampled_tokens_per_s": tokens / med_f,
        "full_vs_topk_time": med_f / med_k,
        "rows_identical_to_pytorch_teacher": same / max(total, 1),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
