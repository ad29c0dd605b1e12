"""TRL 1.16's served-teacher distillation against one service holding two teachers.

What TRL 1.16 ships (read from its installed source):

* ``trl.experimental.async_distillation.AsyncDistillationTrainer`` (multi-teacher on-policy
  distillation, ``AsyncDistillationConfig.teacher_server_urls: dict[str, str]``). Its rollout
  worker (``async_rollout_worker._AsyncRolloutLoop``) samples the student on a ``vllm serve`` of
  the student that the trainer updates over NCCL (``weight_transfer.WeightTransferClient``), so
  the whole trainer cannot run on a CPU box; its teacher side is plain HTTP: each URL's
  ``GET /v1/models`` ``data[0].id`` names the teacher (``_resolve_teacher_model_names``), then
  ``POST /v1/completions`` with ``prompt_logprobs = teacher_top_k``, ``max_tokens: 1`` and
  ``temperature = teacher_temperature`` (``_score_with_teacher``). That side runs here, unchanged,
  with one URL per teacher of the same service (``/teachers/<name>``).
* ``trl.experimental.server_distillation.ServerDistillationTrainer`` (one
  ``teacher_model_server_url``; the student generates locally): a few real training steps of the
  tiny student run here against the service's second teacher, and its ``temperature`` is checked
  to reach the teacher (the rows equal a transformers forward at that temperature, and they are
  kept in that temperature's cache).
"""

from __future__ import annotations

import asyncio
from importlib.util import find_spec

import numpy as np
import pytest
from engine_support import full_forward_logprobs
from logitcache.server.metrics import scraped_total
from server_support import ThreadedServer, eventually, server_settings

# Checked, not imported: TRL and aiohttp load in the tests that use them, not at collection.
pytestmark = pytest.mark.skipif(
    find_spec("trl") is None or find_spec("aiohttp") is None, reason="needs trl and aiohttp"
)

T = 0.7
K = 5


@pytest.fixture(scope="module")
def two(tiny, tmp_path_factory):
    work = tmp_path_factory.mktemp("trl-teachers")
    other = work / "tiny-b"
    other.mkdir()
    for f in tiny.teacher_dir.iterdir():  # the same weights under another name
        (other / f.name).symlink_to(f)
    teachers = [
        {"name": "tiny-a", "model": str(tiny.teacher_dir)},
        {"name": "tiny-b", "model": str(other)},
    ]
    settings = server_settings(work, "", backend="hf", teachers=teachers, k=8)
    with ThreadedServer(settings, None) as srv:
        yield srv


def total(text: str, which: str) -> float:
    return scraped_total(text, f"logitcache_cache_{which}_total")


