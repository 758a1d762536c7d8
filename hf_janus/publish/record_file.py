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
      frontier {chosen, criterion, past_tasks, new_tasks, metrics, points} | null   <- hf-janus frontier only

  ``sha`` is the commit of a Hub repo (``None`` for a local directory); ``fingerprint`` is the ``datasets``
  fingerprint of the replay dataset (a sha256 of the token ids for in-memory samples). The rectification
  report sits at the top level. This is the only document written under that name: the Trainer callback writes it
  too, into ``output_dir`` at train end (whether or not it was given the trainer), and ``trainer.save_model()``
  writes it with the weights.
* a short form of it in the ``__metadata__`` of every safetensors weight file (``janus.*`` string keys,
  :func:`hf_janus.publish.weights_meta.safetensors_metadata`), so a weight file on its own still says
  where it came from;
* ``README.md``: a model card rendered from ``model_card_templates/`` through huggingface_hub's
  ``ModelCard``/``ModelCardData`` (:mod:`hf_janus.publish.card`); an existing card (e.g. the one ``Trainer`` writes)
  is merged, not replaced.

:func:`hf_janus.publish.files.write_publication_files` adds all three to a folder that already holds the weights;
:func:`hf_janus.publish.hub.push_folder` uploads such a folder in one commit;
:func:`hf_janus.publish.hub.load_report` reads the record back from a local directory or a Hub repo;
:func:`hf_janus.integrations.trainer_publish.install_trainer_hooks` makes ``trainer.save_model()`` and
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
from hf_janus.version import __version__

logger = logging.getLogger(__name__)

#: Version of the ``janus_rectification.json`` document written here. Bump it when a field changes meaning
#: or disappears (readers refuse newer versions); adding a field does not need a bump.
SCHEMA_VERSION = 1
REPORT_NAME = "janus_rectification.json"
KINDS = ("adapter", "full")
# Fields of the document that are not RectificationReport fields (the report is stored inline).
_PUBLICATION_FIELDS = ("schema_version", "hf_janus_version", "kind", "created_at", "base_model", "adapter", "replay",
                       "merge", "frontier", "report_schema_version")



def _now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


# ---- what a record may hold: a downloaded janus_rectification.json is untrusted input --------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(check: Any) -> Any:
    return lambda v: v is None or check(v)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _str_keyed(values: Any) -> Any:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and values(x) for k, x in v.items())


_TRIAL = {"step": (_count, "a count"), "alpha": (_number, "a number"), "mean_cosine": (_opt(_number), "a number"),
          "layer_cosines": (_str_keyed(_opt(_number)), "an object of numbers"),
          "taken": (_is_bool, "true or false"), "score": (_opt(_number), "a number"),
          "passed": (_opt(_is_bool), "true or false"),
          "replay_loss": (_opt(_number), "a number")}
_STEP = {"step": (_count, "a count"), "alpha": (_number, "a number"), "forced": (_is_bool, "true or false"),
         "trials": (lambda v: isinstance(v, list), "a list")}
_LAYER = {"name": (_is_str, "a string"), "path": (_is_str, "a string"), "delta_norm": (_number, "a number"),
          "rect_delta_norm": (_number, "a number"), "residual": (_opt(_number), "a number"),
          "gram_rank": (_count, "a count"),
          "shape": (lambda v: isinstance(v, list) and len(v) == 2 and all(_count(x) for x in v), "[d_out, d_in]")}
_RECTIFICATION = {
    "config": (lambda v: isinstance(v, dict), "an object"), "steps": (lambda v: isinstance(v, list), "a list"),
    "num_jacobian_evals": (_count, "a count"), "num_samples": (_count, "a count"), "num_tokens": (_count, "a count"),
    "replay_loss": (_str_keyed(_opt(_number)), "an object of numbers"),
    "layers": (lambda v: isinstance(v, list), "a list"),
    "timings": (_str_keyed(_opt(_number)), "an object of numbers"), "converged": (_is_bool, "true or false"),
    "stop_reason": (_is_str, "a string"), "stopped_early": (_is_bool, "true or false"),
    "discarded_final_step": (_opt(_str_keyed(_opt(_number))), "an object of numbers"),
    "output": (lambda v: isinstance(v, dict), "an object"), "memory_plan": (lambda v: isinstance(v, dict), "an object"),
    "report_schema_version": (_opt(_count), "a count"),
    "repair": (_opt(lambda v: isinstance(v, dict)), "an object")}
_REF = {"id": (_is_str, "a string"), "revision": (_opt(_is_str), "a string"), "sha": (_opt(_is_str), "a string"),
        "local": (_is_bool, "true or false"), "kind": (_opt(_is_str), "a string"),
        "peft_type": (_opt(_is_str), "a string")}
_REPLAY = {"id": (_opt(_is_str), "a string"), "source": (_opt(_is_str), "a string"),
           "split": (_opt(_is_str), "a string"),
           "revision": (_opt(_is_str), "a string"), "sha": (_opt(_is_str), "a string"),
           "fingerprint": (_opt(_is_str), "a string"), "size": (_opt(_count), "a count"),
           "local": (_is_bool, "true or false"),
           "self_replay": (_opt(lambda v: isinstance(v, dict)), "an object")}
