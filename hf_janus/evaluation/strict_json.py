"""JSON as strict readers take it: Python's ``json`` writes NaN and infinities as bare ``NaN``/``Infinity``, which
JavaScript, ``jq`` and most other parsers reject, so a score that went non-finite would make a whole results file
unreadable there. Non-finite numbers are written as ``null`` (no figure), and the writer is told to refuse any that
slipped through, so that a new field that bypasses the conversion fails when written, not when read."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping


def finite_or_none(data: Any) -> Any:
    """``data`` with every non-finite float (in dicts, lists and tuples, at any depth) replaced by ``None``."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, Mapping):
        return {k: finite_or_none(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_none(v) for v in data]
    return data


def dumps(data: Any, indent: int = 2) -> str:
    """``data`` as strict JSON text, non-finite numbers as ``null``."""
    return json.dumps(finite_or_none(data), indent=indent, allow_nan=False)
