"""Publishing rectified models with their JANUS record, and reading that record back.

Every output of hf-janus (``RectifiedDelta.save_adapter``/``save_full``/``push_to_hub``, and a ``Trainer`` output
directory rectified by :class:`~hf_janus.JanusCallback`) carries three things:

* ``janus_rectification.json``: the full record, schema :data:`SCHEMA_VERSION`. One flat JSON object::

      schema_version, hf_janus_version, kind ("adapter" | "full"), created_at,
      base_model {id, revision, sha, local}, adapter {id, revision, sha, local, kind, peft_type} | null,
      replay {id, source, split, revision, sha, fingerprint, size, local} | null,
      config, steps, num_jacobian_evals, replay_loss, layers, timings, num_samples, num_tokens,
      converged, stop_reason, output, report_schema_version,   <- the RectificationReport, inline
      merge {adapter_kind, rectified_layers, ..., refactorization} | null   <- JanusMerger only

  ``sha`` is the commit of a Hub repo (``None`` for a local directory); ``fingerprint`` is the ``datasets``
  fingerprint of the replay dataset (a sha256 of the token ids for in-memory samples). The rectification
  report sits at the top level, so readers of the callback's bare report (``data["output"]``, ...) keep working.
* a short form of it in the ``__metadata__`` of every safetensors weight file (``janus.*`` string keys,
  :func:`safetensors_metadata`), so a weight file on its own still says where it came from;
* ``README.md``: a model card rendered from ``model_card_templates/`` through huggingface_hub's
  ``ModelCard``/``ModelCardData`` (:mod:`hf_janus.publish.card`); an existing card (e.g. the one ``Trainer`` writes)
  is merged, not replaced.

:func:`write_publication_files` adds all three to a folder that already holds the weights;
:func:`push_folder` uploads such a folder in one commit; :func:`load_report` reads the record back from a
local directory or a Hub repo; :func:`install_trainer_hooks` makes ``trainer.save_model()`` and
``trainer.push_to_hub()`` publish it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_write_text
from hf_janus.engine.report import RectificationReport

if TYPE_CHECKING:  # pragma: no cover
    from huggingface_hub import CommitInfo

logger = logging.getLogger(__name__)

#: Version of the ``janus_rectification.json`` document written here. Bump it when a field changes meaning
#: or disappears (readers refuse newer versions); adding a field does not need a bump.
SCHEMA_VERSION = 1
REPORT_NAME = "janus_rectification.json"
CARD_NAME = "README.md"
#: Prefix of the keys this package adds to the safetensors ``__metadata__``.
METADATA_PREFIX = "janus."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODEL_WEIGHTS = "model.safetensors"
KINDS = ("adapter", "full")

_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# Fields of the document that are not RectificationReport fields (the report is stored inline).
_PUBLICATION_FIELDS = ("schema_version", "hf_janus_version", "kind", "created_at", "base_model", "adapter", "replay",
                       "merge", "report_schema_version")


# ---- what was rectified ----------------------------------------------------------------------------------
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

    @property
    def is_hub(self) -> bool:
        return not self.local

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k in ("revision", "sha")}

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]]) -> Optional["RepoRef"]:
        if data is None:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


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

    @property
    def is_hub(self) -> bool:
        return self.id is not None and not self.local

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Optional[dict[str, Any]]) -> Optional["ReplayInfo"]:
        if data is None:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _looks_local(name: str) -> bool:
    from hf_janus.adapters.loading import _looks_like_local_path

    return os.path.exists(os.path.expanduser(name)) or _looks_like_local_path(name)


def _sha_from_snapshot_path(path: Optional[str]) -> Optional[str]:
    """The commit of a huggingface_hub cache snapshot directory (``.../snapshots/<sha>[/file]``)."""
    if not path:
        return None
    parts = os.path.normpath(os.fspath(path)).split(os.sep)
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1] == "snapshots" and _SHA_RE.match(parts[i]):
            return parts[i]
    return None


def _sha_from_cache(repo_id: str, revision: Optional[str], repo_type: str) -> Optional[str]:
    """The commit the local cache resolved ``revision`` to: what ``from_pretrained`` actually loaded."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        ref = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo_id, repo_type=repo_type), "refs",
                           revision or "main")
        with open(ref, encoding="utf-8") as fh:
            sha = fh.read().strip()
        return sha if _SHA_RE.match(sha) else None
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
                 online: bool = True) -> Optional[RepoRef]:
    """Describe a model/adapter/dataset: ``local`` for an existing or path-like name, else a Hub repo id whose
    commit is taken from, in order: ``revision`` if it is a full sha, ``local_path`` if it is a cache snapshot,
    the local cache's ref for ``revision``, and (``online``) ``HfApi().repo_info(...).sha``."""
    if name is None or isinstance(name, RepoRef):
        return name
    name = os.fspath(name)
    if _looks_local(name):  # a cache snapshot passed as a path still knows its commit
        return RepoRef(id=name, revision=revision, sha=_sha_from_snapshot_path(name), local=True)
    sha = revision if revision and _SHA_RE.match(revision) else None
    sha = sha or _sha_from_snapshot_path(local_path) or _sha_from_cache(name, revision, repo_type)
    if sha is None and online:
        sha = _sha_from_api(name, revision, repo_type, token)
    return RepoRef(id=name, revision=revision, sha=sha, local=False)


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
        from hf_janus.replay.sources import parse_replay_spec

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
    return resolve_repo(name, revision, token=token, online=online)


