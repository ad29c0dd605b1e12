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
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asgi_support import LiveApp
from engine_support import FakeEngine, app_settings, fake_logprobs
from logitcache.cache_format import SequenceRecord

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
            # the actual token's logprob: from the row when it is there, else the cache's
            # actual_logprob (FORMAT.md 4.12; the fake teacher's exact value)
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
                exact = fake_logprobs(seq, 300, 1.0)[t - 1, seq[t]]
                assert tok[t][0] == pytest.approx(exact, abs=1e-6)


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
        ({"token_ids_logprob": [1, 300]}, "token_ids_logprob"),
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
    assert app.engine.calls == [] and app.engine.id_calls == []


def test_token_ids_logprob_from_the_cached_row_or_exact_from_the_engine(app: App) -> None:
    """Asked ids all in the cached top-k: read from the row, no engine work; an id outside it,
    or a sequence not cached: exact ``log_softmax(z / T)`` from the engine's ``score_ids``."""
    from engine_support import fake_logprobs

    seq = SEQS[0][:3]  # two scored positions
    row = app.post("/v1/score", {"input_ids": [seq], "cache": "sg"}).json()["sequences"][0]
    ids, lps = row["topk_ids"], row["topk_logprobs"]
    common = [i for i in ids[0] if i in ids[1]][:2] or None
    asked = common or [ids[0][2], ids[0][0]]
    if common is None:  # the rows share no id: ask at the last position only
        r = app.post("/generate", {**body(seq), "logprob_start_len": 1, "token_ids_logprob": asked})
    else:
        r = app.post("/generate", {**body(seq), "token_ids_logprob": asked})
    assert r.status == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["exact_token_ids"] is False and app.engine.id_calls == []
    at = meta["input_token_ids_logprobs"]
    last = at[-1]
    assert [e[1] for e in last] == asked  # any order, answered in the asked order
    want = dict(zip(ids[-1], lps[-1], strict=True))
    assert [e[0] for e in last] == pytest.approx([want[i] for i in asked])

    outside = [i for i in range(300) if i not in ids[0] and i not in ids[1]][:3]
    for t in (None, 0.7):
        params = {"max_new_tokens": 0, **({} if t is None else {"temperature": t})}
        asked = [outside[0], ids[1][0], outside[2]]
        cache = {} if t is None else {"cache": None}  # T = 0.7: a cache of its own (a miss)
        r = app.post(
            "/generate",
            {**body(seq), "sampling_params": params, "token_ids_logprob": asked, **cache},
        )
        assert r.status == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["exact_token_ids"] is True
        assert app.engine.temperatures[-1] == (1.0 if t is None else t)
        ref = fake_logprobs(seq, 300, 1.0 if t is None else t)
        at = meta["input_token_ids_logprobs"]
        assert at[0] is None and len(at) == len(seq)
        for pos in (1, 2):
            assert [e[1] for e in at[pos]] == asked
            assert [e[0] for e in at[pos]] == pytest.approx(ref[pos - 1][asked].tolist(), abs=1e-5)


def test_token_ids_logprob_per_sequence_on_a_miss_is_exact_and_stored(app: App) -> None:
    from engine_support import fake_logprobs
    from logitcache.protocol import SglangMetaInfo

    asked = [[7, 250], [3, 299, 0]]
    r = app.post("/generate", body(SEQS, cache="fresh", token_ids_logprob=asked))
    assert r.status == 200, r.text
    metas = [SglangMetaInfo.model_validate(x["meta_info"]) for x in r.json()]  # typed answer
    assert all(m.exact_token_ids for m in metas) and app.engine.id_calls == [2]  # one call
    assert [x["meta_info"]["cached"] for x in r.json()] == [False, False]
    for out, seq, ids in zip(r.json(), SEQS, asked, strict=True):
        ref = fake_logprobs(seq, 300)
        for pos, entry in enumerate(out["meta_info"]["input_token_ids_logprobs"][1:], start=1):
            assert [e[1] for e in entry] == ids
            assert [e[0] for e in entry] == pytest.approx(ref[pos - 1][ids].tolist(), abs=1e-5)
    again = app.post("/v1/score", {"input_ids": SEQS, "cache": "fresh"}).json()
    assert again["hits"] == 2  # the miss was stored


