"""Atomic file and directory writes: a user's files are only ever replaced by rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, Union


def atomic_write_text(path: Union[str, os.PathLike], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def check_output_dir(path: Union[str, os.PathLike], overwrite: bool = False) -> str:
    """Refuse an output location that would destroy something, before any expensive work starts.

    An absent path or an empty directory is fine; an existing non-empty directory needs ``overwrite``;
    an existing file is always refused. Returns the absolute path.
    """
    from hf_janus.errors import JanusError

    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path) or (os.path.exists(path) and not os.path.isdir(path)):
        raise JanusError(f"output path {path!r} exists and is not a directory; choose another output directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise JanusError(
            f"output directory {path!r} already exists and is not empty; pass overwrite=True (--overwrite on the "
            "command line) to replace it, or choose another directory"
        )
    return path


@contextmanager
def atomic_output_dir(path: Union[str, os.PathLike], overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary directory next to ``path``; on success it is renamed to ``path``.

    The destination only ever holds a complete output: everything is written into the temporary
    directory, which replaces ``path`` by rename when the ``with`` block ends without an error (and is
    deleted otherwise). An existing non-empty ``path`` is refused unless ``overwrite``; it is then moved
    aside, replaced, and deleted (the two renames are not one atomic step, but ``path`` is never partly
    written).
    """
    path = check_output_dir(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        yield tmp
        check_output_dir(path, overwrite)  # it may have appeared while we were writing
        if os.path.isdir(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