# ---- the record ------------------------------------------------------------------------------------------
def _package_version() -> str:
    from hf_janus import __version__

    return __version__


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def _report_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(RectificationReport)}


@dataclass
class PublishedReport:
    """``janus_rectification.json``: what was rectified (base model, adapter, replay, with Hub commits) and the
    :class:`~hf_janus.RectificationReport` of how (config, step trajectory, per-layer stats, losses, timings).

    Returned by :func:`load_report`; ``to_dict()`` is the JSON document.
    """

    kind: str
    rectification: RectificationReport
    base_model: Optional[RepoRef] = None
    adapter: Optional[RepoRef] = None
    replay: Optional[ReplayInfo] = None
    merge: Optional[dict[str, Any]] = None  # JanusMerger's extras: layers kept as fine-tuned, re-factorization
    hf_janus_version: str = field(default_factory=_package_version)
    # Microseconds: two publications of the same result are still two records (and two Hub commits).
    created_at: str = field(default_factory=lambda: _now_iso())
    schema_version: int = SCHEMA_VERSION
    source: Optional[str] = None  # where load_report read it (directory or repo id), not serialized
    commit: Optional[str] = None  # the Hub commit load_report read it at, not serialized

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise JanusError(f"kind must be 'adapter' or 'full', got {self.kind!r}")

    # the figures people look for first
    @property
    def config(self) -> dict[str, Any]:
        return self.rectification.config

    @property
    def alphas(self) -> list[float]:
        """The step size α taken at each step."""
        return self.rectification.alphas

    @property
    def mean_cosines(self) -> list[Optional[float]]:
        """c̄ of the accepted trial of each step (``None`` for a step without trials)."""
        return [s.trials[-1].mean_cosine if s.trials else None for s in self.rectification.steps]

    @property
    def replay_loss(self) -> dict[str, float]:
        return self.rectification.replay_loss

    def to_dict(self) -> dict[str, Any]:
        rect = self.rectification.to_dict()
        clash = sorted(set(rect) & (set(_PUBLICATION_FIELDS) - {"schema_version"}))
        if clash:  # pragma: no cover - a RectificationReport field would shadow a publication field
            raise JanusError(f"RectificationReport field(s) {clash} clash with janus_rectification.json fields; "
                             "rename them in hf_janus/report.py")
        report_schema = rect.pop("schema_version", None)
        return {
            "schema_version": self.schema_version, "hf_janus_version": self.hf_janus_version, "kind": self.kind,
            "created_at": self.created_at,
            "base_model": self.base_model.to_dict() if self.base_model else None,
            "adapter": self.adapter.to_dict() if self.adapter else None,
            "replay": self.replay.to_dict() if self.replay else None,
            **rect, "report_schema_version": report_schema, "merge": self.merge,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, kind: Optional[str] = None) -> "PublishedReport":
        """Read a document of any schema up to :data:`SCHEMA_VERSION`; also a bare ``RectificationReport`` or
        a ``MergeReport`` saved on its own (``kind`` then says what it describes, default ``"full"``)."""
        if not isinstance(data, dict):
            raise JanusError(f"janus_rectification.json must hold a JSON object, got {type(data).__name__}")
        if "hf_janus_version" not in data:
            return cls._from_legacy(data, kind)
        version = data.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise JanusError(
                f"janus_rectification.json has schema_version {version!r}, newer than this hf-janus reads "
                f"({SCHEMA_VERSION}); upgrade hf-janus (pip install -U hf-janus)"
            )
        fields = _report_fields()
        rect = {k: v for k, v in data.items() if k in fields and k not in _PUBLICATION_FIELDS}
        if data.get("report_schema_version") is not None:
            rect["schema_version"] = data["report_schema_version"]
        unknown = sorted(set(data) - fields - set(_PUBLICATION_FIELDS))
        if unknown:  # written by a newer hf-janus that added fields: they are kept in the file, not here
            logger.debug("janus_rectification.json: ignoring unknown field(s) %s", unknown)
        try:
            rectification = RectificationReport.from_dict(rect)
        except (TypeError, KeyError) as err:
            raise JanusError(f"janus_rectification.json is malformed ({type(err).__name__}: {err})") from err
        return cls(kind=data.get("kind", kind or "full"), rectification=rectification,
                   base_model=RepoRef.from_dict(data.get("base_model")), adapter=RepoRef.from_dict(data.get("adapter")),
                   replay=ReplayInfo.from_dict(data.get("replay")), merge=data.get("merge"),
                   hf_janus_version=data["hf_janus_version"], created_at=data.get("created_at", ""),
                   schema_version=version)

    @classmethod
    def _from_legacy(cls, data: dict[str, Any], kind: Optional[str]) -> "PublishedReport":
        try:
            if isinstance(data.get("rectification"), dict):  # a MergeReport.to_dict()
                merge = {k: v for k, v in data.items() if k not in ("rectification", "base_model", "adapter",
                                                                      "base_revision", "adapter_revision", "replay")}
                return cls(
                    kind=data.get("output_format") or kind or "adapter",
                    rectification=RectificationReport.from_dict(data["rectification"]),
                    base_model=resolve_repo(data.get("base_model"), data.get("base_revision"), online=False),
                    adapter=resolve_repo(data.get("adapter"), data.get("adapter_revision"), online=False),
                    replay=ReplayInfo(id=data.get("replay"), source=data.get("replay")) if data.get("replay") else None,
                    merge=merge, hf_janus_version="unknown", created_at="",
                )
            fields = _report_fields()
            return cls(kind=kind or "full", hf_janus_version="unknown", created_at="",
                       rectification=RectificationReport.from_dict({k: v for k, v in data.items() if k in fields}))
        except (TypeError, KeyError) as err:
            raise JanusError(f"janus_rectification.json is neither an hf-janus publication nor a rectification "
                             f"report ({type(err).__name__}: {err})") from err

    def summary(self) -> str:
        """A few human-readable lines."""

        def ref(r: Optional[RepoRef]) -> str:
            if r is None:
                return "-"
            where = " (local)" if r.local else (f" @ {r.sha[:12]}" if r.sha else "")
            return f"{r.id}{where}"

        lines = [f"JANUS-rectified {self.kind} (hf-janus {self.hf_janus_version}, schema {self.schema_version})",
                 f"  base model: {ref(self.base_model)}"]
        if self.adapter is not None:
            lines.append(f"  adapter: {ref(self.adapter)}")
        if self.replay is not None:
            rp = self.replay
            lines.append(f"  replay: {rp.id or 'in-memory samples'}"
                         + (f" [{rp.split}]" if rp.split else "") + (f", {rp.size} rows" if rp.size is not None else "")
                         + (f", fingerprint {rp.fingerprint}" if rp.fingerprint else ""))
        lines.append(self.rectification.summary())
        return "\n".join(lines)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the document as JSON (atomically)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


