"""Reading dataclasses back from JSON dicts: the one place that decides what to do with unknown keys."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def field_names(cls: type) -> set[str]:
    """The field names of dataclass ``cls``."""
    return {f.name for f in dataclasses.fields(cls)}


def known_fields(cls: type, data: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """The entries of ``data`` that are fields of dataclass ``cls``.

    Records written by a newer hf-janus may carry fields this version does not know: readers drop them
    (``strict=False``). Configurations are written by people, where an unknown key is a typo: ``strict=True``
    raises ``ValueError`` naming it and the valid fields.
    """
    names = field_names(cls)
    if strict:
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; valid fields are {sorted(names)}")
    return {k: v for k, v in data.items() if k in names}
