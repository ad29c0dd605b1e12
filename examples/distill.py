"""End-to-end offline distillation on this machine with the tiny local teacher.

1. build (or find) the tiny teacher/student fixture (``logitcache.fixtures.tiny``);
2. start the teacher service (``python -m logitcache.server``, vLLM backend by default) on
   127.0.0.1 and score the training corpus into a top-k cache with one batch job over HTTP
   (``TeacherClient``), with a progress bar; check the cache with ``validate`` and against the
   PyTorch teacher;
3. derive the caches the offline methods train from, each sized to a storage budget in bytes per
   position *measured on disk* (``--budgets``, default about 100 and 250 B/position): a top-k
   cache (the first k' columns of the scored rows) and a sampled cache (random-sampling KD,
   ``targets="sampled"``, drawn from the PyTorch teacher with the estimator of
   ``logitcache.cache_format.sampling``) per budget (``distill_caches.py``);
4. train copies of the student on the same stream (same init, same data order): CE only,
   online full-vocabulary KD (teacher in the loop), and per budget offline top-k, top-k + tail
   mass, and sampled targets (``distill_train.py``); ``offline_exact`` trains from a second
   cache the same service scores with ``targets="hidden"`` (the teacher's final hidden states and
   its head: the exact full-vocabulary target, rebuilt in the loss);
5. evaluate every student on held-out text: full-vocabulary KL(teacher || student), perplexity
   and the calibration (ECE) of its top-1 (``distill_eval.py``); print the table and, per
   offline method, its held-out KL vs online KD's, bytes per position and step time, beside the
   paired-seed figures of the committed study (``experiments/results/distill_t128_24seeds.md``).

Everything is written under the work directory (``--workdir``, default ``runs/distill``): the
caches, ``distill.json`` and ``distill.md``; never into tracked files (the committed results
pages are written by ``experiments/distill.py``, which runs this over paired seeds). ``--quick``
(the test suite's mode) scores a small corpus and trains a few steps.

``--teacher-temperature T`` (default 1) distils from the sharpened teacher ``p_T =
softmax(z / T)`` (the same network, logits divided by ``T``) in EVERY method: the service's engine
scores the cache at ``T`` (server ``--temperature``), online KD's target and the sampled targets
are ``softmax(z / T)``, and held-out KL(teacher || student) is measured against ``p_T``. The
cache name gets a ``-T<T>`` suffix. Every run also checks a few cached sequences against the
PyTorch teacher's ``log_softmax(z / T)`` and writes the largest differences into the report.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from distill_eval import evaluate, make_heldout  # noqa: E402
from distill_report import add_ratios, markdown, method_summary  # noqa: E402
from distill_service import TeacherService, score_corpus  # noqa: E402
from distill_train import (  # noqa: E402
    LOSS_IMPLS,
    METHODS,
    TrainSettings,
    make_run,
    parse_head,
    parse_method,
    train_interleaved,
)

#: Offline methods that get one run per storage budget (unless given as ``method@n``).
BUDGETED = ("offline_topk", "offline_topk_tail", "offline_sampled")
#: Candidate k (top-k) and draws (sampled) whose bytes/position are measured to meet a budget.
TOPK_CANDIDATES = (4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
#: A peaked teacher repeats its head tokens: with a 1024-token vocabulary 256 draws hold fewer
#: distinct ids, so the larger budget needs more draws than with 4096.
DRAW_CANDIDATES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
#: ``offline_sampled@384~tau0.8``: a sampled method whose cache is drawn at its own proposal
#: temperature (``--proposal-temperature`` for the others), beside the plain ``@384`` one.
TAU_MARK = "~tau"
#: ``offline_topk_tail@32~sel0.2``: the same method trained on the top 20% teacher-entropy rows
#: of each sequence only (``StreamConfig(entropy_top_fraction=0.2)``, client/selection.py), from
#: its cache with per-row entropy (the service scores with ``--entropy``).
SEL_MARK = "~sel"


def split_tau(spec: str) -> tuple[str, float | None]:
    """``"offline_sampled@384~tau0.8"`` -> ``("offline_sampled@384", 0.8)``; a spec without
    ``~tau`` -> ``(spec, None)``. Only offline sampled methods with ``@n`` take one; ``tau`` must
    be finite and > 0."""
    spec_, mark, t = spec.partition(TAU_MARK)
    if not mark:
        return spec, None
    try:
        tau = float(t)
    except ValueError:
        tau = float("nan")
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"bad method {spec!r}: ~tau needs a finite proposal temperature > 0")
    if not (spec_.startswith("offline_sampled") and "@" in spec_):
        raise ValueError(f"bad method {spec!r}: only offline_sampled@n methods take ~tau")
    return spec_, tau


def split_sel(spec: str) -> tuple[str, float | None]:
    """``"offline_topk_tail@32~sel0.2"`` -> ``("offline_topk_tail@32", 0.2)``; a spec without
    ``~sel`` -> ``(spec, None)``. Only offline methods take one; the fraction is in ``(0, 1]``."""
    spec_, mark, x = spec.partition(SEL_MARK)
    if not mark:
        return spec, None
    try:
        frac = float(x)
    except ValueError:
        frac = float("nan")
    if not 0 < frac <= 1:
        raise ValueError(f"bad method {spec!r}: ~sel needs a fraction in (0, 1]")
    if not spec_.startswith("offline"):
        raise ValueError(f"bad method {spec!r}: only offline methods take ~sel")
    return spec_, frac


def plain_spec(spec: str) -> tuple[str, float | None]:
    """The method spec without its ``~sel`` and ``~tau`` marks, and its ``~tau``."""
    return split_tau(split_sel(spec)[0])


@dataclass(frozen=True)
class Plan:
    """What one run does (defaults: the full comparison at one seed)."""

    workdir: Path
    k: int = 256
    seq_len: int = 128
    train_seqs: int = 1200  # 0: every training piece
    tokens_per_item: int = 128
    batch_items: int = 8
    steps: int = 100
    lr: float = 3e-3
    seed: int = 0
    eval_tokens: int = 8192
    methods: tuple[str, ...] = ("online_kd", *BUDGETED)
    budgets: tuple[float, ...] = (100.0, 250.0)
    probe_seqs: int = 200
    topk_candidates: tuple[int, ...] = TOPK_CANDIDATES
    draw_candidates: tuple[int, ...] = DRAW_CANDIDATES
    proposal_temperature: float = 1.0
    reuse_cache: bool = False
    backend: str = "vllm"
    read_from: str = "store"
    threads: int = 1
    teacher_temperature: float = 1.0
    loss_impl: str = "auto"
    out_json: Path | None = None
    out_md: Path | None = None

    @property
    def entropy(self) -> bool:
        """Whether a method selects rows by entropy (``~sel``): the service then scores with
        ``--entropy``."""
        return any(split_sel(m)[1] is not None for m in self.methods)

    @property
    def temperature_tag(self) -> str:
        """``""`` at ``T = 1`` (the default names), else ``"_T0.5"``-style."""
        t = self.teacher_temperature
        return "" if t == 1.0 else f"_T{t:g}"


QUICK = {
    "k": 64,
    "seq_len": 64,
    "train_seqs": 200,
    "tokens_per_item": 64,
    "batch_items": 8,
    "steps": 40,
    "lr": 5e-3,
    "eval_tokens": 2048,
    "methods": ("offline_topk_tail", "offline_sampled"),
    "budgets": (100.0,),
    "probe_seqs": 20,
    "topk_candidates": (16, 32, 64),
    "draw_candidates": (16, 32, 64),
}


def parse_args(argv: list[str] | None) -> tuple[Plan, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--workdir", type=Path, default=ROOT / "runs/distill")
    p.add_argument("--quick", action="store_true", help="small and fast (the test suite's mode)")
    p.add_argument(  # -k as in logitcache-server; --k kept for existing commands
        "-k", "--k", type=int, help="k of the scored cache (the largest top-k budget)"
    )
    p.add_argument("--seq-len", type=int, help="longest training piece (tokens)")
    p.add_argument("--train-seqs", type=int, help="training pieces to score (0: all)")
    p.add_argument("--tokens-per-item", type=int)
    p.add_argument("--batch-items", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, help="data order and sampling seed")
    p.add_argument("--eval-tokens", type=int)
    p.add_argument(
        "--methods",
        help=f"comma list of {','.join(METHODS)}; offline ones run once per budget, or "
        "give method@n (k or draws) for one fixed cache",
    )
    p.add_argument("--budgets", help="comma list of storage budgets in bytes/position")
    p.add_argument("--proposal-temperature", type=float, help="sampled targets' tau")
    p.add_argument(
        "--topk-candidates",
        help="comma list of k whose bytes/position are probed to meet a budget (default: "
        f"{','.join(map(str, TOPK_CANDIDATES))})",
    )
    p.add_argument(
        "--draw-candidates",
        help="comma list of draws per row probed to meet a budget (default: "
        f"{','.join(map(str, DRAW_CANDIDATES))})",
    )
    p.add_argument(
        "--reuse-cache",
        action="store_true",
        default=None,
        help="skip the service when the work dir's cache already holds every sequence",
    )
    p.add_argument("--backend", choices=("vllm", "hf"))
    p.add_argument(
        "--read-from",
        choices=("store", "http"),
        help="train from the Zarr store directly or stream the cache from the service over HTTP",
    )
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--teacher-temperature",
        type=float,
        help="distil every method from softmax(teacher_logits / T) (default 1)",
    )
    p.add_argument(
        "--loss-impl",
        choices=LOSS_IMPLS,
        help="topk_distill_loss impl of the sparse-target methods (default auto: small_vocab on "
        "this CPU setup; fused_chunked reproduces the pages before session 7)",
    )
    p.add_argument("--out-json", type=Path, help="default: <workdir>/distill.json")
    p.add_argument("--out-md", type=Path, help="default: <workdir>/distill.md")
    args = p.parse_args(argv)
    plan = Plan(workdir=args.workdir)
    if args.quick:
        plan = replace(plan, **QUICK)
    given = {k: v for k, v in vars(args).items() if v is not None and k not in ("quick", "workdir")}
    if "methods" in given:
        given["methods"] = tuple(m.strip() for m in given["methods"].split(",") if m.strip())
        for m in given["methods"]:
            try:
                parse_method(plain_spec(m)[0])
            except ValueError as e:
                if m not in BUDGETED:
                    p.error(str(e))
    for key in ("topk_candidates", "draw_candidates"):
        if key in given:
            try:
                given[key] = tuple(int(x) for x in given[key].split(",") if x.strip())
            except ValueError:
                p.error(f"--{key.replace('_', '-')} must be integers, got {given[key]!r}")
            if not given[key] or min(given[key]) < 1:
                p.error(f"--{key.replace('_', '-')} needs sizes >= 1")
    if "budgets" in given:
        try:
            given["budgets"] = tuple(float(b) for b in given["budgets"].split(",") if b.strip())
        except ValueError:
            p.error(f"--budgets must be numbers, got {given['budgets']!r}")
        if not given["budgets"] or min(given["budgets"]) <= 0:
            p.error("--budgets needs positive bytes/position values")
    t = given.get("teacher_temperature", 1.0)
    if not (math.isfinite(t) and t > 0):
        p.error(f"--teacher-temperature must be finite and > 0, got {t}")
    tau = given.get("proposal_temperature", 1.0)
    if not (math.isfinite(tau) and tau > 0):
        p.error(f"--proposal-temperature must be finite and > 0, got {tau}")
    plan = replace(plan, **given)
    if plan.out_json is None:
        plan = replace(plan, out_json=plan.workdir / "distill.json")
    if plan.out_md is None:
        plan = replace(plan, out_md=plan.workdir / "distill.md")
    return plan, args


@dataclass
class TemperedTeacherService(TeacherService):
    """:class:`TeacherService` whose engine scores at ``temperature`` (server ``--temperature``:
    cached rows are the top-k of ``log_softmax(z / T)``)."""

    temperature: float = 1.0
    entropy: bool = False

    def command(self) -> list[str]:
        extra = ["--entropy"] if self.entropy else []
        return [*super().command(), "--temperature", repr(float(self.temperature)), *extra]


class ScaledHead(torch.nn.Module):
    """``head(h) / T``: wraps a teacher's lm head so every consumer sees the logits ``z / T``."""

    def __init__(self, head: torch.nn.Module, temperature: float):
        super().__init__()
        self.head = head
        self.inv_temperature = 1.0 / temperature

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = self.head(hidden)
        return z if self.inv_temperature == 1.0 else z * self.inv_temperature


