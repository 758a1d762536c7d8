"""The benchmarks of hf-janus, run as modules from the repository root (``python -m benchmarks.forgetting.run``).

A package, so that the scripts share their helpers by ordinary imports: :mod:`benchmarks.smollm2` (the offline
SmolLM2-135M folder, also used by the real-model tests), :mod:`benchmarks.memory_probe` (a process's own peak
memory), :mod:`benchmarks.forgetting` and :mod:`benchmarks.perf`. Nothing here is part of the installed library.
"""
