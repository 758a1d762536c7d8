"""The environment this process started with, for the settings the C library reads once at start-up.

glibc's malloc reads ``MALLOC_MMAP_THRESHOLD_`` and the dynamic loader reads ``GLIBC_TUNABLES`` before Python runs
a line; assigning ``os.environ`` later changes what child processes inherit, not how this process allocates. So what
decides the allocator's behaviour is the environment at ``execve``: ``/proc/self/environ`` on Linux (the kernel
keeps the start-up block there, which ``setenv`` does not rewrite), else ``os.environ`` as it was when this module
was first imported, the nearest to start-up that can still be read.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

#: the variables through which glibc fixes malloc's mmap threshold at start-up
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")

PROC_ENVIRON = "/proc/self/environ"


def read_start_environment(path: str = PROC_ENVIRON, fallback: Optional[Mapping[str, str]] = None,
                           names: tuple[str, ...] = ALLOCATOR_VARIABLES) -> dict[str, str]:
    """``names`` as the process started with them: from ``path`` (NUL-separated ``KEY=VALUE`` entries), or from
    ``fallback`` (default ``os.environ`` now) where ``path`` cannot be read."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        source = os.environ if fallback is None else fallback
        return {k: source[k] for k in names if k in source}
    found = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        name = os.fsdecode(key)
        if sep and name in names:
            found[name] = os.fsdecode(value)
    return found


#: the allocator's variables at start-up, read when the engine is first imported (before any caller can change
#: ``os.environ`` through it)
START_ENVIRONMENT: Mapping[str, str] = read_start_environment()
