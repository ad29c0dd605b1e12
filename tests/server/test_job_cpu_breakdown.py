"""benchmarks/job_cpu_bench.py accounts for every thread's CPU (issue #19): the job writer
thread, which ends inside the timed job, and zarr's IO and store threads are split into stages,
so the stages add up to the process's CPU instead of leaving them in an "other" remainder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "job_cpu_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("job_cpu_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["job_cpu_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_breakdown_splits_each_thread_into_its_stages() -> None:
    bench = _bench()
    stages = {"engine": 1.0, "convert": 2.0, "encode": 3.0, "append": 5.0, "compress": 4.0}
    stages |= {"put": 1.5, "read": 0.5, "submit": 0.25, "pair": 0.25, "sqlite": 0.5}
    groups = {"event_loop": 4.0, "workers": 3.0, "job_writer": 6.0, "zarr_io": 5.0}
    groups["other_threads"] = 0.5
    total = sum(groups.values()) + 0.125
    out = bench.breakdown(stages, groups, total)
    assert out["write"] == pytest.approx(1.0 + 2.0 + 1.5)  # zarr_io - compress, append - encode
    assert out["bookkeeping"] == pytest.approx(0.5)  # job writer - append - sqlite
    assert out["event_loop"] == pytest.approx(1.0)
    assert out["handoffs"] == pytest.approx(3.0 - 2.5 + 0.5)
    assert out["other"] == pytest.approx(0.125)
    assert sum(out.values()) == pytest.approx(total)


def test_a_small_job_is_accounted_for_thread_by_thread(tmp_path: Path) -> None:
    bench = _bench()
    bench._track_thread_ends()
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, bench.VOCAB, 64).tolist() for _ in range(24)]
    settings = {"k": 8, "job_batch_sequences": 8, "log_level": "warning"}
    r = bench.one_run(8, prompts, settings, seed=0)
    groups = r["thread_group_us_per_position"]
    assert groups["job_writer"] > 0 and groups["zarr_io"] > 0  # the writer thread is counted
    st = r["stage_us_per_position"]
    assert st["encode"] > 0 and st["compress"] > 0 and st["write"] > 0
    assert sum(st.values()) == pytest.approx(r["us_per_position"])
    # every thread's CPU lands in a stage: little is left unexplained
    assert abs(st["other"]) < 0.25 * r["us_per_position"], st
