"""``python -m benchmarks``: list the suites, or run one (from the checkout's root).

::

    python -m benchmarks --list                  # the suites and their modes
    python -m benchmarks SUITE [MODE ARGS ...]   # = python -m benchmarks.SUITE MODE ARGS ...

A suite is a module (or a package with ``__main__``) of this package other than the harness;
it runs in a child process, whose exit status is this command's (an unknown suite: 2).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USAGE = "usage: python -m benchmarks --list | SUITE [MODE ARGS ...]"


def _summary(source: Path) -> str:
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def suites() -> dict[str, tuple[str, str]]:
    """Suite name -> (the module whose ``main(argv)`` runs it, its docstring's first paragraph)."""
    found = {}
    for path in sorted((ROOT / "benchmarks").iterdir()):
        if (path / "__main__.py").is_file():
            doc = path / "__init__.py" if (path / "__init__.py").is_file() else path / "__main__.py"
            found[path.name] = (f"benchmarks.{path.name}.__main__", _summary(doc))
        elif path.suffix == ".py" and not path.name.startswith("_") and path.stem != "harness":
            if '__name__ == "__main__"' in path.read_text():
                found[path.stem] = (f"benchmarks.{path.stem}", _summary(path))
    return found


def modes(module: str) -> list[str]:
    """The suite's modes, as its ``--help`` lists them."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        with contextlib.suppress(SystemExit):
            importlib.import_module(module).main(["--help"])
    found = re.search(r"\{([\w,-]+)\}", out.getvalue())
    return found.group(1).split(",") if found else []


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    found = suites()
    if not args or args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--list":
        width = max(map(len, found))
        print(f"suites in {ROOT / 'benchmarks'} (run: python -m benchmarks SUITE MODE [options]):")
        for name, (module, summary) in found.items():
            print(f"  {name:<{width}}  modes: {', '.join(modes(module)) or '-'}")
            print(f"  {'':<{width}}  {summary}")
        return 0
    if args[0] not in found:
        print(
            f"{USAGE}\nno benchmark suite {args[0]!r}; the suites: {', '.join(found)}",
            file=sys.stderr,
        )
        return 2
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{args[0]}", *args[1:]], cwd=ROOT
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
