"""Print what installing the project with a set of extras needs, one requirement per line, from
pyproject.toml alone (standard library only: it runs before the project is installed): the build
backend (``[build-system] requires``), ``[project] dependencies`` and each extra's.

The images install these in a layer of their own, so that layer is rebuilt only when
pyproject.toml changes, and the project's own source follows in a small layer (``--no-deps``).

Usage: ``python3 docker/requirements.py pyproject.toml server,cpu,s3``
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """Build requirements, dependencies and each extra's, in order, without duplicates.

    Raises ``KeyError`` for an extra pyproject.toml does not define.
    """
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = data["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise KeyError(f"extras not in {pyproject}: {unknown} (known: {sorted(optional)})")
    out: list[str] = []
    build = data.get("build-system", {}).get("requires", [])
    for req in [
        *build,
        *project.get("dependencies", []),
        *(r for e in extras for r in optional[e]),
    ]:
        if req not in out:
            out.append(req)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    extras = [e.strip() for e in argv[1].split(",") if e.strip()]
    try:
        reqs = requirements(Path(argv[0]), extras)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
