"""The evaluation and time budgets of a rectification (``JanusConfig.max_evaluations`` / ``max_seconds``); whether a
trial passes is :mod:`hf_janus.engine.acceptance`'s."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional


class Budget:
    """``JanusConfig.max_evaluations`` / ``max_seconds``: whether another Jacobian evaluation still fits."""

    def __init__(self, max_evaluations: Optional[int], max_seconds: Optional[float],
                 clock: Callable[[], float] = time.perf_counter):
        self.max_evaluations, self.max_seconds, self.clock = max_evaluations, max_seconds, clock
        self.start = clock()
        # passes that decide nothing (captures="two" taking a dropped capture again): not charged, so that the
        # schedule changes how much memory a run needs, never which trials a time budget lets it evaluate
        self.excluded = 0.0
        #: why the budget ran out (None while it has not), and the knob that raises it
        self.reason: Optional[str] = None
        self.knob = ""

    def exhausted(self, evaluations: int) -> bool:
        if self.reason is not None:
            return True
        if self.max_evaluations is not None and evaluations >= self.max_evaluations:
            self.reason = f"budget: max_evaluations={self.max_evaluations} reached"
            self.knob = "JanusConfig.max_evaluations (--max-evaluations)"
        elif self.max_seconds is not None:
            elapsed = self.clock() - self.start - self.excluded
            # Stop before a trial that would end past the limit, not after it: one evaluation can take minutes.
            if elapsed + elapsed / max(evaluations, 1) > self.max_seconds:
                self.reason = (f"budget: max_seconds={self.max_seconds:g} would be exceeded by the next evaluation "
                               f"({elapsed:.0f} s spent)")
                self.knob = "JanusConfig.max_seconds (--max-seconds)"
        return self.reason is not None

    @contextmanager
    def not_charged(self) -> Iterator[None]:
        """Leave the time spent inside out of ``max_seconds`` (repeated passes, see :attr:`excluded`)."""
        start = self.clock()
        try:
            yield
        finally:
            self.excluded += self.clock() - start
