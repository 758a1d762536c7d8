"""A disk cache for replay that θ0 generated (:mod:`hf_janus.replay.self_replay`).

Generating a few hundred answers costs minutes on a CPU, and the same θ0, tokenizer, prompts and settings always
give the same answers, so a rerun (another τ, another rank, a retried merge) reads them back instead. An entry is
keyed by a digest of every byte of the model's weights and buffers with its config and generation config, of the
tokenizer (its vocabulary, normalizer and decoder, which decide where a stop string cuts an answer), of the prompt
token ids and of the generation settings: a change to any of them is another key. Entries are JSON files written
atomically; nothing is ever unpickled. An entry that cannot be read, or whose samples do not fit the prompts they
answer, is logged and generated again; a cache folder that cannot be read or written never fails the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from hf_janus.io_utils import atomic_write_text
from hf_janus.parallel.sharding import is_sharded, is_zero3_param

logger = logging.getLogger(__name__)

#: Environment variable naming the cache's root folder (default: ``$HF_HOME/hf_janus``).
CACHE_ENV = "HF_JANUS_CACHE"
CACHE_FORMAT = 2
# fields that name where a model was loaded from or which library wrote it, or how it runs (the Trainer turns the KV
# cache off for training; generation turns it on), not what it computes
_UNSTABLE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "use_cache")
# tensors are hashed in pieces of this many bytes, so that an accelerator's tensor is never copied whole to the host
_CHUNK_BYTES = 1 << 26


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


def _local_piece(tensor: Tensor) -> Optional[Tensor]:
    """What this process holds of ``tensor``: a DTensor's local shard, a ZeRO-3 parameter's partition, else the
    tensor; None for a meta tensor, which holds no values."""
    if is_sharded(tensor):
        tensor = tensor.to_local()
    elif is_zero3_param(tensor):
        tensor = tensor.ds_tensor
    return None if tensor.is_meta else tensor


def _byte_chunks(tensor: Tensor) -> Iterator[memoryview]:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return
    raw = flat.view(torch.uint8)  # any dtype, bfloat16 and float8 included, as its bytes
    for start in range(0, raw.numel(), _CHUNK_BYTES):
        yield memoryview(raw[start: start + _CHUNK_BYTES].cpu().numpy())


def _quant_state_tensors(tensor: Tensor) -> list[tuple[str, Tensor]]:
    """The tensors of a bitsandbytes 4-bit weight's quantization state (its scales are not parameters)."""
    state = getattr(tensor, "quant_state", None)
    if state is None or not hasattr(state, "as_dict"):
        return []
    return sorted((k, v) for k, v in state.as_dict(packed=True).items() if isinstance(v, Tensor))


def weights_digest(model: nn.Module) -> str:
    """A digest of every byte of ``model``'s parameters and buffers, with their names, shapes and dtypes.

    Under FSDP2 or ZeRO-3 each rank hashes the shard it holds and the ranks' digests are combined in rank order
    (a collective: every rank must call it), so two models that differ in any value differ here too; another
    sharding of the same weights gives another digest, which only costs a cache miss.
    """
    import xxhash

    digest = hashlib.sha256()
    sharded = False
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        sharded = sharded or is_sharded(tensor) or is_zero3_param(tensor)
        pieces = [(name, _local_piece(tensor))] + [(f"{name}.{k}", v) for k, v in _quant_state_tensors(tensor)]
        for piece_name, piece in pieces:
            shape = None if piece is None else tuple(piece.shape)
            digest.update(f"{piece_name}:{tuple(tensor.shape)}:{shape}:{tensor.dtype};".encode())
            if piece is None:
                continue
            # xxh3 reads gigabytes a second; sha256 over every byte would cost a 7B model tens of seconds
            fast = xxhash.xxh3_128()
            for chunk in _byte_chunks(piece):
                fast.update(chunk)
            digest.update(fast.digest())
    local = digest.hexdigest()
    if not sharded:
        return local
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local
    gathered: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return hashlib.sha256(":".join(str(g) for g in gathered).encode()).hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """A digest of what turns ``tokenizer``'s ids into text and back: for a fast tokenizer its whole
    ``tokenizers`` state (vocabulary, merges, normalizer, pre-tokenizer, decoder); otherwise its vocabulary; with,
    for both, its class, special tokens, chat template and clean-up setting."""
    parts: dict[str, Any] = {
        "class": type(tokenizer).__name__,
        "special": getattr(tokenizer, "special_tokens_map", None),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "clean_up": getattr(tokenizer, "clean_up_tokenization_spaces", None),
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        parts["backend"] = backend.to_str()
    elif hasattr(tokenizer, "get_vocab"):
        parts["vocab"] = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def model_fingerprint(model: nn.Module, tokenizer: Any = None) -> str:
    """The cache's name for θ0: its config, generation config, every weight byte (:func:`weights_digest`) and,
    given one, its tokenizer (:func:`tokenizer_digest`). Two models with equal weights, config and tokenizer share
    it wherever they were loaded from."""
    digest = hashlib.sha256()
    for part in (_stable_dict(getattr(model, "config", None)), _stable_dict(getattr(model, "generation_config", None))):
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    digest.update(weights_digest(model).encode())
    if tokenizer is not None:
        digest.update(tokenizer_digest(tokenizer).encode())
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


def read_entry(cache_dir: str, key: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               vocab_size: Optional[int] = None) -> Optional[list[dict[str, Any]]]:
    """The samples stored under ``key`` (``{"input_ids", "prompt_length"}`` each), or None when there are none or
    the entry cannot serve: unreadable (not a file, not UTF-8 JSON), of another format or key, or whose samples
    are not one answer to each of ``prompts`` in order (each sample's ids begin with its prompt's, are integers
    below ``vocab_size``, and add at most ``max_new_tokens``). Those are logged and generated again."""
    path = _entry_path(cache_dir, key)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:  # a folder or a damaged file where the entry should be
        logger.warning("cannot read the self-replay cache entry %s (%s: %s); generating it again", path,
                       type(err).__name__, err)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or data.get("key") != key:
            raise ValueError("another format or key")
        return _checked_samples(data.get("samples"), prompts, max_new_tokens, vocab_size)
    except ValueError as err:
        logger.warning("ignoring the self-replay cache entry %s (%s); generating it again", path, err)
        return None


def _is_token(value: Any, vocab_size: Optional[int]) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= 0
            and (not vocab_size or value < vocab_size))


def _checked_samples(samples: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     vocab_size: Optional[int]) -> list[dict[str, Any]]:
    """``samples`` when they answer ``prompts`` one each, in order; else ``ValueError`` naming the first fault."""
    if not isinstance(samples, list) or len(samples) != len(prompts):
        count = len(samples) if isinstance(samples, list) else type(samples).__name__
        raise ValueError(f"{count} samples stored for {len(prompts)} prompts")
    for i, (sample, prompt) in enumerate(zip(samples, prompts)):
        ids = sample.get("input_ids") if isinstance(sample, dict) else None
        length = sample.get("prompt_length") if isinstance(sample, dict) else None
        if not isinstance(ids, list) or not all(_is_token(t, vocab_size) for t in ids):
            raise ValueError(f"sample {i} has input_ids that are not token ids of this model")
        if length != len(prompt) or ids[:length] != list(prompt):
            raise ValueError(f"sample {i} does not begin with its prompt")
        if len(ids) - length > max_new_tokens:
            raise ValueError(f"sample {i} answers with more than {max_new_tokens} new tokens")
    return samples


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
