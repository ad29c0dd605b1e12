"""Several teachers behind one service: what routing costs a miss, and what a swap costs.

One engine on the tiny teacher in this process is the default teacher of two apps under uvicorn
in threads (``tests/server_support.ThreadedServer``), in one run (two rounds, each app started
first in one of them):

1. **one teacher**: ``--model`` only (the one-teacher case);
2. **two teachers**: the same engine as the first of two teachers (``tiny-a``; ``tiny-b`` is the
   same weights under another name, built by the service), room for one engine;

then per sequence a ``POST /v1/score`` (no cache: the engine scores it) on (1) and on (2) naming
``tiny-a``, in turn (which goes first alternates): the routing's cost is their ratio. Last,
``--swaps`` requests for ``tiny-b``, each after one for ``tiny-a`` on (2): each unloads
``tiny-a`` (the caller's engine: nothing to close) and builds ``tiny-b``'s engine (the request for
``tiny-a`` closes it again); their median over the one-teacher request is what a request that
swaps teachers waits.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import options
from benchmarks.service.common import mode_parser, parse, recorded, tiny_engine, tiny_windows
from tests.server_support import ThreadedServer, server_settings


def _miss(client: Any, seq: list[int], k: int, model: str | None) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/score", json={"input_ids": [seq], "k": k, "model": model})
    r.raise_for_status()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = mode_parser("teachers", __doc__)
    backend = ("transformers", None, {"choices": ["transformers", "vllm"]})
    options(ap, sequences=32, length=128, k=8, swaps=6, backend=backend)
    args = parse(ap, argv)

    from logitcache.server.serving.teachers import weights_bytes

    tiny, seqs = tiny_windows(args.length, 2 * args.sequences + 2)
    engine = tiny_engine(tiny, args.backend, 20)
    engine_options = {"vllm_mode": "inproc"} if args.backend == "vllm" else {}
    one, two, swaps = [], [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            other = Path(tmp) / "tiny-b"
            other.mkdir()
            for f in tiny.teacher_dir.iterdir():
                (other / f.name).symlink_to(f)
            common = {"k": args.k, "backend": args.backend, "engine_options": engine_options}
            single = server_settings(Path(tmp) / "one", str(tiny.teacher_dir), **common)
            teachers = [
                {"name": "tiny-a", "model": str(tiny.teacher_dir)},
                {"name": "tiny-b", "model": str(other)},
            ]
            budget = weights_bytes(str(tiny.teacher_dir))
            double = server_settings(
                Path(tmp) / "two", "", teachers=teachers, teacher_memory_bytes=budget, **common
            )
            for rnd in range(2):  # each app started first in one round (the first-started
                # one answered ~0.8x slower in a same-settings check: a bias, not routing)
                order = (single, double) if rnd == 0 else (double, single)
                with (
                    ThreadedServer(order[0], engine) as sa, sa.client() as ca,
                    ThreadedServer(order[1], engine) as sb, sb.client() as cb,
                ):  # fmt: skip
                    c1, c2 = (ca, cb) if rnd == 0 else (cb, ca)
                    _miss(c1, seqs[0], args.k, None), _miss(c2, seqs[1], args.k, "tiny-a")
                    for i in range(args.sequences):  # in turn, which goes first alternating
                        a, b = seqs[2 + 2 * i + i % 2], seqs[3 + 2 * i - i % 2]
                        if i % 2:
                            two.append(_miss(c2, b, args.k, "tiny-a"))
                        one.append(_miss(c1, a, args.k, None))
                        if not i % 2:
                            two.append(_miss(c2, b, args.k, "tiny-a"))
                    for i in range(2 * args.swaps):  # tiny-b's requests build its engine
                        model = "tiny-b" if i % 2 == 0 else "tiny-a"
                        took = _miss(c2, seqs[i % len(seqs)], args.k, model)
                        if model == "tiny-b":
                            swaps.append(took)
    finally:
        asyncio.run(engine.aclose())

    med_one, med_two, med_swap = (statistics.median(x) for x in (one, two, swaps))
    head, rec = recorded("teachers", args)
    result: dict[str, Any] = {
        **head,
        "median_s": {"one_teacher_miss": med_one, "two_teachers_miss": med_two, "swap": med_swap},
        "routed_over_one_teacher": med_two / med_one,
        "swap_over_one_teacher_miss": med_swap / med_one,
    }
    for key in ("routed_over_one_teacher", "swap_over_one_teacher_miss"):
        rec.add("score_miss", key, "ratio", result[key])
    rec.finish(result, args.json)


if __name__ == "__main__":
    main()
