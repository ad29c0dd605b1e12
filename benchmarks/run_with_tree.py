"""Run a script with the project's code taken from another tree (A/B runs of two trees in one
session, on the same stores).

Usage::

    git archive 279dc6b cache_format | tar -x -C /tmp/base
    python benchmarks/run_with_tree.py /tmp/base/cache_format benchmarks/random_access_bench.py ...

The first argument is a ``cache_format`` folder (only ``logitcache.cache_format`` is taken from
it) or a tree's root holding the project's packages, as ``git archive <rev> | tar -x`` makes it
(each package found there: ``cache_format``, ``server``, ``client``, ...). It points the editable
install's module map (``__editable___logitcache_*_finder.MAPPING``) there before the script
imports anything, so the script and everything it imports from those packages run the other
tree's code; the rest is this checkout's. ``benchmarks/job_cpu_ab.py`` runs its bench processes
through it.
"""

from __future__ import annotations

import glob
import importlib
import os
import runpy
import sys
import sysconfig


def main() -> None:
    folder, script, *args = sys.argv[1:]
    site = sysconfig.get_paths()["purelib"]
    finders = glob.glob(os.path.join(site, "__editable___logitcache_*_finder.py"))
    if not finders:
        raise SystemExit("no editable install of logitcache in this environment")
    finder = importlib.import_module(os.path.basename(finders[0])[:-3])
    folder = os.path.abspath(folder)
    if os.path.isdir(os.path.join(folder, "cache_format")):  # a tree: each package it holds
        for name, path in list(finder.MAPPING.items()):
            package = os.path.join(folder, os.path.basename(path.rstrip("/")))
            if os.path.isdir(package):
                finder.MAPPING[name] = package
    else:
        finder.MAPPING["logitcache.cache_format"] = folder
    import logitcache.cache_format as taken

    assert str(taken.__path__[0]).startswith(folder), (taken.__path__, folder)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
