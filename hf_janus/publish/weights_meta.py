"""The short form of the record in the ``__metadata__`` of safetensors weight files, and finding those files."""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any, Iterable, Optional, Union

from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_replace
from hf_janus.publish.record_file import REPORT_NAME, PublishedReport

#: Prefix of the keys this package adds to the safetensors ``__metadata__``.
METADATA_PREFIX = "janus."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODEL_WEIGHTS = "model.safetensors"


def safetensors_metadata(published: PublishedReport) -> dict[str, str]:
    """The short form for the ``__metadata__`` of the weight files: ``janus.*`` keys, string values (JSON for
    lists and dicts), the pointer to the full record in ``janus.report``."""
    rect = published.rectification
    cfg = rect.config

    def short(values: Iterable[Optional[float]]) -> list[Optional[float]]:  # 6 digits: a summary, not the record
        return [None if v is None else float(f"{v:.6g}") for v in values]

    entries: dict[str, Any] = {
        "schema_version": published.schema_version,
        "hf_janus_version": published.hf_janus_version,
        "kind": published.kind,
        "report": REPORT_NAME,
        "config": {k: cfg.get(k) for k in ("tau", "beta", "compression_rank", "max_steps", "min_alpha") if k in cfg},
        "num_samples": rect.num_samples,
        "alphas": short(published.alphas),
        "mean_cosines": short(published.mean_cosines),
        "replay_loss": dict(zip(rect.replay_loss, short(rect.replay_loss.values()))),
        "converged": rect.converged,
    }
    for key, ref in (("base_model", published.base_model), ("adapter", published.adapter)):
        if ref is not None:
            entries[key] = ref.id
            entries[f"{key}_sha"] = ref.sha
    if published.replay is not None:
        rp = published.replay
        entries.update(replay=rp.id, replay_split=rp.split, replay_fingerprint=rp.fingerprint, replay_size=rp.size)
    out: dict[str, str] = {}
    for key, value in entries.items():
        if value is None:
            continue
        out[METADATA_PREFIX + key] = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return out


def read_safetensors_metadata(path: Union[str, os.PathLike]) -> dict[str, str]:
    """The whole ``__metadata__`` of a safetensors file (``safe_open`` reads only the header)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as fh:
            return dict(fh.metadata() or {})
    except (OSError, SafetensorError) as err:
        raise JanusError(f"{os.fspath(path)!r} is not a readable safetensors file ({err})") from err


def add_safetensors_metadata(path: Union[str, os.PathLike], metadata: dict[str, str]) -> None:
    """Replace the ``janus.*`` keys of the ``__metadata__`` of a safetensors file by ``metadata``.

    Only the header is rewritten; the tensor bytes are streamed unchanged into a temporary file next to
    ``path`` that then replaces it (:func:`~hf_janus.io_utils.atomic_replace`), so a crash never leaves a
    half-written weight file and a multi-GB shard never has to fit in memory. Other metadata (``format: pt``,
    ...) is kept.
    """
    path = os.fspath(path)
    bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise JanusError(f"safetensors metadata must map strings to strings; bad entries: {bad}")
    meta = {k: v for k, v in read_safetensors_metadata(path).items() if not k.startswith(METADATA_PREFIX)}
    meta.setdefault("format", "pt")  # transformers refuses safetensors weights without it
    meta.update(metadata)
    header, data_start = _raw_header(path)
    header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the format pads the header with spaces to keep tensors 8-byte aligned
    with atomic_replace(path) as tmp, open(tmp, "wb") as dst, open(path, "rb") as src:
        dst.write(struct.pack("<Q", len(blob)))
        dst.write(blob)
        src.seek(data_start)
        shutil.copyfileobj(src, dst, 16 * 1024 * 1024)


def _raw_header(path: str) -> tuple[dict[str, Any], int]:
    """The header of a file ``safe_open`` has already validated, and where its tensor bytes start.

    safetensors has no call that changes the metadata of a file without loading every tensor, and
    ``safe_open`` does not expose the tensors' byte offsets that a header rewritten in front of the unchanged
    bytes must keep; so this reads them: an 8-byte little-endian length, then that much JSON.
    """
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(size)), 8 + size


def weight_files(folder: Union[str, os.PathLike]) -> list[str]:
    """The safetensors weight files of a saved adapter or model: ``adapter_model.safetensors``,
    ``model.safetensors`` and every shard named in a ``*.safetensors.index.json`` (names, sorted). Other
    safetensors files (e.g. the callback's θ0 snapshot) are not weights and are left alone."""
    folder = os.fspath(folder)
    names = {n for n in (ADAPTER_WEIGHTS, MODEL_WEIGHTS) if os.path.isfile(os.path.join(folder, n))}
    for index in os.listdir(folder):
        if not index.endswith(".safetensors.index.json"):
            continue
        try:
            with open(os.path.join(folder, index), encoding="utf-8") as fh:
                weight_map = json.load(fh).get("weight_map", {})
        except (OSError, ValueError) as err:
            raise JanusError(f"cannot read the shard index {index!r} in {folder!r}: {err}") from err
        for name in set(weight_map.values()):
            # A shard is a plain file name in this folder: an index naming "../x" or "/abs/x" would make the
            # metadata rewrite touch files outside it.
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise JanusError(
                    f"the shard index {index!r} in {folder!r} names {name!r}, which is not a file name inside the "
                    "folder; shard names must be plain file names (e.g. model-00001-of-00002.safetensors)"
                )
            if os.path.isfile(os.path.join(folder, name)):
                names.add(name)
    return sorted(names)


def weight_files_present(folder: str) -> bool:
    """Whether ``folder`` exists and holds safetensors weights (see :func:`weight_files`)."""
    return os.path.isdir(folder) and bool(weight_files(folder))