def sharpen(teacher: Any, temperature: float) -> Any:
    """The same teacher with logits ``z / T`` (in place; no new parameters). Both the model's
    forward (``.logits``) and a direct ``teacher.lm_head(h)`` (online KD) go through it."""
    if temperature != 1.0:
        teacher.lm_head = ScaledHead(teacher.lm_head, temperature)
    return teacher


def check_cache(url: str, teacher: Any, sequences: int = 4) -> dict[str, Any]:
    """Compare the first ``sequences`` cached sequences with the PyTorch teacher (already
    sharpened): ``max |cached logprob - log_softmax(z / T)[id]|`` over every cached entry, the
    same for the tail mass ``1 - sum_topk p``, and the share of rows whose cached top-1 is the
    teacher's argmax (float16 storage bounds the logprob difference to ~|logprob| * 2^-11)."""
    from logitcache.cache_format import CacheReader

    reader = CacheReader(url)
    lp_diff, tail_diff, top1, rows = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for i in range(min(sequences, reader.num_sequences)):
            rec = reader.sequence(i)
            ids = torch.as_tensor(rec.input_ids, dtype=torch.long)[None]
            lp = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1].float(), -1).numpy()
            want = np.take_along_axis(lp, rec.topk_ids.astype(np.int64), axis=1)
            lp_diff = max(lp_diff, float(np.abs(rec.topk_logprobs - want).max()))
            tail = 1.0 - np.exp(want).sum(-1)
            tail_diff = max(tail_diff, float(np.abs(rec.tail_or_computed() - tail).max()))
            top1 += int((rec.topk_ids[:, 0] == lp.argmax(-1)).sum())
            rows += lp.shape[0]
    return {
        "sequences": min(sequences, reader.num_sequences),
        "rows": rows,
        "max_abs_logprob_diff": lp_diff,
        "max_abs_tail_mass_diff": tail_diff,
        "top1_agreement": top1 / max(rows, 1),
    }


