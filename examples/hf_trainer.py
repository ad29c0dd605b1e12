"""Distil a student from a teacher cache with the Hugging Face Trainer (``CacheDistillTrainer``).

One process, or one per GPU / CPU slot under torchrun (gloo on CPU, nccl on GPUs)::

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/hf_trainer.py \\
        --cache ./caches/corpus-k20 --student /path/to/student --out runs/hf --max-steps 100

Each rank reads its own part of the cache once per epoch (``client/hf.py``); checkpoints go to
``--out`` every ``--save-steps`` steps, and ``--resume`` continues from the newest one with the
same data stream. The student directory holds a ``*ForCausalLM`` and its tokenizer (the cache
refuses a student whose tokenizer differs from the teacher's). Prints one JSON line on rank 0:
steps, final training loss, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from logitcache.client import StreamConfig


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True, help="cache location (path, s3://..., server URL)")
    p.add_argument("--student", required=True, help="student model + tokenizer directory")
    p.add_argument("--out", required=True, help="output / checkpoint directory")
    p.add_argument("--tokens-per-item", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4, help="items per device per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ce-weight", type=float, default=0.0)
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    import torch
    from logitcache.client import CacheDataset
    from logitcache.client.hf import CacheDistillTrainer
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    distributed = "WORLD_SIZE" in os.environ
    targs = TrainingArguments(
        args.out,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        logging_steps=10,
        save_steps=args.save_steps,
        seed=args.seed,
        report_to=[],
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        ddp_backend=("nccl" if torch.cuda.is_available() else "gloo") if distributed else None,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    student = AutoModelForCausalLM.from_pretrained(args.student)
    ds = CacheDataset(
        args.cache,
        StreamConfig(
            tokens_per_item=args.tokens_per_item,
            mode="pack",
            batch_size=args.batch_size,
            seed=args.seed,
            rank=targs.process_index,
            world_size=targs.world_size,
        ),
        tokenizer=tokenizer,
        vocab_size=student.config,
    )
    trainer = CacheDistillTrainer(
        model=student,
        args=targs,
        train_dataset=ds,
        temperature=args.temperature,
        ce_weight=args.ce_weight,
    )
    resume = get_last_checkpoint(args.out) if args.resume and Path(args.out).is_dir() else None
    t0 = time.perf_counter()
    out = trainer.train(resume_from_checkpoint=resume)
    summary = {
        "steps": trainer.state.global_step,
        "train_loss": out.training_loss,
        "wall_s": round(time.perf_counter() - t0, 2),
        "world_size": targs.world_size,
        "resumed_from": resume,
    }
    if targs.process_index == 0:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
