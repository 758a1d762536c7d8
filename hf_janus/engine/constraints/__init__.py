"""What the replay constrains: the per-sample functions whose Jacobian JANUS keeps unchanged, one small object per
kind behind one interface (:class:`Constraint`), and a registry of them that ``JanusConfig.constraint`` names.

Constraints, by name: ``loss`` (the paper's: each sample's summed next-token loss, at ``constraint_temperature``),
``target_logit`` (the summed logit of each target token), ``logit_projections`` (``constraint_projections`` random
projections of the logits per sample) and ``token_loss`` (the loss of each of a sample's first
``constraint_tokens`` tokens alone, and the rest of its loss).

A new constraint is one module: a subclass of :class:`Constraint` with its name, summary, options, rows per sample
and functions, registered with :func:`register`.
"""

from __future__ import annotations

from hf_janus.engine.constraints.base import IGNORE_INDEX, Constraint, ReplayLogits, per_token_cross_entropy
from hf_janus.engine.constraints.logit_projections import LogitProjectionsConstraint, logit_projections
from hf_janus.engine.constraints.loss import LossConstraint
from hf_janus.engine.constraints.registry import constraint_named, constraint_names, make_constraint, register
from hf_janus.engine.constraints.target_logit import TargetLogitConstraint
from hf_janus.engine.constraints.token_loss import TokenLossConstraint

# the order of the configuration's choices and of the docs
for _constraint in (LossConstraint, TargetLogitConstraint, LogitProjectionsConstraint, TokenLossConstraint):
    register(_constraint)
del _constraint

__all__ = ["IGNORE_INDEX", "Constraint", "LogitProjectionsConstraint", "LossConstraint", "ReplayLogits",
           "TargetLogitConstraint", "TokenLossConstraint", "constraint_named", "constraint_names", "logit_projections",
           "make_constraint", "per_token_cross_entropy", "register"]
