"""The bytes a piece of work adds to this process at its peak, for the memory-plan probes that run whole
rectifications in fresh processes (tests/engine/test_memory_plan.py, tests/real/test_real_model_rectify.py,
benchmarks/perf/real_memory.py).

Linux only: the kernel's peak-RSS mark is reset through ``/proc/self/clear_refs``. Run the probe with glibc's
``MALLOC_MMAP_THRESHOLD_`` pinned, so that the RSS follows the live bytes, which is what the plan models.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, TypeVar

T = TypeVar("T")


def _status(key: str) -> int:
    with open(f"/proc/{os.getpid()}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))


def own_peak_bytes(work: Callable[[], T]) -> tuple[int, T]:
    """``(peak RSS during work() minus the RSS just before it, what work() returned)``."""
    try:  # hand the heap's free pages back, so that the baseline holds only live memory
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as fh:
        fh.write("5")  # reset the kernel's peak-RSS mark: what follows is the work's own peak
    baseline = _status("VmRSS:")
    result = work()
    return _status("VmHWM:") - baseline, result
