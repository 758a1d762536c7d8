"""What every replay constraint is: the per-sample function(s) of the replay whose Jacobian JANUS keeps unchanged.

A constraint is one subclass registered under a name (:mod:`hf_janus.engine.constraints.registry`), as the
acceptance rules are: the capture asks the object for its functions, the memory plan for its rows per sample, the
configuration and the model card for its options, instead of dispatching on the string ``JanusConfig.constraint``.
This module imports nothing from the engine, so that the configuration can validate its field against the registry.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_janus.kinds import KindOption, kind_options, setting
from hf_janus.replay.prepare import IGNORE_INDEX


@dataclass(frozen=True)
class ReplayLogits:
    """One replay batch's next-token predictions, as every constraint reads them.

    ``scores`` are the float logits predicting position t+1 from position t, ``(B, T-1, vocab)``; ``targets`` the
    token each should predict, ``IGNORE_INDEX`` where it does not count; ``per_token`` the cross-entropy of each
    position at temperature 1 (0 where it does not count)."""

    scores: Tensor
    targets: Tensor
    per_token: Tensor

    @property
    def counted(self) -> Tensor:
        """``(B, T-1)``: the positions whose prediction counts toward the loss."""
        return self.targets != IGNORE_INDEX

    def masked_sum(self, values: Tensor) -> Tensor:
        """``values`` (``(B, T-1)`` or ``(B, T-1, k)``) summed over the counted positions of each sample."""
        counted = self.counted if values.dim() == 2 else self.counted.unsqueeze(-1)
        return torch.where(counted, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(dim=1)

    def loss_at(self, temperature: float) -> Tensor:
        """``(B, T-1)``: each position's cross-entropy with the logits divided by ``temperature``."""
        if temperature == 1.0:
            return self.per_token
        return per_token_cross_entropy(self.scores / temperature, self.targets)


def per_token_cross_entropy(scores: Tensor, targets: Tensor) -> Tensor:
    """``(B, T-1)`` cross-entropy of each position, 0 where the target is ``IGNORE_INDEX``."""
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="none").view(targets.shape)


class Constraint(abc.ABC):
    """One per-sample constraint. Subclasses set the class attributes and implement :meth:`functions`; their
    ``__init__`` takes the options they declare, as keywords.

    Class attributes: ``name`` (the ``JanusConfig.constraint`` value), ``summary`` (one line for the configuration's
    help) and ``options`` (its :class:`~hf_janus.kinds.KindOption`\\ s, which ``JanusConfig.constraint_options``
    sets by name; the configuration's help lists them and the model card names those the run set).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    options: ClassVar[tuple[KindOption, ...]] = ()

    @classmethod
    def from_config(cls, config: Any) -> "Constraint":
        """The constraint with its options from a ``JanusConfig`` or a config dict (a record's ``config``)."""
        return cls(**cls.options_from(config))

    @classmethod
    def options_from(cls, config: Any) -> dict[str, Any]:
        """Its options as ``__init__`` takes them: those ``config``'s ``constraint_options`` sets, the others at
        their defaults (checked: see :func:`~hf_janus.kinds.kind_options`)."""
        return kind_options(cls, "replay constraint", "JanusConfig.constraint_options",
                            setting(config, "constraint_options"))

    @property
    def rows_per_sample(self) -> int:
        """How many functions, so Jacobian rows, each replay sample contributes (one backward pass each)."""
        return 1

    @property
    def logits_copies(self) -> int:
        """Float32 logits-sized tensors its functions make beyond the batch's own (the memory plan counts them)."""
        return 0

    @abc.abstractmethod
    def functions(self, batch: ReplayLogits) -> Tensor:
        """The constrained functions of each sample: ``(B,)`` for one per sample, else ``(B, rows_per_sample)``."""
