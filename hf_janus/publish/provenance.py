"""Provenance: which model, adapter and replay data were rectified, down to the Hub commit."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

from hf_janus.io_utils import hub_cache_snapshot, is_local
from hf_janus.replay.sources import parse_replay_spec
from hf_janus.serialization import known_fields

logger = logging.getLogger(__name__)

SHA_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class RepoRef:
    """A model or adapter as the user named it, with the Hub commit it resolved to.

    ``id`` is the Hub repo id or the local path as given; ``sha`` is the 40-hex commit of a Hub repo (``None``
    for a local directory, or when it could not be resolved, e.g. offline without a cache entry).
    """

    id: str
    revision: Optional[str] = None
    sha: Optional[str] = None
    local: bool = False
    kind: Optional[str] = None  # adapters: "lora", "dora", "pissa (converted)", ...
    peft_type: Optional[str] = None
    #: the licence its own model card declares (``license``, and ``license_name``/``license_link`` for "other"),
    #: which a card derived from it repeats; None when it has no card or the card says none
    license: Optional[dict[str, str]] = None

    @property
    def is_hub(self) -> bool:
        return not self.local

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k in ("revision", "sha")}

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]]) -> Optional["RepoRef"]:
        if data is None:
            return None
        return cls(**known_fields(cls, data))


@dataclass
class ReplayInfo:
    """The past-task data JANUS replayed: where it came from and which exact rows (``fingerprint``)."""

    id: Optional[str] = None  # Hub dataset id or local path; None for in-memory samples
    source: Optional[str] = None  # as the user wrote it, e.g. "org/data:train"
    split: Optional[str] = None
    revision: Optional[str] = None
    sha: Optional[str] = None  # Hub commit of a dataset repo
    fingerprint: Optional[str] = None  # datasets' Dataset._fingerprint, or "sha256:..." of in-memory token ids
    size: Optional[int] = None  # rows in the dataset (split); JANUS used report.num_samples of them
    local: bool = False
    #: replay that θ0 generated (``SelfReplay``): the prompts, count, decoding settings and cache key
    self_replay: Optional[dict[str, Any]] = None

    @property
    def is_hub(self) -> bool:
        return self.id is not None and not self.local

    def self_replay_line(self) -> Optional[str]:
        """``"θ0's own answers to generic: 100 samples, greedy, at most 64 new tokens, cache key 1a2b…"``, for
        replay that θ0 generated; None otherwise."""
        info = self.self_replay
        if not info:
            return None
        decoding = info.get("decoding") or {}
        how = "sampled" if decoding.get("do_sample") else "greedy"
        if decoding.get("do_sample"):
            settings = ", ".join(f"{k} {decoding[k]}" for k in ("temperature", "top_p", "top_k", "seed")
                                 if decoding.get(k) is not None)
            how += f" ({settings})" if settings else ""
        parts = [f"θ0's own answers to {info.get('prompts')}: {info.get('num_samples')} samples, {how}",
                 f"at most {decoding.get('max_new_tokens')} new tokens"]
        if decoding.get("stop"):
            parts.append("stopped at " + ", ".join(repr(s) for s in decoding["stop"]))
        if info.get("cache_key"):
            parts.append(f"cache key {str(info['cache_key'])[:16]}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]]) -> Optional["ReplayInfo"]:
        if data is None:
            return None
        return cls(**known_fields(cls, data))


def _snapshot_sha(path: Optional[str]) -> Optional[str]:
    snapshot = hub_cache_snapshot(path)
    return snapshot.sha if snapshot is not None else None


def _sha_from_cache(repo_id: str, revision: Optional[str], repo_type: str) -> Optional[str]:
    """The commit the local cache resolved ``revision`` to: what ``from_pretrained`` actually loaded."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        ref = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type=repo_type), "refs",
                           revision or "main")
        with open(ref, encoding="utf-8") as fh:
            sha = fh.read().strip()
        return sha if SHA_RE.match(sha) else None
    except (OSError, ImportError, ValueError):
        return None


def _sha_from_api(repo_id: str, revision: Optional[str], repo_type: str, token: Any) -> Optional[str]:
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:  # asked not to touch the network: the commit stays unknown
        return None
    try:
        return HfApi(token=token).repo_info(repo_id, revision=revision, repo_type=repo_type).sha
    except Exception as err:  # provenance is best effort: a publication must not fail on it
        logger.warning("could not resolve the Hub commit of %s %r (%s: %s); it is recorded as unknown", repo_type,
                       repo_id, type(err).__name__, err)
        return None


