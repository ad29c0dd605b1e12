"""On-policy distillation against a running teacher service.

Each epoch the student samples a completion for every prompt (seeded per prompt, so a sample the
student draws again is the same sequence), the service scores prompt + completion over HTTP into
a cache (``POST /v1/score``: a sequence scored before is a hit, no engine work), and the loss is
``topk_distill_loss`` on the completion rows: reverse KL on the teacher's top-k rows, plus reverse
KL at the student's own top-k ids, whose teacher logprobs come exactly from the chosen-ids route
(vLLM's ``POST /inference/v1/generate`` with ``prompt_logprob_token_ids``). Per epoch it prints
the loss, the cache hits and the engine time the cache saved (the tokens it answered, at the
engine's seconds per token measured on the misses so far, from ``/metrics``)::

    python examples/on_policy.py --url http://127.0.0.1:8000 --student /models/tiny-student
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from typing import Any

import httpx
import numpy as np
import torch
from logitcache.client.loss import topk_distill_loss
from logitcache.server.metrics import scraped_total
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["def read(path):", "class Queue:", "Return the number of", "import os\n"]


def metric(http: httpx.Client, name: str) -> float:
    """A ``/metrics`` series summed over its teachers (``source="score"`` where it has a source),
    0 if absent."""
    text = http.get("/metrics").text
    source = {"source": "score"} if "scored" in name or "engine" in name else {}
    return scraped_total(text, name, **source)


def teacher_at(http: httpx.Client, seq: list[int], ids: np.ndarray, model: str | None) -> Any:
    """The teacher's exact logprobs at ``ids[t]`` for every row ``t`` of ``seq`` (``[L-1, k]``)."""
    body = {"token_ids": seq, "sampling_params": {"prompt_logprob_token_ids": ids.tolist()}}
    r = http.post("/inference/v1/generate", json={**body, "model": model})
    r.raise_for_status()
    return np.load(io.BytesIO(base64.b64decode(r.json()["prompt_token_id_logprobs"])))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--student", required=True)
    ap.add_argument("--model", default=None, help="the teacher (default: the service's first)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.student)
    student = AutoModelForCausalLM.from_pretrained(args.student, dtype=torch.float32)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    http = httpx.Client(base_url=args.url, timeout=120)
    report = []
    for epoch in range(args.epochs):
        seqs = []
        for i, p in enumerate(prompts):  # the student samples (seeded per prompt)
            torch.manual_seed(i)
            out = student.generate(
                torch.tensor([p]), do_sample=True, max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            seqs.append(out[0].tolist())
        hits0, saved0 = metric(http, "logitcache_cache_hits_total"), 0.0
        tokens0 = metric(http, "logitcache_cache_tokens_saved_total")
        body = {"input_ids": seqs, "k": args.k, "cache": "on-policy", "model": args.model}
        rows = http.post("/v1/score", json=body).json()["sequences"]  # misses scored and stored
        hits = metric(http, "logitcache_cache_hits_total") - hits0
        per_token = metric(http, "logitcache_engine_seconds_sum") / max(
            metric(http, "logitcache_tokens_scored_total"), 1.0
        )
        saved0 = (metric(http, "logitcache_cache_tokens_saved_total") - tokens0) * per_token
        loss = torch.zeros(())
        for p, seq, row in zip(prompts, seqs, rows, strict=True):
            ids = torch.tensor([seq])
            hidden = student.model(ids).last_hidden_state[0, :-1]  # rows predicting seq[1:]
            weight = student.lm_head.weight
            mask = torch.arange(len(seq) - 1) >= len(p) - 1  # the completion's rows
            on_teacher = topk_distill_loss(
                hidden, weight, torch.tensor(row["topk_ids"]),
                torch.tensor(row["topk_logprobs"]), torch.tensor(row["tail_mass"]),
                mask=mask, loss="reverse_kl",
            )  # fmt: skip
            mine = (hidden @ weight.T).topk(args.k, dim=-1).indices.detach()
            at = torch.from_numpy(teacher_at(http, seq, mine.numpy(), args.model))
            on_student = topk_distill_loss(hidden, weight, mine, at, mask=mask, loss="reverse_kl")
            loss = loss + (on_teacher + on_student) / len(seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        line = {"epoch": epoch, "loss": round(float(loss), 5), "hits": int(hits)}
        line |= {"sequences": len(seqs), "engine_s_saved": round(saved0, 4)}
        print(json.dumps(line), flush=True)
        report.append(line)
    http.close()
    return {"epochs": report}


if __name__ == "__main__":
    main()