def build_report(report: RectificationReport, *, kind: str, base_model: Union[str, RepoRef, None] = None,
                 adapter: Union[str, RepoRef, None] = None, replay_info: Union[ReplayInfo, dict, None] = None,
                 merge: Optional[dict[str, Any]] = None, token: Any = None, online: bool = True) -> PublishedReport:
    """Assemble the :class:`PublishedReport` of a rectification (Hub ids get their commit, see :func:`resolve_repo`)."""
    if not isinstance(report, RectificationReport):
        raise JanusError(f"report must be a RectificationReport, got {type(report).__name__}")
    if isinstance(replay_info, dict):
        replay_info = ReplayInfo.from_dict(replay_info)
    return PublishedReport(kind=kind, rectification=report,
                           base_model=resolve_repo(base_model, token=token, online=online),
                           adapter=resolve_repo(adapter, token=token, online=online), replay=replay_info, merge=merge)


# ---- safetensors __metadata__ ----------------------------------------------------------------------------
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
        "config": {k: cfg.get(k) for k in ("tau", "beta", "rank", "max_steps", "min_alpha") if k in cfg},
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
    """The whole ``__metadata__`` of a safetensors file (read from its header only)."""
    return dict(_read_safetensors_header(os.fspath(path))[0].get("__metadata__") or {})


