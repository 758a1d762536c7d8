"""Step-size control of the multi-step loop: which step size α to try next, given the trials made so far.

The controllers never judge a trial themselves: the run's acceptance rule (:mod:`hf_janus.engine.acceptance`,
``JanusConfig.acceptance``) turns each trial's measurements into a *score*, and a trial passes when its score
reaches the rule's *threshold*: for the paper's rule the score is the mean principal-angle cosine c̄ measured on the
whole replay and the threshold τ; the loss rules map the share of their allowance a trial used onto a score with
threshold 0.5. The loop takes a failing trial only when it has no choice left (the smallest step size, or the last
step). Only the choice of the α to try differs between controllers, and with it the number of trials, each a
Jacobian evaluation (a forward/backward over the replay). Below, c̄ and τ stand for the score and the threshold.

- ``"paper"``: Algorithm 1 of the paper. Every step starts at α=1 and shrinks by β until c̄ ≥ τ: it takes the
  largest α on the grid ``1, β, β², ...`` that passes, and pays for every grid point above it.
- ``"adaptive"``: looks for the same grid point, the largest that passes, with fewer trials. It models the
  orientation gap ``1 − c̄`` as ``k · s^p`` in the step's absolute length ``s = α ‖Δθ_proj‖``, jumps straight
  to the grid point predicted to pass, and after a pass tries the point above it only when the model predicts
  that it passes too. A step's first trial is predicted from the last step. Where the model is right it accepts
  the paper's grid point; where it wrongly predicts a failure above, it accepts one grid point lower.

Why the same grid point and not the largest α that passes: measured on the demo, the replay loss rises by about
the same amount at every accepted step, whatever its α (second-order terms at c̄ ≈ τ), so a controller that takes
more or smaller steps repairs less (a continuous controller aiming just inside τ took more steps than the paper's
and ended at a higher replay loss); matching the paper's accepted steps keeps its result.

Why the absolute length: after a step of size α the remaining update is about (1 − α) of the last one, so the
same α is a shorter move. Principal angles grow with the distance moved, about linearly for short moves, so
``1 − cos`` grows about as its square: p starts at 2 and is re-fitted from two trials of one step whose gaps are
below ``SATURATED_GAP`` (farther apart, 1 − c̄ saturates and says little about the slope near τ).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

from hf_janus.engine.config import STEP_CONTROLS


#: Trials with a larger gap lie where 1 − c̄ saturates; they set k but not p.
SATURATED_GAP = 0.3
#: The adaptive controller jumps down to the grid point predicted at this share of 1 − τ (a little inside the
#: boundary, since a jump that still fails costs a trial) and, after a pass, tries the grid point above only when
#: it is predicted within ``PROBE_SHARE`` of 1 − τ: 1.0 probes only a point predicted to pass, which on the demo
#: took fewer evaluations than probing when unsure, for the same full fine-tuning result and a LoRA result lower
#: in replay loss (docs/concepts/step-control.md).
TARGET_SHARE = 0.9
PROBE_SHARE = 1.0
P_RANGE = (0.5, 4.0)


@dataclass
class Decision:
    """What the loop does after a trial: ``"accept"`` it, ``"accept_kept"`` (take the passing trial kept
    earlier in this step instead), or ``"try"`` ``alpha`` next, keeping this trial as the fallback if ``keep``."""

    action: str
    alpha: float = 0.0
    keep: bool = False


class StepController(ABC):
    """Chooses the step sizes of one rectification: :meth:`start_step` once per step, :meth:`decide` after each
    trial."""

    def __init__(self, threshold: float, beta: float, min_alpha: float):
        self.threshold, self.beta, self.min_alpha = threshold, beta, min_alpha
        self.proj_norm = 0.0
        self._steps = 0
        self._trials = 0
        # The grid 1, β, β², ... as Algorithm 1 computes it (repeated products), down to the first point whose next
        # shrink would fall below min_alpha: that point is taken whatever c̄.
        grid = [1.0]
        while grid[-1] * beta >= min_alpha:
            grid.append(grid[-1] * beta)
        self.grid = grid

    def start_step(self, proj_norm: float, final: bool = False) -> float:
        """The first step size to try at a step whose projected update has Frobenius norm ``proj_norm`` (over all
        layers). The last allowed step always starts at α=1: it takes the remaining update unchecked."""
        self.proj_norm = proj_norm
        self._begin_step()  # every step, the final one included, starts from fresh per-step state
        return 1.0 if final else self._first_alpha()

    def _begin_step(self) -> None:
        """Forget what the trials of the previous step found (nothing to forget by default)."""

    def decide(self, alpha: float, score: float, forced_ok: bool) -> Decision:
        """The decision after a trial at ``alpha`` measured ``score``; ``forced_ok``: the loop may take this trial
        even if it fails (the last allowed step)."""
        self._trials += 1
        decision = self._decide(alpha, score, forced_ok or self.is_floor(alpha))
        if decision.action != "try":
            self._steps += 1
        return decision

    def is_floor(self, alpha: float) -> bool:
        """Whether ``alpha`` is the smallest step size tried (a trial there is taken whatever c̄)."""
        return alpha * self.beta < self.min_alpha

    @abstractmethod
    def _first_alpha(self) -> float: ...

    @abstractmethod
    def _decide(self, alpha: float, score: float, forced_ok: bool) -> Decision: ...

    def estimated_remaining_evaluations(self, alpha: float, steps_left: int) -> Optional[int]:
        """A rough count of the Jacobian evaluations still to come after a step taken at ``alpha``, for the
        progress bar: the remaining update (about ``(1 − α)`` of this step's) in steps as long as this one
        (``α`` of it), times the trials a step has cost so far. None before the first step ends."""
        if self._steps == 0:
            return None
        if alpha >= 1.0 or steps_left <= 0:
            return 0
        steps = min(steps_left, max(1, math.ceil((1.0 - alpha) / alpha))) if alpha > 0 else steps_left
        return max(1, round(steps * self._trials / self._steps))


class PaperStepController(StepController):
    """Algorithm 1 as published: α=1 first, then α·β after each rejection, down to ``min_alpha``."""

    def _first_alpha(self) -> float:
        return 1.0

    def _decide(self, alpha: float, score: float, forced_ok: bool) -> Decision:
        if score >= self.threshold or forced_ok:
            return Decision("accept")
        return Decision("try", alpha * self.beta)


class AdaptiveStepController(StepController):
    """Finds the paper's grid point (the largest α on ``1, β, β², ...`` that passes) with fewer trials, from a
    model ``1 − c̄ ≈ k s^p`` of the trials made so far (see the module docstring)."""

    def __init__(self, threshold: float, beta: float, min_alpha: float):
        super().__init__(threshold, beta, min_alpha)
        self.p = 2.0
        self._reference: Optional[tuple[float, float]] = None  # (s, gap) of the last accepted trial
        self._passed: dict[int, float] = {}  # grid index -> gap, this step
        self._failed: dict[int, float] = {}
        self._kept: Optional[int] = None

    def _index(self, alpha: float) -> int:
        return min(range(len(self.grid)), key=lambda j: abs(self.grid[j] - alpha))

    def _predict_index(self, length: float, gap: float, share: float) -> int:
        """The largest grid point (smallest index) where the model through (length, gap) predicts a gap of at most
        ``share · (1 − τ)``."""
        if gap <= 0.0 or length <= 0.0 or self.proj_norm <= 0.0:
            return 0
        bound = share * (1.0 - self.threshold)
        for j, alpha in enumerate(self.grid):
            if gap * (alpha * self.proj_norm / length) ** self.p <= bound:
                return j
        return len(self.grid) - 1

    def _begin_step(self) -> None:
        self._passed, self._failed, self._kept = {}, {}, None

    def _first_alpha(self) -> float:
        if self._reference is None:
            return 1.0
        return self.grid[self._predict_index(*self._reference, TARGET_SHARE)]

    def _fit_p(self, j: int, gap: float) -> None:
        if not 0.0 < gap < SATURATED_GAP:
            return
        for other, other_gap in list(self._passed.items()) + list(self._failed.items()):
            if other != j and 0.0 < other_gap < SATURATED_GAP:
                p = math.log(gap / other_gap) / math.log(self.grid[j] / self.grid[other])
                self.p = min(max(p, P_RANGE[0]), P_RANGE[1])
                return

    def _accept(self, j: int, gap: float, kept: bool = False) -> Decision:
        self._reference = (self.grid[j] * self.proj_norm, gap)
        return Decision("accept_kept" if kept else "accept")

    def _decide(self, alpha: float, score: float, forced_ok: bool) -> Decision:
        j, gap = self._index(alpha), max(0.0, 1.0 - score)
        self._fit_p(j, gap)
        length = alpha * self.proj_norm
        if score >= self.threshold:
            self._passed[j] = gap
            if j == 0 or (j - 1) in self._failed:
                return self._accept(j, gap)
            predicted_above = gap * (self.grid[j - 1] / alpha) ** self.p
            if predicted_above > PROBE_SHARE * (1.0 - self.threshold):
                return self._accept(j, gap)
            self._kept = j
            return Decision("try", self.grid[j - 1], keep=True)
        self._failed[j] = gap
        if self._kept is not None and self._kept == j + 1:
            return self._accept(j + 1, self._passed[j + 1], kept=True)
        if forced_ok:
            return self._accept(j, gap)
        # A pass is only ever followed by the grid point above it, so a failure with a pass below is the kept
        # case above: going down, every grid point below j is still untried.
        target = max(j + 1, self._predict_index(length, gap, TARGET_SHARE))
        return Decision("try", self.grid[min(target, len(self.grid) - 1)])


def make_step_controller(kind: str, threshold: float, beta: float, min_alpha: float) -> StepController:
    """The controller named by ``JanusConfig.step_control``."""
    if kind == "paper":
        return PaperStepController(threshold, beta, min_alpha)
    if kind == "adaptive":
        return AdaptiveStepController(threshold, beta, min_alpha)
    raise ValueError(f"unknown step_control {kind!r}: expected one of {STEP_CONTROLS}")