@pytest.mark.parametrize(
    "over",
    [
        {"token_ids_logprob": [300]},  # outside the fake vocabulary
        {"token_ids_logprob": [1, 2], "input_ids": [SEQS[0], SEQS[1]]},
        {"token_ids_logprob": [[1], [2], [3]], "input_ids": [SEQS[0]]},
    ],
)
def test_bad_token_ids_logprob_is_a_422_and_writes_nothing(
    app: App, over: dict, tmp_path: Path
) -> None:
    b = {**body(SEQS[0]), "cache": "never", **over}
    if over.get("token_ids_logprob") == [1, 2]:  # valid: the control case
        assert app.post("/generate", b).status == 200
        return
    r = app.post("/generate", b)
    assert r.status == 422, r.text
    assert app.engine.calls == [] and app.engine.id_calls == []
    assert not (tmp_path / "caches" / "never").exists()


def _ref_json_lp(lp: float | None) -> float | None:
    """A logprob as SGLang's JSON carries it: ``-inf`` (a token the teacher rules out) becomes
    ``null``, as SGLang's orjson answers write it."""
    return lp if lp is None or math.isfinite(lp) else None


def _ref_meta(
    rec: SequenceRecord,
    start: int,
    top: int,
    at: tuple[list[int], np.ndarray, bool] | None,
    decode: Any,
    cached: bool,
    mask: np.ndarray | None,
    rid: str,
) -> dict[str, Any]:
    """The reference: ``meta_info`` built as Python objects, written by Starlette's
    ``JSONResponse`` (the route's first implementation)."""
    ids = rec.input_ids.tolist()
    rows_ids = rec.topk_ids.tolist()
    rows_lps = rec.topk_logprobs.tolist()
    actual = None if rec.actual_logprob is None else rec.actual_logprob.tolist()
    at_lps = at[1].tolist() if at is not None else []
    row0 = max(start, 1) - 1
    token: list[list[Any]] = []
    tops: list[list[list[Any]] | None] = []
    at_ids: list[list[list[Any]] | None] = []
    spread: list[list[int] | None] = []
    for t in range(start, len(ids)):
        x = ids[t]
        if t == 0:
            token.append([None, x, decode(x)])
            tops.append(None)
            at_ids.append(None)
            spread.append(None)
            continue
        row = dict(zip(rows_ids[t - 1], rows_lps[t - 1], strict=True))
        if at is not None:
            at_ids.append(
                [
                    [_ref_json_lp(lp), i, decode(i)]
                    for i, lp in zip(at[0], at_lps[t - 1 - row0], strict=True)
                ]
            )
            if mask is not None:
                spread.append([i for i, m in zip(at[0], mask[t - 1 - row0], strict=True) if m])
        lp = row.get(x, None if actual is None else actual[t - 1])
        token.append([_ref_json_lp(lp), x, decode(x)])
        tops.append(
            [
                [_ref_json_lp(lp), tid, decode(tid)]
                for tid, lp in zip(rows_ids[t - 1][:top], rows_lps[t - 1][:top], strict=True)
            ]
            if top
            else None
        )
    chosen = {"input_token_ids_logprobs": at_ids, "exact_token_ids": at[2]} if at else {}
    if at is not None and mask is not None:
        chosen["approximated_token_ids"] = spread
    return {
        "id": rid,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "cached_tokens": len(ids) if cached else 0,
        "input_token_logprobs": token,
        "input_top_logprobs": tops,
        **chosen,
        "output_token_logprobs": [],
        "output_top_logprobs": [],
        "cached": cached,
    }


