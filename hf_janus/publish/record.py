"""``janus_rectification.json``: the publication record of a rectification, written and read back.

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
  :func:`hf_janus.publish.weights_meta.safetensors_metadata`), so a weight file on its own still says where it came from;
* ``README.md``: a model card rendered from ``model_card_templates/`` through huggingface_hub's
  ``ModelCard``/``ModelCardData`` (:mod:`hf_janus.publish.card`); an existing card (e.g. the one ``Trainer`` writes)
  is merged, not replaced.

:func:`hf_janus.publish.files.write_publication_files` adds all three to a folder that already holds the weights;
:func:`hf_janus.publish.hub.push_folder` uploads such a folder in one commit; :func:`hf_janus.publish.hub.load_report` reads the record back from a
local directory or a Hub repo; :func:`hf_janus.integrations.trainer_publish.install_trainer_hooks` makes ``trainer.save_model()`` and
``trainer.push_to_hub()`` publish it.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_write_text
from hf_janus.publish.provenance import ReplayInfo, RepoRef, resolve_repo
from hf_janus.serialization import field_names

logger = logging.getLogger(__name__)

#: Version of the ``janus_rectification.json`` document written here. Bump it when a field changes meaning
#: or disappears (readers refuse newer versions); adding a field does not need a bump.
SCHEMA_VERSION = 1
REPORT_NAME = "janus_rectification.json"
KINDS = ("adapter", "full")
# Fields of the document that are not RectificationReport fields (the report is stored inline).
_PUBLICATION_FIELDS = ("schema_version", "hf_janus_version", "kind", "created_at", "base_model", "adapter", "replay",
                       "merge", "report_schema_version")



def _package_version() -> str:
    from hf_janus import __version__  # at call time: hf_janus/__init__ imports this module

    return __version__


def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


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
        fields = field_names(RectificationReport)
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
            fields = field_names(RectificationReport)
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



def read_record(path: str, kind: Optional[str] = None) -> PublishedReport:
    """Read a local ``janus_rectification.json`` (any schema up to :data:`SCHEMA_VERSION`, see
    :meth:`PublishedReport.from_dict`)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError as err:
        raise JanusError(f"{os.path.dirname(path) or '.'!r} has no {REPORT_NAME}: it was not published by hf-janus "
                         "(or the file was removed)") from err
    except (OSError, ValueError) as err:
        raise JanusError(f"cannot read {path!r}: {err}") from err
    return PublishedReport.from_dict(data, kind=kind)

