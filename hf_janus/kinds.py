"""A registry of the kinds of one varying behaviour (acceptance rules, replay constraints, frontier candidates): each
kind a class registered under its ``name`` (and the aliases it declares), looked up by the field or spec that names
it. Imports nothing of hf_janus but its errors, so that the engine's configuration and the evaluation's candidates
share it."""

from __future__ import annotations

from typing import Callable, Generic, Iterable, TypeVar

from hf_janus.errors import JanusError

K = TypeVar("K", bound=type)


class KindRegistry(Generic[K]):
    """The registered kinds of one behaviour, in registration order (the built-ins first).

    ``noun`` names one kind in messages ("acceptance rule"), ``base`` is the class every kind subclasses,
    ``field`` the configuration field (or spec) that names one and ``package`` the module users register theirs with;
    ``aliases`` gives the other names a kind answers to (a candidate's JSON ``kind``)."""

    def __init__(self, noun: str, base: type, field: str, package: str,
                 aliases: Callable[[K], Iterable[str]] = lambda kind: ()):
        self.noun, self.base, self.field, self.package, self.aliases = noun, base, field, package, aliases
        self._kinds: dict[str, K] = {}

    def register(self, kind: K) -> K:
        """Register ``kind`` under its ``name`` (usable as a class decorator); a second kind of the same name is
        refused, so that a plugin cannot silently replace a built-in."""
        if not (isinstance(kind, type) and issubclass(kind, self.base)):
            raise JanusError(f"{self._article()} {self.noun} must subclass {self.package}.{self.base.__name__}, "
                             f"got {kind!r}")
        for name in (kind.name, *self.aliases(kind)):
            existing = self._find(name)
            if existing is not None and existing is not kind:
                raise JanusError(f"{self._article()} {self.noun} named {name!r} is already registered "
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
        if name in self._kinds:
            return self._kinds[name]
        return next((kind for kind in self._kinds.values() if name in self.aliases(kind)), None)

    def _article(self) -> str:
        return "an" if self.noun[0] in "aeiou" else "a"
