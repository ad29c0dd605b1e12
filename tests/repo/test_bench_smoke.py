"""One smoke test per benchmark suite (``python -m benchmarks.<suite>``), the harness and the
distillation study: each runs at a tiny size, from the repository root, and writes real rows to
a temporary CSV. The ``ddp`` suite's smoke test is ``test_ddp_gloo.py``; the demo's is
``test_e2e_distill.py``."""

from __future__ import annotations

import csv
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-W", "ignore", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_harness_runs_a_command_on_another_tree_and_appends_csv_rows(tmp_path: Path) -> None:
    """``with-tree``: every package found in the tree is taken from it, the others from this
    checkout; a Recorder's rows carry the machine row and the quantiles."""
    from benchmarks.harness import Recorder, measure, quantiles

    tree = tmp_path / "tree"
    for package in ("cache_format", "client"):
        shutil.copytree(
            ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__")
        )
        (tree / package / "marker.py").write_text(f"WHERE = 'tree {package}'\n")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\n"
        "from logitcache.cache_format import marker as a\n"
        "from logitcache.client import marker as b\n"
        "from logitcache import server\n"
        "print(a.WHERE, '|', b.WHERE, '|', server.__path__[0], sys.argv[1:])\n"
    )
    out = _run("-m", "benchmarks.harness", "with-tree", str(tree), "--", str(probe), "--x", "1")
    assert out.strip() == f"tree cache_format | tree client | {ROOT / 'server'} ['--x', '1']"
    assert quantiles([4.0, 1.0, 3.0, 2.0, 5.0]) == [3.0, 1.8, 4.2]
    rec = Recorder("selftest", "mode", csv_path=tmp_path / "rows.csv")
    q50, q20, q80 = quantiles(measure(lambda: None, 5).wall)
    rec.add("case", "seconds", "s", q50, p20=q20, p80=q80, samples=5)
    rec.save()
    rec.save()  # appends; one header
    rows = _rows(tmp_path / "rows.csv")
    assert len(rows) == 2 and rows[0]["suite"] == "selftest" and rows[0]["samples"] == "5"
    assert float(rows[0]["p20"]) <= float(rows[0]["value"]) <= float(rows[0]["p80"])
    assert rows[0]["git_sha"] and rows[0]["cpu_count"] and rows[0]["load_avg"]


def test_benchmarks_command_lists_the_suites_and_runs_the_format_suite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m benchmarks --list`` names every suite with its modes; ``python -m benchmarks
    format configs ...`` is ``python -m benchmarks.format configs ...`` (a child process); an
    unknown suite or no argument exits with status 2."""
    from benchmarks.__main__ import main

    assert main(["--list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    lines = {line.split()[0]: line for line in listing if "modes:" in line}
    assert set(lines) == {"format", "loader", "loss", "service", "ddp", "train_step"}
    assert "configs, random, codecs, index" in lines["format"]
    assert "jobs, cpu, overload, cache, appends, ray, gpu, protocols" in lines["service"]
    for argv, says in (["nope"], "no benchmark suite 'nope'"), ([], "usage: python -m benchmarks"):
        assert main(argv) == 2
        assert says in capsys.readouterr().err
    csv_path = tmp_path / "rows.csv"
    args = ["-m", "benchmarks", "format", "configs", "--positions", "4092", "--configs"]
    args += ["default,random-access", "--random-reads", "4", "--repeats", "1", "--csv"]
    out = _run(*args, str(csv_path))
    assert "| default |" in out and "| baseline (npy) |" in out
    bpp = {
        r["case"]: float(r["value"]) for r in _rows(csv_path) if r["metric"] == "bytes_per_position"
    }
    assert 150 < bpp["default"] < bpp["random-access"] < bpp["baseline (npy)"] < 700


def _page_commands() -> list[tuple[str, str, list[str]]]:
    """``(page, module, argv)`` of every ``python -m benchmarks.<suite> ...`` (or ``python -m
    benchmarks <suite> ...``, ``... -- -m benchmarks.<suite> ...``) command the results pages
    print, placeholders (``<mode>``) and elisions (``...``) left out; a service mode's module is
    its own."""
    from benchmarks.service.__main__ import MODES

    out = []
    for page in sorted((ROOT / "benchmarks").glob("**/*.md")):
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # a code block's continued lines
        text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace("\n", " "), text)
        for m in re.finditer(r"(?:python|--) -m benchmarks[. ](\w+) ?([^`\n|)#<]*)", text):
            words = shlex.split(m.group(2).split(" -- ")[0])
            module = f"benchmarks.{m.group(1)}"  # python -m benchmarks SUITE is benchmarks.SUITE
            argv = [w for w in words if w != "..."]  # "..." elides options
            if module == "benchmarks.harness" or not argv:
                continue
            if module == "benchmarks.service":
                module, argv = f"benchmarks.service.{MODES[argv[0]]}", argv[1:]
            out.append((page.name, module, argv))
    return out


def test_every_command_the_pages_print_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A figure is rerun with the command its page prints: each parses against its suite (its
    options exist, its values have their types); nothing is run."""
    import argparse
    import importlib

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> None:
        parse(self, *a, **kw)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    commands = _page_commands()
    assert len(commands) >= 20
    failed = []
    for page, module, argv in commands:
        try:
            importlib.import_module(module).main(argv)
        except Parsed:
            continue
        except SystemExit:
            failed.append(f"{page}: {module} {' '.join(argv)}")
    assert not failed, failed