def _read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than 8 bytes")
            (size,) = struct.unpack("<Q", raw)
            if size > 100 * 1024 * 1024:  # the format's own limit
                raise ValueError(f"header of {size} bytes")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as err:
        raise JanusError(f"{path!r} is not a readable safetensors file ({err})") from err
    if not isinstance(header, dict):
        raise JanusError(f"{path!r} is not a safetensors file (its header is not a JSON object)")
    return header, 8 + size


def add_safetensors_metadata(path: Union[str, os.PathLike], metadata: dict[str, str]) -> None:
    """Replace the ``janus.*`` keys of the ``__metadata__`` of a safetensors file by ``metadata``.

    Only the header is rewritten; the tensor bytes are streamed unchanged into a temporary file next to
    ``path`` that then replaces it (``os.replace``), so a crash never leaves a half-written weight file and a
    multi-GB shard never has to fit in memory. Other metadata (``format: pt``, ...) is kept.
    """
    path = os.fspath(path)
    bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise JanusError(f"safetensors metadata must map strings to strings; bad entries: {bad}")
    header, data_start = _read_safetensors_header(path)
    meta = {k: v for k, v in (header.get("__metadata__") or {}).items() if not k.startswith(METADATA_PREFIX)}
    meta.setdefault("format", "pt")  # transformers refuses safetensors weights without it
    meta.update(metadata)
    header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the format pads the header with spaces to keep tensors 8-byte aligned
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(fd, "wb") as dst, open(path, "rb") as src:
            dst.write(struct.pack("<Q", len(blob)))
            dst.write(blob)
            src.seek(data_start)
            shutil.copyfileobj(src, dst, 16 * 1024 * 1024)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
        names.update(n for n in weight_map.values() if os.path.isfile(os.path.join(folder, n)))
    return sorted(names)


