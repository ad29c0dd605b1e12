"""The teacher service: job path vs the engine, CPU per position, overload, cache serving,
protocol routes, several teachers, Ray.

One module per mode (``python -m benchmarks.service <mode>``; the page:
``benchmarks/results/service.md``); the real-engine modes run the tiny trained teacher
(``logitcache.fixtures.tiny``) and start the service with ``tests.server_support``.
"""
