"""SGLang-compatible ``POST /generate`` (issue #35), fast tier: in-process app on the fake engine.

Request and response shapes from SGLang: ``GenerateReqInput`` in
``python/sglang/srt/managers/io_struct.py`` (fields ``input_ids``, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``, ``sampling_params``) and the
``meta_info`` fields ``input_token_logprobs`` / ``input_top_logprobs`` (``[logprob, token_id,
text]``, length ``len(input_ids) - logprob_start_len``) as checked by SGLang's logprob tests
(``test/srt/test_logprobs.py``; the same assertions in sgl-jax ``test_logprobs.py``), SGLang
0.5.x. Numbers are compared with ``/v1/score`` on the same cache; "no engine work" is the fake
engine's own call count.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from asgi_support import LiveApp
from engine_support import FakeEngine, app_settings

pytestmark = pytest.mark.fast

JSON = {"content-type": "application/json"}
SEQS = [[5, 9, 2, 7, 11, 3], [4, 4, 8, 1]]


class App(LiveApp):
    def __init__(self, root: Path) -> None:
        self.engine = FakeEngine()
        super().__init__(app_settings(root), self.engine)

    def post(self, target: str, body: Any) -> Answer:
        status, _headers, data = self.request("POST", target, JSON, json.dumps(body).encode())
        return Answer(status, data.decode())


@dataclass
class Answer:
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[App]:
    a = App(tmp_path)
    yield a
    a.close()


def body(input_ids: Any, **over: Any) -> dict[str, Any]:
    return {
        "input_ids": input_ids,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "cache": "sg",
        **over,
    }


def test_batch_through_the_cache_matches_score(app: App) -> None:
    first = app.post("/generate", body(SEQS))
    assert first.status == 200, first.text
    calls = list(app.engine.calls)
    second = app.post("/generate", body(SEQS))
    assert app.engine.calls == calls, "a repeated request must not reach the engine"
    a, b = first.json(), second.json()
    assert isinstance(a, list) and len(a) == 2
    assert [x["meta_info"]["cached"] for x in a] == [False, False]
    assert [x["meta_info"]["cached"] for x in b] == [True, True]
    assert [x["meta_info"]["input_top_logprobs"] for x in a] == [
        x["meta_info"]["input_top_logprobs"] for x in b
    ]
    ref = app.post("/v1/score", {"input_ids": SEQS, "cache": "sg", "k": 3}).json()
    assert ref["hits"] == 2
    for out, seq, want in zip(a, SEQS, ref["sequences"], strict=True):
        meta = out["meta_info"]
        assert out["output_ids"] == [] and meta["completion_tokens"] == 0
        assert meta["prompt_tokens"] == len(seq)
        tok, top = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert len(tok) == len(top) == len(seq)  # len(input_ids) - logprob_start_len
        assert tok[0] == [None, seq[0], None] and top[0] is None
        for t in range(1, len(seq)):
            ids, lps = want["topk_ids"][t - 1], want["topk_logprobs"][t - 1]
            assert [e[1] for e in top[t]] == ids
            assert [e[0] for e in top[t]] == pytest.approx(lps)
            assert tok[t][1] == seq[t]
            # the actual token's logprob: from the row when it is there, else None (no estimate)
            full = app.post("/v1/score", {"input_ids": [seq], "cache": "sg"}).json()
            row = dict(
                zip(
                    full["sequences"][0]["topk_ids"][t - 1],
                    full["sequences"][0]["topk_logprobs"][t - 1],
                    strict=True,
                )
            )
            if seq[t] in row:
                assert tok[t][0] == pytest.approx(row[seq[t]])
            else:
                assert tok[t][0] is None


def test_single_sequence_and_start_len(app: App) -> None:
    r = app.post("/generate", body(SEQS[0], logprob_start_len=2, top_logprobs_num=2))
    assert r.status == 200, r.text
    out = r.json()
    assert isinstance(out, dict)
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(SEQS[0]) - 2
    assert [e[1] for e in meta["input_token_logprobs"]] == SEQS[0][2:]
    assert all(len(row) == 2 for row in meta["input_top_logprobs"])
    assert all(row[0][0] >= row[1][0] for row in meta["input_top_logprobs"])
    # SGLang's default logprob_start_len=-1: the last input position only
    last = app.post("/generate", body(SEQS[0], logprob_start_len=-1)).json()["meta_info"]
    assert len(last["input_token_logprobs"]) == 1


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"sampling_params": {"max_new_tokens": 8}}, "max_new_tokens"),
        ({"sampling_params": {}}, "max_new_tokens"),
        ({"sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}, "temperature"),
        ({"token_ids_logprob": [[1, 2]]}, "token_ids_logprob"),
        ({"token_ids_logprob": ["1"]}, ""),
        ({"return_logprob": False}, "return_logprob"),
        ({"stream": True}, "stream"),
        ({"input_ids": None, "text": "hello"}, "input_ids"),
        ({"logprob_start_len": 99}, "logprob_start_len"),
        ({"input_ids": [1.0, 2.0]}, ""),
    ],
)
def test_refused_with_a_422_and_nothing_written(app: App, over: dict, needle: str) -> None:
    r = app.post("/generate", {**body(SEQS[0]), **over})
    assert r.status == 422, r.text
    assert needle in r.text
    if needle not in ("logprob_start_len", "token_ids_logprob"):
        assert app.engine.calls == []


def test_token_ids_logprob_from_the_cached_row_or_refused(app: App) -> None:
    seq = SEQS[0][:2]  # one scored position
    row = app.post("/v1/score", {"input_ids": [seq], "cache": "sg"}).json()["sequences"][0]
    ids, lps = row["topk_ids"][0], row["topk_logprobs"][0]
    asked = [ids[2], ids[0]]  # any order, answered in the asked order
    r = app.post("/generate", {**body(seq), "token_ids_logprob": asked})
    assert r.status == 200, r.text
    at = r.json()["meta_info"]["input_token_ids_logprobs"]
    assert at[0] is None and [e[1] for e in at[1]] == asked
    assert [e[0] for e in at[1]] == pytest.approx([lps[2], lps[0]])
    outside = next(i for i in range(1000) if i not in ids)
    bad = app.post("/generate", {**body(seq), "token_ids_logprob": [ids[0], outside]})
    assert bad.status == 422 and "outside the cached top" in bad.text, bad.text
