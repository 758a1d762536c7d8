"""Atomic file and directory writes, and telling a local path from a Hub repo id."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional, Union

from hf_janus.errors import JanusError

PathLike = Union[str, os.PathLike]

logger = logging.getLogger(__name__)


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


def _is_within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_output_dir(path: PathLike, overwrite: bool = False,
                     inputs: Optional[Mapping[str, Optional[PathLike]]] = None, *, recover: bool = True) -> str:
    """Refuse an output location that would destroy something, before any expensive work starts.

    An absent path or an empty directory is fine; an existing non-empty directory needs ``overwrite``;
    an existing file is always refused. ``inputs`` (``{"adapter": path, ...}``; non-local entries are ``None``)
    are never overwritten: an output that is, contains or lies inside one of them is refused, with or without
    ``overwrite``. What a killed earlier write to ``path`` left behind is recovered first
    (:func:`recover_output_dir`; ``recover=False`` while a write of our own is under way). Returns the absolute
    path.
    """
    path = os.path.abspath(os.fspath(path))
    if recover:
        recover_output_dir(path)
    real = os.path.realpath(path)
    for what, source in (inputs or {}).items():
        if source is None or not os.path.exists(os.path.expanduser(os.fspath(source))):
            continue
        source_real = os.path.realpath(os.path.expanduser(os.fspath(source)))
        if _is_within(real, source_real) or _is_within(source_real, real):
            raise JanusError(
                f"output directory {path!r} would overwrite the {what} it is made from ({source_real!r}); "
                "choose an output directory outside the inputs"
            )
    if os.path.isfile(path) or (os.path.exists(path) and not os.path.isdir(path)):
        raise JanusError(f"output path {path!r} exists and is not a directory; choose another output directory")
    ancestor = path
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        what = "is not a directory" if not os.path.isdir(ancestor) else "is not writable"
        raise JanusError(f"cannot write the output {path!r}: {ancestor!r} {what}; choose another output directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise JanusError(
            f"output directory {path!r} already exists and is not empty; pass overwrite=True (--overwrite on the "
            "command line) to replace it, or choose another directory"
        )
    return path


def recover_output_dir(path: PathLike) -> None:
    """Finish or undo what a killed :func:`atomic_output_dir` left next to ``path``.

    A run killed between its two renames leaves the previous output in a hidden ``.<name>.old-*`` folder and
    ``path`` missing: the old output is moved back. Leftover ``.<name>.tmp-*`` folders (a run killed while
    writing) and ``.old-*`` folders whose replacement is complete are deleted.
    """
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.dirname(path), os.path.basename(path)
    if not os.path.isdir(parent):
        return
    olds = sorted(e for e in os.listdir(parent) if e.startswith(f".{name}.old-"))
    for entry in olds:
        old = os.path.join(parent, entry)
        if not os.path.exists(path):
            os.rename(old, path)
            logger.warning("restored %s from %s, left by an interrupted run", path, old)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for entry in os.listdir(parent):
        if entry.startswith(f".{name}.tmp-"):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            logger.info("removed %s, left by an interrupted run", os.path.join(parent, entry))


@contextmanager
def atomic_output_dir(path: PathLike, overwrite: bool = False,
                      inputs: Optional[Mapping[str, Optional[PathLike]]] = None) -> Iterator[str]:
    """Yield a fresh temporary directory next to ``path``; on success it is renamed to ``path``.

    The destination only ever holds a complete output: everything is written into the temporary
    directory, which replaces ``path`` by rename when the ``with`` block ends without an error (and is
    deleted otherwise). An existing non-empty ``path`` is refused unless ``overwrite``; it is then moved
    aside, replaced, and deleted. The two renames are not one atomic step: a run killed between them leaves
    ``path`` missing and the old output in a hidden ``.old-`` folder, which the next check of ``path``
    (:func:`check_output_dir`) moves back. ``inputs``: see :func:`check_output_dir`.
    """
    path = check_output_dir(path, overwrite, inputs)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        yield tmp
        check_output_dir(path, overwrite, inputs, recover=False)  # it may have appeared while we were writing
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
