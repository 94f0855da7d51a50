"""``ember bench``: ember side by side with the engines users would run instead.

Every backend (ember, transformers, vLLM-CPU, llama-cpp-python) runs in its own process and, except ember, its own
virtual environment (``benchmarks/setup_baselines.sh``), driven by a small script in ``drivers/`` that speaks one
JSON protocol: a spec file in (model, dtype, mode, the request list as token ids), a result file out (load time,
wall time, per-request token timestamps). The harness owns the workloads, the repeats and the statistics, so every
backend sees the identical seeded requests and is measured the same way.
"""
