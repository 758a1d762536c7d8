"""Whether a trial step passes: the acceptance rules, one small object per test behind one interface
(:class:`AcceptanceRule`), and a registry of them that ``JanusConfig.acceptance`` names.

Rules, by name: ``cosine`` (the paper's, c̄ ≥ τ), ``loss`` (the replay loss may rise by ``tolerance · α``
times the fine-tune's rise per step), ``both`` (the two together) and ``loss-absolute`` (the replay loss stays
within ``tolerance`` times the fine-tune's rise of θ0's over the whole run).

A new rule is one module: a subclass of :class:`AcceptanceRule` with its name, summary, options, score and
descriptions, decorated with :func:`register` (the user's own rule: registered before the config that names it is
built; see docs/guides/add-a-kind.md).
"""

from __future__ import annotations

from typing import Any

from hf_janus.engine.acceptance.base import SCORE_THRESHOLD, AcceptanceRule, TrialMeasurement
from hf_janus.engine.acceptance.registry import make_acceptance, register, rule_named, rule_names

# Each rule registers itself when its module is imported: in the order of the configuration's choices and the docs.
from hf_janus.engine.acceptance.cosine import CosineAcceptance
from hf_janus.engine.acceptance.loss import LossAcceptance
from hf_janus.engine.acceptance.both import BothAcceptance
from hf_janus.engine.acceptance.loss_absolute import LossAbsoluteAcceptance


def acceptance_score(config: Any, cbar: float, alpha: float, trial_loss: float, current_loss: float,
                     rise: float) -> float:
    """The score of one trial under ``config.acceptance`` (measured from the current point; θ0's loss unknown):
    a shortcut for ``make_acceptance(config).score(TrialMeasurement(...))``."""
    return make_acceptance(config).score(TrialMeasurement(alpha=alpha, mean_cosine=cbar, trial_loss=trial_loss,
                                                          current_loss=current_loss, rise=rise))


__all__ = ["SCORE_THRESHOLD", "AcceptanceRule", "BothAcceptance", "CosineAcceptance", "LossAbsoluteAcceptance",
           "LossAcceptance", "TrialMeasurement", "acceptance_score", "make_acceptance", "register", "rule_named",
           "rule_names"]
