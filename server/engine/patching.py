"""Patch-once for the vLLM hooks (:mod:`.vllm_logprobs`, :mod:`.vllm_sampling`).

A hook wraps methods of a vLLM class, once per process, and must be safe to install from any
thread (an engine built in a worker thread, a worker process importing its extension class) and
any number of times. :func:`patch_once` turns the hook's ``apply()`` into that ``install()``:

* the first call runs ``apply()`` under a lock and remembers the answer; later calls return it;
* ``apply()`` first looks up what it wraps; an ``ImportError`` or ``AttributeError`` there
  means this vLLM lacks the hook: ``install()`` returns False (and stays False), and the caller
  keeps vLLM's own path. ``apply()`` assigns its wrappers only after every lookup succeeded, so
  a False install leaves vLLM untouched;
* any other exception propagates and nothing is remembered (the next call tries again).
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
