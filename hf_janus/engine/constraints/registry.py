"""The replay constraints by name: ``JanusConfig.constraint`` names one, :func:`make_constraint` builds it."""

from __future__ import annotations

from typing import Any

from hf_janus.engine.constraints.base import Constraint
from hf_janus.kinds import KindRegistry

_CONSTRAINTS: KindRegistry[type[Constraint]] = KindRegistry(
    "replay constraint", Constraint, "JanusConfig.constraint", "hf_janus.engine.constraints")

#: Register a constraint under its ``name`` (usable as a class decorator); a second one of the same name is refused.
register = _CONSTRAINTS.register
#: The registered names, in registration order (the built-ins first).
constraint_names = _CONSTRAINTS.names
#: The constraint registered as ``name``; an unknown name raises :class:`~hf_janus.errors.JanusError`.
constraint_named = _CONSTRAINTS.named


def make_constraint(config: Any) -> Constraint:
    """The constraint ``config.constraint`` names, with its options from ``config`` (a ``JanusConfig`` or a dict)."""
    name = config.get("constraint", "loss") if isinstance(config, dict) else config.constraint
    return constraint_named(name).from_config(config)
