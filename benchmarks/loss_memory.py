"""Which tensors are alive at a step's memory peak (CPU or CUDA), for the loss's memory work.

:class:`LiveBytes` is a ``TorchDispatchMode`` that counts the storage bytes of every tensor an
aten op creates inside it, from creation until the storage is freed, and keeps the largest
live tensors at the highest total. Storages that exist before the mode (inputs, parameters)
are not counted when passed to :meth:`LiveBytes.known`. What it cannot see: memory that is no
tensor (cuBLAS/cuBLASLt workspaces, Triton scratch); on CUDA, ``max_memory_allocated`` minus
the tracked peak bounds that from below.

Used by ``loss_floor_bench.py --anatomy`` on the GPU and by ``tests/test_loss_memory.py`` on
the CPU.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Peak of the bytes held by tensors created inside the mode; see the module docstring."""

    def __init__(self, top: int = 12) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.top = top
        self._alive: dict[int, tuple[int, str, tuple[int, ...], str]] = {}
        self.at_peak: list[tuple[int, str, tuple[int, ...], str]] = []

    def known(self, *tensors: torch.Tensor | None) -> LiveBytes:
        """Storages that existed before (inputs): never counted."""
        for t in tensors:
            if t is not None:
                self._alive[t.untyped_storage().data_ptr()] = (0, "input", tuple(t.shape), "")
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t, str(func))
        return out

    def _count(self, t: torch.Tensor, op: str) -> None:
        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or key in self._alive:
            return
        self._alive[key] = (n, op, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        self.live += n

        def gone(key: int = key, n: int = n) -> None:
            self.live -= n
            self._alive.pop(key, None)

        weakref.finalize(st, gone)
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = sorted(self._alive.values(), key=lambda v: -v[0])[: self.top]

    def report(self) -> dict:
        """The peak and the largest tensors alive at it (bytes, op, shape, dtype)."""
        return {
            "tracked_peak_bytes": self.peak,
            "alive_at_peak": [
                {"bytes": n, "op": op, "shape": list(shape), "dtype": dt}
                for n, op, shape, dt in self.at_peak
                if n
            ],
        }