def temperature_note(t: float, chk: dict[str, Any]) -> str:
    """The report's line on the teacher temperature and on :func:`check_cache`'s figures."""
    which = (
        "teacher temperature T=1 (the teacher as trained)"
        if t == 1.0
        else f"teacher temperature T={t:g}: every method distils from softmax(z / {t:g}) (the "
        "service scored the cache at T, online KD's target and the held-out KL use the same "
        "sharpened PyTorch teacher; the teacher ppl above is its ppl at T)"
    )
    return (
        f"{which}. Cache vs PyTorch teacher at T on {chk['rows']} rows of {chk['sequences']} "
        f"sequences: max |logprob diff| {chk['max_abs_logprob_diff']:.2e} (float16 storage), "
        f"max |tail mass diff| {chk['max_abs_tail_mass_diff']:.2e}, top-1 agreement "
        f"{100 * chk['top1_agreement']:.1f}%"
    )


def committed_sequences(url: str) -> int:
    """Sequences already committed in the cache at ``url`` (0 if there is none yet)."""
    from logitcache.cache_format import CacheReader, FormatError

    try:
        return CacheReader(url).num_sequences
    except (FormatError, OSError):
        return 0


def prefix_mass(logprobs: np.ndarray, ks: tuple[int, ...]) -> dict[str, float]:
    """``{str(j): mean_rows sum_{i < j} exp(logprobs[:, i])}``: the teacher mass the first ``j``
    cached columns hold (what an ``@j`` method trains on), for each ``j <= k`` in ``ks``."""
    k = logprobs.shape[1]
    cum = np.cumsum(np.exp(logprobs.astype(np.float64)), axis=1)
    return {str(j): float(cum[:, j - 1].mean()) for j in sorted(set(ks)) if 1 <= j <= k}


