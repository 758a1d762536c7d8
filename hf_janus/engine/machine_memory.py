"""What this machine has: the process's resident memory and its peak over a block, what the host, a container's
cgroup, a CUDA device and a cache directory's disk can still take, and the shares of each a rectification may fill.
Measured, not assumed; the memory plan (:mod:`.memory_plan`) compares its predictions with these."""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Callable, Optional

import torch

from hf_janus.engine.store import available_host_memory
from hf_janus.errors import JanusError

# Share of the device's capacity the plan may fill: the allocator's fragmentation and the CUDA context need the rest.
DEVICE_FILL = 0.92
# Share of the host memory available at planning time the plan may fill (the OS, other processes, page cache).
HOST_FILL = 0.85
# Share of the cache directory's free disk the factors may fill (other writers, the file system's own reserve).
DISK_FILL = 0.9


def current_host_bytes() -> int:
    """This process's resident set size (``VmRSS``), 0 where it cannot be read."""
    try:
        with open(f"/proc/{os.getpid()}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class HostPeak:
    """The largest resident set size of this process inside a ``with`` block (``peak``, bytes; ``None`` where it
    cannot be read), sampled every ``interval`` seconds by a thread: the host's counterpart of
    ``torch.cuda.max_memory_allocated``, without resetting the kernel's peak mark, which other tools may read.
    A spike shorter than the interval can be missed."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.peak = interval, None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak or 0, current_host_bytes())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "HostPeak":
        if current_host_bytes() == 0:
            return self
        self._thread = threading.Thread(target=self._sample, name="hf-janus-host-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak or 0, current_host_bytes())


def free_disk_bytes(cache: str, disk_usage: Callable[[str], Any] = shutil.disk_usage) -> Optional[int]:
    """Free bytes on the file system of the cache directory (or of its nearest existing parent); None for
    ``cache="memory"`` or where it cannot be read. ``disk_usage``: what reads a path's file system (tests pass their
    own to see which path is measured)."""
    if str(cache) == "memory":
        return None
    path = os.path.abspath(os.fspath(cache))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return disk_usage(path).free
    except OSError:
        return None


def check_cache_directory(cache: str) -> None:
    """Refuse, before any work, a ``cache`` directory that cannot be made or written: the factor store would fail
    there only after the memory plan said the run fits."""
    if str(cache) == "memory":
        return
    path = os.path.abspath(os.fspath(cache))
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"lies under {existing!r}, which is a file"
        raise JanusError(f"cache={os.fspath(cache)!r} {where}, so the factors cannot be stored there: point cache at "
                         "a directory (it is created if missing), or use cache='memory'")
    if not os.access(existing, os.W_OK | os.X_OK):
        made = "" if existing == path else f" (its nearest existing parent {existing!r})"
        raise JanusError(f"cache={os.fspath(cache)!r}{made} is not writable by this process, so the factors cannot "
                         "be stored there: point cache at a directory you can write, or use cache='memory'")


#: Where the process's cgroup memory controller is mounted (its own cgroup, in a container with a cgroup namespace).
CGROUP_ROOT = "/sys/fs/cgroup"


def _read_number(path: str, key: Optional[str] = None) -> Optional[int]:
    """The integer in a cgroup file (or on its line starting with ``key``); None for "max" or an unreadable file."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                fields = line.split()
                if key is None and fields:
                    return int(fields[0]) if fields[0] != "max" else None
                if len(fields) == 2 and fields[0] == key:
                    return int(fields[1])
    except (OSError, ValueError):
        pass
    return None


def container_available_memory(root: str = CGROUP_ROOT) -> Optional[int]:
    """Bytes the container may still take under its cgroup memory limit: the limit (v2 ``memory.max``, v1
    ``memory/memory.limit_in_bytes``) less what the cgroup uses that cannot be reclaimed (its usage less inactive
    file pages, which the kernel drops before it kills). None without a limit or where none can be read: a
    container's limit does not show in ``/proc/meminfo``, which reports the whole machine."""
    layouts = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
               ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                "total_inactive_file"))
    for limit_file, usage_file, stat_file, inactive_key in layouts:
        limit = _read_number(os.path.join(root, limit_file))
        if limit is None:
            continue
        if limit >= 1 << 60:  # cgroup v1 writes "no limit" as the largest page-aligned number
            return None
        usage = _read_number(os.path.join(root, usage_file)) or 0
        inactive = _read_number(os.path.join(root, stat_file), inactive_key) or 0
        return max(0, limit - max(0, usage - inactive))
    return None


def measure_in_use_and_capacity(device: torch.device, cache: str = "memory",
                                cgroup_root: str = CGROUP_ROOT) -> tuple[dict[str, int], dict[str, Optional[int]]]:
    """Bytes in use now and the most the plan may fill, on the device, on the host (the machine's available memory
    or the container's cgroup limit, whichever is lower) and (with a cache directory) on the disk that holds it:
    measured on this machine, not assumed. ``cgroup_root``: where the cgroup files are read."""
    rss = current_host_bytes()
    known = [n for n in (available_host_memory(), container_available_memory(cgroup_root)) if n is not None]
    available = min(known) if known else None
    host_capacity = None if available is None else rss + int(HOST_FILL * available)
    free_disk = free_disk_bytes(cache)
    disk_capacity = None if free_disk is None else int(DISK_FILL * free_disk)
    device = torch.device(device)
    if device.type == "cuda":
        allocated, device_capacity = cuda_in_use_and_capacity(device)
        return ({"device": allocated, "host": rss},
                {"device": device_capacity, "host": host_capacity, "disk": disk_capacity})
    return {"device": 0, "host": rss}, {"device": None, "host": host_capacity, "disk": disk_capacity}


def free_bytes(device: torch.device, cgroup_root: str = CGROUP_ROOT) -> Optional[int]:
    """Bytes that work on ``device`` may still allocate there: the device's share (the host's, for the CPU) of
    :func:`measure_in_use_and_capacity` less what is in use; ``None`` where it cannot be measured."""
    device = torch.device(device)
    in_use, capacity = measure_in_use_and_capacity(device, cgroup_root=cgroup_root)
    where = "device" if device.type == "cuda" else "host"
    return None if capacity[where] is None else max(0, capacity[where] - in_use[where])


def cuda_in_use_and_capacity(device: torch.device) -> tuple[int, int]:
    """Bytes this process has allocated on a CUDA device and the most it may fill there: what is free or held idle
    by the caching allocator, capped by ``torch.cuda.set_per_process_memory_fraction`` (how a shared card, or a
    benchmark standing in for a smaller one, limits a process), times :data:`DEVICE_FILL`."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved_idle = torch.cuda.memory_reserved(device) - allocated
    reachable = allocated + reserved_idle + free
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(device)
    return allocated, int(DEVICE_FILL * min(reachable, fraction * total))