def test_format_index_mode(tmp_path: Path) -> None:
    """The ``index`` mode builds its caches, probes reader and writer in fresh processes and
    reports their figures (the ``validate`` probe, a kernel load, is left out)."""
    csv_path = tmp_path / "rows.csv"
    args = ["--sequences", "300", "--repeats", "1", "--validate-max", "0"]
    args += ["--store-dir", str(tmp_path / "stores")]
    out = _run("-m", "benchmarks.format", "index", *args, "--csv", str(csv_path))
    assert "| this tree n=300 |" in out
    got = {r["metric"]: float(r["value"]) for r in _rows(csv_path)}
    for role, metric in [("reader", "first_index_of_s"), ("writer", "first_contains_s")]:
        assert got[f"{role}_open_s"] > 0 and got[f"{role}_{metric}"] > 0
        assert got[f"{role}_rss_after_key"] >= 0
    assert (tmp_path / "stores" / "n300.json").exists()


def test_loader_suite(tmp_path: Path) -> None:
    from benchmarks import loader

    url = str(tmp_path / "bench")
    built = loader.build(url, 100_000)
    assert built["positions"] >= 100_000 and 150 < built["bytes_per_position"] < 700
    assert loader.reader_rate(url, 0.2)["pos_per_s"] > 0
    r = loader.loader_rate(url, 0, 0.3, pin=False, shuffle=False, warm=1)
    assert r["positions"] > 0 and r["pos_per_s"] > 0


def test_loss_suite(tmp_path: Path) -> None:
    from benchmarks.loss import main

    csv_path = tmp_path / "rows.csv"
    main(["sweep", "--device", "cpu", "--sizes", "64", "--configs", "500x32", "--k", "8",
          "--variants", "fused_chunked,floor,torch_dense_gather", "--reps", "2",
          "--csv", str(csv_path)])  # fmt: skip
    ms = {r["case"] for r in _rows(csv_path) if r["metric"] == "ms"}
    assert ms == {"fused_chunked", "floor", "torch_dense_gather"}


def test_loss_suite_exact_mode(tmp_path: Path) -> None:
    """``loss exact``: the exact (teacher hidden + head) losses against the top-k loss, every
    variant timed and checked against float64."""
    from benchmarks.loss import main

    csv = tmp_path / "rows.csv"
    out = tmp_path / "exact.json"
    variants = "topk_fused_chunked,topk_floor,exact_forward_kl,exact_jsd_torch_c32,exact_reverse_kl"
    main(["exact", "--device", "cpu", "--sizes", "64,128", "--configs", "256x16", "--k", "8",
          "--reps", "2", "--chunk", "16", "--gemm-chunks", "16", "--check", "--variants", variants,
          "--csv", str(csv), "--out", str(out)])  # fmt: skip
    import json

    result = json.loads(out.read_text())["exact"]
    rows = result["rows"]
    assert {r["variant"] for r in rows} == set(variants.split(","))
    assert {r["n"] for r in rows} == {64, 128}
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["tracked_peak_mib"] > 0 for r in rows)
    assert all(r["ms_vs_topk_fused_chunked"] > 0 for r in rows)
    assert result["gemm"]["256x16"]["four_gemms_ms_c16"] > 0
    # the float32 torch passes against float64, every objective
    assert {c["loss"] for c in result["check"]} == {"forward_kl", "reverse_kl", "jsd"}
    assert all(c["rel_grad_w"] < 1e-4 for c in result["check"])
    assert "exact_jsd_torch_c32" in csv.read_text()


def test_service_suite_accounts_a_small_job_thread_by_thread() -> None:
    """``service cpu``: the job writer thread (which ends inside the job) and zarr's IO threads
    are split into stages that add up to the process's CPU."""
    pytest.importorskip("vllm")
    import numpy as np

    from benchmarks.service import cpu
    from benchmarks.service.replay import RandomTeacherRows

    cpu.track_thread_ends()
    rows = RandomTeacherRows(k=8, pool=4096)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, rows.vocab, 64).tolist() for _ in range(24)]
    settings = {"k": 8, "job_batch_sequences": 8, "log_level": "warning"}
    r = cpu.one_run(8, prompts, settings, rows)
    groups = r["thread_group_us_per_position"]
    assert groups["job_writer"] > 0 and groups["zarr_io"] > 0
    st = r["stage_us_per_position"]
    assert st["encode"] > 0 and st["compress"] > 0 and st["write"] > 0
    assert sum(st.values()) == pytest.approx(r["us_per_position"])
    assert abs(st["other"]) < 0.25 * r["us_per_position"], st


