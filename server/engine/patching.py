"""Patch-once for the vLLM hooks (:mod:`.vllm_logprobs`, :mod:`.vllm_sampling`).

:func:`patch_once` turns a hook's ``apply()`` into a thread-safe ``install()``: the first call
runs it under a lock and remembers the answer; an ``ImportError`` or ``AttributeError`` (this
vLLM lacks what it wraps; ``apply()`` assigns nothing before every lookup succeeded) makes it
False; any other exception propagates and the next call tries again.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable


def patch_once(apply: Callable[[], None]) -> Callable[[], bool]:
    """``install()`` for ``apply`` (see the module docstring): True once ``apply`` has patched
    vLLM in this process, False if this vLLM lacks what it wraps."""
    lock = threading.Lock()
    done: list[bool] = []  # the remembered answer, once there is one

    @functools.wraps(apply)
    def install() -> bool:
        with lock:
            if not done:
                try:
                    apply()
                except (ImportError, AttributeError):
                    done.append(False)
                else:
                    done.append(True)
            return done[0]

    return install
