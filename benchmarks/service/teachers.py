"""Several teachers behind one service: what routing costs a miss, and what a swap costs.

One transformers engine on the tiny teacher in this process serves two apps under uvicorn in
threads (``tests/server_support.ThreadedServer``): **one teacher** (``--model`` only) and **two
teachers** (the engine as ``tiny-a``; ``tiny-b``, the same weights under another name, built by
the service; room for one engine). Per sequence a ``POST /v1/score`` miss on each, in turn (the
order alternating; two rounds, each app started first in one): routing costs their ratio. Then
``--swaps`` requests for ``tiny-b``, each after one for ``tiny-a``, each unloading one engine and
building the other: their median over the one-teacher request is what a swap waits.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.service.common import parse, recorded, tiny_engine, tiny_windows
from tests.server_support import ThreadedServer, server_settings


def _miss(client: Any, seq: list[int], k: int, model: str | None) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/score", json={"input_ids": [seq], "k": k, "model": model})
    r.raise_for_status()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse("teachers", __doc__, argv, sequences=32, length=128, k=8, swaps=6)
    from logitcache.server.serving.teachers import weights_bytes

    tiny, seqs = tiny_windows(args.length, 2 * args.sequences + 2)
    engine = tiny_engine(tiny.teacher_dir, 20)
    one, two, swaps = [], [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            other = Path(tmp) / "tiny-b"
            other.mkdir()
            for f in tiny.teacher_dir.iterdir():
                (other / f.name).symlink_to(f)
            common = {"k": args.k, "backend": "transformers", "engine_options": {}}
            single = server_settings(Path(tmp) / "one", str(tiny.teacher_dir), **common)
            teachers = [{"name": "tiny-a", "model": str(tiny.teacher_dir)},
                        {"name": "tiny-b", "model": str(other)}]  # fmt: skip
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
    ratios = {"routed_over_one_teacher": med_two / med_one,
              "swap_over_one_teacher_miss": med_swap / med_one}  # fmt: skip
    for key, value in ratios.items():
        rec.add("score_miss", key, "ratio", value)
    median_s = {"one_teacher_miss": med_one, "two_teachers_miss": med_two, "swap": med_swap}
    rec.finish(head | {"median_s": median_s} | ratios, args.json)


if __name__ == "__main__":
    main()