# ---- the folder ------------------------------------------------------------------------------------------
def detect_kind(folder: Union[str, os.PathLike]) -> str:
    """``"adapter"`` if the folder holds a PEFT adapter (``adapter_config.json``), else ``"full"``."""
    return "adapter" if os.path.isfile(os.path.join(os.fspath(folder), "adapter_config.json")) else "full"


def _pipeline_tag(folder: str, kind: str) -> Optional[str]:
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
        repo_id: the Hub repo id (or directory) the output will be loaded from, for the card's usage snippet;
            default ``folder``.
        online: allow a Hub request to resolve commit shas (the local cache is tried first).

    Returns:
        The :class:`PublishedReport` written.
    """
    from hf_janus.publish.card import render_card

    folder = os.fspath(folder)
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
                                 merge=merge, token=token, online=online)

    metadata = safetensors_metadata(published)
    for name in weights:
        add_safetensors_metadata(os.path.join(folder, name), metadata)
    published.save(os.path.join(folder, REPORT_NAME))
    card_path = os.path.join(folder, CARD_NAME)
    existing = _read_text(card_path)
    card = render_card(published, load_id=repo_id or folder, existing=existing,
                       pipeline_tag=_pipeline_tag(folder, kind))
    atomic_write_text(card_path, str(card))
    return published


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


# ---- the Hub ---------------------------------------------------------------------------------------------
def _is_connection_error(err: BaseException) -> bool:
    # huggingface_hub 2.x raises httpx2's transport errors; 1.x httpx's, 0.x requests': match by name.
    names = {cls.__name__ for cls in type(err).__mro__}
    return bool(names & {"TransportError", "ConnectError", "ConnectionError", "TimeoutException", "Timeout",
                         "NetworkError", "OfflineModeIsEnabled"})


def _hub_failure(action: str, repo_id: str, err: BaseException, local: Optional[str] = None) -> JanusError:
    """A JanusError for a failed Hub call: what failed, the likely cause, the fix, and that local files are safe."""
    from huggingface_hub import constants

    kept = f" The local files in {local!r} were not changed." if local else ""
    status = getattr(getattr(err, "response", None), "status_code", None)
    detail = f"{type(err).__name__}: {err}".strip()
    if status in (401, 403):
        return JanusError(
            f"the Hugging Face Hub refused to {action} {repo_id!r} (HTTP {status}: invalid, missing or read-only "
            f"token). Log in with `hf auth login` or pass token= with write access to this repo.{kept} ({detail})"
        )
    if _is_connection_error(err):
        return JanusError(
            f"could not reach the Hugging Face Hub at {constants.ENDPOINT} to {action} {repo_id!r} ({detail}). Check "
            f"the network, HF_ENDPOINT and HF_HUB_OFFLINE, then retry.{kept}"
        )
    name = type(err).__name__
    if name == "RevisionNotFoundError":
        return JanusError(f"could not {action} {repo_id!r}: the revision does not exist ({detail}).{kept}")
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        return JanusError(f"could not {action} {repo_id!r}: the repo does not exist or you have no access to it; "
                          f"check the id, or pass token= for a private repo ({detail}).{kept}")
    return JanusError(f"could not {action} {repo_id!r}: {detail}.{kept}")


def _folder_files(folder: str) -> list[str]:
    """Relative paths of the files to upload: everything but hidden files and folders (``.git``, ``.cache``,
    leftovers of interrupted atomic writes)."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                out.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
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

    from hf_janus.publish.card import render_card

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise JanusError(f"cannot push {folder!r}: it is not a directory")
    files = _folder_files(folder)
    if not files:
        raise JanusError(f"cannot push {folder!r}: it holds no files")
    card_bytes: Optional[bytes] = None
    if REPORT_NAME in files:
        published = _load_local(os.path.join(folder, REPORT_NAME), kind=detect_kind(folder))
        card = render_card(published, load_id=repo_id, existing=_read_text(os.path.join(folder, CARD_NAME)),
                           pipeline_tag=_pipeline_tag(folder, published.kind))
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
        raise _hub_failure(action, repo_id, err, local=folder) from err


