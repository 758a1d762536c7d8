"""Atomic file and directory writes, and telling a local path from a Hub repo id."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional, Union

from hf_janus.errors import JanusError

PathLike = Union[str, os.PathLike]


@contextmanager
def atomic_replace(path: PathLike) -> Iterator[str]:
    """Yield a temporary file name next to ``path``; write it inside the block, and it replaces ``path``.

    The temporary file lives in the same folder (so ``os.replace`` is a rename, atomic on POSIX) under a hidden
    ``.tmp-`` name (so an interrupted write is never uploaded as part of the folder). It is flushed to disk
    before the rename and removed if the block raises: ``path`` is either untouched or completely new.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_replace`."""
    with atomic_replace(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)


def check_output_dir(path: PathLike, overwrite: bool = False) -> str:
    """Refuse an output location that would destroy something, before any expensive work starts.

    An absent path or an empty directory is fine; an existing non-empty directory needs ``overwrite``;
    an existing file is always refused. Returns the absolute path.
    """
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
def atomic_output_dir(path: PathLike, overwrite: bool = False) -> Iterator[str]:
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


def looks_like_local_path(name: str) -> bool:
    """Whether ``name`` is meant as a local path: a Hub repo id is ``name`` or ``org/name``, so anything with
    path syntax (``./x``, ``/x``, ``~/x``, ``a/b/c``, backslashes) is a path, existing or not."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def is_local(name: str) -> bool:
    """An existing file or directory, or a name with path syntax (:func:`looks_like_local_path`)."""
    return os.path.exists(os.path.expanduser(name)) or looks_like_local_path(name)


class CacheSnapshot(NamedTuple):
    """Where a path inside huggingface_hub's cache comes from."""

    repo_id: Optional[str]  # None when the path has a snapshots/<sha> part but no "<type>s--org--name" folder
    repo_type: Optional[str]  # "model", "dataset" or "space"
    sha: str  # the commit


_SNAPSHOT_RE = re.compile(
    r"(?:(?P<type>models|datasets|spaces)--(?P<repo>[^/\\]+)[/\\])?snapshots[/\\](?P<sha>[0-9a-f]{40})(?=[/\\]|$)"
)


def hub_cache_snapshot(path: Optional[PathLike]) -> Optional[CacheSnapshot]:
    """Parse a huggingface_hub cache path (``.../models--org--name/snapshots/<sha>[/file]``); None otherwise."""
    if not path:
        return None
    matches = list(_SNAPSHOT_RE.finditer(os.path.abspath(os.path.expanduser(os.fspath(path)))))
    if not matches:
        return None
    match = matches[-1]
    repo = match.group("repo")
    return CacheSnapshot(repo_id=repo.replace("--", "/") if repo else None,
                         repo_type=match.group("type")[:-1] if match.group("type") else None, sha=match.group("sha"))


def read_text(path: PathLike) -> Optional[str]:
    """The UTF-8 text of ``path``, or None when there is no such file."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
