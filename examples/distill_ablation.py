"""Issue #12 ablation: why every offline method sits above online KD (the page's figures).

* :func:`row_kl`: per training position, ``KL(cached top-k + tail || live teacher)`` with the
  live teacher's distribution collapsed onto the same buckets (the cached ids and one tail
  bucket): 0 (up to float16 rounding) when a batch's cached rows are the rows the live teacher
  computes on the batch's own inputs;
* :func:`row_check`: that KL over the first ``batches`` training batches of a cache at one item
  layout (``tokens_per_item`` x ``batch_items``), with the share of rows that differ and the
  top-1 agreement: how far the cache's targets are from what the teacher would say given the
  context the student actually sees;
* :func:`ablation_markdown`: the results page (``python -m experiments.distill --ablation``) from
  the per-seed reports of each configuration and the row checks.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.nn.functional as F

#: A row "differs" when its KL(cache || live) exceeds this (float16 rounding gives ~1e-6).
DIFF_NATS = 0.01


def row_kl(batch: dict[str, torch.Tensor], t_lp: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` ``KL(cached || live)`` over the cached ids plus one tail bucket (``t_lp``: the
    live teacher's log-probabilities ``[B, T, V]`` on the batch's inputs). Positions without a
    row are 0."""
    ids = batch["topk_ids"].long()
    clp = batch["topk_logprobs"].float().clamp_min(-80.0)
    live = t_lp.float().gather(-1, ids)
    live_tail = (1.0 - live.exp().sum(-1)).clamp_min(1e-12)
    c_tail = batch["tail_mass"].float().clamp_min(1e-12)
    kl = (clp.exp() * (clp - live)).sum(-1) + c_tail * (c_tail.log() - live_tail.log())
    return torch.where(batch["loss_mask"], kl, torch.zeros_like(kl))


def _packed(
    url: str,
    tokens_per_item: int,
    batch_items: int,
    seed: int,
    epoch: int,
    tokenizer: Any,
    vocab_size: int | None,
) -> Any:
    """The comparison's ``CacheDataset`` over ``url`` (packed, batched as it trains), at
    ``epoch``."""
    from logitcache.client import CacheDataset, StreamConfig

    ds = CacheDataset(
        url,
        StreamConfig(
            tokens_per_item=tokens_per_item, mode="pack", batch_size=batch_items, seed=seed
        ),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
    )
    ds.set_epoch(epoch)
    return ds


def same_stream(
    urls: list[str],
    *,
    tokens_per_item: int,
    batch_items: int,
    seed: int = 0,
    epoch: int = 1,
    batches: int = 30,
    tokenizer: Any = None,
    vocab_size: int | None = None,
) -> bool:
    """Whether the caches at ``urls`` (the scored cache and those derived from it) yield the same
    ``input_ids``, ``position_ids`` and ``loss_mask`` in their first ``batches`` batches of
    ``epoch``: every method trains on the same inputs in the same order."""
    streams = []
    for url in urls:
        ds = _packed(url, tokens_per_item, batch_items, seed, epoch, tokenizer, vocab_size)
        got = []
        for i, b in enumerate(ds):
            if i == batches:
                break
            got.append([b[k] for k in ("input_ids", "position_ids", "loss_mask")])
        streams.append(got)
    first = streams[0]
    return all(
        len(s) == len(first)
        and all(
            torch.equal(x, y)
            for a, b in zip(s, first, strict=True)
            for x, y in zip(a, b, strict=True)
        )
        for s in streams[1:]
    )


