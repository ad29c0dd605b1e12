"""Peak bytes of the tensors a CPU computation creates (the loss tests' memory bounds without a
GPU; ``python -m benchmarks.loss exact`` on the CPU reports it too)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Inside the mode, ``.peak`` is the most bytes held at once by the storages aten ops create,
    from creation until freed; storages passed to :meth:`known` (inputs) are not counted. Memory
    that is no tensor (cuBLAS workspaces, Triton scratch) is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def known(self, *tensors: torch.Tensor | None) -> LiveBytes:
        for t in tensors:
            if t is not None:
                self._seen.add(t.untyped_storage().data_ptr())
        return self

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        return out

    def _count(self, st: torch.UntypedStorage) -> None:
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.live += n

        def gone(key: int = key, n: int = n) -> None:
            self.live -= n
            self._seen.discard(key)

        weakref.finalize(st, gone)
        self.peak = max(self.peak, self.live)
