"""``CacheDistillTrainer`` under ``torchrun --nproc-per-node 2`` (gloo, CPU) vs one process.

Three real runs of ``transformers.Trainer`` on a hand-built cache (``client_support``: 44
sequences of 2..40 tokens, vocab 97, k=4) and a tiny random Llama (same init on every run):

* ``ddp``: 2 ranks, 2 epochs, checkpoints every ``save`` steps (one lands mid-epoch 1);
* ``resumed``: 2 fresh ranks resuming from that mid-epoch-1 checkpoint;
* ``single``: 1 process, gradient accumulation 2, whose micro-batches are rank 0's and rank 1's
  batches of the same step (the same global batch).

Every rank records, per optimizer step, the documents it trained (token tuples, mapped back to
cache sequences) and its share of the loss; the assertions below re-derive each claim from them.
Run as a script (``python -m torch.distributed.run ... tests/client/test_client_hf.py worker ...``) this
file is the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
T, B, NUM_SEQ = 48, 2, 44


# ---------------------------------------------------------------------------------------------
# worker (runs in the torchrun / single processes)
# ---------------------------------------------------------------------------------------------
def _student() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def worker(argv: list[str]) -> None:
    import torch
    from logitcache.client import CacheDataset
    from logitcache.client.hf import CacheDistillTrainer, RankEvenStream, planned_units
    from transformers import TrainingArguments

    opts = json.loads(argv[0])
    single = opts["mode"] == "single"
    args = TrainingArguments(
        str(Path(opts["out"]) / ("one" if single else "ddp")),
        per_device_train_batch_size=B,
        gradient_accumulation_steps=2 if single else 1,
        num_train_epochs=2,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=opts["save"],
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,  # a parameter without gradient would be an error
        seed=0,
    )
    rank = args.process_index

    def dataset(r: int, w: int) -> CacheDataset:
        return CacheDataset(
            opts["cache"], tokens_per_item=T, batch_size=B, seed=5, rank=r, world_size=w
        )

    log: list[dict[str, Any]] = []

    class Recording(CacheDistillTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, False, num_items_in_batch)
            ids, seg = inputs["input_ids"].numpy(), inputs["segment_ids"].numpy()
            docs = [
                [int(t) for t in ids[b][seg[b] == s]]
                for b in range(ids.shape[0])
                for s in range(1, int(seg[b].max(initial=0)) + 1)
            ]
            step = self.state.global_step
            log.append({"step": step, "loss": float(loss.detach()), "docs": docs})
            return loss

    def run(trainer: Any, out: Path, resume: str | None = None) -> None:
        log.clear()
        trainer.train(resume_from_checkpoint=resume)
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).numpy()
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / f"params-{rank}.npy", params)
        (out / f"log-{rank}.json").write_text(json.dumps(log))

    out = Path(opts["out"])
    if single:  # rank 0's and rank 1's batches of a step as one step's two micro-batches

        class Interleaved(RankEvenStream):
            def __init__(self) -> None:
                parts = [dataset(r, 2) for r in (0, 1)]
                units = max(planned_units(p, e, r) for e in (0, 1) for r, p in enumerate(parts))
                super().__init__(parts[0], units)
                self.parts = [RankEvenStream(p, units) for p in parts]

            def __len__(self) -> int:
                return 2 * self.units_per_epoch

            def set_epoch(self, epoch: int) -> None:
                for p in self.parts:
                    p.set_epoch(epoch)

            def __iter__(self):
                for a, b in zip(*self.parts, strict=True):
                    yield a
                    yield b

        class Reference(Recording):
            def get_train_dataloader(self):
                from logitcache.client.hf import _EpochLoader

                self._stream = Interleaved()
                return _EpochLoader(self._stream, batch_size=None)

        run(Reference(model=_student(), args=args, train_dataset=dataset(0, 1)), out / "one")
        return
    # the full run, then fresh trainers resuming from its mid-epoch-1 checkpoint
    run(Recording(model=_student(), args=args, train_dataset=dataset(rank, 2)), out / "ddp")
    args.output_dir = str(out / "res")
    trainer = Recording(model=_student(), args=args, train_dataset=dataset(rank, 2))
    run(trainer, out / "res", resume=str(out / "ddp" / f"checkpoint-{opts['save']}"))


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
def _launch(opts: dict[str, Any], nproc: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if nproc == 1:
        cmd = [sys.executable, __file__, "worker", json.dumps(opts)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(opts["port"]),
            __file__,
            "worker",
            json.dumps(opts),
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _read(out: Path, ranks: int) -> tuple[list[list[dict]], list[np.ndarray]]:
    logs = [json.loads((out / f"log-{r}.json").read_text()) for r in range(ranks)]
    params = [np.load(out / f"params-{r}.npy") for r in range(ranks)]
    return logs, params


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from client_support import build_cache, make_sequences
    from logitcache.client import CacheDataset
    from logitcache.client.hf import planned_units

    work = tmp_path_factory.mktemp("hf")
    seqs = make_sequences(NUM_SEQ, seed=11, min_len=2, max_len=40)
    cache = work / "cache"
    build_cache(cache, seqs)
    parts = [
        CacheDataset(cache, tokens_per_item=T, batch_size=B, seed=5, rank=r, world_size=2)
        for r in (0, 1)
    ]
    units = {(e, r): planned_units(p, e, r) for e in (0, 1) for r, p in enumerate(parts)}
    per_epoch = max(units.values())
    save = per_epoch + per_epoch // 2  # a checkpoint in the middle of epoch 1
    base = {"cache": str(cache), "save": save, "out": str(work)}
    _launch({**base, "mode": "ddp", "port": _free_port()}, 2)
    _launch({**base, "mode": "single"}, 1)
    index = {tuple(int(t) for t in s): i for i, s in enumerate(seqs)}
    return {
        "index": index,
        "per_epoch": per_epoch,
        "units": units,
        "save": save,
        "ddp": _read(work / "ddp", 2),
        "res": _read(work / "res", 2),
        "one": _read(work / "one", 1),
    }


def _by_step(log: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in log:
        out.setdefault(e["step"], []).append(e)
    return out


@pytest.mark.slow
def test_every_row_trained_exactly_once_per_epoch(runs: dict[str, Any]) -> None:
    (logs, _), n, index = runs["ddp"], runs["per_epoch"], runs["index"]
    for r in (0, 1):
        assert [e["step"] for e in logs[r]] == list(range(2 * n)), "ranks ran different steps"
    for epoch in (0, 1):
        seen = [
            index[tuple(d)]
            for r in (0, 1)
            for e in logs[r]
            if epoch * n <= e["step"] < (epoch + 1) * n
            for d in e["docs"]
        ]
        assert sorted(seen) == list(range(NUM_SEQ)), f"epoch {epoch}: not every row exactly once"
    # the two epochs use different orders (set_epoch reached the dataset)
    first = [index[tuple(d)] for e in logs[0][:n] for d in e["docs"]]
    second = [index[tuple(d)] for e in logs[0][n:] for d in e["docs"]]
    assert first != second


@pytest.mark.slow
def test_parameters_bit_identical_across_ranks(runs: dict[str, Any]) -> None:
    _, params = runs["ddp"]
    assert params[0].shape == params[1].shape and params[0].size > 1000
    assert np.array_equal(params[0], params[1])
    _, resumed = runs["res"]
    assert np.array_equal(resumed[0], resumed[1])


@pytest.mark.slow
def test_loss_matches_one_process_with_same_global_batch(runs: dict[str, Any]) -> None:
    (logs, params), (one_logs, one_params) = runs["ddp"], runs["one"]
    ddp_steps = [_by_step(log) for log in logs]
    one = _by_step(one_logs[0])
    assert sorted(one) == sorted(ddp_steps[0]) == list(range(2 * runs["per_epoch"]))
    ddp_loss, one_loss = [], []
    for s in sorted(one):
        # same documents in the step (rank 0's then rank 1's batch == the two micro-batches)
        assert [e["docs"] for e in one[s]] == [ddp_steps[r][s][0]["docs"] for r in (0, 1)]
        # a rank's share is sum/N * world; the global loss is the mean of the shares
        ddp_loss.append(sum(ddp_steps[r][s][0]["loss"] for r in (0, 1)) / 2)
        one_loss.append(sum(e["loss"] for e in one[s]))
    np.testing.assert_allclose(ddp_loss, one_loss, rtol=2e-5, atol=1e-6)
    assert all(np.isfinite(one_loss)) and min(one_loss) > 0.5
    np.testing.assert_allclose(params[0], one_params[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_resume_continues_the_data_stream_exactly(runs: dict[str, Any]) -> None:
    (logs, params), (res_logs, res_params), save = runs["ddp"], runs["res"], runs["save"]
    for r in (0, 1):
        after = [e for e in logs[r] if e["step"] >= save]
        assert len(after) > 0 and res_logs[r][0]["step"] == save
        assert [(e["step"], e["docs"]) for e in res_logs[r]] == [
            (e["step"], e["docs"]) for e in after
        ]
        np.testing.assert_allclose(
            [e["loss"] for e in res_logs[r]], [e["loss"] for e in after], rtol=1e-6, atol=1e-7
        )
    np.testing.assert_allclose(res_params[0], params[0], rtol=1e-6, atol=1e-7)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    worker(sys.argv[2:])