def row_check(
    url: str,
    teacher: Any,
    *,
    tokens_per_item: int,
    batch_items: int,
    seed: int = 0,
    batches: int = 30,
    tokenizer: Any = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """:func:`row_kl` over the first ``batches`` batches of epoch 0 of a top-k cache, packed as
    the comparison packs it (a sequence longer than ``tokens_per_item`` is cut into pieces that
    restart at position 0: the live teacher, like the student, no longer sees their prefix)."""
    from distill_train import _body

    ds = _packed(url, tokens_per_item, batch_items, seed, 0, tokenizer, vocab_size)
    kls, top1 = [], []
    with torch.no_grad():
        for i, batch in enumerate(ds):
            if i == batches:
                break
            t_lp = F.log_softmax(teacher.lm_head(_body(teacher, batch)), -1)
            mask = batch["loss_mask"]
            kls.append(row_kl(batch, t_lp)[mask])
            top1.append((t_lp.argmax(-1) == batch["topk_ids"][..., 0].long())[mask])
    kl = torch.cat(kls).double()
    differs = kl > DIFF_NATS
    rows = ds.lengths.astype("int64") - 1
    return {
        "share_rows_in_cut_pieces": cut_share(rows, tokens_per_item),
        "tokens_per_item": tokens_per_item,
        "batch_items": batch_items,
        "batches": len(kls),
        "rows": int(kl.numel()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "share_rows_differ": float(differs.double().mean()),
        "mean_kl_differing": float(kl[differs].mean()) if bool(differs.any()) else 0.0,
        "top1_agreement": float(torch.cat(top1).double().mean()),
    }


def cut_share(rows: Any, tokens_per_item: int) -> float:
    """Share of a cache's rows (``rows``: rows per sequence) that ``long_sequences="split"``
    puts in a piece after a sequence's first (row ``j >= T`` of a sequence: its piece starts at
    a multiple of ``T`` > 0 and restarts at position 0, without the prefix the row was scored
    with)."""
    import numpy as np
    from logitcache.client.collate import cut_rows

    r = np.asarray(rows, dtype=np.int64)
    return cut_rows(r + 1, tokens_per_item) / max(1, int(r.sum()))


def same_text(check: dict[str, Any]) -> str:
    """The row check's stream-identity cell (``""`` when it was not measured)."""
    if "same_stream" not in check:
        return ""
    yes = "yes" if check["same_stream"] else "**NO**"
    return f"{yes} ({check['stream_caches']} caches, epoch 1, first {check['batches']} batches)"


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error (0 with one seed) of ``a_i / b_i - 1`` over seeds."""
    d = [x / y - 1.0 for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
    return statistics.fmean(d), se


#: Pairs whose paired gap the page states: (method, reference) where both ran.
PAIRS = (
    ("offline_topk_tail@128", "online_kd"),
    ("online_topk_tail@128", "online_kd"),
    ("offline_topk_tail@128", "online_topk_tail@128"),
    ("offline_sampled@384", "online_kd"),
    ("online_sampled@384", "online_kd"),
    ("offline_sampled@384", "online_sampled@384"),
    ("offline_sampled@384", "offline_topk_tail@128"),
    ("offline_sampled_head@32+96", "online_kd"),
    ("offline_sampled_head@32+96", "online_sampled_head@32+96"),
    ("offline_sampled_head@32+96", "offline_sampled@384"),
    ("offline_sampled_head@32+96", "offline_topk_tail@128"),
)


def config_lines(name: str, reports: list[dict[str, Any]], label: Any) -> list[str]:
    """One configuration's table (per method: KL mean and per seed, paired gap to online KD,
    step time vs online KD) and its paired gaps."""
    names = [m for m in reports[0]["methods"] if all(m in r["methods"] for r in reports)]
    seeds = [r["train"]["seed"] for r in reports]
    t = reports[0]["train"]
    loads = [r["train"].get("load_avg") or {} for r in reports]
    load = ", ".join(
        f"seed {s} {x['min']:.1f}-{x['max']:.1f} (mean {x['mean']:.1f})"
        for s, x in zip(seeds, loads, strict=True)
        if x
    )
    out = [
        f"### {name}: {t['batch_items']} items x {t['tokens_per_item']} tokens, seeds {seeds}",
        "",
        f"1-minute load average while training (2 cores): {load or 'not recorded'}.",
        "",
        "| method | B/pos | held-out KL (mean) | KL per seed | vs online KD, paired (mean +- SE) "
        "| per seed | step vs online KD (median of seeds) |",
        "|---|---:|---:|---|---:|---|---:|",
    ]
    kl = {m: [r["methods"][m]["kl"] for r in reports] for m in names}
    merged = {m for r in reports for m in r.get("merged_methods", [])}
    unscaled = {m for r in reports for m in r.get("unscaled_methods", [])}
    for m in names:
        ref = kl.get("online_kd")
        gap = paired(kl[m], ref) if ref else (0.0, 0.0)
        per = ", ".join(
            f"{100 * (x / y - 1):+.1f}%" for x, y in zip(kl[m], ref or kl[m], strict=True)
        )
        step = statistics.median(
            r["methods"][m]["step_ms_median"] / r["methods"]["online_kd"]["step_ms_median"]
            for r in reports
            if "online_kd" in r["methods"]
        )
        sep = " (separate run: step time vs its own run's online KD)" if m in merged else ""
        if m in unscaled:
            sep = " (separate run without online KD: step time not comparable)"
        b = [r["methods"][m].get("bytes_per_position") for r in reports]
        bpos = f"{statistics.fmean(b):.0f}" if all(x is not None for x in b) else ""
        out.append(
            f"| {label(m)}{sep} | {bpos} | {statistics.fmean(kl[m]):.4f} | "
            f"{', '.join(f'{x:.4f}' for x in kl[m])} | "
            f"{100 * gap[0]:+.1f}% +- {100 * gap[1]:.1f} | {per} | "
            + ("n/a |" if m in unscaled else f"{step:.2f}x |")
        )
    gaps = []
    for a, b in PAIRS:
        if a in kl and b in kl:
            g = paired(kl[a], kl[b])
            gaps.append(f"`{a}` vs `{b}` {100 * g[0]:+.1f}% +- {100 * g[1]:.1f}")
    if gaps:
        out += ["", "Paired KL gaps (mean +- standard error over seeds): " + "; ".join(gaps) + "."]
    return out


def ablation_markdown(
    configs: dict[str, list[dict[str, Any]]],
    checks: list[dict[str, Any]],
    *,
    command: str,
    intro: list[str],
    label: Any,
    verdicts: dict[str, list[str]] | None = None,
) -> str:
    """The ablation page: the row checks, then one table per configuration."""
    r0 = next(iter(configs.values()))[0]
    lines = [
        "# Why offline distillation sits above online KD (issue #12 ablation)",
        "",
        f"- command: `{command}` (per seed and configuration: `{r0['command']}` with the "
        "configuration's `--seed`, `--methods`, `--tokens-per-item`, `--batch-items`)",
        f"- machine: {r0['machine']} (shared; 1 torch thread per process)",
        f"- teacher {r0['models']['teacher_params']:,} params, student "
        f"{r0['models']['student_params']:,} params, vocab {r0['models']['vocab_size']}; "
        f"scored cache {r0['cache']['num_sequences']} sequences (pieces of <= "
        f"{r0['plan']['seq_len']} tokens), k={r0['cache']['k']}; {r0['train']['steps']} steps, "
        f"AdamW lr {r0['train']['lr']}; held-out {r0['heldout']['positions']:,} positions in "
        f"windows of {r0['heldout']['window']} tokens, full-vocabulary KL(teacher || student)",
        "",
        *[x for para in intro for x in (para, "")],
        "## Cached rows vs the live teacher on the same training batches",
        "",
        "KL(cached top-k + tail || live teacher collapsed onto the same buckets), per training "
        f"position, first batches of epoch 0 (seed 0); a row differs when KL > {DIFF_NATS}.",
        "",
        "| items x tokens | cache rows in cut pieces (whole cache) | rows checked | mean KL | "
        "share of rows that differ | mean KL of those | max KL | top-1 agreement | same inputs "
        "from every method's cache |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c['batch_items']} x {c['tokens_per_item']} | "
            f"{100 * c['share_rows_in_cut_pieces']:.1f}% | {c['rows']:,} | "
            f"{c['mean_kl']:.2e} | {100 * c['share_rows_differ']:.1f}% | "
            f"{c['mean_kl_differing']:.4f} | {c['max_kl']:.2e} | "
            f"{100 * c['top1_agreement']:.2f}% | {same_text(c)} |"
        )
    lines += ["", "## Training runs", ""]
    for name, reports in configs.items():
        lines += [*config_lines(name, reports, label), ""]
        if verdicts and verdicts.get(name):
            lines += ["On this configuration's seed means: " + " ".join(verdicts[name]), ""]
    return "\n".join(lines)


__all__ = ["DIFF_NATS", "ablation_markdown", "paired", "row_check", "row_kl", "same_stream"]
