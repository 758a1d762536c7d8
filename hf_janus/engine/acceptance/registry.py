"""The acceptance rules by name: ``JanusConfig.acceptance`` names one, :func:`make_acceptance` builds it."""

from __future__ import annotations

from typing import Any

from hf_janus.engine.acceptance.base import AcceptanceRule
from hf_janus.kinds import KindRegistry

_RULES: KindRegistry[type[AcceptanceRule]] = KindRegistry(
    "acceptance rule", AcceptanceRule, "JanusConfig.acceptance", "hf_janus.engine.acceptance")

#: Register a rule under its ``name`` (usable as a class decorator); a second rule of the same name is refused.
register = _RULES.register
#: The registered names, in registration order (the built-ins first).
rule_names = _RULES.names
#: The rule registered as ``name``; an unknown name raises :class:`~hf_janus.errors.JanusError` listing the known ones.
rule_named = _RULES.named


def make_acceptance(config: Any) -> AcceptanceRule:
    """The rule ``config.acceptance`` names, with its options from ``config`` (a ``JanusConfig`` or a dict)."""
    name = config.get("acceptance", "cosine") if isinstance(config, dict) else config.acceptance
    return rule_named(name).from_config(config)
