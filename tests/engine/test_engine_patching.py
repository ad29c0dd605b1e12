"""The vLLM hooks' patch-once helper (server/engine/patching.py); the two hooks built on it are
checked on the real engine in test_sampled_targets.py (test_both_vllm_hooks_install_once)."""

from __future__ import annotations

import threading

import pytest
from logitcache.server.engine.patching import patch_once


@pytest.mark.fast
def test_patch_once_applies_once_across_threads() -> None:
    calls: list[int] = []
    gate = threading.Event()

    @patch_once
    def install() -> None:
        gate.wait(5)  # every thread is inside install() before the first apply ends
        calls.append(1)

    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(install())) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert results == [True] * 8 and calls == [1]
    assert install() is True and calls == [1]
    assert install.__name__ == "install"


@pytest.mark.fast
@pytest.mark.parametrize("missing", [ImportError("no module"), AttributeError("no method")])
def test_a_missing_hook_is_false_and_stays_false(missing: Exception) -> None:
    calls: list[int] = []

    @patch_once
    def install() -> None:
        calls.append(1)
        raise missing

    assert install() is False and install() is False
    assert calls == [1]  # not retried


@pytest.mark.fast
def test_another_failure_propagates_and_is_retried() -> None:
    calls: list[int] = []

    @patch_once
    def install() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("patch failed")

    with pytest.raises(RuntimeError, match="patch failed"):
        install()
    assert install() is True and install() is True
    assert calls == [1, 1]
