"""Reading dataclasses back from JSON dicts: the one place that decides what to do with unknown keys."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from hf_janus.errors import JanusError, did_you_mean


def field_names(cls: type) -> set[str]:
    """The field names of dataclass ``cls``."""
    return {f.name for f in dataclasses.fields(cls)}


def known_fields(cls: type, data: Mapping[str, Any], *, strict: bool = False,
                 hints: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """The entries of ``data`` that are fields of dataclass ``cls``.

    Records written by a newer hf-janus may carry fields this version does not know: readers drop them
    (``strict=False``). Configurations are written by people, where an unknown key is a typo: ``strict=True``
    raises :class:`~hf_janus.errors.JanusError` (a ``ValueError``) naming it and the field meant: ``hints[key]``
    when the class knows a name people reach for, else the closest field name.
    """
    names = field_names(cls)
    if strict:
        unknown = sorted(set(data) - names)
        if unknown:
            raise JanusError(unknown_field_message(cls.__name__, unknown[0], names, hints or {}))
    return {k: v for k, v in data.items() if k in names}


def unknown_field_message(owner: str, key: str, names: set[str], hints: Mapping[str, str]) -> str:
    if key in hints:
        return f"{owner} has no field {key!r}: {hints[key]}"
    return f"{owner} has no field {key!r}: {did_you_mean(key, names)}The fields are {', '.join(sorted(names))}"
