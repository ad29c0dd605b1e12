"""Run a script with ``logitcache.cache_format`` taken from another folder (A/B runs of two trees
in one session, on the same stores).

Usage::

    git archive 279dc6b cache_format | tar -x -C /tmp/base
    python benchmarks/run_with_tree.py /tmp/base/cache_format benchmarks/random_access_bench.py ...

It points the editable install's module map (``__editable___logitcache_*_finder.MAPPING``) at
the folder before the script imports anything, so the script and everything it imports from
``logitcache.cache_format`` run the other tree's code; the rest of the package is this checkout's.
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
    finder.MAPPING["logitcache.cache_format"] = os.path.abspath(folder)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
