"""vLLM's prompt logprobs as rows: the conversions of one ``RequestOutput`` (no engine here).

Every prompt position but the first holds ``k + 1`` entries: the actual token, then the top-k
by descending logprob; reshaped to ``[L - 1, k + 1]`` with column 0 dropped, row ``j`` is the
top-k of token ``j + 1``. The dict form goes through a per-position fallback. Rows of the worker
hook carry its marker in column 0, checked by :func:`hooked_from_output`.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from .protocol import EngineError, TeacherScores, make_scores
from .vllm_logprobs import TensorPromptLogprobs


def _flat_columns(flat: Any, k: int, length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``[L-1, k+1]`` ids and logprobs of a ``FlatLogprobs`` in vLLM 0.32's layout (column
    0: the prompt's tokens), or ``None`` for another layout."""
    starts = flat.start_indices
    n = len(starts)
    if n != length:
        raise EngineError(f"vLLM returned {n} prompt positions for a {length}-token prompt")
    w = k + 1
    m = length - 1
    total = len(flat.token_ids)
    regular = (
        total == m * w
        and flat.end_indices[0] == starts[0] == 0
        and (m == 0 or (starts[1] == 0 and flat.end_indices[-1] == total))
    )
    if regular and m > 0:
        st = np.asarray(starts, dtype=np.int64)
        en = np.asarray(flat.end_indices, dtype=np.int64)
        regular = bool(np.all(en[1:] - st[1:] == w)) and bool(np.all(st[2:] == en[1:-1]))
    if not regular:
        return None
    # array.array reads a list of Python ints/floats ~20% faster than np.asarray (no per-item
    # type dispatch); the [:, 1:] slices are copied to contiguous int32/float32 by make_scores
    ids = np.frombuffer(array.array("q", flat.token_ids), dtype=np.int64).reshape(m, w)
    lps = np.frombuffer(array.array("d", flat.logprobs), dtype=np.float64).reshape(m, w)
    return ids, lps


def actual_from_dicts(
    positions: Sequence[dict[int, Any] | None], prompt: Sequence[int] | None
) -> np.ndarray | None:
    """Each row's logprob of the prompt's next token from vLLM's per-position dicts (vLLM adds
    the prompt token to every position), or ``None`` without the prompt or such an entry."""
    if prompt is None or len(positions) != len(prompt):
        return None
    out = np.empty(len(prompt) - 1, np.float32)
    for j, pos in enumerate(positions[1:]):
        lp = (pos or {}).get(prompt[j + 1])
        if lp is None:
            return None
        out[j] = lp.logprob
    return out


def rows_from_dicts(
    positions: Sequence[dict[int, Any] | None], k: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Fallback for ``list[dict[token_id, Logprob] | None]``: per position the ``k`` entries of
    best rank, by descending logprob."""
    if len(positions) != length:
        raise EngineError(f"vLLM returned {len(positions)} prompt positions for {length} tokens")
    ids = np.empty((length - 1, k), dtype=np.int32)
    lps = np.empty((length - 1, k), dtype=np.float32)
    for j, pos in enumerate(positions[1:]):
        if not pos:
            raise EngineError(f"vLLM returned no logprobs for prompt position {j + 1}")
        ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]
        if len(ranked) < k:
            raise EngineError(f"vLLM returned {len(ranked)} < k={k} logprobs at position {j + 1}")
        ranked.sort(key=lambda kv: -kv[1].logprob)
        ids[j] = [t for t, _ in ranked]
        lps[j] = [lp.logprob for _, lp in ranked]
    return ids, lps


def scores_from_output(output: Any, k: int, length: int) -> TeacherScores:
    """A :class:`TeacherScores` from one vLLM ``RequestOutput``."""
    pl = output.prompt_logprobs
    if pl is None:
        raise EngineError("vLLM returned no prompt_logprobs (was prompt_logprobs set?)")
    if isinstance(pl, TensorPromptLogprobs):  # the array form (vllm_logprobs.py)
        ids, lps = pl.rows(k)
        if ids.shape != (length - 1, k):
            raise EngineError(
                f"vLLM returned prompt logprobs of shape {ids.shape} for a {length}-token "
                f"prompt at k={k}"
            )
        return make_scores(ids, lps, actual_logprob=pl.column0_values())  # the prompt's tokens
    full = _flat_columns(pl, k, length) if hasattr(pl, "start_indices") else None
    if full is not None:
        return make_scores(full[0][:, 1:], full[1][:, 1:], actual_logprob=full[1][:, 0])
    positions = list(pl)
    ids, lps = rows_from_dicts(positions, k, length)
    act = actual_from_dicts(positions, getattr(output, "prompt_token_ids", None))
    return make_scores(ids, lps, actual_logprob=act)


def hooked_from_output(
    output: Any, length: int, width: int, entropy: bool = False
) -> TeacherScores:
    """The rows of one ``RequestOutput`` the worker hook answered: ``[L - 1, width + 1]`` arrays
    whose column 0 (the hook's marker) is checked and dropped; with ``entropy`` one more column."""
    from .vllm_sampling import MARK

    pl = output.prompt_logprobs
    if not isinstance(pl, TensorPromptLogprobs):
        raise EngineError("vLLM returned no prompt-logprob arrays for a hooked request")
    if not pl.token_ids:
        raise EngineError(f"vLLM returned no rows for a {length}-token prompt")
    ids, lps = pl.rows(width)  # column 0 (the marker) is kept apart: pl.column0()
    have = pl.width
    ent_ids, ent = pl.last_column() if entropy else (np.full(1, MARK), None)
    if (
        ids.shape != (length - 1, width)
        or have != width + 1 + int(entropy)
        or not (pl.column0() == MARK).all()
        or not (ent_ids == MARK).all()
    ):
        raise EngineError(
            f"vLLM returned prompt rows of shape {(ids.shape[0], have)} without the hook's "
            f"marker for a {length}-token prompt at width {width}: the worker hook did not run "
            "in vLLM's worker (is worker_extension_cls overridden?)"
        )
    return make_scores(ids, lps, entropy=ent, actual_logprob=pl.column0_values())


def first_columns(rows: TeacherScores, k: int) -> TeacherScores:
    """``rows``' first ``k`` columns, with their entropy and actual-token logprob."""
    ids, lps = rows.topk_ids[:, :k], rows.topk_logprobs[:, :k]
    return make_scores(ids, lps, None, rows.entropy, rows.actual_logprob)
