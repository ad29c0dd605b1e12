"""The engines' protocol routes on a miss: overhead vs calling the engine directly, and bytes on
the wire per position (JSON vs the base64 ``.npy`` matrix).

Usage (from the repository root)::

    python -m benchmarks.service protocols [--sequences 24] [--length 128] [--ids 8] [--k 8]
        [--backend transformers] [--shape small] [--json OUT.json]

One engine on the tiny teacher (or, with ``--shape NAME``, on a random-weight Llama of that
shape from :data:`benchmarks.service.gpu.SHAPES`, made in a temporary directory; ``small`` is
sized so that a forward over 128 tokens takes ~0.2 s on a CPU, as a real teacher's forward is
far slower than the tiny teacher's; the windows' ids are taken modulo its vocabulary) in this
process, served by the real app under uvicorn in a
thread (``tests/server_support.ThreadedServer``), so the routes and the direct calls share the
engine and the run. ``--sequences`` windows of ``--length`` tokens, each asked once per path
(every route request is a miss: a sequence its cache has not seen), with ``--ids`` candidate ids
per row drawn at random from the vocabulary (as a student's top-k mostly is: outside the
teacher's top-``k``, so the matrix comes from the engine's ``score_ids``). Per sequence, in
turn:

1. **direct ids**: ``engine.score_ids`` for the row's candidates (what a bare teacher computes);
2. **direct ids + top-k**: ``engine.score_with_ids`` at ``k`` (one forward on the transformers
   backend): the engine work a read-through miss does (its top-k rows are stored so that later
   epochs hit);
3. **score route**: ``POST /v1/score`` with a cache (``bench-score``): the read-through miss
   every route shares (lookup, top-k scored, stored in a group commit, answered), no chosen ids;
4. **vLLM route**: ``POST /inference/v1/generate`` with ``prompt_logprob_token_ids`` (per-row
   candidates), into cache ``bench-vllm``;
5. **SGLang route**: ``POST /generate`` with ``token_ids_logprob`` (one list for every row, as
   SGLang defines it) and ``top_logprobs_num: 0``, into cache ``bench-sglang``.

Each path is timed alone: after a route's answer the next path waits until the route's cache
holds the sequence (the protocol routes commit behind their answer; a commit running beside the
next path's engine call would be charged to that path).

Figures: median wall seconds and process CPU seconds per sequence of each, the routes' ratios to
(1), (2) and (3), their milliseconds above (2) (the service's own cost per miss: HTTP, checks,
lookup, store; also as the median of the per-sequence differences, and in CPU, with and without
the commit behind the answer), and the answer bytes per position of the two routes (the whole
HTTP body, over the scored positions; the SGLang answer also carries the actual token's entry at
each position).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import options
from benchmarks.service.common import mode_parser, parse, recorded, tiny_engine, tiny_windows
from benchmarks.service.gpu import SHAPES, make_model_dir
from tests.server_support import ThreadedServer, server_settings

#: The timed routes.
ROUTES = ("score_route", "vllm_route", "sglang_route")


def _settle(caches: Any, name: str, n: int) -> None:
    """Wait until cache ``name`` holds ``n`` sequences and its writer's append has returned (the
    routes that answer first commit behind their answer), so no commit overlaps the next timed
    path."""
    deadline = time.monotonic() + 60
    while (
        caches.open_writers().get(name)
        or (m := caches.manifest(name)) is None
        or m.num_sequences < n
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"cache {name!r} did not reach {n} sequences")
        time.sleep(0.004)


def _paths(
    engine: Any, client: Any, caches: Any, seq: list[int], rows: list[list[int]], k: int, n: int
) -> dict:
    """Wall and process CPU seconds and answer bytes of the five paths for one sequence (the
    ``n``-th into each cache); each route's CPU also until its rows are stored (``_cpu_stored``)."""
    union = sorted({i for r in rows for i in r})
    score = {"input_ids": [seq], "k": k, "cache": "bench-score"}
    vllm = {
        "token_ids": seq,
        "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": rows},
        "cache": "bench-vllm",
    }
    sglang = {
        "input_ids": seq,
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 0,
        "token_ids_logprob": rows[0],
        "sampling_params": {"max_new_tokens": 0},
        "cache": "bench-sglang",
    }
    calls: list[tuple[str, Any, str | None]] = [
        ("direct_ids", lambda: asyncio.run(engine.score_ids([seq], [union])), None),
        ("direct_ids_topk", lambda: asyncio.run(engine.score_with_ids([seq], k, [union])), None),
        ("score_route", lambda: client.post("/v1/score", json=score), "bench-score"),
        ("vllm_route", lambda: client.post("/inference/v1/generate", json=vllm), "bench-vllm"),
        ("sglang_route", lambda: client.post("/generate", json=sglang), "bench-sglang"),
    ]
    out: dict[str, Any] = {}
    for key, call, cache in calls:
        c0, t0 = time.process_time(), time.perf_counter()
        r = call()
        out[key] = time.perf_counter() - t0
        out[f"{key}_cpu"] = time.process_time() - c0
        if cache is None:
            continue
        r.raise_for_status()
        _settle(caches, cache, n)
        out[f"{key}_cpu_stored"] = time.process_time() - c0
        if key == "vllm_route":
            assert r.json()["cached"] is False, "every route request must be a miss"
        if key != "score_route":
            out[f"{key.split('_')[0]}_bytes"] = len(r.content)
    return out


