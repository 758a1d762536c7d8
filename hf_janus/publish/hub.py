"""The Hugging Face Hub side of publishing: upload a published folder in one commit, read a record back."""

from __future__ import annotations

import fnmatch
import logging
import os
from typing import TYPE_CHECKING, Optional, Union

from hf_janus.errors import JanusError, hub_error
from hf_janus.io_utils import hub_cache_snapshot, is_local, read_text
from hf_janus.publish.card import CARD_NAME, render_card
from hf_janus.publish.files import pipeline_tag
from hf_janus.publish.record_file import REPORT_NAME, PublishedReport, read_record

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from huggingface_hub import CommitInfo


#: Never uploaded: pickles (they run code when loaded; ``training_args.bin`` is one), and, as ``Trainer``'s own
#: push ignores them, files whose name starts with "_" (the θ0 snapshot ``_janus_theta0.safetensors`` of
#: ``JanusCallback``) and ``checkpoint-*`` folders (which carry that snapshot).
NEVER_PUBLISHED = ("_*", "*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle", "*.ckpt")
NEVER_PUBLISHED_DIRS = ("_*", "checkpoint-*")


def _folder_files(folder: str) -> list[str]:
    """Relative paths of the files to upload: everything but hidden files and folders (``.git``, ``.cache``,
    leftovers of interrupted atomic writes) and :data:`NEVER_PUBLISHED`."""
    out, skipped = [], []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                         and not any(fnmatch.fnmatch(d, p) for p in NEVER_PUBLISHED_DIRS))
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if name.startswith("."):
                continue
            if any(fnmatch.fnmatch(name, p) for p in NEVER_PUBLISHED):
                skipped.append(rel)
            else:
                out.append(rel)
    if skipped:
        logger.warning("not uploading %s: pickles and private files (θ0 snapshots) are never published",
                       ", ".join(skipped))
    return out


def push_folder(folder: Union[str, os.PathLike], repo_id: str, *, private: Optional[bool] = None,
                token: Union[str, bool, None] = None, revision: Optional[str] = None,
                commit_message: Optional[str] = None) -> "CommitInfo":
    """Create ``repo_id`` if needed and upload ``folder`` in one commit (the branch ``revision`` is created from
    ``main`` if missing). Returns the ``CommitInfo`` (a ``str``: the commit URL).

    When the folder holds ``janus_rectification.json``, the uploaded ``README.md`` is re-rendered so that its
    usage snippet names ``repo_id``; the local folder itself is never modified. Any Hub failure raises a
    :class:`~hf_janus.JanusError` that says what to do, and leaves ``folder`` untouched.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise JanusError(f"cannot push {folder!r}: it is not a directory")
    files = _folder_files(folder)
    if not files:
        raise JanusError(f"cannot push {folder!r}: it holds no files")
    card_bytes: Optional[bytes] = None
    if REPORT_NAME in files:
        published = read_record(os.path.join(folder, REPORT_NAME))
        card = render_card(published, load_id=repo_id, existing=read_text(os.path.join(folder, CARD_NAME)),
                           pipeline_tag=pipeline_tag(folder, published.kind))
        card_bytes = str(card).encode("utf-8")
    operations = [
        CommitOperationAdd(path_in_repo=rel, path_or_fileobj=os.path.join(folder, rel))
        for rel in files if not (card_bytes is not None and rel == CARD_NAME)
    ]
    if card_bytes is not None:
        operations.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card_bytes))
    api = HfApi(token=token)
    action = "create the repo"
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True)
        repo_id = repo.repo_id  # "name" without a namespace lands in the token owner's
        if revision not in (None, "main"):
            action = f"create the branch {revision!r} in"
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        action = "upload to"
        return api.create_commit(repo_id, operations=operations, revision=revision,
                                 commit_message=commit_message or "Upload JANUS-rectified model with hf-janus")
    except JanusError:
        raise
    except Exception as err:
        raise hub_error(action, repo_id, err, local=folder) from err


def load_report(repo_id_or_dir: Union[str, os.PathLike], revision: Optional[str] = None,
                token: Union[str, bool, None] = None) -> PublishedReport:
    """Read the JANUS record of a published adapter or model.

    Args:
        repo_id_or_dir: a local directory (or the ``janus_rectification.json`` file itself) or a Hub model repo
            id.
        revision: branch, tag or commit of the Hub repo (default: ``main``).
        token: Hub token for private repos (default: the logged-in one).

    Returns:
        A :class:`PublishedReport` (``.rectification`` is the :class:`~hf_janus.RectificationReport`;
        ``.commit`` the Hub commit it was read at).
    """
    name = os.fspath(repo_id_or_dir)
    expanded = os.path.expanduser(name)
    if os.path.isfile(expanded):
        report = read_record(expanded)
        report.source = name
        return report
    if os.path.isdir(expanded):
        report = read_record(os.path.join(expanded, REPORT_NAME))
        report.source = name
        return report
    if is_local(name):
        raise JanusError(f"{name!r} does not exist; pass an existing directory or a Hub repo id (org/name)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        path = hf_hub_download(name, REPORT_NAME, revision=revision, token=token)
    except LocalEntryNotFoundError as err:
        raise JanusError(f"could not download {REPORT_NAME} of {name!r}: the Hub is unreachable (or offline mode "
                         f"is on) and it is not in the local cache ({err})") from err
    except EntryNotFoundError as err:
        raise JanusError(f"the Hub repo {name!r}{f' at {revision!r}' if revision else ''} has no {REPORT_NAME}: it "
                         "was not published with hf-janus") from err
    except Exception as err:
        raise hub_error("read the JANUS report of", name, err, revision=revision) from err
    report = read_record(path)
    snapshot = hub_cache_snapshot(path)
    report.source, report.commit = name, snapshot.sha if snapshot is not None else None
    return report

