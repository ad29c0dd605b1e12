"""numba, an optional dependency of the format's compiled kernels: whether it is installed
(decided once, at import), the kernels' status codes, and the llvmlite guard a process that also
runs vLLM needs. A leaf: imports nothing of the package."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

AVAILABLE = importlib.util.find_spec("numba") is not None
"""Whether numba is importable in this process (the compiled encode and decode kernels may
run; each still self-checks before its first use)."""

EMPTY = 2**64 - 1
"""A shard index entry of an empty inner chunk (``offset = nbytes = 2**64 - 1``)."""

OK, NEED_BUFFER, FALLBACK, NEED_SHARDS = 0, 1, 2, 3
"""Status codes of the compiled read (``status[0]``): done; the read buffer is too small
(``status[1]`` bytes needed); hand the call back to the NumPy decoder (empty chunk, short read,
a frame failing its CRC32C / header / decompression: ``status[1]`` the global chunk); shards
not open yet (``status[1]`` of them, ``(array, shard)`` pairs from ``status[2]`` on)."""


def harden_llvmlite() -> None:
    """Make llvmlite's library wrapper (``llvmlite.binding.ffi.lib``, imported with numba) answer
    dunder lookups with AttributeError, once per process, if llvmlite is imported.

    The wrapper turns any attribute it lacks into a C-function wrapper, ``__dict__`` included, so
    code that scans every module's values (vLLM's CPU platform, ``register_kernels``, at each
    engine start: ``vars(value).get(...)`` on whatever has a ``__dict__``) fails with
    "'_lib_fn_wrapper' object has no attribute 'get'" in a process that imported numba first.
    Its functions are named ``LLVMPY_*``: no dunder name is one of them."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    cls = getattr(ffi, "_lib_wrapper", None)
    if cls is None or getattr(cls, "_dunders_refused", False):
        return
    original = cls.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    cls.__getattr__ = __getattr__
    cls._dunders_refused = True
