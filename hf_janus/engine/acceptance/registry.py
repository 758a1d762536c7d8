"""The acceptance rules by name: ``JanusConfig.acceptance`` names one, :func:`make_acceptance` builds it."""

from __future__ import annotations

from typing import Any

from hf_janus.engine.acceptance.base import AcceptanceRule
from hf_janus.errors import JanusError

_RULES: dict[str, type[AcceptanceRule]] = {}


def register(rule: type[AcceptanceRule]) -> type[AcceptanceRule]:
    """Register a rule under its ``name`` (usable as a class decorator); a second rule of the same name is
    refused, so that a plugin cannot silently replace a built-in test."""
    if not (isinstance(rule, type) and issubclass(rule, AcceptanceRule)):
        raise JanusError(f"an acceptance rule must subclass hf_janus.engine.acceptance.AcceptanceRule, got {rule!r}")
    existing = _RULES.get(rule.name)
    if existing is not None and existing is not rule:
        raise JanusError(f"an acceptance rule named {rule.name!r} is already registered ({existing.__qualname__}); "
                         "give the new rule another name")
    _RULES[rule.name] = rule
    return rule


def rule_names() -> tuple[str, ...]:
    """The registered names, in registration order (the built-ins first)."""
    return tuple(_RULES)


def rule_named(name: str) -> type[AcceptanceRule]:
    """The rule registered as ``name``; an unknown name raises :class:`JanusError` listing the known ones."""
    try:
        return _RULES[name]
    except (KeyError, TypeError):
        raise JanusError(f"no acceptance rule is named {name!r}: JanusConfig.acceptance must be one of "
                         f"{', '.join(map(repr, _RULES))} (or a rule registered with "
                         "hf_janus.engine.acceptance.register)") from None


def make_acceptance(config: Any) -> AcceptanceRule:
    """The rule ``config.acceptance`` names, with its options from ``config`` (a ``JanusConfig`` or a dict)."""
    name = config.get("acceptance", "cosine") if isinstance(config, dict) else config.acceptance
    return rule_named(name).from_config(config)
