"""The benchmarks' one harness: machine row, timers, quantiles, peak memory, the results CSV
(one value per row with its suite/mode/case, configuration and machine row), A/B runs of two
trees, the device runner and plots. A suite states *what* it measures; this module *how*.

::

    python -m benchmarks.harness machine                   # the machine row, as JSON
    python -m benchmarks.harness ab REV_A REV_B -- -m benchmarks.format configs --positions 65536
    python -m benchmarks.harness with-tree TREE -- -m benchmarks.format configs --positions 65536
    python -m benchmarks.harness device WHEELS -- -m benchmarks.loader scaling --positions 1e8

``ab`` runs the command under the packages of each revision (``git archive``) in turn,
``--rounds`` times; ``with-tree`` under another tree's packages; ``device`` where the project is
not installed (wheels from ``WHEELS`` to ``/tmp/site``, the packages linked from this checkout).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import glob
import importlib
import json
import os
import platform
import runpy
import shlex
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CSV_PATH = RESULTS / "all_benchmark_data.csv"
PACKAGES = ("cache_format", "client", "server")
#: The revision whose packages this process runs under ``ab`` (recorded in each row's config).
TREE = os.environ.get("BENCH_TREE", "")


def log(*parts: Any) -> None:
    """A timestamped progress line on stdout."""
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# --------------------------------------------------------------------------- machine row
def _git_sha(root: Path = ROOT) -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes); in a ``git archive`` copy
    (no ``.git``), the commit its ``GIT_SHA`` file names."""
    if not (root / ".git").exists() and (root / "GIT_SHA").is_file():
        return (root / "GIT_SHA").read_text().strip() + "+archive"

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip

    try:
        sha, dirty = git("rev-parse", "--short=10", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Where a figure was measured: git sha, CPU, usable CPUs, load average, Python, torch, CUDA,
    GPU name (``""`` where absent)."""
    row: dict[str, Any] = dict(git_sha=_git_sha(), cpu=_cpu_name(), torch="", cuda="", gpu="")
    row |= dict(cpu_count=len(os.sched_getaffinity(0)), python=platform.python_version())
    row["load_avg"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if importlib.util.find_spec("torch") is not None:
        import torch

        row["torch"] = torch.__version__
        row["cuda"] = torch.version.cuda or ""
        if torch.cuda.is_available():
            row["gpu"] = torch.cuda.get_device_name(0)
            row["gpu_count"] = torch.cuda.device_count()
    return row


def machine_line(row: Mapping[str, Any] | None = None) -> str:
    """The machine row as one line for a page."""
    m = dict(row or machine())
    gpu = f", {m['gpu']}" if m.get("gpu") else ", no GPU"
    torch = f", torch {m['torch']}" + (f" (CUDA {m['cuda']})" if m.get("cuda") else "")
    return (
        f"{m['cpu']}, {m['cpu_count']} CPUs{gpu}, Python {m['python']}"
        f"{torch if m.get('torch') else ''}, load {m['load_avg']}, git {m['git_sha']}"
    )


def pin_cores(n: int) -> None:
    """Run this process (and blosc's/zarr's threads) on its first ``n`` usable cores."""
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:n]))
    with contextlib.suppress(ImportError):
        import numcodecs.blosc
        import zarr

        numcodecs.blosc.set_nthreads(n)
        zarr.config.set({"threading.max_workers": n})


# --------------------------------------------------------------------------- timing
def quantiles(samples: Sequence[float], qs: Sequence[float] = (0.5, 0.2, 0.8)) -> list[float]:
    """The ``qs`` quantiles of ``samples`` (linear interpolation; Liger reports 0.5/0.2/0.8)."""
    if not samples:
        raise ValueError("no samples")
    s = sorted(samples)
    out = []
    for q in qs:
        pos = q * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return out


def percentile(xs: Sequence[float], q: float) -> float | None:  # the service suite's
    """The nearest-rank ``q``-th percentile of ``xs`` (None if empty)."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else None


@dataclass(frozen=True)
class Measurement:
    """Seconds per call, one sample per repeat: ``wall`` and ``cpu`` (process, all threads)."""

    wall: list[float]
    cpu: list[float] = field(default_factory=list)

    def rate(self, work: float, cpu: bool = False, best: bool = False) -> float:
        """``work`` per second (per CPU-second with ``cpu``), at the median or the best."""
        samples = self.cpu if cpu else self.wall
        return work / (min(samples) if best else statistics.median(samples))


def measure(fn: Callable[[], Any], repeats: int = 3, warmup: int = 0) -> Measurement:
    """Time ``repeats`` calls of ``fn`` (wall and process CPU) after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return Measurement(wall, cpu)


def sync(cuda: bool) -> None:
    """Wait for the GPU's queued work (no-op on the CPU)."""
    if cuda:
        import torch

        torch.cuda.synchronize()


def time_call(cuda: bool, fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn``: CUDA events on the GPU, ``perf_counter`` on the CPU."""
    if cuda:
        import torch

        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(cuda: bool, fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (:func:`time_call`) after ``warmup``."""
    for _ in range(warmup):
        fn()
    sync(cuda)
    return statistics.median(time_call(cuda, fn) for _ in range(repeats))


# --------------------------------------------------------------------------- processes
@contextlib.contextmanager
def server_process(
    cmd: Sequence[str],
    ready: str,
    *,
    log: Path | None = None,
    timeout: float = 300,
    every: float = 0.1,
    env: Mapping[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` (output to ``log``), yield it once the URL ``ready`` answers 200 (else a
    ``RuntimeError`` with the log's tail), terminate it afterwards."""
    import httpx

    out = log.open("wb") if log is not None else None
    proc = subprocess.Popen(
        list(cmd), cwd=ROOT, stdout=out, stderr=out and subprocess.STDOUT, env=env
    )
    try:
        deadline, up = time.monotonic() + timeout, False
        with httpx.Client(timeout=5) as poll:  # one client: httpx.get builds one per call
            while not up and time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(httpx.TransportError):
                    up = poll.get(ready).status_code == 200
                time.sleep(0 if up else every)
        if not up:
            why = f"{ready} did not answer in {timeout:.0f} s"
            if proc.poll() is not None:
                why = f"the server process exited with {proc.returncode}"
            tail = log.read_text()[-4000:] if log is not None else ""
            raise RuntimeError(f"{why}\n{tail}")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        if out is not None:
            out.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu(pid: int, children: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` (with ``children``, also its waited-for
    children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11 : 15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds per thread (``"<tid>:<name>"``) of process ``pid``, from ``schedstat`` (else
    the ``stat`` ticks); this process's threads carry their Python names."""
    names = {t.native_id: t.name for t in threading.enumerate()} if pid == "self" else {}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_text()
            ns = (task / "schedstat").read_text().split()[0]
        except (OSError, IndexError):
            continue
        name = names.get(int(task.name)) or raw[raw.index("(") + 1 : raw.rindex(")")]
        f = raw[raw.rindex(")") + 2 :].split()
        ticks = (int(f[11]) + int(f[12])) / tick
        out[f"{task.name}:{name}"] = int(ns) / 1e9 if ns.isdigit() else ticks
    return out


def load1() -> float:
    """The 1-minute load average now."""
    return round(os.getloadavg()[0], 2)


# --------------------------------------------------------------------------- memory
def free_memory(cuda: bool) -> None:
    """Collect garbage; on the GPU also hand the CUDA cache's free blocks back."""
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


def rss_bytes() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """``fn()`` sampled every ``interval`` s by a thread in the ``with`` block (``.samples``)."""

    def __init__(self, fn: Callable[[], Any] | None, interval: float) -> None:
        self.fn, self.interval, self.samples = fn, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.fn())  # type: ignore[misc]

    def __enter__(self) -> Any:
        if self.fn is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class PeakRSS(Sampler):
    """Resident bytes during the ``with`` block: ``.start``, ``.peak``, ``.growth``."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(rss_bytes, interval)
        self.start = 0

    def __enter__(self) -> PeakRSS:
        self.start = rss_bytes()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
        self.samples.append(rss_bytes())

    @property
    def peak(self) -> int:
        return max([self.start, *self.samples])

    @property
    def growth(self) -> int:
        return self.peak - self.start


# --------------------------------------------------------------------------- the CSV
COLUMNS = (
    "timestamp suite mode case metric unit value p20 p80 samples config "
    "git_sha cpu cpu_count load_avg torch cuda gpu command"
).split()


class Recorder:
    """One run's rows (:meth:`add`), appended to the CSV by :meth:`save`; the machine row is
    taken when it is made, ``config`` joins every row's configuration."""

    def __init__(
        self,
        suite: str,
        mode: str,
        *,
        csv_path: Path | None = None,
        command: str = "",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.suite, self.mode, self.config = suite, mode, dict(config or {})
        self.csv_path = CSV_PATH if csv_path is None else csv_path
        self.machine = machine()
        self.command = command or "python -m " + " ".join(
            [f"benchmarks.{suite}", *map(shlex.quote, sys.argv[1:])]
        )
        self.rows: list[dict[str, Any]] = []

    def add(
        self,
        case: str,
        metric: str,
        unit: str,
        value: float,
        *,
        p20: float | None = None,
        p80: float | None = None,
        samples: int = 1,
        config: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        cfg = self.config | dict(config or {}) | ({"tree": TREE} if TREE else {})
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        p20_, p80_ = ("" if p is None else float(p) for p in (p20, p80))
        values = [when, self.suite, self.mode, case, metric, unit, float(value), p20_, p80_]
        values += [samples, json.dumps(cfg, sort_keys=True, default=str)]
        values += [self.machine.get(k, "") for k in COLUMNS[11:18]] + [self.command]
        row = dict(zip(COLUMNS, values, strict=True))
        self.rows.append(row)
        return row

    def add_flat(
        self,
        case: str,
        values: Mapping[str, Any],
        *,
        prefix: str = "",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """One row per number in ``values`` (nested mappings flattened as ``a.b``; the unit is
        left to the metric's name)."""
        for key, v in values.items():
            if isinstance(v, Mapping):
                self.add_flat(case, v, prefix=f"{prefix}{key}.", config=config)
            elif isinstance(v, int | float) and not isinstance(v, bool):
                self.add(case, f"{prefix}{key}", "", v, config=config)

    def table(self) -> str:
        """The rows as a markdown table: a column per metric, a line per case and configuration
        (labelled by the configuration values that differ between the case's lines)."""
        lines: dict[tuple[str, str], dict[str, str]] = {}
        for r in self.rows:
            lines.setdefault((r["case"], r["config"]), {})[r["metric"]] = _num(r["value"])
        metrics = list(dict.fromkeys(m for cells in lines.values() for m in cells))
        body = []
        for case, config in lines:
            cfg, mates = json.loads(config), [json.loads(c) for k, c in lines if k == case]
            own = [f"{k}={v}" for k, v in cfg.items() if any(m.get(k) != v for m in mates)]
            cells = lines[case, config]
            body.append([" ".join([case, *own]), *(cells.get(m, "") for m in metrics)])
        return md_table(["case", *metrics], body)

    def save(self) -> Path:
        """Append the rows to the CSV (header written if the file is new)."""
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        with self.csv_path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            if new:
                w.writeheader()
            w.writerows(self.rows)
        return self.csv_path

    def finish(
        self, result: Any, json_path: Path | None = None, *, indent: int = 2, show: int = 0
    ) -> None:
        """:meth:`save`, print ``result`` as JSON (its first ``show`` characters if ``show`` > 0,
        nothing if < 0), write it to ``json_path`` if given."""
        self.save()
        text = json.dumps(result, indent=indent, default=str)
        if show >= 0:
            print(text[:show] if show else text, flush=True)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(text + "\n")


def suite_parser(suite: str, doc: str) -> tuple[argparse.ArgumentParser, Any]:
    """The parser of ``python -m benchmarks.<suite>`` and its ``mode`` subparsers."""
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{suite}", description=doc.split("\n")[0]
    )
    return p, p.add_subparsers(dest="mode", required=True)


def options(parser: argparse.ArgumentParser, **spec: Any) -> argparse.ArgumentParser:
    """One ``--name-with-dashes`` option per keyword, typed by its default (a list: ``nargs="+"``
    of its first item's type; ``False``: a flag); a value ``(default, help[, {add_argument
    keywords}])`` adds those. Returns ``parser``."""
    for name, value in spec.items():
        default, help_, extra = (
            (*value, None, None)[:3] if isinstance(value, tuple) else (value, None, None)
        )
        kw: dict[str, Any] = {"default": default, "help": help_}
        kind = type(default[0] if isinstance(default, list) else default)
        if default is False:
            kw["action"] = "store_true"
        elif kind not in (str, type(None)):
            kw["type"] = kind
        if isinstance(default, list):
            kw["nargs"] = "+"
        parser.add_argument("--" + name.replace("_", "-"), **kw | (extra or {}))
    return parser


def add_csv_option(parser: argparse.ArgumentParser) -> None:
    """``--csv PATH``: where a run appends its rows (default: the committed CSV)."""
    parser.add_argument("--csv", type=Path, default=CSV_PATH, help="append the rows here")


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- two trees
def _editable_finder() -> Any:
    site = sysconfig.get_paths()["purelib"]
    finders = glob.glob(os.path.join(site, "__editable___logitcache_*_finder.py"))
    if not finders:
        raise SystemExit("no editable install of logitcache in this environment")
    return importlib.import_module(os.path.basename(finders[0])[:-3])


def use_tree(tree: str | Path) -> list[str]:
    """Point this process's ``logitcache.*`` packages at those found in ``tree`` (a tree's root,
    or a ``cache_format`` folder) before anything imports them; the names moved."""
    finder = _editable_finder()
    tree = Path(tree).resolve()
    moved = []
    if (tree / "cache_format").is_dir():
        for name, path in list(finder.MAPPING.items()):
            package = tree / Path(path.rstrip("/")).name
            if package.is_dir():
                finder.MAPPING[name] = str(package)
                moved.append(name)
    else:
        finder.MAPPING["logitcache.cache_format"] = str(tree)
        moved.append("logitcache.cache_format")
    import logitcache.cache_format as taken

    if not str(taken.__path__[0]).startswith(str(tree)):
        raise RuntimeError(f"logitcache.cache_format still comes from {taken.__path__[0]}")
    return moved


def _run_target(target: Sequence[str]) -> None:
    """Run ``-m module args...`` or ``script.py args...`` in this process."""
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        runpy.run_path(target[0], run_name="__main__")


def export_tree(rev: str, dest: Path) -> Path:
    """``git archive rev`` of the project's packages under ``dest``; ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, *PACKAGES], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def ab(
    rev_a: str, rev_b: str, target: Sequence[str], rounds: int = 2
) -> list[tuple[str, int, int]]:
    """Run ``target`` (``-m module args...``) under the packages of ``rev_a`` and ``rev_b``,
    alternating, ``rounds`` times each (``BENCH_TREE`` names the revision); ``(rev, round,
    returncode)`` per run."""
    out = []
    with tempfile.TemporaryDirectory(prefix="lc-ab-") as tmp:
        trees = {rev: export_tree(rev, Path(tmp) / rev.replace("/", "_")) for rev in (rev_a, rev_b)}
        for r in range(rounds):
            for rev, tree in trees.items():
                log(f"round {r}: {rev}")
                env = dict(os.environ, BENCH_TREE=rev)
                cmd = [sys.executable, "-m", "benchmarks.harness", "with-tree", str(tree), "--"]
                out.append((rev, r, subprocess.run([*cmd, *target], cwd=ROOT, env=env).returncode))
    return out


# --------------------------------------------------------------------------- device runner
def device_env(
    wheels: Path, site: Path = Path("/tmp/site"), pkg: Path = Path("/tmp/lcpkg")
) -> dict[str, str]:
    """The environment to run a suite in where the project is not installed: ``wheels`` go to
    ``site``, ``pkg/logitcache/<package>`` link to this checkout's packages."""
    whls = sorted(glob.glob(str(wheels / "*.whl")))
    if whls:
        pip = "-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
        subprocess.run([sys.executable, *pip.split(), "--target", str(site), *whls], check=True)
    (pkg / "logitcache").mkdir(parents=True, exist_ok=True)
    for name in (*PACKAGES, "protocol", "fixtures"):
        link = pkg / "logitcache" / name
        if not link.exists() and (ROOT / name).is_dir():
            link.symlink_to(ROOT / name)
    path = os.pathsep.join([str(site), str(pkg), str(ROOT)])
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


# --------------------------------------------------------------------------- plots
Point = tuple[float, float]


def line_plot(
    out: str | Path,
    series: Mapping[str, Sequence[Point]],
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
    hline_label: str = "",
    note: str = "",
    size: tuple[float, float] = (6.4, 4.0),
) -> Path:
    """A line chart of ``series`` (name -> [(x, y), ...]) as a PNG at ``out`` (deterministic
    bytes); ``hline`` draws a dashed reference (a goal), ``note`` a caption under the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not series:
        raise ValueError("nothing to plot: series is empty")
    fig, ax = plt.subplots(figsize=size, dpi=120)
    try:
        for name, pts in series.items():
            if not pts:
                continue
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.5, label=name)
        if hline is not None:
            ax.axhline(hline, linestyle="--", color="grey", linewidth=1, label=hline_label or None)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        if note:
            fig.text(0.01, 0.01, note, fontsize=6, color="dimgrey")
        fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    return out


# --------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    i = argv.index("--") if "--" in argv else len(argv)
    own, target = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.harness", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("machine", help="print the machine row as JSON")
    a = sub.add_parser("ab", help="run a command under two revisions' packages, alternating")
    a.add_argument("rev_a")
    a.add_argument("rev_b")
    a.add_argument("--rounds", type=int, default=2)
    t = sub.add_parser("with-tree", help="run a command with the packages of another tree")
    t.add_argument("tree", type=Path)
    d = sub.add_parser("device", help="run a command where the project is not installed")
    d.add_argument("wheels", type=Path)
    args = p.parse_args(own)
    if args.cmd == "machine":
        print(json.dumps(machine(), indent=1))
        return 0
    if not target:
        raise SystemExit("give the command to run after --, e.g. -- -m benchmarks.format configs")
    if args.cmd == "ab":
        runs = ab(args.rev_a, args.rev_b, target, args.rounds)
        return max(rc for _, _, rc in runs)
    if args.cmd == "with-tree":
        use_tree(args.tree)
        _run_target(target)
        return 0
    env = device_env(args.wheels)
    return subprocess.run([sys.executable, *target], cwd=ROOT, env=env).returncode


@contextlib.contextmanager
def scratch(prefix: str = "lc-bench-") -> Iterator[Path]:
    """A temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield Path(d)


if __name__ == "__main__":
    sys.exit(main())
