"""Exceptions raised by hf_janus; messages name the problem and the fix."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


class JanusError(ValueError):
    """Invalid input to a JANUS operation (replay, reference weights, targets, adapters)."""


class RectificationError(RuntimeError):
    """Rectification failed; the model has been restored to its fine-tuned weights."""


def did_you_mean(key: object, names: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` naming the one of ``names`` closest to a mistyped ``key``, or ``""`` when none is."""
    close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def hub_unreachable(err: BaseException) -> bool:
    """Whether the Hub never answered (no HTTP status): offline mode, or a transport error of the HTTP client,
    also when a download wrapped it (``LocalEntryNotFoundError`` raised from a connection error)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:  # huggingface_hub >= 1 names its HTTP client's (httpx) base error; transport errors derive from it
        from huggingface_hub.errors import HTTPError as ClientError
    except ImportError:  # pragma: no cover - huggingface_hub 0.x uses requests
        from requests import RequestException as ClientError
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OfflineModeIsEnabled):
            return True
        if isinstance(err, HfHubHTTPError):  # the Hub answered with a status
            return False
        if isinstance(err, (ClientError, ConnectionError, TimeoutError)):
            return True
        if isinstance(err, LocalEntryNotFoundError) and "offline" in str(err).lower():
            return True
        err = err.__cause__ or err.__context__
    return False


def hub_error(action: str, repo_id: str, err: BaseException, *, revision: Optional[str] = None,
              local: Optional[str] = None, alternative: str = "") -> JanusError:
    """A :class:`JanusError` for a failed Hub call: what failed, the likely cause, the fix, and (``local``) that
    the local files are safe. ``alternative`` is appended as a last resort (e.g. "or pass a local directory")."""
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    kept = f" The local files in {local!r} were not changed." if local else ""
    other = f", {alternative}" if alternative else ""
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    status = getattr(getattr(err, "response", None), "status_code", None)
    detail = f"{type(err).__name__}: {err}".strip()
    if hub_unreachable(err):
        return JanusError(
            f"could not reach the Hugging Face Hub at {constants.ENDPOINT} to {action} {where} ({detail}). Check "
            f"the network, HF_ENDPOINT and HF_HUB_OFFLINE, then retry{other}.{kept}"
        )
    if isinstance(err, RevisionNotFoundError):
        return JanusError(f"could not {action} {where}: the revision does not exist ({detail}).{kept}")
    if isinstance(err, RepositoryNotFoundError):  # GatedRepoError derives from it; a read with a bad token too
        return JanusError(f"could not {action} {where}: the repo does not exist or you have no access to it; "
                          f"check the id, or log in (`hf auth login`) or pass token= for a private repo{other} "
                          f"({detail}).{kept}")
    if status in (401, 403):
        return JanusError(
            f"the Hugging Face Hub refused to {action} {where} (HTTP {status}: invalid, missing or read-only "
            f"token). Log in with `hf auth login` or pass token= with access to this repo{other}.{kept} ({detail})"
        )
    return JanusError(f"could not {action} {where}: {detail}{other}.{kept}")
