"""Choosing the implementation and the chunk size."""

from __future__ import annotations

import torch

from .spec import GRAD_WEIGHT_DTYPES, IMPLS, KERNELS, REDUCTIONS, LossInputError, check_choice
from .vocab_parallel import VocabShard

#: Bytes of one chunk's logits buffer that the automatic chunk size aims at.
CHUNK_BUDGET_BYTES_GPU = 1 << 30
CHUNK_BUDGET_BYTES_CPU = 64 << 20
_ROW_MULTIPLE = 256
#: ``grad_weight_dtype="auto"`` accumulates ``grad_W`` in a bf16/fp16 weight's own dtype up
#: to this many chunks (each chunk adds one rounding of the running sum; see RESULTS).
AUTO_LOWP_MAX_CHUNKS = 8
#: ``impl="auto"`` takes ``"small_vocab"`` on the CPU up to this vocabulary and this many rows x
#: vocabulary entries (see :func:`picks_small_vocab`; figures: ``benchmarks/results/loss.md``).
SMALL_VOCAB_MAX_VOCAB = 4096
SMALL_VOCAB_MAX_ELEMENTS = 1 << 22


def picks_small_vocab(
    n_rows: int, vocab: int, device: torch.device, chunk_size: int | None, sharded: bool
) -> bool:
    """Whether ``impl="auto"`` computes the loss on the full ``[N, V]`` logits: on the CPU for
    a small ``N x V`` (its three ``[N, V]`` float32 buffers at most 16 MiB each, within one chunk
    of the fused path's budget), without an explicit ``chunk_size`` or a vocab-parallel head."""
    return (
        device.type == "cpu"
        and chunk_size is None
        and not sharded
        and vocab <= SMALL_VOCAB_MAX_VOCAB
        and n_rows * vocab <= SMALL_VOCAB_MAX_ELEMENTS
    )


def resolve_impl(
    impl: str,
    reduction: str,
    *,
    n_rows: int | None = None,
    vocab: int | None = None,
    device: torch.device | None = None,
    chunk_size: int | None = None,
    sharded: bool = False,
) -> str:
    """The concrete implementation for ``impl``.

    ``"auto"``: ``"small_vocab"`` where :func:`picks_small_vocab` says so (needs the problem's
    ``n_rows``, ``vocab`` and ``device``), else the fused chunked path.
    """
    check_choice("impl", impl, IMPLS)
    if impl == "auto":
        small = (
            n_rows is not None
            and vocab is not None
            and device is not None
            and picks_small_vocab(n_rows, vocab, device, chunk_size, sharded)
        )
        impl = "small_vocab" if small else "fused_chunked"
    if impl == "fused_chunked" and reduction == "none":
        impl = "fused_chunked_recompute"  # per-row grad_output is only known in backward
    return impl


def auto_chunk_size(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk so that one chunk of logits is about the budget (a multiple of 256).

    On CUDA the budget is 1 GiB of logits in their own dtype (the Triton passes need no other
    ``[chunk, V]`` buffer): 4096 rows at V=128256 in bf16. On CPU the torch path also keeps
    float32 temporaries, so the budget is 64 MiB counted at 4 bytes per logit.
    """
    if device.type == "cuda":
        per_row = vocab * torch.finfo(dtype).bits // 8
        budget = CHUNK_BUDGET_BYTES_GPU
    else:
        per_row = vocab * 4
        budget = CHUNK_BUDGET_BYTES_CPU
    rows = max(_ROW_MULTIPLE, budget // per_row // _ROW_MULTIPLE * _ROW_MULTIPLE)
    return max(1, min(rows, n_rows))


def check_options(
    reduction: str, chunk_size: int | None, grad_weight_dtype: str, kernels: str, impl: str = "auto"
) -> None:
    """The checks of the loss options that need no tensor (a typed error on the first bad one)."""
    check_choice("reduction", reduction, REDUCTIONS)
    check_chunk_size(chunk_size)
    check_choice("grad_weight_dtype", grad_weight_dtype, GRAD_WEIGHT_DTYPES)
    check_choice("kernels", kernels, KERNELS)
    resolve_impl(impl, reduction)


def plan_chunks(
    chunk_size: int | None,
    n_rows: int,
    weight: torch.Tensor,
    shard: VocabShard | None,
    grad_weight_dtype: str,
    n_valid: int,
    buffers: int = 1,
) -> tuple[int, torch.dtype | None]:
    """Rows per chunk (``chunk_size``, else :func:`auto_chunk_size` for ``buffers`` logits
    buffers of this rank's columns: every rank of a shard counts ``ceil(V / world)`` so that
    they cut the same chunks) and the ``grad_W`` accumulation dtype."""
    cols = weight.shape[0] if shard is None else -(-shard.vocab // shard.world)
    chunk = chunk_size or auto_chunk_size(n_rows, cols * buffers, weight.dtype, weight.device)
    return chunk, resolve_grad_weight_dtype(grad_weight_dtype, weight.dtype, n_valid, chunk)


def check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise LossInputError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def resolve_grad_weight_dtype(
    option: str, weight_dtype: torch.dtype, n_rows: int, chunk: int
) -> torch.dtype | None:
    """The ``grad_W`` accumulation dtype for the fused paths (``None``: their default, fp32
    for bf16/fp16 weights); see ``topk_distill_loss(grad_weight_dtype=...)``."""
    check_choice("grad_weight_dtype", option, GRAD_WEIGHT_DTYPES)
    if weight_dtype not in (torch.bfloat16, torch.float16) or option == "float32":
        return None
    if option == "weight":
        return weight_dtype
    n_chunks = -(-max(n_rows, 1) // chunk)
    return weight_dtype if n_chunks <= AUTO_LOWP_MAX_CHUNKS else None
