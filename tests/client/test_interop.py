"""``logitcache export --format parquet|distillkit`` and ``logitcache import`` against files laid
out the way axolotl's KD code and DistillKit's capture code lay them out.

The peer-side writers and readers below are written for these tests from the peers' published
code (axolotl ``integrations/kd``: chat_template.transform_logprobs, the KD collator and trainer;
DistillKit ``sample_logits_vllm.py``, ``compression/{bitpack,monotonic_logprobs}.py``), in torch
as the peers do, independently of ``logitcache.client.interop``'s numpy code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from client_support import VOCAB, build_cache, make_sequences
from typer.testing import CliRunner

FP = "sha256:test-fingerprint"


def _cli(*args: str) -> Any:
    from logitcache.cache_format.cli import app

    return CliRunner().invoke(app, list(args))


@pytest.fixture()
def cache(tmp_path: Path) -> tuple[str, list]:
    url = tmp_path / "cache"
    records = build_cache(url, make_sequences(7, seed=4, min_len=2, max_len=30))
    return str(url), records


def _read_cache(url: str) -> list:
    from logitcache.cache_format import CacheReader, validate

    assert validate(url).ok
    reader = CacheReader(url)
    return reader.sequences(range(reader.num_sequences))


# -- axolotl ----------------------------------------------------------------------------------
def test_export_parquet_is_axolotl_kd_layout(cache: tuple[str, list], tmp_path: Path) -> None:
    import datasets

    url, records = cache
    out = tmp_path / "kd.parquet"
    res = _cli("export", url, str(out), "--format", "parquet")
    assert res.exit_code == 0, res.output
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert ds.column_names == [
        "input_ids",
        "labels",
        "attention_mask",
        "target_token_ids",
        "target_logprobs",
        "target_mask",
    ]
    assert len(ds) == len(records)
    for row, rec in zip(ds, records, strict=True):
        L, k = len(rec.input_ids), rec.topk_ids.shape[1]
        ids, lp = np.array(row["target_token_ids"]), np.array(row["target_logprobs"])
        mask = np.array(row["target_mask"])
        assert ids.shape == lp.shape == mask.shape == (L, k)
        assert row["labels"] == row["input_ids"] == rec.input_ids.tolist()
        # axolotl's contract: target row j is the distribution over input_ids[j + 1]
        assert (ids[:-1, 0] == np.asarray(row["input_ids"][1:])).all()
        np.testing.assert_array_equal(ids[:-1], rec.topk_ids)
        np.testing.assert_array_equal(lp[:-1], rec.topk_logprobs)
        assert mask[:-1].all() and not mask[-1].any() and (lp[-1] == -1e9).all()


def _axolotl_rows(seqs: list[np.ndarray], k: int) -> tuple[list[dict], list[tuple]]:
    """Rows as axolotl's KD chat-template strategy emits them, from vLLM-style prompt logprobs:
    teacher coverage starts at token ``front + 1`` (``front`` padded rows), prompt rows carry
    real, renormalised logprobs with mask 0, one row has only ``k - 1`` slots, the last row is
    padding. Returns the rows and, per sequence, the expected cache (tokens, ids, logprobs)."""
    pad = -1e9
    rows, expected = [], []
    rng = np.random.default_rng(0)
    for n, tokens in enumerate(seqs):
        L = len(tokens)
        front = 1 if n % 2 else 0
        prompt = min(2, L - 1)
        t_ids, t_lp, t_mask = [[0] * k] * front, [[pad] * k] * front, [[0] * k] * front
        exp_ids, exp_lp = [], []
        for j in range(front, L - 1):
            width = k - 1 if j == L - 2 and n == 3 else k
            ids = [int(tokens[j + 1])] + [
                int(x)
                for x in rng.choice(
                    [v for v in range(VOCAB) if v != tokens[j + 1]], width - 1, replace=False
                )
            ]
            raw = torch.sort(torch.randn(width) * 2, descending=True).values
            lp = torch.log_softmax(raw, dim=0)  # rescale_topk_logprobs at T1 == T2: renormalised
            valid = 0 if j < prompt else 1
            t_ids.append(ids + [0] * (k - width))
            t_lp.append(lp.tolist() + [pad] * (k - width))
            t_mask.append([valid] * width + [0] * (k - width))
            exp_ids.append(ids)
            exp_lp.append(lp.tolist())
        t_ids.append([0] * k)
        t_lp.append([pad] * k)
        t_mask.append([0] * k)
        labels = [-100 if j <= prompt else int(t) for j, t in enumerate(tokens)]
        rows.append(
            {
                "input_ids": [int(t) for t in tokens],
                "attention_mask": [1] * L,
                "labels": labels,
                "target_token_ids": t_ids,
                "target_logprobs": t_lp,
                "target_mask": t_mask,
            }
        )
        expected.append((np.asarray(tokens[front:]), exp_ids, exp_lp))
    return rows, expected


def test_import_axolotl_rows(tmp_path: Path) -> None:
    import datasets

    seqs = make_sequences(6, seed=9, min_len=5, max_len=20)
    rows, expected = _axolotl_rows(seqs, k=5)
    src = tmp_path / "axolotl.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(src))
    url = str(tmp_path / "imported")
    args = ["import", str(src), url, "--format", "axolotl", "--teacher-model", "t"]
    res = _cli(*args, "--tokenizer-fingerprint", FP, "--vocab-size", str(VOCAB))
    assert res.exit_code == 0, res.output
    got = _read_cache(url)
    assert len(got) == len(seqs)
    assert {r.topk_ids.shape[1] for r in got} == {4}  # one row had 4 valid slots: k = 4
    for rec, (tokens, ids, lp) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(rec.input_ids, tokens)
        np.testing.assert_array_equal(rec.topk_ids, np.array([r[:4] for r in ids]))
        want = np.array([r[:4] for r in lp], dtype=np.float32)
        np.testing.assert_allclose(rec.topk_logprobs, want, rtol=0, atol=2e-3)  # float16 store
        tail = 1 - np.exp(np.array([r[:4] for r in lp])).sum(axis=1)
        np.testing.assert_allclose(rec.tail_mass, tail, atol=2e-3)


def test_axolotl_round_trip(cache: tuple[str, list], tmp_path: Path) -> None:
    url, records = cache
    out, back = tmp_path / "kd.parquet", str(tmp_path / "back")
    assert _cli("export", url, str(out), "--format", "parquet").exit_code == 0
    res = _cli(
        "import",
        str(out),
        back,
        "--format",
        "axolotl",
        "--teacher-model",
        "t",
        "--tokenizer-fingerprint",
        FP,
        "--vocab-size",
        str(VOCAB),
    )
    assert res.exit_code == 0, res.output
    for a, b in zip(records, _read_cache(back), strict=True):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-3)


# -- DistillKit -------------------------------------------------------------------------------
def _torch_pack(x: torch.Tensor, bits: int) -> torch.Tensor:
    """DistillKit's bit packing: each value MSB first, the stream padded to bytes."""
    shifts = torch.arange(bits - 1, -1, -1)
    stream = ((x.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).flatten(-2)
    stream = torch.nn.functional.pad(stream, (0, (-stream.shape[-1]) % 8))
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    return (stream.view(*stream.shape[:-1], -1, 8) * weights).sum(-1).to(torch.uint8)


def _torch_unpack(b: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    stream = ((b.unsqueeze(-1) >> torch.arange(7, -1, -1)) & 1).flatten(-2)[..., : n * bits]
    return (stream.view(*b.shape[:-1], n, bits).long() * 2 ** torch.arange(bits - 1, -1, -1)).sum(
        -1
    )


def test_export_distillkit_reads_back_like_distillkit(cache: tuple[str, list], tmp_path: Path):
    import pyarrow.parquet as pq
    import yaml

    url, records = cache
    out = tmp_path / "dk"
    assert _cli("export", url, str(out), "--format", "distillkit").exit_code == 0
    cfg = yaml.safe_load((out / "compression_config.yaml").read_text())
    assert cfg["d"] == VOCAB and cfg["k"] == cfg["exact_k"] == 4 and cfg["residual_bins"] == []
    table = pq.read_table(out / "data_0.parquet")
    assert str(table.schema.field("input_ids").type) == "list<element: uint64>"
    bits = math.ceil(math.log2(cfg["d"]))
    for row, rec in zip(table.to_pylist(), records, strict=True):
        assert row["input_ids"] == rec.input_ids.tolist()
        lp_bytes = torch.tensor(row["compressed_logprobs"], dtype=torch.uint8)
        values = lp_bytes.view(torch.float32)  # exact_dtype float32, no delta encoding
        ids = _torch_unpack(torch.tensor(row["bytepacked_indices"], dtype=torch.uint8), bits, 4)
        assert values.shape == (len(rec.input_ids) - 1, 4)  # one row per position but the first
        np.testing.assert_array_equal(ids.numpy(), rec.topk_ids)
        np.testing.assert_array_equal(values.numpy(), rec.topk_logprobs)


def _write_distillkit(out: Path, seqs: list[np.ndarray], cfg: dict) -> list[tuple]:
    """A capture directory as DistillKit's sample_logits_vllm writes it, with the compression of
    ``cfg`` (bf16 exact values, delta encoding, polynomial tail, no residual bins). Returns the
    (ids, logprobs) each row decodes to."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    k, exact_k, d = cfg["k"], cfg["exact_k"], cfg["d"]
    bits = math.ceil(math.log2(d))
    out.mkdir()
    (out / "compression_config.yaml").write_text(yaml.safe_dump(cfg))
    gen = torch.Generator().manual_seed(1)
    rows, decoded = [], []
    for tokens in seqs:
        R = len(tokens) - 1
        ids = torch.stack([torch.randperm(d, generator=gen)[:k] for _ in range(R)])
        lp = torch.sort(torch.log_softmax(torch.randn(R, d, generator=gen) * 3, -1), -1, True)
        top = lp.values[:, :k]
        deltas = torch.cat([top[:, :1], top[:, 1:] - top[:, :-1]], -1)
        exact = deltas[:, :exact_k].to(torch.bfloat16)
        t = torch.arange(k - exact_k, dtype=torch.float32)
        X = torch.stack([torch.ones_like(t), t, t.sqrt()], -1)
        coeffs = torch.linalg.lstsq(X, deltas[:, exact_k:].T).solution.T.contiguous()
        lp_bytes = torch.cat([exact.view(torch.uint8), coeffs.view(torch.uint8)], -1)
        rows.append(
            {
                "input_ids": [int(x) for x in tokens],
                "compressed_logprobs": lp_bytes.tolist(),
                "bytepacked_indices": _torch_pack(ids, bits).tolist(),
            }
        )
        approx = coeffs @ X.T
        dec = torch.cumsum(torch.cat([exact.float(), approx], -1), -1)
        decoded.append((ids.numpy(), dec.numpy()))
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.uint64())),
            ("compressed_logprobs", pa.list_(pa.list_(pa.uint8()))),
            ("bytepacked_indices", pa.list_(pa.list_(pa.uint8()))),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), out / "data_0.parquet")
    return decoded


def test_import_distillkit_capture(tmp_path: Path) -> None:
    cfg = {
        "d": 300,
        "k": 8,
        "exact_k": 3,
        "exact_dtype": "bfloat16",
        "polynomial_terms": [0, 1, "sqrt"],
        "term_dtype": "float32",
        "residual_bins": [],
        "delta_encoding": True,
        "error_diffusion": False,
    }
    seqs = make_sequences(5, seed=2, min_len=3, max_len=25)
    decoded = _write_distillkit(tmp_path / "dk", seqs, cfg)
    url = str(tmp_path / "imported")
    res = _cli(
        "import",
        str(tmp_path / "dk"),
        url,
        "--format",
        "distillkit",
        "--teacher-model",
        "t",
        "--tokenizer-fingerprint",
        FP,
    )
    assert res.exit_code == 0, res.output
    got = _read_cache(url)
    from logitcache.cache_format import CacheReader

    assert CacheReader(url).manifest.vocab_size == 300 and got[0].topk_ids.shape[1] == 8
    for rec, tokens, (ids, lp) in zip(got, seqs, decoded, strict=True):
        np.testing.assert_array_equal(rec.input_ids, tokens)
        order = np.argsort(-lp, axis=1, kind="stable")  # the cache keeps rows descending
        np.testing.assert_array_equal(rec.topk_ids, np.take_along_axis(ids, order, 1))
        want = np.minimum(np.take_along_axis(lp, order, 1), 0)
        np.testing.assert_allclose(rec.topk_logprobs, want, rtol=1e-3, atol=2e-3)


def test_import_refuses_residual_bins_and_writes_nothing(tmp_path: Path) -> None:
    import yaml

    seqs = make_sequences(2, seed=3, min_len=3, max_len=6)
    cfg = {
        "d": 300,
        "k": 8,
        "exact_k": 3,
        "exact_dtype": "bfloat16",
        "polynomial_terms": [0, 1, "sqrt"],
        "term_dtype": "float32",
        "residual_bins": [],
        "delta_encoding": True,
    }
    _write_distillkit(tmp_path / "dk", seqs, cfg)
    cfg["residual_bins"] = [{"scale_dtype": "float16", "element_bits": 4, "num_elements": 5}]
    (tmp_path / "dk" / "compression_config.yaml").write_text(yaml.safe_dump(cfg))
    url = tmp_path / "nope"
    res = _cli(
        "import",
        str(tmp_path / "dk"),
        str(url),
        "--format",
        "distillkit",
        "--teacher-model",
        "t",
        "--tokenizer-fingerprint",
        FP,
    )
    assert res.exit_code == 2
    assert "residual_bins" in res.output and len(res.output.strip().splitlines()) == 1
    assert not url.exists()


def test_import_out_of_vocab_ids_is_refused_before_writing(tmp_path: Path) -> None:
    import datasets

    rows, _ = _axolotl_rows(make_sequences(3, seed=9, min_len=5, max_len=20), k=5)
    src = tmp_path / "axolotl.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(src))
    url = tmp_path / "nope"
    res = _cli(
        "import", str(src), str(url), "--format", "axolotl", "--teacher-model", "t",
        "--tokenizer-fingerprint", FP, "--vocab-size", "50",
    )  # fmt: skip
    assert res.exit_code == 2 and "outside vocab" in res.output
    assert not url.exists()