def _record(start_k: int, actual: bool, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    n, k = 9, start_k
    topk = np.stack([rng.choice(40, k, replace=False) for _ in range(n - 1)]).astype(np.int32)
    ids = rng.integers(0, 40, n).astype(np.int32)
    ids[2] = topk[1, k - 1]  # a next token in its row's top-k (last column)
    lps = np.sort(rng.normal(-3, 2, (n - 1, k)).astype(np.float32), axis=1)[:, ::-1].copy()
    lps[3, 0] = -np.inf  # a token the teacher rules out
    lps[4, 1] = -0.0
    act = rng.normal(-4, 1, n - 1).astype(np.float32) if actual else None
    if act is not None:
        act[5] = -np.inf
    return SequenceRecord("k", ids, topk, lps, np.full(n - 1, 0.1, np.float32), actual_logprob=act)


TEXTS = {i: t for i, t in enumerate(["a", '"q"', "\\", "é", "\n", "", "日本", "\u2028"] * 5)}


@pytest.mark.parametrize("start", [0, 1, 3])
@pytest.mark.parametrize("top", [0, 2, 4])
@pytest.mark.parametrize("chosen", [None, [3, 17, 0], [21]])
@pytest.mark.parametrize("variant", ["plain", "actual", "texts", "approximate"])
def test_the_answer_is_byte_equal_to_the_reference_json(start, top, chosen, variant) -> None:
    """The meta_info written as JSON text is byte for byte what ``JSONResponse`` makes of the
    reference's Python objects (ids, logprobs as ``repr`` or ``null``, texts, key order)."""
    from logitcache.server.api.sglang import _meta_json
    from starlette.responses import JSONResponse

    rec = _record(4, variant == "actual", seed=start * 7 + top)
    decode = TEXTS.get if variant == "texts" else (lambda i: None)
    at = mask = None
    if chosen is not None:
        rows = len(rec.input_ids) - max(start, 1)
        vals = np.random.default_rng(top).normal(-5, 2, (rows, len(chosen))).astype(np.float32)
        vals[0, 0] = -np.inf
        at = (chosen, vals, variant != "approximate")
        if variant == "approximate":
            mask = np.random.default_rng(1).random((rows, len(chosen))) < 0.5
    for cached in (False, True):
        want = JSONResponse(_ref_meta(rec, start, top, at, decode, cached, mask, "r1")).body
        got = _meta_json(rec, start, top, at, decode, cached, mask, "r1").encode()
        assert got == want


@pytest.mark.parametrize("chosen", [[], [4]])
def test_the_shortest_answers_are_byte_equal_to_the_reference_json(chosen) -> None:
    """Two tokens (one row), an empty id list: still the reference's bytes."""
    from logitcache.server.api.sglang import _meta_json
    from starlette.responses import JSONResponse

    n = 2
    rec = SequenceRecord(
        "k",
        np.arange(n, dtype=np.int32),
        np.full((n - 1, 2), 3, np.int32) + np.arange(2, dtype=np.int32),
        np.full((n - 1, 2), -1.5, np.float32),
        np.zeros(n - 1, np.float32),
    )
    at = (chosen, np.full((n - 1, len(chosen)), -2.25, np.float32), True)
    for start, top in ((0, 0), (0, 2), (n - 1, 2)):
        want = JSONResponse(_ref_meta(rec, start, top, at, str, True, None, "r")).body
        assert _meta_json(rec, start, top, at, str, True, None, "r").encode() == want


def test_a_ruled_out_token_is_null_in_the_json_answer() -> None:
    """A ``-inf`` logprob (the teacher rules a token out: a padded vocabulary row, an asked id)
    is ``null`` in SGLang's answer, as orjson writes it, never invalid JSON or a 500."""
    from logitcache.server.api.sglang import _meta_json

    inf = float("-inf")
    rec = SequenceRecord(
        key="k",
        input_ids=np.array([1, 2, 3], dtype=np.int32),
        topk_ids=np.array([[2, 5], [3, 6]], dtype=np.int32),
        topk_logprobs=np.array([[-0.1, inf], [inf, -0.2]], dtype=np.float32),
    )
    at = ([6], np.array([[inf], [-0.2]], dtype=np.float32), True)
    back = json.loads(_meta_json(rec, 0, 2, at, str, False, None, "r"))  # strict JSON
    assert back["input_token_logprobs"][2][0] is None  # token 3: -inf at row 1
    assert back["input_top_logprobs"][1][1][0] is None
    assert back["input_token_ids_logprobs"][1][0][0] is None
    assert back["input_token_ids_logprobs"][2][0][0] == pytest.approx(-0.2)
