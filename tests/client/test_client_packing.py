"""Packed batches through a HF causal LM: no document sees another, through the wrapper's forward.

The fixture student (``build_tiny_models``, a small ``LlamaForCausalLM``, float32) runs on packed
``CacheDataset`` batches of a cache of held-out token sequences; every document of every item must
get the hidden states it gets when run alone (tolerance: max |diff| <= 1e-4, float32 on CPU), for
every attention implementation transformers offers on CPU here (``eager``, ``sdpa``, and
``flex_attention``, marked slow: it compiles). The reference is each document run alone with
eager attention. A negative control runs the leaky call the README used to show
(``model.model(input_ids, position_ids)``, cache on) and checks that it does leak, so the
comparison can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

TOL = 1e-4
IMPLS = ("eager", "sdpa")


@pytest.fixture(scope="module")
def packed_batches(tiny: Any, heldout_sequences: list[list[int]], tmp_path_factory: Any) -> list:
    from client_support import build_cache
    from logitcache.client import CacheDataset

    url = tmp_path_factory.mktemp("packing") / "cache"
    vocab = _student(tiny, "sdpa").config.vocab_size
    build_cache(url, [torch.tensor(s).numpy() for s in heldout_sequences], vocab_size=vocab)
    ds = CacheDataset(url, tokens_per_item=256, mode="pack", batch_size=3, seed=1)
    batches = list(ds)
    assert max(int(b["segment_ids"].max()) for b in batches) >= 3, "items must hold several docs"
    assert any(bool((b["attention_mask"] == 0).any()) for b in batches), "need padding too"
    return batches


def _student(tiny: Any, impl: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny.student_dir, attn_implementation=impl, dtype=torch.float32
    )
    return model.eval()


def _docs(batch: dict[str, torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(item, boolean token mask) of every document in the batch."""
    out = []
    for b in range(batch["input_ids"].shape[0]):
        for s in range(1, int(batch["segment_ids"][b].max()) + 1):
            out.append((b, batch["segment_ids"][b] == s))
    return out


def _alone(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]


@pytest.fixture(scope="module")
def alone(tiny: Any, packed_batches: list) -> list[list[torch.Tensor]]:
    """Per batch, per document: its hidden states run alone (eager attention, no packing)."""
    model = _student(tiny, "eager")
    with torch.no_grad():
        return [
            [_alone(model, batch["input_ids"][b][mask]) for b, mask in _docs(batch)]
            for batch in packed_batches
        ]


@pytest.mark.parametrize("impl", [*IMPLS, pytest.param("flex_attention", marks=pytest.mark.slow)])
def test_each_document_equals_the_document_alone(
    tiny: Any, packed_batches: list, alone: list, impl: str
) -> None:
    from logitcache.client.packing import attn_implementation, packed_hidden_states

    model = _student(tiny, impl)
    assert attn_implementation(model) == impl
    worst, leak, n_docs = 0.0, 0.0, 0
    pairs = list(zip(packed_batches, alone, strict=True))
    if impl not in IMPLS:  # flex compiles per shape: one batch
        pairs = pairs[:1]
    with torch.no_grad():
        for batch, refs in pairs:
            hidden = packed_hidden_states(model, batch)
            assert hidden.shape == (*batch["input_ids"].shape, model.config.hidden_size)
            leaky = None
            if impl in IMPLS:  # the call the README used to show: the cache is on
                leaky = model.model(
                    input_ids=batch["input_ids"], position_ids=batch["position_ids"]
                ).last_hidden_state
            for (b, mask), ref in zip(_docs(batch), refs, strict=True):
                worst = max(worst, float((hidden[b][mask] - ref).abs().max()))
                if leaky is not None:
                    leak = max(leak, float((leaky[b][mask] - ref).abs().max()))
                n_docs += 1
    print(f"{impl}: {n_docs} documents, max |packed - alone| = {worst:.2e}, leaky call {leak:.2f}")
    assert n_docs >= (20 if impl in IMPLS else 3)
    assert worst <= TOL
    if impl in IMPLS:
        assert leak > 100 * TOL, "the negative control did not leak: the comparison is vacuous"


def test_goes_through_the_wrapper_and_returns_the_lm_head_input(tiny: Any, packed_batches: list):
    from logitcache.client.packing import packed_hidden_states, unwrap_model

    model = _student(tiny, "sdpa")

    class Wrapper(torch.nn.Module):  # stands for DDP / FSDP / accelerate: hooks live on forward
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, **kwargs: Any) -> Any:
            self.calls += 1
            assert kwargs["use_cache"] is False and "attention_mask" not in kwargs
            return self.module(**kwargs)

    wrapped = Wrapper(model)
    assert unwrap_model(wrapped) is model
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    batch = packed_batches[0]
    with torch.no_grad():
        hidden = packed_hidden_states(wrapped, batch)
        ids, pos = batch["input_ids"], batch["position_ids"]
        full = model(input_ids=ids, position_ids=pos, use_cache=False)
    handle.remove()
    assert wrapped.calls == 1
    # logits_to_keep=1: the packed call projected one position only; the full call all of them
    assert seen[0].shape[1] == 1 and seen[1].shape[1] == batch["input_ids"].shape[1]
    torch.testing.assert_close(hidden, seen[1], rtol=0, atol=1e-5)
    assert full.logits.shape[1] == batch["input_ids"].shape[1]


def test_varlen_boundaries_for_flash_attention() -> None:
    from logitcache.client.errors import ConfigError
    from logitcache.client.packing import packed_model_inputs, varlen_kwargs

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 4, 5, 0]])
    kw = varlen_kwargs(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 7, 13, 14]
    assert kw["cu_seq_lens_q"].dtype == torch.int32 and kw["max_length_q"] == 6
    batch = {"input_ids": torch.zeros_like(pos), "position_ids": pos}
    flash = packed_model_inputs(batch, attn_implementation="flash_attention_2")
    assert flash["cu_seq_lens_k"] is flash["cu_seq_lens_q"] and flash["use_cache"] is False
    assert "cu_seq_lens_q" not in packed_model_inputs(batch, attn_implementation="sdpa")
    with pytest.raises(ConfigError):
        varlen_kwargs(torch.tensor([[1, 2, 0]]))
    with pytest.raises(ConfigError):
        packed_model_inputs({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
