"""A disk cache for replay that θ0 generated (:mod:`hf_janus.replay.self_replay`).

Generating a few hundred answers costs minutes on a CPU, and the same θ0, prompts and settings always give the same
answers, so a rerun (another τ, another rank, a retried merge) reads them back instead. An entry is keyed by a
fingerprint of the model (its config, generation config, and the names, shapes, dtypes and a few evenly spaced
values of every parameter and buffer), the prompt token ids and the generation settings: a change to any of them
is another key. Entries are JSON files written atomically; nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from hf_janus.io_utils import atomic_write_text, read_text
from hf_janus.parallel.sharding import digest_sample

logger = logging.getLogger(__name__)

#: Environment variable naming the cache's root folder (default: ``$HF_HOME/hf_janus``).
CACHE_ENV = "HF_JANUS_CACHE"
CACHE_FORMAT = 1
_VALUES_PER_TENSOR = 64
# fields that name where a model was loaded from or which library wrote it, not what it computes
_UNSTABLE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


def default_cache_dir() -> str:
    """``$HF_JANUS_CACHE/self_replay``, else ``$HF_HOME/hf_janus/self_replay`` (read at call time, so that an
    environment set after import counts)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        from huggingface_hub import constants

        root = os.path.join(constants.HF_HOME, "hf_janus")
    return os.path.join(os.path.expanduser(root), "self_replay")


def _stable_dict(obj: Any) -> Optional[dict[str, Any]]:
    if obj is None or not hasattr(obj, "to_dict"):
        return None
    data = obj.to_dict()
    return {k: v for k, v in data.items() if k not in _UNSTABLE_CONFIG_KEYS}


def model_fingerprint(model: nn.Module) -> str:
    """A digest of ``model``'s config, generation config and a sample of every parameter and buffer.

    A sample rather than every byte keeps it to milliseconds at 7B; any training step, merge or reload of other
    weights moves the sampled values too. Two models with equal weights and config share it wherever they were
    loaded from.
    """
    digest = hashlib.sha256()
    for part in (_stable_dict(getattr(model, "config", None)), _stable_dict(getattr(model, "generation_config", None))):
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest_sample(digest, name, tensor, _VALUES_PER_TENSOR)
    return "sha256:" + digest.hexdigest()


def cache_key(model_fp: str, prompts: Sequence[Sequence[int]], settings: Mapping[str, Any]) -> str:
    """The entry name of θ0 ``model_fp`` answering ``prompts`` (token ids, one list per replay sample) with
    ``settings``."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"format": CACHE_FORMAT, "model": model_fp, "settings": dict(settings)},
                             sort_keys=True, default=str).encode())
    for ids in prompts:
        digest.update(json.dumps(list(ids)).encode())
    return digest.hexdigest()


def _entry_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"{key}.json")


def read_entry(cache_dir: str, key: str) -> Optional[list[dict[str, Any]]]:
    """The samples stored under ``key`` (``{"input_ids", "prompt_length"}`` each), or None when there are none or
    the file is unreadable (it is then regenerated and replaced)."""
    path = _entry_path(cache_dir, key)
    text = read_text(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
        samples = data["samples"]
        if data.get("format") != CACHE_FORMAT or data.get("key") != key or not isinstance(samples, list):
            raise ValueError("another format or key")
        for sample in samples:
            if not isinstance(sample["input_ids"], list) or not isinstance(sample["prompt_length"], int):
                raise ValueError("a malformed sample")
        return samples
    except (ValueError, KeyError, TypeError) as err:
        logger.warning("ignoring the unreadable self-replay cache entry %s (%s); generating it again", path, err)
        return None


def write_entry(cache_dir: str, key: str, samples: Sequence[Mapping[str, Any]], description: Mapping[str, Any]) -> str:
    """Store ``samples`` under ``key`` atomically (a reader sees the old file or the whole new one); returns the
    file's path. A cache that cannot be written is a warning: the samples are already in hand."""
    path = _entry_path(cache_dir, key)
    data = {"format": CACHE_FORMAT, "key": key, **dict(description),
            "samples": [{"input_ids": list(s["input_ids"]), "prompt_length": int(s["prompt_length"])}
                        for s in samples]}
    try:
        atomic_write_text(path, json.dumps(data))
    except OSError as err:
        logger.warning("could not write the self-replay cache %s (%s: %s); the replay is used without being cached",
                       path, type(err).__name__, err)
    return path
