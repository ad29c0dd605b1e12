"""``python -m benchmarks``: list the suites, or run one (from the checkout's root).

::

    python -m benchmarks --list                  # the suites and their modes
    python -m benchmarks SUITE [MODE ARGS ...]   # = python -m benchmarks.SUITE MODE ARGS ...

A suite is a module (or a package with ``__main__``) of this package that runs as
``python -m benchmarks.<suite>``; the harness (:mod:`benchmarks.harness`) is the suites' tool,
not a suite. A suite runs in a child process of this interpreter, from the checkout's root; its
exit status is this command's. An unknown suite exits with status 2.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: The checkout's root (the folder holding ``benchmarks/``).
ROOT = Path(__file__).resolve().parents[1]
#: Modules of this package that run as programs but are not suites.
NOT_SUITES = frozenset({"harness", "__main__"})
_MODES = re.compile(r"\{([\w,-]+)\}")
USAGE = "usage: python -m benchmarks --list | SUITE [MODE ARGS ...]"


@dataclass(frozen=True)
class Suite:
    name: str
    summary: str
    #: the module whose ``main(argv)`` runs the suite
    module: str


def _summary(source: Path) -> str:
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def suites() -> list[Suite]:
    """The suites, by name."""
    found = []
    for path in sorted((ROOT / "benchmarks").iterdir()):
        if path.is_dir() and (path / "__main__.py").is_file():
            doc = path / "__init__.py" if (path / "__init__.py").is_file() else path / "__main__.py"
            found.append(Suite(path.name, _summary(doc), f"benchmarks.{path.name}.__main__"))
        elif path.suffix == ".py" and not path.name.startswith("_"):
            if path.stem not in NOT_SUITES and '__name__ == "__main__"' in path.read_text():
                found.append(Suite(path.stem, _summary(path), f"benchmarks.{path.stem}"))
    return found


def modes(suite: Suite) -> list[str]:
    """The suite's modes, as its ``--help`` (or bare usage line) lists them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        with contextlib.suppress(SystemExit):
            importlib.import_module(suite.module).main(["--help"])
    found = _MODES.search(out.getvalue())
    return found.group(1).split(",") if found else []


def listing() -> str:
    """One line per suite: its name and modes, then the first paragraph of its docstring."""
    found = suites()
    width = max((len(s.name) for s in found), default=0)
    lines = [f"suites in {ROOT / 'benchmarks'} (run: python -m benchmarks SUITE MODE [options]):"]
    for suite in found:
        lines.append(f"  {suite.name:<{width}}  modes: {', '.join(modes(suite)) or '-'}")
        lines.append(f"  {'':<{width}}  {suite.summary}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--list":
        print(listing())
        return 0
    names = [s.name for s in suites()]
    if args[0] not in names:
        print(
            f"{USAGE}\nno benchmark suite {args[0]!r}; the suites: {', '.join(names)}",
            file=sys.stderr,
        )
        return 2
    command = [sys.executable, "-m", f"benchmarks.{args[0]}", *args[1:]]
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