def _load_local(path: str, kind: Optional[str] = None) -> PublishedReport:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError as err:
        raise JanusError(f"{os.path.dirname(path) or '.'!r} has no {REPORT_NAME}: it was not published by hf-janus "
                         "(or the file was removed)") from err
    except (OSError, ValueError) as err:
        raise JanusError(f"cannot read {path!r}: {err}") from err
    return PublishedReport.from_dict(data, kind=kind)


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
        report = _load_local(expanded)
        report.source = name
        return report
    if os.path.isdir(expanded):
        report = _load_local(os.path.join(expanded, REPORT_NAME), kind=detect_kind(expanded))
        report.source = name
        return report
    if _looks_local(name):
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
        raise _hub_failure("read the JANUS report of", name, err) from err
    report = _load_local(path)
    report.source, report.commit = name, _sha_from_snapshot_path(path)
    return report


# ---- Trainer ---------------------------------------------------------------------------------------------
def install_trainer_hooks(trainer: Any, report: Union[RectificationReport, Callable[[], Optional[RectificationReport]]],
                          *, replay: Any = None, replay_info: Union[ReplayInfo, dict, None] = None,
                          base_model: Union[str, RepoRef, None] = None, token: Any = None) -> None:
    """Make ``trainer.save_model()`` and ``trainer.push_to_hub()`` publish the JANUS record with the weights.

    ``trainer.push_to_hub()`` saves the model again and then rewrites ``output_dir/README.md`` with
    ``create_model_card()`` just before uploading, so files written earlier would lose their metadata and
    card. This wraps the two instance methods (nothing on the ``Trainer`` class changes): after
    ``save_model`` and after ``create_model_card``, :func:`write_publication_files` adds the record, merges
    our section and tags into the card the Trainer wrote, and stamps the weight files, so the upload that
    follows carries them. ``report`` is the report or a callable returning it (``None``: not rectified yet;
    the hooks then do nothing). Installing twice only replaces the report source.
    """
    provider = report if callable(report) else (lambda: report)
    state = getattr(trainer, "_janus_publication", None)
    if state is not None:
        state.update(provider=provider, replay=replay, replay_info=replay_info, base_model=base_model, token=token)
        return
    state = {"provider": provider, "replay": replay, "replay_info": replay_info, "base_model": base_model,
             "token": token, "built": {}}
    original_save, original_card = trainer.save_model, trainer.create_model_card

    def publish(output_dir: Optional[str]) -> None:
        rect = state["provider"]()
        folder = output_dir or trainer.args.output_dir
        if rect is None or not trainer.is_world_process_zero() or not weight_files_present(folder):
            return
        kind = detect_kind(folder)
        key = (id(rect), kind)
        if key not in state["built"]:  # one record per report: repeated saves do not change created_at
            base = state["base_model"] or describe_model(trainer.model, token=state["token"])
            info = state["replay_info"]
            if info is None and state["replay"] is not None:
                info = describe_replay(state["replay"], token=state["token"])
            state["built"] = {key: build_report(rect, kind=kind, base_model=base, replay_info=info,
                                                token=state["token"])}
        repo_id = getattr(trainer, "hub_model_id", None) or trainer.args.hub_model_id
        write_publication_files(folder, state["built"][key], repo_id=repo_id or folder, token=state["token"])

    def save_model(output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        original_save(output_dir, _internal_call=_internal_call)
        publish(output_dir)

    def create_model_card(*args: Any, **kwargs: Any) -> None:
        original_card(*args, **kwargs)
        publish(None)  # the Trainer writes the card in args.output_dir, right before uploading it

    trainer.save_model, trainer.create_model_card = save_model, create_model_card
    trainer._janus_publication = state


def weight_files_present(folder: str) -> bool:
    """Whether ``folder`` exists and holds safetensors weights (see :func:`weight_files`)."""
    return os.path.isdir(folder) and bool(weight_files(folder))