_TOP = {"kind": (lambda v: v in KINDS, f"one of {KINDS}"), "hf_janus_version": (_is_str, "a string"),
        "created_at": (_is_str, "a string"), "merge": (_opt(lambda v: isinstance(v, dict)), "an object"),
        "frontier": (_opt(lambda v: isinstance(v, dict)), "an object")}


def _check_fields(data: Any, spec: dict, where: str) -> None:
    if not isinstance(data, dict):
        raise JanusError(f"janus_rectification.json is malformed: {where.rstrip('.') or 'the document'} must be an "
                         f"object, got {type(data).__name__}")
    for key, (ok, expected) in spec.items():
        if key in data and not ok(data[key]):
            raise JanusError(f"janus_rectification.json is malformed: {where}{key} must be {expected}, got "
                             f"{json.dumps(data[key])[:80]}")


def check_record(data: dict[str, Any]) -> None:
    """Raise :class:`JanusError` naming the first field of a record whose type or range is wrong."""
    _check_fields(data, {**_TOP, **_RECTIFICATION}, "")
    for ref in ("base_model", "adapter"):
        if data.get(ref) is not None:
            _check_fields(data[ref], _REF, f"{ref}.")
    if data.get("replay") is not None:
        _check_fields(data["replay"], _REPLAY, "replay.")
    for i, step in enumerate(data.get("steps", [])):
        _check_fields(step, _STEP, f"steps[{i}].")
        for j, trial in enumerate(step.get("trials", [])):
            _check_fields(trial, _TRIAL, f"steps[{i}].trials[{j}].")
    for i, layer in enumerate(data.get("layers", [])):
        _check_fields(layer, _LAYER, f"layers[{i}].")


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
    # hf_janus.frontier's choice: the point saved (candidate, AP1/AP2), the criterion, and every scored point.
    frontier: Optional[dict[str, Any]] = None
    hf_janus_version: str = field(default_factory=lambda: __version__)
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
        return [s.taken.mean_cosine if s.taken else None for s in self.rectification.steps]

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
            **rect, "report_schema_version": report_schema, "merge": self.merge, "frontier": self.frontier,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PublishedReport":
        """Read a document of any schema up to :data:`SCHEMA_VERSION`."""
        if not isinstance(data, dict):
            raise JanusError(f"janus_rectification.json must hold a JSON object, got {type(data).__name__}")
        if "hf_janus_version" not in data:
            raise JanusError("janus_rectification.json is not an hf-janus publication record (it has no "
                             "hf_janus_version); a report saved with RectificationReport.save is read with "
                             "RectificationReport.load")
        version = data.get("schema_version")
        if not _is_int(version) or version < 1:
            raise JanusError(f"janus_rectification.json is malformed: schema_version must be an integer >= 1, got "
                             f"{json.dumps(version)[:80]}")
        check_record(data)
        if "kind" not in data:
            raise JanusError(f"janus_rectification.json is malformed: it has no kind (one of {KINDS})")
        if version > SCHEMA_VERSION:
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
        return cls(kind=data["kind"], rectification=rectification,
                   base_model=RepoRef.from_dict(data.get("base_model")), adapter=RepoRef.from_dict(data.get("adapter")),
                   replay=ReplayInfo.from_dict(data.get("replay")), merge=data.get("merge"),
                   frontier=data.get("frontier"), hf_janus_version=data["hf_janus_version"],
                   created_at=data.get("created_at", ""), schema_version=version)

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
            lines.append(f"  replay: {rp.id or rp.self_replay_line() or 'in-memory samples'}"
                         + (f" [{rp.split}]" if rp.split else "") + (f", {rp.size} rows" if rp.size is not None else "")
                         + (f", fingerprint {rp.fingerprint}" if rp.fingerprint else ""))
        lines.append(self.rectification.summary())
        return "\n".join(lines)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the document as JSON (atomically)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")


def build_report(report: RectificationReport, *, kind: str, base_model: Union[str, RepoRef, None] = None,
                 adapter: Union[str, RepoRef, None] = None, replay_info: Union[ReplayInfo, dict, None] = None,
                 merge: Optional[dict[str, Any]] = None, frontier: Optional[dict[str, Any]] = None, token: Any = None,
                 online: bool = True) -> PublishedReport:
    """Assemble the :class:`PublishedReport` of a rectification (Hub ids get their commit, see :func:`resolve_repo`)."""
    if not isinstance(report, RectificationReport):
        raise JanusError(f"report must be a RectificationReport, got {type(report).__name__}")
    if isinstance(replay_info, dict):
        replay_info = ReplayInfo.from_dict(replay_info)
    return PublishedReport(kind=kind, rectification=report,
                           base_model=resolve_repo(base_model, token=token, online=online, licence=True),
                           adapter=resolve_repo(adapter, token=token, online=online), replay=replay_info, merge=merge,
                           frontier=frontier)



def read_record(path: str) -> PublishedReport:
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
    except RecursionError as err:
        raise JanusError(f"cannot read {path!r}: its JSON is nested too deeply to be a JANUS record") from err
    return PublishedReport.from_dict(data)