def student_completion(tiny, prompt: list[int], n: int = 10) -> list[int]:
    """``n`` tokens the tiny student samples after ``prompt`` (on-policy)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny.student_dir), dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt]), do_sample=True, max_new_tokens=n, min_new_tokens=n, pad_token_id=3
    )
    return out[0, len(prompt) :].tolist()


def test_async_distillation_teacher_side_with_two_teachers(two, tiny, heldout_sequences) -> None:
    from accelerate import PartialState
    from trl.experimental.async_distillation.async_rollout_worker import _AsyncRolloutLoop

    PartialState()  # the worker logs through accelerate (its child process sets this up)

    urls = {"math": f"{two.url}/teachers/tiny-a", "code": f"{two.url}/teachers/tiny-b"}
    loop = _AsyncRolloutLoop(
        model_name="student",
        dataset=[],
        processing_class=tiny.load_tokenizer(),
        eos_token_ids=[2],
        rollout_buffer=None,
        model_version_value=None,
        heartbeat_value=None,
        failed_event=None,
        exception_info_queue=None,
        metrics_queue=None,
        teacher_server_urls=urls,
        teacher_top_k=K,
        teacher_temperature=T,
    )
    prompt = list(heldout_sequences[1][:12])
    completion = student_completion(tiny, prompt)

    async def score() -> dict[str, tuple[list, list]]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            loop.session = session
            await loop._resolve_teacher_model_names()
            out = {}
            for teacher_id in urls:
                tid, url = loop._resolve_teacher_server_url({"teacher_id": teacher_id})
                name = loop.teacher_model_names[tid]
                out[name] = await loop._score_with_teacher(prompt, completion, url, name)
            return out

    got = asyncio.run(score())
    assert loop.teacher_model_names == {"math": "tiny-a", "code": "tiny-b"}
    ref = full_forward_logprobs(str(tiny.teacher_dir), prompt + completion, temperature=T)
    for ids, lps in got.values():  # both teachers: the same weights, at TRL's temperature
        assert len(ids) == len(completion)
        for j, (row_ids, row_lps) in enumerate(zip(ids, lps, strict=True)):
            t = len(prompt) - 1 + j  # the row predicting completion[j]
            top = np.argsort(-ref[t])[:K]
            assert row_ids[:K] == top.tolist()
            np.testing.assert_allclose(row_lps[:K], ref[t][top], atol=2e-3)
    with two.client() as c:
        caches = {x["name"]: x for x in c.get("/v1/caches").json()["caches"]}
        for name in ("openai-completions-t0.7", "openai-completions-tiny-b-t0.7"):
            url = f"/v1/caches/{name}"  # stored behind the answers
            eventually(lambda url=url: c.get(url).status_code == 200)
            assert c.get(f"/v1/caches/{name}").json()["manifest"]["temperature"] == T
    assert "openai-completions" not in caches  # nothing was scored at the engine's T = 1


def test_server_distillation_trainer_steps_against_the_second_teacher(two, tiny, tmp_path) -> None:
    texts = ["def read(path):", "class Queue:", "Return the", "import os"]
    trainer = _served_trainer(
        tiny, tmp_path, f"{two.url}/teachers/tiny-b", texts, temperature=T, beta=0.0, loss_top_k=K
    )
    with two.client() as c:
        r = c.get("/v1/caches/openai-completions-tiny-b-t0.7")
        before = r.json()["num_rows"] if r.status_code == 200 else 0
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(np.isfinite(losses)), trainer.state.log_history
    with two.client() as c:
        name = "/v1/caches/openai-completions-tiny-b-t0.7"  # stored behind the answers
        eventually(
            lambda: c.get(name).status_code == 200 and c.get(name).json()["num_rows"] > before
        )
        after = c.get(name).json()
    assert after["manifest"]["temperature"] == T  # TRL's temperature reached the teacher
    assert after["num_rows"] > before  # the student's completions were scored into it


def test_server_distillation_trainer_at_its_defaults_gets_the_actual_tokens(
    two, tiny, tmp_path
) -> None:
    """TRL's defaults (``beta=1.0``, ``loss_top_k=1``: reverse KL on the sampled token) need the
    teacher's logprob of every completion token, which TRL reads from the token's own entry in
    vLLM's ``prompt_logprobs`` (``VLLMClient._format_sequence_logprobs``; ``-inf`` when absent
    fails the step). The service answers it from the cache's ``actual_logprob`` array (FORMAT.md
    4.12): every value TRL trained on equals a plain transformers forward at TRL's temperature,
    and a repeated request is served with no engine work."""
    texts = ["def read(path):", "class Queue:"] * 2
    trainer = _served_trainer(tiny, tmp_path, f"{two.url}/teachers/tiny-a", texts)
    args = trainer.args
    assert (args.beta, args.loss_top_k) == (1.0, 1)  # TRL's defaults, untouched
    asked: list[tuple[list, list, dict]] = []
    client = trainer.teacher_client
    original = client.get_sequence_logprobs

    def recorded(sequences, prompt_lengths, **kw):
        out = original(sequences=sequences, prompt_lengths=prompt_lengths, **kw)
        asked.append((sequences, prompt_lengths, out))
        return out

    client.get_sequence_logprobs = recorded
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(np.isfinite(losses)), trainer.state.log_history
    assert len(asked) == 2
    checked = 0
    for sequences, prompt_lengths, out in asked:
        for seq, p, actual, top_ids, top_lps in zip(
            sequences,
            prompt_lengths,
            out["actual_logprobs"],
            out["logprob_token_ids"],
            out["logprobs"],
            strict=True,
        ):
            ref = full_forward_logprobs(str(tiny.teacher_dir), seq, temperature=args.temperature)
            for j, t in enumerate(range(p, len(seq))):  # position t: the row t - 1
                row = ref[t - 1]
                np.testing.assert_allclose(actual[j][0], row[seq[t]], atol=2e-4)
                assert top_ids[j][0] == int(np.argmax(row))
                np.testing.assert_allclose(top_lps[j][0], row.max(), atol=2e-3)  # float16 cache
                checked += 1
    assert checked >= 8
    with two.client() as c:
        before = {m: total(c.get("/metrics").text, m) for m in ("hits", "misses")}  # all teachers
        seqs, lens, _ = asked[-1]
        again = original(
            sequences=seqs, prompt_lengths=lens, top_logprobs=1, temperature=args.temperature
        )
        after = {m: total(c.get("/metrics").text, m) for m in ("hits", "misses")}
    assert after == {"hits": before["hits"] + len(seqs), "misses": before["misses"]}
    assert again["actual_logprobs"] == asked[-1][2]["actual_logprobs"]


def _served_trainer(tiny, tmp_path, url: str, prompts: list[str], **config):
    """TRL's ``ServerDistillationTrainer`` of the tiny student against the teacher at ``url``:
    two steps of two prompts on the CPU, TRL's defaults but for ``config``."""
    from datasets import Dataset
    from trl.experimental.server_distillation import (
        ServerDistillationConfig,
        ServerDistillationTrainer,
    )

    args = ServerDistillationConfig(
        output_dir=str(tmp_path / "out"),
        teacher_model_server_url=url,
        max_steps=2,
        per_device_train_batch_size=2,
        max_completion_length=8,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        **config,
    )
    return ServerDistillationTrainer(
        model=str(tiny.student_dir),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tiny.load_tokenizer(),
    )