def resolve_repo(name: Union[str, os.PathLike, RepoRef, None], revision: Optional[str] = None, *,
                 repo_type: str = "model", token: Any = None, local_path: Optional[str] = None,
                 online: bool = True, licence: bool = False) -> Optional[RepoRef]:
    """Describe a model/adapter/dataset: ``local`` for an existing or path-like name, else a Hub repo id whose
    commit is taken from, in order: ``revision`` if it is a full sha, ``local_path`` if it is a cache snapshot,
    the local cache's ref for ``revision``, and (``online``) ``HfApi().repo_info(...).sha``. With ``licence`` (a base
    model, whose licence a derived model's card repeats), the licence its own model card declares."""
    if name is None or isinstance(name, RepoRef):
        return name
    name = os.fspath(name)
    if is_local(name):  # a cache snapshot passed as a path still knows its commit
        card = os.path.join(name, CARD_FILE) if os.path.isdir(name) else None
        return RepoRef(id=name, revision=revision, sha=_snapshot_sha(name), local=True,
                       license=_card_license(card) if licence else None)
    sha = revision if revision and SHA_RE.match(revision) else None
    sha = sha or _snapshot_sha(local_path) or _sha_from_cache(name, revision, repo_type)
    if sha is None and online:
        sha = _sha_from_api(name, revision, repo_type, token)
    ref = RepoRef(id=name, revision=revision, sha=sha, local=False)
    if licence:
        ref.license = _card_license(_hub_card(name, sha or revision, token, online))
    return ref


#: a model repository's card, whose front matter says its licence
CARD_FILE = "README.md"
#: the front-matter entries of a licence, repeated from a base model's card into the cards derived from it
LICENCE_KEYS = ("license", "license_name", "license_link")


def _hub_card(repo_id: str, revision: Optional[str], token: Any, online: bool) -> Optional[str]:
    """The local path of a Hub model's card: from the cache, else downloaded (``online``); None when it has none or
    the Hub cannot be reached (the licence is then left out of what derives from it, never guessed)."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, CARD_FILE, revision=revision)
    if isinstance(cached, str):
        return cached
    if not online or constants.HF_HUB_OFFLINE:
        return None
    try:
        return hf_hub_download(repo_id, CARD_FILE, revision=revision, token=token)
    except Exception as err:  # provenance is best effort: a publication must not fail on it
        logger.info("no model card read for %r (%s: %s): its licence is not repeated", repo_id, type(err).__name__,
                    err)
        return None


def _card_license(path: Optional[str]) -> Optional[dict[str, str]]:
    """The licence entries of the model card at ``path`` (its YAML front matter); None without one."""
    if path is None or not os.path.isfile(path):
        return None
    from huggingface_hub import ModelCard

    try:
        data = ModelCard.load(path, ignore_metadata_errors=True).data
    except Exception as err:  # an unreadable card names no licence
        logger.info("could not read the model card %s (%s: %s)", path, type(err).__name__, err)
        return None
    found = {key: str(data.get(key)) for key in LICENCE_KEYS if data.get(key)}
    return found if "license" in found else None


def _samples_fingerprint(samples: Iterable[Any]) -> Optional[str]:
    """A content hash of in-memory replay samples (token ids), stable across processes."""
    digest = hashlib.sha256()
    try:
        for sample in samples:
            row = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in dict(sample).items()}
            digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    except (TypeError, ValueError):
        return None
    return "sha256:" + digest.hexdigest()


def describe_replay(replay: Any, *, source: Optional[str] = None, split: Optional[str] = None,
                    revision: Optional[str] = None, token: Any = None, online: bool = True) -> ReplayInfo:
    """Describe replay data: a ``datasets.Dataset`` (its fingerprint, split and size), a ``DataLoader`` (its
    dataset), or a list of samples (a sha256 of their contents). ``source``: the dataset id or path the data
    was loaded from, optionally ``SOURCE:SPLIT``; a Hub dataset id also gets its commit."""
    info = ReplayInfo(source=source, split=split, revision=revision)
    if source is not None:
        name, spec_split = parse_replay_spec(source)
        info.split = split or spec_split or "train"
        ref = resolve_repo(name, revision, repo_type="dataset", token=token, online=online)
        info.id, info.sha, info.local = ref.id, ref.sha, ref.local
    data = getattr(replay, "dataset", None) if not hasattr(replay, "_fingerprint") else None
    data = replay if data is None else data  # a DataLoader: describe what it iterates over
    if hasattr(data, "_fingerprint"):
        info.fingerprint = str(data._fingerprint)
        if info.split is None and getattr(data, "split", None) is not None:
            info.split = str(data.split)
    elif isinstance(data, (list, tuple)):
        info.fingerprint = _samples_fingerprint(data)
        info.self_replay = getattr(data, "provenance", None)  # hf_janus.replay.self_replay.GeneratedReplay
    try:
        info.size = len(data)
    except TypeError:
        info.size = None
    return info


def describe_model(model: Any, *, token: Any = None, online: bool = True) -> Optional[RepoRef]:
    """The pretrained model a ``Trainer`` model was fine-tuned from (the PEFT base for a ``PeftModel``)."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        cfg = peft_config.get(getattr(model, "active_adapter", None)) or next(iter(peft_config.values()))
        name, revision = getattr(cfg, "base_model_name_or_path", None), getattr(cfg, "revision", None)
    else:
        config = getattr(model, "config", None)
        name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
        revision = None
    if not name:  # built from a config: nothing to point at
        return None
    return resolve_repo(name, revision, token=token, online=online, licence=True)
