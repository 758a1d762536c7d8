"""Wall-clock accounting per phase; accelerator work is synchronized so each phase pays its own way."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch


def synchronize(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Accumulates seconds per named phase."""

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self._spans: list[tuple[str, Any, Any]] = []  # CUDA event pairs not read yet

    def synchronize(self) -> None:
        """Wait for the device (the only place the capture does)."""
        synchronize(self.device)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the work queued inside without waiting for the device: on CUDA a pair of events, read by :meth:`settle`
        (a synchronization per span would stall every layer's hook); elsewhere the wall-clock time."""
        if self.device is None or self.device.type != "cuda":
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[name] += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            end.record()
            self._spans.append((name, begin, end))

    def settle(self) -> None:
        """Add the device time of the spans recorded so far (waits for the device once if there are any)."""
        if not self._spans:
            return
        self.synchronize()
        for name, begin, end in self._spans:
            self.seconds[name] += begin.elapsed_time(end) / 1000.0
        self._spans.clear()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in sorted(self.seconds.items())}
