"""Add the record, the model card and the weight metadata to a folder that holds saved weights."""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_write_text, read_text
from hf_janus.publish.card import CARD_NAME, rectified_adapter_subfolder, render_card
from hf_janus.publish.provenance import ReplayInfo, RepoRef, describe_model, describe_replay
from hf_janus.publish.record_file import KINDS, REPORT_NAME, PublishedReport, build_report
from hf_janus.publish.weights_meta import add_safetensors_metadata, safetensors_metadata, weight_files


def detect_kind(folder: Union[str, os.PathLike]) -> str:
    """``"adapter"`` if the folder holds a PEFT adapter (``adapter_config.json``), else ``"full"``."""
    return "adapter" if os.path.isfile(os.path.join(os.fspath(folder), "adapter_config.json")) else "full"


def pipeline_tag(folder: str, kind: str) -> Optional[str]:
    """``text-generation`` for causal LMs, so the Hub shows the right widget; ``None`` when unsure."""
    name = "adapter_config.json" if kind == "adapter" else "config.json"
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    if kind == "adapter":
        return "text-generation" if config.get("task_type") == "CAUSAL_LM" else None
    archs = config.get("architectures") or []
    return "text-generation" if any(str(a).endswith("ForCausalLM") or str(a).endswith("LMHeadModel")
                                    for a in archs) else None


def _saved_weights(folder: str, kind: Optional[str]) -> tuple[list[str], str]:
    """The safetensors weight files in ``folder`` and the kind of output they are (``kind``, checked, or detected);
    refuses a folder that holds no weights, or another kind than ``kind``."""
    if not os.path.isdir(folder):
        raise JanusError(f"{folder!r} is not a directory; save the model or adapter there first")
    weights = weight_files(folder)
    if not weights:
        raise JanusError(
            f"{folder!r} holds no safetensors weights (adapter_model.safetensors, model.safetensors or an indexed "
            "shard): save the model with safetensors (the default of save_pretrained) before publishing"
        )
    detected = detect_kind(folder)
    kind = kind or detected
    if kind not in KINDS:
        raise JanusError(f"kind must be 'adapter' or 'full', got {kind!r}")
    if kind != detected:
        holds = "an adapter (adapter_config.json present)" if detected == "adapter" else "a full model"
        raise JanusError(f"kind={kind!r} but {folder!r} holds {holds}; pass kind={detected!r} or kind=None")
    return weights, kind


def write_publication_files(
    folder: Union[str, os.PathLike],
    report: Union[RectificationReport, PublishedReport],
    *,
    kind: Optional[str] = None,
    base_model: Union[str, RepoRef, None] = None,
    adapter: Union[str, RepoRef, None] = None,
    replay_info: Union[ReplayInfo, dict, None] = None,
    replay: Any = None,
    model: Any = None,
    merge: Optional[dict[str, Any]] = None,
    frontier: Optional[dict[str, Any]] = None,
    repo_id: Optional[str] = None,
    token: Any = None,
    online: bool = True,
) -> PublishedReport:
    """Add ``janus_rectification.json``, the ``README.md`` card and the safetensors metadata to ``folder``.

    ``folder`` must already hold the saved weights (``save_pretrained`` of an adapter or model, or
    ``trainer.save_model()``). Each file is replaced atomically (temporary file + ``os.replace``); an existing
    ``README.md`` is merged (its metadata kept, our tags added, our section replaced or appended), never
    discarded.

    Args:
        folder: the saved adapter or model.
        report: the :class:`~hf_janus.RectificationReport` (or an already built :class:`PublishedReport`, which
            is written as is: the other descriptive arguments are then ignored).
        kind: ``"adapter"`` or ``"full"``; detected from ``adapter_config.json`` when ``None``.
        base_model, adapter: Hub ids or local paths (or :class:`RepoRef`); Hub ids get their commit sha.
            ``base_model`` defaults to what ``model`` was loaded from (:func:`describe_model`).
        replay_info: a :class:`ReplayInfo`; or ``replay``: the replay data, described with
            :func:`describe_replay`.
        merge: :class:`~hf_janus.JanusMerger` extras for the ``merge`` field.
        frontier: :func:`hf_janus.frontier`'s choice for the ``frontier`` field.
        repo_id: the Hub repo id (or directory) the output will be loaded from, for the card's usage snippet;
            default ``folder``.
        online: allow a Hub request to resolve commit shas (the local cache is tried first).

    Returns:
        The :class:`PublishedReport` written.
    """
    folder = os.fspath(folder)
    # an adapter kept beside the trained one (new_adapter_name): PEFT saved it in a subfolder of its name
    subfolder = rectified_adapter_subfolder(
        (report.rectification if isinstance(report, PublishedReport) else report).output)
    weights, kind = _saved_weights(os.path.join(folder, subfolder or ""), kind)
    if isinstance(report, PublishedReport):
        published = report
        if published.kind != kind:
            raise JanusError(f"the report describes a {published.kind} output but {folder!r} holds a {kind} output")
    else:
        if base_model is None and model is not None:
            base_model = describe_model(model, token=token, online=online)
        if replay_info is None and replay is not None:
            replay_info = describe_replay(replay, token=token, online=online)
        published = build_report(report, kind=kind, base_model=base_model, adapter=adapter, replay_info=replay_info,
                                 merge=merge, frontier=frontier, token=token, online=online)

    _write_files(folder, os.path.join(folder, subfolder or ""), weights, published, load_id=repo_id or folder,
                 kind=kind)
    return published


def _write_files(folder: str, weights_dir: str, weights: list[str], published: PublishedReport, *, load_id: str,
                 kind: str) -> None:
    """Stamp ``published`` into the safetensors ``weights`` of the rectified output (``folder``, or the subfolder
    of an adapter kept beside the trained one: the trained weights are not stamped), then write the record and the
    card into ``folder``."""
    metadata = safetensors_metadata(published)
    for name in weights:
        add_safetensors_metadata(os.path.join(weights_dir, name), metadata)
    published.save(os.path.join(folder, REPORT_NAME))
    card_path = os.path.join(folder, CARD_NAME)
    existing = read_text(card_path)
    card = render_card(published, load_id=load_id, existing=existing, pipeline_tag=pipeline_tag(weights_dir, kind))
    atomic_write_text(card_path, str(card))

