"""The replay constraints by name: ``JanusConfig.constraint`` names one, :func:`make_constraint` builds it."""

from __future__ import annotations

from typing import Any

from hf_janus.engine.constraints.base import Constraint
from hf_janus.errors import JanusError

_CONSTRAINTS: dict[str, type[Constraint]] = {}


def register(constraint: type[Constraint]) -> type[Constraint]:
    """Register a constraint under its ``name`` (usable as a class decorator); a second one of the same name is
    refused, so that a plugin cannot silently replace a built-in."""
    if not (isinstance(constraint, type) and issubclass(constraint, Constraint)):
        raise JanusError("a replay constraint must subclass hf_janus.engine.constraints.Constraint, got "
                         f"{constraint!r}")
    existing = _CONSTRAINTS.get(constraint.name)
    if existing is not None and existing is not constraint:
        raise JanusError(f"a replay constraint named {constraint.name!r} is already registered "
                         f"({existing.__qualname__}); give the new one another name")
    _CONSTRAINTS[constraint.name] = constraint
    return constraint


def constraint_names() -> tuple[str, ...]:
    """The registered names, in registration order (the built-ins first)."""
    return tuple(_CONSTRAINTS)


def constraint_named(name: str) -> type[Constraint]:
    """The constraint registered as ``name``; an unknown name raises :class:`JanusError` listing the known ones."""
    try:
        return _CONSTRAINTS[name]
    except (KeyError, TypeError):
        raise JanusError(f"no replay constraint is named {name!r}: JanusConfig.constraint must be one of "
                         f"{', '.join(map(repr, _CONSTRAINTS))} (or one registered with "
                         "hf_janus.engine.constraints.register)") from None


def make_constraint(config: Any) -> Constraint:
    """The constraint ``config.constraint`` names, with its options from ``config`` (a ``JanusConfig`` or a dict)."""
    name = config.get("constraint", "loss") if isinstance(config, dict) else config.constraint
    return constraint_named(name).from_config(config)
