"""Old names kept for a while after a rename, so that callers' code keeps working and is told what to use instead."""

from __future__ import annotations

import warnings


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn (``FutureWarning``, which users see by default) that ``old`` is now ``new``. ``stacklevel`` points the
    warning at the caller's line: 3 for a method or property that calls this directly."""
    warnings.warn(f"{old} is deprecated and will be removed in a future release; use {new}", FutureWarning,
                  stacklevel=stacklevel)
