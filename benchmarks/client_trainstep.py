"""What a distillation training step consumes: positions/s of a student step on one GPU.

The loader benchmark (``client_bench.py``) is compared against this figure. A randomly initialised
Llama-style student (transformers, bf16, SDPA attention) takes packed items shaped like the
loader's (``--batch`` items of ``--tokens`` positions, per-segment ``position_ids``) and runs
forward, the fused top-k distillation loss of ``logitcache.client.loss`` on its final hidden
states, backward and an AdamW step. Timing: ``--warmup`` steps, then the median of ``--steps``
steps, each closed by ``torch.cuda.synchronize()``.

Usage (on a CUDA machine; the loss package is imported from ``client/loss`` directly when the
project is not installed there)::

    python benchmarks/client_trainstep.py [--sizes small 1b] [--batch 8] [--tokens 2048] [--k 20]
        [--json benchmarks/results/client_trainstep.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]

SIZES = {  # hidden, layers, heads, ffn
    "small": (768, 12, 12, 2048),
    "1b": (2048, 16, 16, 5632),
}


def load_loss() -> Any:
    """``topk_distill_loss`` from the installed project, else from the ``client/loss`` folder."""
    try:
        from logitcache.client.loss import topk_distill_loss

        return topk_distill_loss
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "lc_loss",
            REPO / "client" / "loss" / "__init__.py",
            submodule_search_locations=[str(REPO / "client" / "loss")],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["lc_loss"] = module
        spec.loader.exec_module(module)
        return module.topk_distill_loss


def batch(b: int, t: int, k: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """A packed batch like the loader's: segments of 64..1024 tokens, top-k rows, tail mass."""
    g = torch.Generator().manual_seed(0)
    pos = torch.zeros(b, t, dtype=torch.long)
    for row in range(b):
        at = 0
        while at < t:
            n = min(int(torch.randint(64, 1025, (1,), generator=g)), t - at)
            pos[row, at : at + n] = torch.arange(n)
            at += n
    ids = torch.randint(0, vocab, (b, t), generator=g)
    topk = (torch.randint(0, vocab, (b, t, 1), generator=g) + 1237 * torch.arange(k)) % vocab
    logits = torch.sort(torch.randn(b, t, k, generator=g) * 2, dim=-1, descending=True).values
    lp = torch.log_softmax(logits, dim=-1) + torch.log(torch.tensor(0.9))
    tail = 1 - lp.exp().sum(-1)
    out = {
        "input_ids": ids,
        "position_ids": pos,
        "topk_ids": topk,
        "topk_logprobs": lp,
        "tail": tail,
    }
    return {name: v.to(device) for name, v in out.items()}


def measure(size: str, args: argparse.Namespace, loss_fn: Any) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, ffn = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=args.tokens,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batch(args.batch, args.tokens, args.k, args.vocab, "cuda")
    n = args.batch * args.tokens

    def step() -> float:
        out = model.model(input_ids=data["input_ids"], position_ids=data["position_ids"])
        h = out.last_hidden_state.reshape(n, hidden)
        loss = loss_fn(
            h,
            model.lm_head.weight,
            data["topk_ids"].reshape(n, args.k),
            data["topk_logprobs"].reshape(n, args.k),
            data["tail"].reshape(n),
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    return {
        "size": size,
        "params": params,
        "positions_per_step": n,
        "step_s_median": med,
        "step_s_all": times,
        "positions_per_s": n / med,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["small", "1b"], choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    loss_fn = load_loss()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
        "runs": [],
    }
    for size in args.sizes:
        r = measure(size, args, loss_fn)
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in r.items() if k != "step_s_all"}), flush=True)
        result["runs"].append(r)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