def cache_stats(url: str) -> dict[str, Any]:
    """Validation verdict and the figures of the cache the job wrote."""
    from logitcache.cache_format import CacheReader, validate

    report = validate(url)
    reader = CacheReader(url)
    block = reader.rows(0, min(reader.num_rows, 200_000))
    return {
        "url": url,
        "valid": bool(report.ok),
        "validation": str(report).splitlines()[0],
        "num_sequences": reader.num_sequences,
        "num_rows": reader.num_rows,
        "k": reader.manifest.k,
        "logprob_dtype": reader.manifest.logprob_dtype,
        "mean_topk_mass": float(1.0 - np.mean(block.tail_mass)),
        "mean_mass_first": prefix_mass(block.topk_logprobs, (16, 64, reader.manifest.k)),
        "manifest": reader.manifest.to_attrs(),
    }


def resolve_methods(
    plan: Plan, src: str, teacher: Any, caches: Path
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Concrete method specs and the cache of each offline one.

    A budgeted method (no ``@n``) becomes one spec per budget: the k (top-k) or number of draws
    (sampled) whose cache, built for the first ``probe_seqs`` sequences, measured closest to the
    budget in bytes/position on disk. Returns the specs and ``{spec: {"url", "n", "budget"}}``
    (the full caches are built by :func:`build_caches`)."""
    from distill_caches import (
        bytes_per_position,
        cache_dir,
        derive_topk_cache,
        pick_for_budget,
        sampled_caches,
    )

    bases = {m for m in plan.methods if m in BUDGETED}
    probe: dict[str, dict[int, float]] = {}
    if bases & {"offline_topk", "offline_topk_tail"}:
        cands = [k for k in plan.topk_candidates if k <= plan.k]
        probe["topk"] = {
            k: bytes_per_position(
                derive_topk_cache(src, cache_dir(caches, f"probe-topk{k}"), k, plan.probe_seqs)
            )
            for k in cands
        }
    if "offline_sampled" in bases:
        dsts = {
            n: cache_dir(caches, f"probe-sampled{n}-s{plan.seed}-tau{plan.proposal_temperature:g}")
            for n in plan.draw_candidates
        }
        sampled_caches(
            src,
            dsts,
            teacher,
            seed=plan.seed,
            proposal_temperature=plan.proposal_temperature,
            limit=plan.probe_seqs,
        )
        probe["sampled"] = {n: bytes_per_position(u) for n, u in dsts.items()}
    specs: list[str] = []
    where: dict[str, dict[str, Any]] = {}
    for m in plan.methods:
        if m not in BUDGETED:
            specs.append(m)
            plain, tau = plain_spec(m)
            base, n = parse_method(plain)
            if n is not None and base.startswith("offline"):  # online ablations: no cache
                where[m] = {"n": n, "budget": None}
                if tau is not None:
                    where[m]["proposal_temperature"] = tau
            continue
        kind = "sampled" if m == "offline_sampled" else "topk"
        for b in plan.budgets:
            n = pick_for_budget(probe[kind], b)
            spec = f"{m}@{n}"
            if spec not in where:
                specs.append(spec)
                where[spec] = {"n": n, "budget": b}
    return specs, where | {"_probe": probe}


def build_caches(
    plan: Plan, src: str, teacher: Any, caches: Path, where: dict[str, dict[str, Any]]
) -> None:
    """Build the full cache of every offline spec (``where[spec]["url"]`` set, bytes measured)."""
    from distill_caches import (
        bytes_per_position,
        cache_dir,
        derive_topk_cache,
        mean_distinct,
        sampled_caches,
        selected_share,
    )

    src_k = committed_k(src)
    draws: dict[float, dict[int, str]] = {}  # per proposal temperature
    heads: dict[tuple[int, int, float], str] = {}
    for spec, info in where.items():
        if spec.startswith("_"):
            continue
        plain, _ = plain_spec(spec)
        tau = info.get("proposal_temperature", plan.proposal_temperature)
        base, n = parse_method(plain)
        if base == "offline_sampled_head":
            m, d = parse_head(plain)
            url = cache_dir(caches, f"sampled-head{m}+{d}-s{plan.seed}-tau{tau:g}")
            heads[(m, d, tau)] = url
        elif base == "offline_sampled":
            url = cache_dir(caches, f"sampled{n}-s{plan.seed}-tau{tau:g}")
            draws.setdefault(tau, {})[int(n)] = url
        elif n == src_k:
            url = src
        else:
            url = derive_topk_cache(src, cache_dir(caches, f"topk{n}"), n)
        info["url"] = url
    for tau, dsts in draws.items():
        print(
            f"[distill] sampling {sorted(dsts)} draws per row from the teacher (tau {tau:g})",
            flush=True,
        )
        sampled_caches(src, dsts, teacher, seed=plan.seed, proposal_temperature=tau)
    for (m, d, tau), url in heads.items():
        print(f"[distill] sampling head {m} + {d} draws per row from the teacher", flush=True)
        sampled_caches(src, {d: url}, teacher, seed=plan.seed, proposal_temperature=tau, head=m)
    for spec, info in where.items():
        if spec.startswith("_"):
            continue
        info["bytes_per_position"] = bytes_per_position(info["url"])
        frac = split_sel(spec)[1]
        if frac is not None:
            info["entropy_top_fraction"] = frac
            info["selected_share"] = selected_share(info["url"], frac)
        if spec.startswith("offline_sampled"):
            info["mean_distinct_ids"] = mean_distinct(info["url"])


def load_summary(samples: list[float]) -> dict[str, float]:
    """Min, mean and max of the 1-minute load averages sampled while training (``{}``: none)."""
    if not samples:
        return {}
    return {
        "min": min(samples),
        "mean": sum(samples) / len(samples),
        "max": max(samples),
        "samples": len(samples),
        "cores": os.cpu_count() or 0,
    }


def split_note(url: str, tokens_per_item: int) -> str:
    """A warning when items are shorter than the cached sequences: ``long_sequences="split"``
    cuts them into pieces that restart at position 0, so those pieces' cached rows condition on
    a prefix the student (and online KD's teacher) never sees (issue #12 ablation,
    experiments/results/distill_ablation.md); ``""`` when no row is cut."""
    from distill_ablation import cut_share
    from logitcache.cache_format import CacheReader

    reader = CacheReader(url)
    rows = [int(n) - 1 for n in reader.lengths]
    share = cut_share(rows, tokens_per_item)
    if share == 0.0:
        return ""
    return (
        f"{100 * share:.1f}% of the cache's rows lie in pieces cut from sequences longer than "
        f"--tokens-per-item {tokens_per_item} (longest {max(rows) + 1} tokens): their cached "
        "targets condition on a prefix the student never sees, while online KD's teacher sees "
        "the student's context; offline methods are handicapped (use --tokens-per-item >= "
        "--seq-len)"
    )


def spec_run(
    spec: str,
    load_student: Any,
    make_dataset: Any,
    teacher: Any,
    settings: Any,
    where: dict[str, dict[str, Any]],
    plan: Plan,
) -> Any:
    """:func:`make_run` for a spec that may carry ``~tau``: the loss is the plain method's (the
    stored importance weights already hold the proposal), the stream is the spec's own cache.
    ``offline_exact`` gets its hidden cache's head (float32, logit scale ``1 / T``)."""
    plain, _ = plain_spec(spec)
    head = None
    if plain == "offline_exact":
        from logitcache.client import load_head

        head = load_head(where[spec]["url"], dtype=torch.float32)
        head["teacher_logit_scale"] /= plan.teacher_temperature
    run = make_run(plain, load_student, lambda _m: make_dataset(spec), teacher, settings, head)
    run.method = spec
    return run


