"""``python -m benchmarks.service <mode> [options]``: the modes of the service suite."""

from __future__ import annotations

import importlib
import sys

#: mode -> module under ``benchmarks.service`` (each has ``main(argv)``).
MODES = {"jobs": "jobs", "cpu": "cpu", "overload": "overload", "cache": "cache",
         "appends": "appends", "ray": "replicas", "gpu": "gpu", "protocols": "protocols",
         "teachers": "teachers"}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in MODES:
        print(f"usage: python -m benchmarks.service {{{','.join(MODES)}}} [options]")
        raise SystemExit(2)
    importlib.import_module(f"benchmarks.service.{MODES[args[0]]}").main(args[1:])


if __name__ == "__main__":
    main()