def _teacher(tiny: Any, args: Any, tmp: Path) -> tuple[Path, int, Any, dict]:
    """The served teacher's directory, vocabulary size, engine and description: the tiny
    fixture teacher, or a random-weight Llama of shape ``args.shape`` made under ``tmp``."""
    max_k = max(args.k, 20)
    if args.shape is None:
        engine = tiny_engine(tiny, args.backend, max_k)
        return tiny.teacher_dir, tiny.vocab_size, engine, {"shape": "fixture"}
    from logitcache.server.engine import build_engine

    shape, model_dir = SHAPES[args.shape], tmp / "teacher"
    made = make_model_dir(shape, model_dir, "cpu", max_len=max(args.length, 128))
    options = {"vllm_mode": "inproc"} if args.backend == "vllm" else {}
    engine = build_engine(
        model=str(model_dir), backend=args.backend, max_k=max_k, dtype="float32", options=options
    )
    info = {"shape": args.shape, "params": made["params"], "vocab": shape.vocab}
    return model_dir, shape.vocab, engine, info | {"layers": shape.layers, "hidden": shape.hidden}


def main(argv: list[str] | None = None) -> None:
    ap = mode_parser("protocols", __doc__)
    backend = ("transformers", None, {"choices": ["transformers", "vllm"]})
    shape = (None, "a random-weight Llama of this shape, not the tiny teacher", {"choices": SHAPES})
    options(ap, sequences=24, length=128, ids=(8, "candidate ids per row"), k=8, backend=backend)
    options(ap, shape=shape)
    args = parse(ap, argv)

    tiny, seqs = tiny_windows(args.length, args.sequences + 1)
    rng = np.random.default_rng(0)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        teacher_dir, vocab, engine, teacher = _teacher(tiny, args, Path(tmp))
        seqs = [[t % vocab for t in seq] for seq in seqs]

        def candidates(seq: list[int]) -> list[list[int]]:
            return [
                rng.choice(vocab, size=args.ids, replace=False).tolist()
                for _ in range(len(seq) - 1)
            ]

        try:
            settings = server_settings(
                Path(tmp), str(teacher_dir), k=args.k, logprob_dtype="float32"
            )
            with ThreadedServer(settings, engine) as srv, srv.client() as client:
                caches = srv.services.caches
                for n, seq in enumerate(seqs, 1):  # the first: warm-up
                    got = _paths(engine, client, caches, seq, candidates(seq), args.k, n)
                    runs.extend([got] if n > 1 else [])
        finally:
            asyncio.run(engine.aclose())

    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    positions = args.length - 1
    head, rec = recorded("protocols", args)
    bases = ("direct_ids", "direct_ids_topk", "score_route")
    result: dict[str, Any] = {
        **head,
        "teacher": teacher,
        "median_s": {k: v for k, v in med.items() if "bytes" not in k},
    }
    for key in ("vllm", "sglang"):
        result |= {f"{key}_over_{b}": med[f"{key}_route"] / med[b] for b in bases}
    topk, topk_cpu = med["direct_ids_topk"], med["direct_ids_topk_cpu"]
    extra = {
        "extra_ms_over_direct_ids_topk": lambda key: med[key] - topk,
        "paired_extra_ms_over_direct_ids_topk": lambda key: statistics.median(
            r[key] - r["direct_ids_topk"] for r in runs
        ),
        "extra_cpu_ms_over_direct_ids_topk": lambda key: med[f"{key}_cpu"] - topk_cpu,
        "extra_cpu_ms_with_commit_over_direct_ids_topk": lambda key: (
            med[f"{key}_cpu_stored"] - topk_cpu
        ),
    }
    result |= {name: {key: 1e3 * fn(key) for key in ROUTES} for name, fn in extra.items()}
    wire = {"vllm_npy_base64": med["vllm_bytes"], "sglang_json": med["sglang_bytes"]}
    result["bytes_per_position"] = {k: v / positions for k, v in wire.items()}
    result["bytes_per_value"] = {k: v / positions / args.ids for k, v in wire.items()}
    for key in ("vllm", "sglang"):
        for base in bases:
            rec.add(key, f"route_over_{base}", "ratio", result[f"{key}_over_{base}"])
    for key, value in result["bytes_per_position"].items():
        rec.add(key, "bytes_per_position", "B", value)
    rec.finish(result, args.json)


if __name__ == "__main__":
    main()
