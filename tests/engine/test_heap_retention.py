"""The allocator's share of the memory plan follows the environment glibc read at start-up, not ``os.environ`` as a
caller changed it since: glibc no longer reads it."""

from __future__ import annotations

import os
import platform

import pytest

from hf_janus.engine.memory_plan import HEAP_RETENTION, heap_retention
from hf_janus.engine.start_environment import START_ENVIRONMENT, read_start_environment

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the share is modelled under glibc only")


@glibc
def test_changing_os_environ_after_start_up_does_not_change_the_share(monkeypatch):
    at_start = heap_retention()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    assert heap_retention() == at_start
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert heap_retention() == at_start
    assert at_start == heap_retention(START_ENVIRONMENT, "glibc")
    # an environment passed in still decides, whatever os.environ holds
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert heap_retention({}, "glibc") == HEAP_RETENTION
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert heap_retention({"MALLOC_MMAP_THRESHOLD_": "131072"}, "glibc") == 0.0


def test_the_start_environment_is_read_from_proc_or_else_from_the_fallback(tmp_path):
    block = tmp_path / "environ"
    block.write_bytes(b"PATH=/bin\0MALLOC_MMAP_THRESHOLD_=65536\0GLIBC_TUNABLES=glibc.malloc.arena_max=2\0ODD\0")
    assert read_start_environment(str(block), fallback={"MALLOC_MMAP_THRESHOLD_": "1"}) == {
        "MALLOC_MMAP_THRESHOLD_": "65536", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    missing = str(tmp_path / "absent")
    assert read_start_environment(missing, fallback={"MALLOC_MMAP_THRESHOLD_": "1", "PATH": "/bin"}) == {
        "MALLOC_MMAP_THRESHOLD_": "1"}


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux's /proc only")
def test_proc_holds_the_start_up_block_that_setenv_leaves_alone(monkeypatch):
    before = read_start_environment()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert read_start_environment() == before