def test_service_suite_replays_the_transformers_backend_at_a_gpus_pace() -> None:
    """``service cpu --form hf``: the transformers backend's own code behind replayed device
    work (random-teacher rows, paced at ``rate`` tokens/s): its worker thread's host work is
    the ``engine`` stage, the replayed rows' making (the ``device`` stage) is reported apart and
    not counted, and the stages add up to the job path's CPU."""
    import numpy as np

    from benchmarks.service import cpu
    from benchmarks.service.replay import RandomTeacherRows

    cpu.track_thread_ends()
    rows = RandomTeacherRows(k=16, pool=4096)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, rows.vocab, 256).tolist() for _ in range(16)]
    settings = {"k": 16, "job_batch_sequences": 4, "log_level": "warning"}
    r = cpu.one_run(16, prompts, settings, rows, "hf", rate=20000.0)
    assert r["positions"] == 16 * 255 and r["form"] == "hf"
    assert r["wall_s"] >= 16 * 256 / 20000.0  # the replayed device's pace held the job back
    st = r["stage_us_per_position"]
    assert st["engine"] > 0 and st["encode"] > 0 and st["compress"] > 0
    assert r["device_us_per_position"] > 0 and "device" not in st
    assert sum(st.values()) == pytest.approx(r["us_per_position"])
    assert abs(st["other"]) < 0.25 * r["us_per_position"], st


def test_service_protocols_mode_serves_a_random_llama_of_the_asked_shape(tmp_path: Path) -> None:
    """``service protocols --shape tiny``: the routes are timed against a random-weight Llama of
    that shape (not the fixture teacher), which the JSON records, and every path was timed."""
    import json

    from benchmarks.service.gpu import SHAPES

    out = tmp_path / "p.json"
    args = ["--sequences", "2", "--length", "16", "--json", str(out), "--csv", str(tmp_path / "r")]
    _run("-m", "benchmarks.service", "protocols", "--shape", "tiny", *args)
    got = json.loads(out.read_text())
    assert got["args"]["shape"] == "tiny"
    assert got["teacher"]["shape"] == "tiny" and got["teacher"]["vocab"] == SHAPES["tiny"].vocab
    assert got["teacher"]["params"] > 0 and got["teacher"]["layers"] == SHAPES["tiny"].layers
    assert all(got["median_s"][p] > 0 for p in ("direct_ids_topk", "vllm_route", "sglang_route"))
    assert got["bytes_per_position"]["vllm_npy_base64"] > 0


def _report(seed: int, kls: dict[str, float]) -> dict[str, Any]:
    methods: dict[str, dict[str, Any]] = {}
    for m, kl in kls.items():
        methods[m] = {"kl": kl, "ppl": 80.0, "ece": 0.02, "step_ms_median": 500.0}
        if m != "online_kd":
            methods[m].update(bytes_per_position=100.0, budget=100.0, step_ms_median=300.0)
    return {
        "command": "python examples/distill.py --steps 3",
        "machine": "test box",
        "models": {"teacher_params": 10, "student_params": 5, "vocab_size": 1024},
        "plan": {"teacher_temperature": 1.0, "budgets": [100.0]},
        "heldout": {"teacher_ppl": 28.0, "positions": 100},
        "cache": {
            "num_sequences": 2,
            "num_rows": 10,
            "k": 8,
            "mean_topk_mass": 0.9,
            "bytes_per_position": 40.0,
        },
        "train": {"steps": 3, "batch_items": 2, "tokens_per_item": 4, "lr": 0.1, "seed": seed},
        "methods": methods,
        "notes": ["a note"],
    }


def test_distill_study_pairs_each_seed_with_its_own_online_run() -> None:
    from experiments import distill

    reports = [
        _report(0, {"online_kd": 1.0, "offline_topk_tail@8": 1.10, "offline_sampled@16": 1.05}),
        _report(1, {"online_kd": 2.0, "offline_topk_tail@8": 2.02, "offline_sampled@16": 2.2}),
    ]
    methods = distill.combine(reports)
    tail = methods["offline_topk_tail@8"]
    assert tail["kl_by_seed"] == [1.10, 2.02]
    assert tail["kl_vs_online_by_seed"] == pytest.approx([0.10, 0.01])
    assert tail["kl_vs_online"] == pytest.approx(1.56 / 1.5 - 1)  # on the seed means
    text = distill.markdown(reports, methods)
    assert "| +10.0%, +1.0% |" in text


def test_machine_row_names_the_commit_of_an_archive_copy(tmp_path: Path) -> None:
    """A ``git archive`` copy (no ``.git``) is named by its ``GIT_SHA`` file, not by the checkout
    the harness happens to run from; a copy without one is ``unknown``."""
    from benchmarks.harness import _git_sha

    assert _git_sha(tmp_path) == "unknown"
    (tmp_path / "GIT_SHA").write_text("0123456789\n")
    assert _git_sha(tmp_path) == "0123456789+archive"
    assert _git_sha().split("+")[0] != "0123456789"
