"""The elementwise kernels of logprob decoding: the row-delta inverse (FORMAT.md 4.2) and
float16 -> float32 widening, of whole arrays and of a read call's row blocks
(:func:`undelta_block`, :func:`widen_block`); and float32 -> float16 rounding.

numpy runs these as scalar loops; torch's CPU kernels compute the same bits vectorised (wrapping
sums on the same bits viewed as signed, exact widening), so they are used where torch is
installed (decided at import, imported at the first call; :func:`backend` says which runs)."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from types import ModuleType

import numpy as np

from . import _outbuf as outbuf

_SIGNED = {np.dtype(np.uint8): "uint8", np.dtype(np.uint16): "int16", np.dtype(np.uint32): "int32"}


TORCH = importlib.util.find_spec("torch") is not None
"""Whether torch is installed (then the kernels use it; imported at their first call)."""


@cache
def torch_module() -> ModuleType | None:
    """The torch module where it is installed, else ``None``."""
    if not TORCH:
        return None
    import torch

    return torch


#: Arrays smaller than this (elements) use numpy even when torch is selected: torch's
#: intra-op thread start-up costs more than the work on one sequence's rows.
TORCH_MIN_ELEMENTS = 1 << 20


def backend() -> str:
    """``"torch"`` or ``"numpy"``: the backend the kernels use in this process."""
    return "numpy" if torch_module() is None else "torch"


def row_undelta(d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``u[:, j] = (d[:, 0] + ... + d[:, j]) mod 2**bits`` for ``[n, k]`` unsigned ``d``, into
    ``out`` if given (same shape and dtype, may be ``d`` itself)."""
    d = np.ascontiguousarray(d)
    if not d.flags.writeable:  # torch.from_numpy warns on read-only arrays
        d = d.copy()
    if d.ndim != 2 or d.dtype not in _SIGNED:
        raise ValueError(f"row_undelta needs a 2-D uint8/16/32 array, got {d.dtype} {d.shape}")
    if out is None:
        out = np.empty_like(d)
    elif out.shape != d.shape or out.dtype != d.dtype or not out.flags.c_contiguous:
        raise ValueError("row_undelta: out must be a C-contiguous array like d")
    torch = torch_module()
    if torch is None or d.size < TORCH_MIN_ELEMENTS:
        return np.cumsum(d, axis=1, dtype=d.dtype, out=out)
    signed = getattr(torch, _SIGNED[d.dtype])
    src = torch.from_numpy(d.view(_SIGNED[d.dtype]))
    dst = torch.from_numpy(out.view(_SIGNED[d.dtype]))
    if np.shares_memory(d, out):
        dst.copy_(torch.cumsum(src, 1, dtype=signed))
    else:
        torch.cumsum(src, 1, dtype=signed, out=dst)
    return out


def half_to_float(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Exact float16 -> float32 of ``h`` (into ``out`` if given)."""
    h = np.ascontiguousarray(h)
    if not h.flags.writeable:
        h = h.copy()
    if h.dtype != np.float16:
        raise ValueError(f"half_to_float needs float16, got {h.dtype}")
    if out is None:
        out = outbuf.empty(h.shape, np.float32)  # a read's output: no huge-page request
    elif out.shape != h.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError("half_to_float: out must be a C-contiguous float32 array of h's shape")
    torch = torch_module()
    if torch is None or h.size < TORCH_MIN_ELEMENTS:
        np.copyto(out, h, casting="same_kind")
        return out
    torch.from_numpy(out).copy_(torch.from_numpy(h))
    return out


#: Elements per torch call of :func:`float_to_half`: below torch's parallel grain size (32768),
#: so the conversion stays on the calling thread (in the service it shares the process with an
#: in-process engine whose OpenMP threads must not be competed with).
HALF_BLOCK = 1 << 15


#: Values :func:`float_to_half` casts with numpy before it imports torch (where torch is not
#: imported yet): the import costs ~1.1 CPU-s, what numpy's cast spends over torch's on about
#: this many values; a process that casts fewer (a writer of a few short sequences) never
#: imports torch for it.
TORCH_AFTER_VALUES = 1 << 28
_numpy_halves = 0  # values cast with numpy while torch was not imported


def float_to_half(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 rounded to nearest even, bit-identical to ``x.astype(np.float16)``;
    through torch's vectorised cast in blocks of :data:`HALF_BLOCK` once torch is imported
    (:data:`TORCH_AFTER_VALUES`)."""
    global _numpy_halves
    x = np.ascontiguousarray(x, dtype=np.float32)
    if "torch" not in sys.modules and _numpy_halves < TORCH_AFTER_VALUES:
        _numpy_halves += x.size
        return x.astype(np.float16)
    torch = torch_module()
    if torch is None:
        return x.astype(np.float16)
    if not x.flags.writeable:  # torch.from_numpy warns on read-only arrays
        x = x.copy()
    out = np.empty(x.shape, dtype=np.float16)
    src, dst = x.reshape(-1), out.reshape(-1)
    for a in range(0, src.size, HALF_BLOCK):
        b = min(a + HALF_BLOCK, src.size)
        torch.from_numpy(dst[a:b]).copy_(torch.from_numpy(src[a:b]))
    return out


# --------------------------------------------------------------------------- row blocks
BLOCK_ELEMENTS = 32_000
"""Elements per row-block kernel call: below torch's intra-op grain size of 32,768, so every
call runs in the calling thread, vectorised, with no thread start-up (a read's decode threads
take the blocks)."""


def undelta_block(d: np.ndarray) -> None:
    """In place: ``d[:, j] = d[:, 0] + ... + d[:, j]`` modulo ``2**bits`` (FORMAT.md 4.2) for a
    C-contiguous unsigned ``[m, k]`` block of at most :data:`BLOCK_ELEMENTS` elements."""
    torch = torch_module()
    if torch is None:
        np.cumsum(d, axis=1, dtype=d.dtype, out=d)
        return
    torch.from_numpy(d.view(_SIGNED[d.dtype])).cumsum_(1)  # in place (no temporary)


def widen_block(h: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = h`` (exact float16 -> float32) for a block of at most
    :data:`BLOCK_ELEMENTS` elements."""
    torch = torch_module()
    if torch is None:
        np.copyto(out, h, casting="same_kind")
        return
    torch.from_numpy(out).copy_(torch.from_numpy(h))
