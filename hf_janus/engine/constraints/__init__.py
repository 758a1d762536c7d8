"""What the replay constrains: the per-sample functions whose Jacobian JANUS keeps unchanged, one small object per
kind behind one interface (:class:`Constraint`), and a registry of them that ``JanusConfig.constraint`` names.

Constraints, by name, with their options (``JanusConfig.constraint_options``): ``loss`` (the paper's: each sample's
summed next-token loss, at a softmax ``temperature``), ``target_logit`` (the summed logit of each target token),
``logit_projections`` (``projections`` random projections of the logits per sample) and ``token_loss`` (the loss of
each of a sample's first ``tokens`` tokens alone, and the rest of its loss).

A new constraint is one module: a subclass of :class:`Constraint` with its name, summary, options (declared beside
it), rows per sample and functions, decorated with :func:`register` (see docs/guides/add-a-kind.md).
"""

from __future__ import annotations

from hf_janus.engine.constraints.base import IGNORE_INDEX, Constraint, ReplayLogits, per_token_cross_entropy
from hf_janus.engine.constraints.registry import constraint_named, constraint_names, make_constraint, register

# Each constraint registers itself when its module is imported: in the order of the configuration's choices and the
# docs.
from hf_janus.engine.constraints.loss import LossConstraint
from hf_janus.engine.constraints.target_logit import TargetLogitConstraint
from hf_janus.engine.constraints.logit_projections import LogitProjectionsConstraint, logit_projections
from hf_janus.engine.constraints.token_loss import TokenLossConstraint

__all__ = ["IGNORE_INDEX", "Constraint", "LogitProjectionsConstraint", "LossConstraint", "ReplayLogits",
           "TargetLogitConstraint", "TokenLossConstraint", "constraint_named", "constraint_names", "logit_projections",
           "make_constraint", "per_token_cross_entropy", "register"]
