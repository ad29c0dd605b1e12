"""logitcache's benchmark suites (``python -m benchmarks --list``), over one harness
(:mod:`benchmarks.harness`) and one synthetic teacher (:mod:`benchmarks.synthetic`)."""
