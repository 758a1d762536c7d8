"""A registry of the kinds of one varying behaviour (acceptance rules, replay constraints, frontier candidates): each
kind a class registered under its one ``name``, looked up by the field or spec that names it, and the options a
kind declares beside itself. Imports nothing of hf_janus but its errors, so that the engine's
configuration and the evaluation's candidates share it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Mapping, Optional, TypeVar

from hf_janus.errors import JanusError, did_you_mean

K = TypeVar("K", bound=type)


class KindRegistry(Generic[K]):
    """The registered kinds of one behaviour, in registration order (the built-ins first).

    ``noun`` names one kind in messages ("acceptance rule"), ``base`` is the class every kind subclasses,
    ``field`` the configuration field (or spec) that names one and ``package`` the module users register theirs
    with."""

    def __init__(self, noun: str, base: type, field: str, package: str):
        self.noun, self.base, self.field, self.package = noun, base, field, package
        self._kinds: dict[str, K] = {}

    def register(self, kind: K) -> K:
        """Register ``kind`` under its ``name`` (usable as a class decorator); a second kind of the same name is
        refused, so that a plugin cannot silently replace a built-in."""
        if not (isinstance(kind, type) and issubclass(kind, self.base)):
            raise JanusError(f"{self._article()} {self.noun} must subclass {self.package}.{self.base.__name__}, "
                             f"got {kind!r}")
        existing = self._find(kind.name)
        if existing is not None and existing is not kind:
            raise JanusError(f"{self._article()} {self.noun} named {kind.name!r} is already registered "
                             f"({existing.__qualname__}); give the new one another name")
        self._kinds[kind.name] = kind
        return kind

    def kinds(self) -> list[K]:
        """The registered kinds, in registration order."""
        return list(self._kinds.values())

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._kinds)

    def named(self, name: str) -> K:
        """The kind registered as ``name`` (or answering to it); an unknown name raises :class:`JanusError` listing
        the known ones."""
        kind = self._find(name)
        if kind is None:
            raise JanusError(f"no {self.noun} is named {name!r}: {self.field} must be one of "
                             f"{', '.join(map(repr, self._kinds))} (or one registered with "
                             f"{self.package}.register)")
        return kind

    def _find(self, name: object) -> "K | None":
        if not isinstance(name, str):
            return None
        return self._kinds.get(name)

    def _article(self) -> str:
        return "an" if self.noun[0] in "aeiou" else "a"


@dataclass(frozen=True)
class KindOption:
    """One option a kind declares beside itself (as a PEFT config's field does): its name, its default, what it does
    and which values it takes (``valid``, described by ``expected``); the kind's ``__init__`` takes it by name."""

    name: str
    default: Any
    help: str
    valid: Callable[[Any], bool] = lambda value: True
    expected: str = "any value"


def kind_options(kind: type, noun: str, field: str, given: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The keyword arguments of ``kind`` (one with ``options``, a tuple of :class:`KindOption`): ``given`` (what the
    user set in ``field``, e.g. ``JanusConfig.constraint_options``) over each option's default. An option the kind
    does not declare raises a :class:`JanusError` naming the ones it does; a value it does not take, a
    ``ValueError`` naming the field, the option and what it takes."""
    given = dict(given or {})
    declared = {option.name: option for option in getattr(kind, "options", ())}
    for key in given:
        if key not in declared:
            known = (f"its options are {', '.join(map(repr, declared))}" if declared else "it takes no options")
            raise JanusError(f"the {noun} {kind.name!r} has no option {key!r} ({field}): "
                             + did_you_mean(key, declared) + known)
    values = {}
    for name, option in declared.items():
        value = given.get(name, option.default)
        if not option.valid(value):
            raise ValueError(f"{field}[{name!r}]={value!r} is invalid for the {noun} {kind.name!r}: expected "
                             f"{option.expected}")
        values[name] = value
    return values


def setting(config: Any, key: str) -> Any:
    """``config``'s ``key``, from a ``JanusConfig`` or a config dict (a record's ``config``, None when it lacks it)."""
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key)


def parse_options(text: str) -> dict[str, Any]:
    """``"name=value,name=value"`` (the command line's form of a kind's options) as a dict, each value read as JSON
    (``3``, ``0.5``, ``true``) and kept as text otherwise; ``""`` is no options."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{item!r} is not name=value")
        try:
            options[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[name.strip()] = value.strip()
    return options


def describe_options(kinds: Iterable[type]) -> str:
    """One line per kind with options, for a field's help: ``kind: name (help; default D), ...``."""
    return "; ".join(f"{kind.name}: " + ", ".join(f"{o.name} ({o.help}; default {o.default})" for o in kind.options)
                     for kind in kinds if getattr(kind, "options", ()))


def is_int(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
