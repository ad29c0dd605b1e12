"""Which implementation of each compiled step runs in this process (numba and torch are
optional: each is decided once per process)."""

from __future__ import annotations

from . import _fastdecode as fastdecode
from . import _kernels as kernels
from . import fastencode


def kernels_in_use() -> dict[str, str]:
    """``{"decode": "numba" | "numpy", "encode": "numba" | "numpy", "elementwise": "torch" |
    "numpy"}``: the reader's point-read decoder, the writer's encode pass and the logprob
    kernels (row-delta inverse, float16 widening) outside them. The numba kernels compile (or
    load from numba's cache) at the first call where they have not yet: a few seconds."""
    return {
        "decode": "numba" if fastdecode.ready() else "numpy",
        "encode": "numba" if fastencode.ready() else "numpy",
        "elementwise": kernels.backend(),
    }
