"""logitcache's benchmark suites, each runnable from the repository root as
``python -m benchmarks.<suite> <mode> [options]`` or ``python -m benchmarks <suite> <mode>
[options]`` (``python -m benchmarks --list``: the suites and their modes), over one harness
(:mod:`benchmarks.harness`) and one synthetic teacher (:mod:`benchmarks.synthetic`). Rows go to
``benchmarks/results/all_benchmark_data.csv``; each suite has one current page
``benchmarks/results/<suite>.md``; ``benchmarks/RESULTS.md`` is the goals dashboard.
"""
