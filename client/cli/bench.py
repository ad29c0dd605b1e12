"""``logitcache bench``: run a benchmark suite of a logitcache checkout.

::

    logitcache bench --list                  # the suites and their modes
    logitcache bench SUITE [MODE ARGS ...]   # = python -m benchmarks.SUITE MODE ARGS ...

A suite is a module (or a package with ``__main__``) under the checkout's ``benchmarks/`` that
runs as ``python -m benchmarks.<suite>``; the harness (``benchmarks/harness.py``) is the suites'
tool, not a suite. The checkout is the current directory or the nearest parent with a
``benchmarks/`` folder, else the source tree this module was imported from. The suite runs in a
child process of this interpreter, from the checkout's root; its exit status is the command's.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import CliError

#: Modules under ``benchmarks/`` that run as programs but are not suites.
NOT_SUITES = frozenset({"harness"})
_MODES = re.compile(r"\{([\w,-]+)\}")


@dataclass(frozen=True)
class Suite:
    name: str
    summary: str
    #: the module whose ``main(argv)`` runs the suite
    module: str


def find_checkout(start: Path | None = None) -> Path:
    """The root of the logitcache checkout whose ``benchmarks/`` the suites come from."""
    here = (start or Path.cwd()).resolve()
    source_tree = Path(__file__).resolve().parents[2]
    for root in (here, *here.parents, source_tree):
        if (root / "benchmarks" / "__init__.py").is_file():
            return root
    raise CliError(
        f"no benchmarks/ folder in {here} or above: run `logitcache bench` in a logitcache checkout"
    )


def _summary(source: Path) -> str:
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def suites(root: Path) -> list[Suite]:
    """The checkout's suites, by name."""
    found = []
    for path in sorted((root / "benchmarks").iterdir()):
        if path.is_dir() and (path / "__main__.py").is_file():
            doc = path / "__init__.py" if (path / "__init__.py").is_file() else path / "__main__.py"
            found.append(Suite(path.name, _summary(doc), f"benchmarks.{path.name}.__main__"))
        elif path.suffix == ".py" and not path.name.startswith("_"):
            if path.stem not in NOT_SUITES and '__name__ == "__main__"' in path.read_text():
                found.append(Suite(path.stem, _summary(path), f"benchmarks.{path.stem}"))
    return found


def _command(suite: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", f"benchmarks.{suite}", *args]


#: Run in one child process from the checkout's root: each suite's ``main(["--help"])``, its
#: output captured; prints ``{suite: help text}`` as JSON.
_HELP_SCRIPT = """
import contextlib, importlib, io, json, sys
texts = {}
for arg in sys.argv[1:]:
    name, module = arg.split("=")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            importlib.import_module(module).main(["--help"])
        except SystemExit:
            pass
    texts[name] = out.getvalue()
print(json.dumps(texts))
"""


def modes(root: Path, found: list[Suite]) -> dict[str, list[str]]:
    """Each suite's modes, as its ``--help`` (or bare usage line) lists them; one child process
    imports every suite."""
    out = subprocess.run(
        [sys.executable, "-c", _HELP_SCRIPT, *(f"{s.name}={s.module}" for s in found)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise CliError(f"could not read the suites' modes: {out.stderr.strip()[-500:]}")
    texts: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    found_modes = {name: _MODES.search(text) for name, text in texts.items()}
    return {name: m.group(1).split(",") if m else [] for name, m in found_modes.items()}


def list_suites(root: Path) -> str:
    """One line per suite: its name, its modes and the first paragraph of its docstring."""
    found = suites(root)
    all_modes = modes(root, found)
    width = max((len(s.name) for s in found), default=0)
    lines = [f"suites in {root / 'benchmarks'} (run: logitcache bench SUITE MODE [options]):"]
    for suite in found:
        lines.append(f"  {suite.name:<{width}}  modes: {', '.join(all_modes[suite.name]) or '-'}")
        lines.append(f"  {'':<{width}}  {suite.summary}")
    return "\n".join(lines)


def run_suite(root: Path, suite: str, args: list[str]) -> int:
    """``python -m benchmarks.<suite> ARGS`` from the checkout's root; its exit status."""
    names = [s.name for s in suites(root)]
    if suite not in names:
        raise CliError(f"no benchmark suite {suite!r}; the suites: {', '.join(names)}")
    return subprocess.run(_command(suite, args), cwd=root).returncode
