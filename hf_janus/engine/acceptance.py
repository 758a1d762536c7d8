"""Whether a trial step is taken: the acceptance score the step controller compares with its threshold, the
evaluation and time budgets, and the guard on the unchecked final step."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

from hf_janus.engine.config import JanusConfig

#: The step controller's threshold for the loss-based acceptance tests (:func:`acceptance_score` maps a pass to a
#: score at or above it).
SCORE_THRESHOLD = 0.5


def threshold(config: JanusConfig) -> float:
    """What the step controller compares scores with: τ for the paper's test, :data:`SCORE_THRESHOLD` otherwise."""
    return config.tau if config.acceptance == "cosine" else SCORE_THRESHOLD


def acceptance_score(config: JanusConfig, cbar: float, alpha: float, trial_loss: float, current_loss: float,
                     rise: float) -> float:
    """What the step controller compares with its threshold (``config.acceptance``).

    ``"cosine"``: c̄ itself, against τ (the paper's test). ``"loss"``: the trial passes when the whole-replay loss
    rose from the current point by at most ``loss_tolerance · α`` times the fine-tune's ``rise`` (the update's share
    this step moves); the ratio of the rise to that allowance is mapped to ``1 − ratio · (1 −`` the threshold ``)``
    so that it passes exactly when the ratio is at most 1, and the adaptive controller's model of the gap in α
    applies unchanged. ``"both"``: the larger of the loss ratio and the cosine's ``(1 − c̄)/(1 − τ)``. Undefined
    (NaN) fails.
    """
    if config.acceptance == "cosine":
        return cbar
    # a replay the fine-tune did not hurt still gets a small allowance, so that the loop can move
    allowed = config.loss_tolerance * alpha * max(rise, 1e-3 * abs(current_loss), 1e-12)
    ratio = (trial_loss - current_loss) / allowed
    if config.acceptance == "both":
        tau = config.tau
        cosine = (1.0 - cbar) / (1.0 - tau) if tau < 1.0 else (0.0 if cbar >= 1.0 else math.inf)
        # not max(): max(ratio, nan) is ratio and max(nan, ratio) is nan, so either order would let one undefined
        # half pass; an undefined loss or c̄ fails the whole test
        ratio = math.nan if math.isnan(ratio) or math.isnan(cosine) else max(ratio, cosine)
    if not math.isfinite(ratio):
        return -math.inf
    return 1.0 - ratio * (1.0 - SCORE_THRESHOLD)


def undoing_final_step(alpha: float, cbar: float, trial_loss: float,
                       kept_loss: float) -> Optional[dict[str, float]]:
    """The record of an unchecked final step whose whole-replay loss is higher than at the last accepted point (NaN
    counts as higher), or None when it may be kept. Every rank answers the same: captures carry every rank's
    losses (:func:`~hf_janus.engine.capture.combine_ranks`)."""
    if trial_loss <= kept_loss:
        return None
    return {"alpha": alpha, "mean_cosine": cbar, "replay_loss": trial_loss, "kept_replay_loss": kept_loss}


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
