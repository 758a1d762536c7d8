"""A registry of the kinds of one varying behaviour (acceptance rules, replay constraints): each kind a class
registered under its ``name``, looked up by the ``JanusConfig`` field that names it. Imports nothing from the
engine, so that the configuration can validate its fields against the registries."""

from __future__ import annotations

from typing import Generic, TypeVar

from hf_janus.errors import JanusError

K = TypeVar("K", bound=type)


class KindRegistry(Generic[K]):
    """The registered kinds of one behaviour, in registration order (the built-ins first).

    ``noun`` names one kind in messages ("acceptance rule"), ``base`` is the class every kind subclasses,
    ``field`` the configuration field that names one and ``package`` the module users register theirs with."""

    def __init__(self, noun: str, base: type, field: str, package: str):
        self.noun, self.base, self.field, self.package = noun, base, field, package
        self._kinds: dict[str, K] = {}

    def register(self, kind: K) -> K:
        """Register ``kind`` under its ``name`` (usable as a class decorator); a second kind of the same name is
        refused, so that a plugin cannot silently replace a built-in."""
        if not (isinstance(kind, type) and issubclass(kind, self.base)):
            raise JanusError(f"{self._article()} {self.noun} must subclass {self.package}.{self.base.__name__}, "
                             f"got {kind!r}")
        existing = self._kinds.get(kind.name)
        if existing is not None and existing is not kind:
            raise JanusError(f"{self._article()} {self.noun} named {kind.name!r} is already registered "
                             f"({existing.__qualname__}); give the new one another name")
        self._kinds[kind.name] = kind
        return kind

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._kinds)

    def named(self, name: str) -> K:
        """The kind registered as ``name``; an unknown name raises :class:`JanusError` listing the known ones."""
        try:
            return self._kinds[name]
        except (KeyError, TypeError):
            raise JanusError(f"no {self.noun} is named {name!r}: {self.field} must be one of "
                             f"{', '.join(map(repr, self._kinds))} (or one registered with "
                             f"{self.package}.register)") from None

    def _article(self) -> str:
        return "an" if self.noun[0] in "aeiou" else "a"
