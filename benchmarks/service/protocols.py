"""The engines' protocol routes on a miss: overhead vs calling the engine directly, and bytes on
the wire per position (JSON vs the base64 ``.npy`` matrix).

One transformers engine in this process on the tiny teacher (or, with ``--shape``, a random-weight
Llama of :data:`benchmarks.service.gpu.SHAPES`, ``small``: a ~0.2 s forward over 128 tokens on a
CPU; the windows' ids taken modulo its vocabulary), served by the real app under uvicorn in a
thread (``tests/server_support.ThreadedServer``). ``--sequences`` windows of ``--length`` tokens,
``--ids`` random candidate ids per row; per sequence, in turn, each path timed alone (the next
waits until the route's cache holds the sequence: the protocol routes commit behind their answer):
``direct_ids`` (``engine.score_ids``), ``direct_ids_topk`` (``engine.score_with_ids`` at ``k``:
the engine work of a read-through miss), ``score_route`` (``POST /v1/score`` with a cache),
``vllm_route`` (``POST /inference/v1/generate`` with ``prompt_logprob_token_ids``) and
``sglang_route`` (``POST /generate`` with ``token_ids_logprob``), every route request a miss.
Figures: median wall and process CPU seconds per sequence, the routes' ratios and milliseconds
above the direct paths, and answer bytes per scored position.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.service.common import parse, recorded, tiny_engine, tiny_windows
from benchmarks.service.gpu import SHAPES, make_model_dir
from tests.server_support import ThreadedServer, server_settings

#: The timed routes.
ROUTES = ("score_route", "vllm_route", "sglang_route")


def _settle(caches: Any, name: str, n: int) -> None:
    """Wait until cache ``name`` holds ``n`` sequences and its writer's append has returned."""
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
        "cache": "bench-vllm",
        "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": rows},
    }
    sglang = {"input_ids": seq, "return_logprob": True, "logprob_start_len": 1,
              "top_logprobs_num": 0, "token_ids_logprob": rows[0],
              "sampling_params": {"max_new_tokens": 0}, "cache": "bench-sglang"}  # fmt: skip
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


def main(argv: list[str] | None = None) -> None:
    args = parse(
        "protocols", __doc__, argv, sequences=24, length=128, ids=(8, "candidate ids per row"),
        k=8, shape=(None, "a random-weight Llama of this shape, not the tiny teacher",
                    {"choices": SHAPES}),
    )  # fmt: skip
    tiny, seqs = tiny_windows(args.length, args.sequences + 1)
    rng = np.random.default_rng(0)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        teacher_dir, vocab, teacher = tiny.teacher_dir, tiny.vocab_size, {"shape": "fixture"}
        if args.shape is not None:
            shape, teacher_dir = SHAPES[args.shape], Path(tmp) / "teacher"
            made = make_model_dir(shape, teacher_dir, "cpu", max_len=max(args.length, 128))
            vocab, teacher = shape.vocab, {"shape": args.shape, "params": made["params"]}
            teacher |= {"vocab": vocab, "layers": shape.layers, "hidden": shape.hidden}
        engine = tiny_engine(teacher_dir, max(args.k, 20))
        seqs = [[t % vocab for t in seq] for seq in seqs]
        try:
            settings = server_settings(
                Path(tmp), str(teacher_dir), k=args.k, logprob_dtype="float32"
            )
            with ThreadedServer(settings, engine) as srv, srv.client() as client:
                for n, seq in enumerate(seqs, 1):  # the first: warm-up
                    rows = [rng.choice(vocab, size=args.ids, replace=False).tolist()
                            for _ in range(len(seq) - 1)]  # fmt: skip
                    got = _paths(engine, client, srv.services.caches, seq, rows, args.k, n)
                    runs.extend([got] if n > 1 else [])
        finally:
            asyncio.run(engine.aclose())

    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    positions = args.length - 1
    head, rec = recorded("protocols", args)
    bases = ("direct_ids", "direct_ids_topk", "score_route")
    result: dict[str, Any] = head | {"teacher": teacher}
    result["median_s"] = {k: v for k, v in med.items() if "bytes" not in k}
    for key in ("vllm", "sglang"):
        for b in bases:
            result[f"{key}_over_{b}"] = ratio = med[f"{key}_route"] / med[b]
            rec.add(key, f"route_over_{b}", "ratio", ratio)
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
    for key, value in result["bytes_per_position"].items():
        rec.add(key, "bytes_per_position", "B", value)
    rec.finish(result, args.json)


if __name__ == "__main__":
    main()