def hidden_cache(
    plan: Plan, service: TeacherService, name: str, sequences: list[list[int]], reuse: bool
) -> str:
    """The ``targets="hidden"`` cache of the same sequences (cache ``<name>-hidden``), scored by
    the running service unless ``reuse`` and it already holds every sequence."""
    from distill_service import score_corpus

    hname = f"{name}-hidden"
    url = service.cache_url(hname)
    if reuse and committed_sequences(url) >= len(sequences):
        return url
    if reuse:
        raise RuntimeError(f"--reuse-cache: the hidden cache {hname!r} is not complete")
    print(f"[distill] scoring {len(sequences)} sequences into hidden cache {hname!r}", flush=True)
    score_corpus(
        service.url,
        hname,
        sequences,
        k=None,
        targets="hidden",
        dataset=f"tiny fixture train split, pieces of <= {plan.seq_len}",
    )
    return url


def check_hidden(url: str, teacher: Any, temperature: float, sequences: int = 4) -> dict[str, Any]:
    """The first ``sequences`` of a hidden cache against the PyTorch teacher (sharpened by
    ``temperature``): ``max |log_softmax(rebuilt z / T) - log_softmax(z / T)|`` over every id of
    every row, and the share of rows whose rebuilt argmax is the teacher's."""
    from logitcache.cache_format import CacheReader
    from logitcache.cache_format.hidden import hidden_tensor

    reader = CacheReader(url)
    head = reader.head()
    diff, top1, rows = 0.0, 0, 0
    with torch.no_grad():
        for i in range(min(sequences, reader.num_sequences)):
            rec = reader.sequence(i)
            ids = torch.as_tensor(rec.input_ids, dtype=torch.long)[None]
            lp = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1].float(), -1)
            h = hidden_tensor(np.asarray(rec.hidden)).float().numpy()
            z = torch.from_numpy(head.logprobs(h))
            got = torch.log_softmax(z.float() / temperature, -1)
            diff = max(diff, float((got - lp).abs().max()))
            top1 += int((got.argmax(-1) == lp.argmax(-1)).sum())
            rows += lp.shape[0]
    return {"rows": rows, "max_abs_logprob_diff": diff, "top1_agreement": top1 / max(rows, 1)}


