"""What every acceptance rule is: a small object that knows its threshold and options, what it needs, how it
describes itself (logs, the progress bar, the model card) and how it scores a trial.

A rule is one subclass registered under a name (:mod:`hf_janus.engine.acceptance.registry`), in the manner of
PEFT's ``LoraVariant``: the step loop, the rectifier and the card ask the object instead of dispatching on the
string ``JanusConfig.acceptance``. This module imports nothing from the engine, so that the configuration can
validate its field against the registry.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from hf_janus.kinds import KindOption, kind_options, setting

#: The step controller's threshold for the score of the loss-based rules: they map a pass to a score at or above
#: it (:func:`loss_score`), so that the adaptive controller's model of the gap in α applies unchanged.
SCORE_THRESHOLD = 0.5


@dataclass(frozen=True)
class TrialMeasurement:
    """What one trial measured, and the figures of the run a rule may judge it against.

    ``rise`` is the fine-tune's replay-loss rise (fine-tuned − θ0), NaN when no rule of the run needs it
    (:attr:`AcceptanceRule.needs_rise`)."""

    alpha: float  # the step size of the trial, a share of the remaining projected update
    mean_cosine: float  # c̄ between the row spaces at the current point and at the trial (NaN: undefined)
    trial_loss: float  # whole-replay loss at the trial
    current_loss: float  # whole-replay loss at the current point θ_t (the last taken)
    reference_loss: float = math.nan  # whole-replay loss at θ0
    rise: float = math.nan


class AcceptanceRule(abc.ABC):
    """One acceptance test of a trial step. Subclasses set the class attributes and implement :meth:`score`,
    :meth:`describe` and :meth:`verdict`; their ``__init__`` takes the options they declare (and ``tau`` when they
    use it), as keywords.

    Class attributes: ``name`` (the ``JanusConfig.acceptance`` value), ``summary`` (one line for the
    configuration's help), ``options`` (its :class:`~hf_janus.kinds.KindOption`\\ s, which
    ``JanusConfig.acceptance_options`` sets by name), ``uses_tau`` (it reads ``JanusConfig.tau``, the paper's
    threshold, a field of its own since the card and the frontier read it too), ``needs_rise`` (it needs the
    fine-tune's replay-loss rise, which the rectifier then measures) and ``bar_key`` (its field on the progress
    bar).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    options: ClassVar[tuple[KindOption, ...]] = ()
    uses_tau: ClassVar[bool] = False
    needs_rise: ClassVar[bool] = False
    bar_key: ClassVar[str] = "test"

    @classmethod
    def from_config(cls, config: Any) -> "AcceptanceRule":
        """The rule with its options from a ``JanusConfig`` or a config dict (a record's ``config``): those
        ``acceptance_options`` sets, the others at their defaults (checked by :func:`~hf_janus.kinds.kind_options`),
        and ``tau`` when it uses it."""
        options = kind_options(cls, "acceptance rule", "JanusConfig.acceptance_options",
                               setting(config, "acceptance_options"))
        return cls(**options, **({"tau": setting(config, "tau")} if cls.uses_tau else {}))

    @property
    @abc.abstractmethod
    def threshold(self) -> float:
        """What the step controller compares :meth:`score` with: a trial passes when its score is at least this."""

    @abc.abstractmethod
    def score(self, trial: TrialMeasurement) -> float:
        """The trial's score, compared with :attr:`threshold` (NaN fails; the adaptive controller models
        ``threshold``-relative gaps of it as it models 1 − c̄)."""

    def passes(self, score: float) -> bool:
        """Whether a score passes (NaN does not)."""
        return score >= self.threshold

    @abc.abstractmethod
    def describe(self) -> str:
        """The test in a few words, with its threshold: for logs, warnings and the model card."""

    @abc.abstractmethod
    def verdict(self, trial: TrialMeasurement, score: float) -> str:
        """One trial's figures against the test, short enough for the progress bar."""

    def card_sentence(self) -> str:
        """How the card's step-trajectory section explains the accepted steps."""
        return (f"Each step tries a step size α, smaller ones after a trial that fails the acceptance test "
                f"({self.describe()}), and takes the largest one found to pass.")


def loss_ratio(trial: TrialMeasurement, tolerance: float, per_step: bool = True) -> float:
    """How much of its allowance a trial's replay-loss rise used. ``per_step``: the rise from the current point
    over ``tolerance · α`` times the fine-tune's rise; otherwise the rise from θ0 over ``tolerance`` times the
    fine-tune's rise. A replay the fine-tune did not hurt still gets a small allowance (a thousandth of the loss),
    so that the loop can move."""
    start = trial.current_loss if per_step else trial.reference_loss
    # (tolerance · α) · rise, in this order: the products of the runs before the rules were objects, bit for bit
    scale = tolerance * trial.alpha if per_step else tolerance
    allowed = scale * max(trial.rise, 1e-3 * abs(start), 1e-12)
    return (trial.trial_loss - start) / allowed


def loss_score(ratio: float) -> float:
    """The score of a loss ratio: ``1 − ratio · (1 − SCORE_THRESHOLD)``, at or above the threshold exactly when
    the ratio is at most 1; an undefined ratio (NaN, infinite) fails."""
    if not math.isfinite(ratio):
        return -math.inf
    return 1.0 - ratio * (1.0 - SCORE_THRESHOLD)


def ratio_of(score: float) -> float:
    """The loss ratio a :func:`loss_score` came from (for the progress bar)."""
    return (1.0 - score) / (1.0 - SCORE_THRESHOLD)
