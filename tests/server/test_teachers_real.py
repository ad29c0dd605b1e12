"""Several teachers behind one real service: the tiny teacher and the same weights under another
name (``tiny-b``, a directory of links), transformers engines built by the service itself,
a memory budget of one engine, the app under real uvicorn, the real ``openai`` client.

The two teachers are two identities (their model ids differ) with the same weights: each answers
what a plain transformers forward gives, their default caches are their own, and with room for
one engine a request for one unloads the other (LRU) and the first comes back on its next request.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_support import full_forward_logprobs
from server_support import ThreadedServer, server_settings

K = 5


@pytest.fixture(scope="module")
def two(tiny, tmp_path_factory):
    from logitcache.server.serving.teachers import weights_bytes

    work = tmp_path_factory.mktemp("teachers")
    other = work / "tiny-b"
    other.mkdir()
    for f in tiny.teacher_dir.iterdir():  # the same weights under another name
        (other / f.name).symlink_to(f)
    teachers = [
        {"name": "tiny-a", "model": str(tiny.teacher_dir)},
        {"name": "tiny-b", "model": str(other)},
    ]
    budget = weights_bytes(str(tiny.teacher_dir))  # room for one engine
    settings = server_settings(
        work, "", backend="hf", teachers=teachers, teacher_memory_bytes=budget
    )
    with ThreadedServer(settings, None) as srv:
        yield srv


def states(srv) -> dict[str, tuple[str, int]]:
    with srv.client() as c:
        return {t["name"]: (t["state"], t["loads"]) for t in c.get("/health").json()["teachers"]}


def test_openai_client_two_teachers_lru_and_transformers_reference(two, tiny, heldout_sequences):
    import openai
    from openai import OpenAI

    seq = list(heldout_sequences[0][:20])
    oa = OpenAI(base_url=f"{two.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["tiny-a", "tiny-b"]
    assert states(two) == {"tiny-a": ("loaded", 1), "tiny-b": ("unloaded", 0)}

    def ask(model: str) -> dict:
        out = oa.completions.create(
            model=model, prompt=[seq], max_tokens=1, extra_body={"prompt_logprobs": K}
        )
        assert out.model == model
        return out.model_dump()["choices"][0]

    a = ask("tiny-a")
    b = ask("tiny-b")  # budget of one engine: tiny-a is unloaded for it
    assert states(two) == {"tiny-a": ("unloaded", 1), "tiny-b": ("loaded", 1)}
    a2 = ask("tiny-a")  # and comes back
    assert states(two) == {"tiny-a": ("loaded", 2), "tiny-b": ("unloaded", 1)}
    assert a2["cached"] and not b["cached"]  # tiny-a's own cache; tiny-b's is another
    ref = full_forward_logprobs(str(tiny.teacher_dir), seq)
    with two.client() as c:  # the caches' k (the server's), above the K asked
        wide = c.get("/v1/caches/openai-completions").json()["manifest"]["k"]
    assert wide > K
    bounded = 0
    for choice in (a, b):
        rows = choice["prompt_logprobs"]
        assert len(rows) == len(seq) and rows[0] is None
        for t, row in enumerate(rows[1:]):
            top = np.argsort(-ref[t])[:K]
            got = sorted(row.items(), key=lambda kv: kv[1]["rank"])[:K]  # vLLM's actual token
            assert [int(i) for i, _ in got] == top.tolist()
            lps = np.array([v["logprob"] for _, v in got])
            np.testing.assert_allclose(lps, ref[t][top], atol=2e-3)  # float16 cache
        # the actual token: vLLM's exact rank inside the cache's top `wide`, else `wide + 1`
        # marked as a bound
        exact = [int((r > r[tok]).sum()) + 1 for r, tok in zip(ref, seq[1:], strict=False)]
        ranks = [row[str(tok)]["rank"] for row, tok in zip(rows[1:], seq[1:], strict=True)]
        assert ranks == [min(r, wide + 1) for r in exact]
        assert choice["rank_lower_bound"] == [t + 1 for t, r in enumerate(exact) if r > wide]
        bounded += len(choice["rank_lower_bound"])
    assert 0 < bounded < 2 * (len(seq) - 1)  # both kinds of position are exercised
    with pytest.raises(openai.NotFoundError) as err:
        ask("tiny-c")
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with two.client() as c:
        caches = {x["name"] for x in c.get("/v1/caches").json()["caches"]}
    assert {"openai-completions", "openai-completions-tiny-b"} <= caches


def test_benchmark_mode_teachers_runs(tiny, tmp_path) -> None:
    """``python -m benchmarks.service teachers`` (a short run): both ratios, rows in the CSV."""
    import csv
    import json

    from benchmarks.service import teachers as bench

    out, rows = tmp_path / "out.json", tmp_path / "rows.csv"
    bench.main(["--sequences", "2", "--swaps", "1", "--json", str(out), "--csv", str(rows)])
    result = json.loads(out.read_text())
    assert result["routed_over_one_teacher"] > 0 and result["swap_over_one_teacher_miss"] > 0
    with rows.open() as f:
        got = {r["metric"] for r in csv.DictReader(f)}
    assert got == {"routed_over_one_teacher", "swap_over_one_teacher_miss"}