def committed_k(url: str) -> int:
    from logitcache.cache_format import CacheReader

    return int(CacheReader(url).manifest.k)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    plan, _ = parse_args(argv)
    import torch
    from distill_caches import bytes_per_position
    from logitcache.client import CacheDataset, StreamConfig, open_source
    from logitcache.fixtures.tiny import build_tiny_models
    from transformers import LlamaForCausalLM

    torch.set_num_threads(plan.threads)
    plan.workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    models = build_tiny_models(verbose=True)
    sequences = models.token_sequences(
        "train", max_len=plan.seq_len, min_len=8, limit=plan.train_seqs or None
    )
    name = f"tiny-{models.root.name[:8]}-k{plan.k}-L{plan.seq_len}-n{len(sequences)}"
    name += plan.temperature_tag.replace("_", "-") + ("-ent" if plan.entropy else "")
    service = TemperedTeacherService(
        models.teacher_dir,
        plan.workdir / "service",
        plan.k,
        max_seq_len=max(256, plan.seq_len),
        backend=plan.backend,
        temperature=plan.teacher_temperature,
        entropy=plan.entropy,
    )
    reuse = (
        plan.reuse_cache
        and plan.read_from == "store"
        and committed_sequences(service.cache_url(name)) >= len(sequences)
    )
    if reuse:
        print(f"[distill] cache {name!r} already holds every sequence: reused", flush=True)
    else:
        print(f"[distill] starting the teacher service ({plan.backend}) on {service.url}")
    with contextlib.nullcontext() if reuse else service:
        already = committed_sequences(service.cache_url(name))
        if reuse:
            job = {"state": "reused", "wall_s": 0.0, "sequences_done": 0, "tokens_done": 0}
        else:
            print(f"[distill] scoring {len(sequences)} sequences into cache {name!r}", flush=True)
            job = score_corpus(
                service.url,
                name,
                sequences,
                k=plan.k,
                dataset=f"tiny fixture train split, pieces of <= {plan.seq_len}",
            )
        teacher = sharpen(
            LlamaForCausalLM.from_pretrained(str(models.teacher_dir)).float().eval(),
            plan.teacher_temperature,
        )
        for p in teacher.parameters():
            p.requires_grad_(False)
        cache = cache_stats(service.cache_url(name))
        if not cache["valid"]:
            raise RuntimeError(f"the job wrote an invalid cache: {cache['validation']}")
        print(f"[distill] {cache['validation']}", flush=True)
        cache["check"] = check_cache(cache["url"], teacher)
        cache["bytes_per_position"] = bytes_per_position(cache["url"])
        print(f"[distill] cache vs PyTorch teacher at T: {cache['check']}", flush=True)
        hidden_url = None
        if "offline_exact" in plan.methods:
            hidden_url = hidden_cache(plan, service, name, sequences, reuse)
            cache["hidden_check"] = check_hidden(hidden_url, teacher, plan.teacher_temperature)
            print(f"[distill] hidden cache vs PyTorch teacher: {cache['hidden_check']}")
        if plan.read_from == "store" and not reuse:
            service.stop()  # training reads the Zarr stores directly: free the engine's memory
        derived = plan.workdir / "caches" / name
        specs, where = resolve_methods(plan, cache["url"], teacher, derived)
        probe = where.pop("_probe")
        build_caches(plan, cache["url"], teacher, derived, where)
        if hidden_url is not None:
            where["offline_exact"] = {"n": None, "budget": None, "url": hidden_url}
            where["offline_exact"]["bytes_per_position"] = bytes_per_position(hidden_url)
        for spec, info in where.items():
            print(
                f"[distill] {spec}: {info['bytes_per_position']:.1f} B/position on disk "
                f"(budget {info['budget']})",
                flush=True,
            )
        tokenizer = models.load_tokenizer()

        def make_dataset(method: str) -> Any:
            url = where.get(method, {}).get("url", cache["url"])
            source = url
            if plan.read_from == "http" and url == cache["url"]:
                source = open_source(service.url, cache=name)
            return CacheDataset(
                source,
                StreamConfig(
                    tokens_per_item=plan.tokens_per_item,
                    mode="pack",
                    batch_size=plan.batch_items,
                    seed=plan.seed,
                    entropy_top_fraction=split_sel(method)[1],
                ),
                tokenizer=tokenizer,
                vocab_size=models.vocab_size,
            )

        def load_student() -> Any:
            return LlamaForCausalLM.from_pretrained(str(models.student_dir)).float()

        held = make_heldout(teacher, models.token_stream("heldout"), plan.seq_len, plan.eval_tokens)
        untrained = evaluate(load_student(), held)
        settings = TrainSettings(
            steps=plan.steps,
            lr=plan.lr,
            warmup_steps=max(1, min(20, plan.steps // 10)),
            seed=plan.seed,
            loss_impl=plan.loss_impl,
        )
        runs = [
            spec_run(m, load_student, make_dataset, teacher, settings, where, plan) for m in specs
        ]
        print(f"[distill] training {', '.join(specs)} for {plan.steps} steps", flush=True)
        load = train_interleaved(runs, plan.steps, log_every=max(1, plan.steps // 6))
    methods = {r.method: method_summary(r, evaluate(r.student, held)) for r in runs}
    for spec, info in where.items():
        methods[spec].update({k: v for k, v in info.items() if k != "url"}, cache=info["url"])
    add_ratios(methods)
    job_tokens = int(job.get("tokens_done") or 0)
    rep = {
        "command": "python examples/distill.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "plan": {k: str(v) if isinstance(v, Path) else v for k, v in plan.__dict__.items()},
        "models": {
            "root": str(models.root),
            "vocab_size": models.vocab_size,
            "teacher_params": sum(p.numel() for p in teacher.parameters()),
            "student_params": sum(p.numel() for p in runs[0].student.parameters()),
            "fixture_teacher_heldout_ppl": models.teacher_heldout_ppl,
        },
        "job": {
            "id": job.get("id"),
            "state": job.get("state"),
            "backend": plan.backend,
            "sequences": job.get("sequences_done"),
            "tokens": job_tokens,
            "wall_s": job["wall_s"],
            "tokens_per_s": job_tokens / job["wall_s"] if job["wall_s"] > 0 else 0.0,
        },
        "cache": cache,
        "probe_bytes_per_position": {
            k: {str(n): b for n, b in v.items()} for k, v in probe.items()
        },
        "heldout": {
            "positions": held.num_positions,
            "window": plan.seq_len,
            "teacher_ppl": held.teacher_ppl,
            "teacher_ece": held.teacher_ece,
        },
        "train": {
            "steps": plan.steps,
            "batch_items": plan.batch_items,
            "lr": plan.lr,
            "tokens_per_item": plan.tokens_per_item,
            "seed": plan.seed,
            "threads": plan.threads,
            "loss_impl": plan.loss_impl,
            "read_from": plan.read_from,
            "load_avg": load_summary(load),
        },
        "untrained": untrained,
        "methods": methods,
        "total_s": time.perf_counter() - t_start,
        "notes": [],
    }
    rep["notes"].append(temperature_note(plan.teacher_temperature, cache["check"]))
    if "hidden_check" in cache:
        hc = cache["hidden_check"]
        rep["notes"].append(
            f"hidden cache (offline_exact) vs PyTorch teacher at T on {hc['rows']} rows: max "
            f"|logprob diff| over all ids {hc['max_abs_logprob_diff']:.2e} (bfloat16 hidden "
            f"states), top-1 agreement {100 * hc['top1_agreement']:.1f}%"
        )
    cut = split_note(cache["url"], plan.tokens_per_item)
    if cut:
        rep["notes"].append(cut)
        print(f"[distill] WARNING: {cut}", flush=True)
    if reuse:
        rep["notes"].append(
            "the scored cache was reused from an earlier run of the same plan (--reuse-cache): "
            "no scoring job ran, so there is no job time"
        )
    elif already:
        rep["notes"].append(
            f"{already} of the {len(sequences)} sequences were already in the cache from an "
            "earlier run; the job skipped them, so its time and tokens/s are not a scoring figure"
        )
    plan.out_json.parent.mkdir(parents=True, exist_ok=True)
    plan.out_json.write_text(json.dumps(rep, indent=1) + "\n")
    text = markdown(rep)
    plan.out_md.parent.mkdir(parents=True, exist_ok=True)
    plan.out_md.write_text(text)
    print(text, flush=True)
    return rep


if __name__ == "__main__":
    main()
