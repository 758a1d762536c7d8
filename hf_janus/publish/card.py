"""The model card (``README.md``) of a JANUS-rectified adapter or model.

Rendered with huggingface_hub's ``ModelCard.from_template`` from ``model_card_templates/janus_modelcard.md``
(shipped inside the package) and ``ModelCardData`` front matter: ``base_model`` (Hub ids only: the Hub
rejects paths there), ``library_name`` (``peft`` for adapters, ``transformers`` for full models), ``tags``
(``janus``, ``hf-janus``, ``janus-rectified``), ``datasets`` (the replay dataset, when it is a Hub id),
``pipeline_tag``, the licence the base model's own card declares, and, for a point ``frontier`` chose, its scores as
``model-index``.

Our text lives between ``<!-- hf-janus:begin ... -->`` and ``<!-- hf-janus:end -->``. When a card already
exists (the one ``Trainer.create_model_card`` writes, or one the user edited), its front matter is kept and
extended and only that block is replaced (or appended), so publishing twice is idempotent and nothing the
user wrote outside the block is lost.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from importlib import resources
from typing import TYPE_CHECKING, Any, Mapping, Optional

from hf_janus.errors import JanusError

if TYPE_CHECKING:  # pragma: no cover
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    from hf_janus.engine.acceptance import AcceptanceRule
    from hf_janus.publish.provenance import RepoRef
    from hf_janus.publish.record_file import PublishedReport

TEMPLATE_NAME = "janus_modelcard.md"
CARD_NAME = "README.md"
JANUS_TAGS = ("janus", "hf-janus", "janus-rectified")
BLOCK_BEGIN = "<!-- hf-janus:begin"
BLOCK_END = "<!-- hf-janus:end -->"
_BLOCK_RE = re.compile(re.escape(BLOCK_BEGIN) + r".*?" + re.escape(BLOCK_END), re.S)


def template_path() -> str:
    """Path of the Jinja template; it ships as package data, so this works from a wheel and a checkout."""
    path = resources.files("hf_janus") / "model_card_templates" / TEMPLATE_NAME
    if not path.is_file():
        raise JanusError(f"the model card template {TEMPLATE_NAME} is missing from the hf_janus package "
                         f"({path}); reinstall hf-janus")
    return os.fspath(path)


def _fmt(value: Optional[float], spec: str) -> str:
    if value is None:
        return "-"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


# A record may come from anywhere (a downloaded janus_rectification.json): every string from it is made inert
# before it goes into the card's markdown, so that an id or a reason cannot add links, images, HTML or table cells.
def _repair_line(repair: Any) -> str:
    """What the repair after JANUS trained, which point it took and why, with the held-out figures."""
    if repair.chosen is None:
        return f"none ({repair.reason})"
    kept = repair.gain_kept()
    janus, chosen = repair.validation.get("janus"), repair.validation.get("chosen")
    nll = ("" if janus is None or chosen is None else
           f"; held-out replay NLL {janus.replay_nll:.4f} at the JANUS point, {chosen.replay_nll:.4f} chosen")
    return (f"{repair.steps} distillation steps (Adam, lr {repair.lr:g} {repair.schedule}, new task "
            f"×{repair.new_task_weight:g}, {repair.new_task_batch_size} of its samples and {repair.replay_batch_size} "
            f"replay samples a step; {repair.trained or 'the target layers'}"
            + (f" and {len(repair.outside_parameters)} other parameters fine-tuning changed"
               if repair.outside_parameters else "") + "); "
            f"chosen {repair.chosen}: {repair.reason}"
            + (f"; {kept:.0%} of the new task's held-out gain kept" if kept is not None else "") + nll)


def _plain(text: Any) -> str:
    """Free text on one line, with HTML and markdown link/image syntax escaped."""
    escaped = html.escape(" ".join(str(text).split()), quote=False)
    for char in "\\`*_[]()!|#":  # the backslash first, so that the escapes added after it stay single
        escaped = escaped.replace(char, "\\" + char)
    return escaped


# Settings that change what JANUS computes beyond τ, β and r (experiments of the research issues); the card names
# those that differ from their defaults, so that a reader never takes a damped or re-targeted run for the paper's.
def _acceptance_rule(cfg: dict[str, Any]) -> Optional["AcceptanceRule"]:
    """The record's acceptance rule with its options, or None for a rule this version does not know (a record from
    a newer hf-janus or a user's own rule) or options it cannot read."""
    from hf_janus.engine.acceptance import make_acceptance

    try:
        return make_acceptance({"acceptance": "cosine", **cfg})
    except (JanusError, TypeError, ValueError):
        return None


def _settings_line(cfg: dict[str, Any]) -> Optional[str]:
    from hf_janus.engine.config import JanusConfig

    defaults = JanusConfig()
    # every kind's options are its own (acceptance_options, constraint_options), so whatever differs was used
    changed = [f"{name}={_setting(cfg[name])}" for name in JanusConfig.method_fields()
               if name in cfg and cfg[name] != getattr(defaults, name)]
    return _plain(", ".join(changed)) if changed else None


def _setting(value: Any) -> str:
    """A setting as the card's settings line writes it: a kind's options as ``(name=value, ...)``."""
    if isinstance(value, dict):
        return "(" + ", ".join(f"{k}={v}" for k, v in value.items()) + ")"
    return str(value)


def _code(text: Any) -> str:
    """An id or path as an inline code span: no backticks or line breaks inside, table pipes escaped."""
    return "`" + " ".join(str(text).split()).replace("`", "'").replace("|", "\\|") + "`"


def _quoted(text: Any) -> str:
    """The inside of a double-quoted Python string literal in the card's code snippets."""
    return json.dumps(str(text))[1:-1]


def _ref_line(ref: Optional["RepoRef"]) -> str:
    if ref is None:
        return "unknown"
    line = _code(ref.id)
    if ref.local:
        return line + " (local directory)"
    if ref.revision and ref.revision != ref.sha:
        line += f" revision {_code(ref.revision)}"
    return line + (f", commit {_code(ref.sha[:12])}" if ref.sha else "")


def _refactor_line(published: "PublishedReport") -> Optional[str]:
    """Ranks and kept energy of the LoRA re-factorization, from the merger's or the callback's record."""
    merge = published.merge or {}
    source = merge.get("refactorization") or published.rectification.output or {}
    layers = [s for s in source.get("layers", []) if isinstance(s, dict) and "rank" in s]
    if not layers:
        return None
    ranks = [int(s["rank"]) for s in layers]
    kept = [float(s["kept_energy"]) for s in layers if s.get("kept_energy") is not None]
    rank_text = str(ranks[0]) if min(ranks) == max(ranks) else f"{min(ranks)}..{max(ranks)}"
    line = f"LoRA rank {rank_text} per layer"
    if kept:
        line += f", kept energy ≥ {min(kept):.4f}"
    if source.get("refine"):
        line += ", refined toward the null space"
    return line


def _frontier_line(published: "PublishedReport") -> Optional[str]:
    """How ``hf-janus frontier`` chose this model, when it did."""
    info = published.frontier
    chosen = info.get("chosen") if isinstance(info, dict) else None
    if not isinstance(chosen, dict):
        return None

    def names(key: str) -> str:  # the record may come from elsewhere: only lists of strings are shown
        value = info.get(key)
        return _plain(", ".join(str(v) for v in value)) if isinstance(value, list) else "-"

    def share(key: str) -> str:
        value = chosen.get(key)
        return _fmt(value, ".1f") if isinstance(value, (int, float)) else "-"

    points = info.get("points")
    line = (f"Chosen by `hf-janus frontier` ({_plain(info.get('criterion', ''))}) among "
            f"{len(points) if isinstance(points, list) else 'several'} candidates ({_candidate_titles(points)}): "
            f"**{_plain(chosen.get('label', '?'))}**, AP1 {share('ap1')}% (past tasks: "
            f"{names('past_tasks')}), AP2 {share('ap2')}% (new tasks: {names('new_tasks')}).")
    description = chosen.get("description")
    if isinstance(description, str):  # the candidate's own words
        line += " " + _plain(description)
    options = chosen.get("options")
    if not isinstance(options, dict) or options.get("tau") is None:
        line += " This point involves no JANUS step, so the rectification record below is empty."
    return line


def _candidate_titles(points: Any) -> str:
    """What kinds of candidate were scored, by the titles the frontier's record gives them."""
    seen: list[str] = []
    for p in points if isinstance(points, list) else []:
        title = p.get("title") if isinstance(p, dict) and isinstance(p.get("title"), str) else None
        if title and title not in seen:
            seen.append(title)
    return _plain(", ".join(seen)) if seen else "WiSE-FT interpolations, JANUS and their hybrids"


def _acceptance_variables(cfg: dict[str, Any]) -> dict[str, Any]:
    """What the card says about the run's acceptance test: its row (only for a rule other than the paper's, whose
    test the τ row states) and the step-trajectory sentence, both from the rule itself."""
    rule = _acceptance_rule(cfg)
    if rule is None:
        return {"acceptance_line": f"{_plain(cfg.get('acceptance'))} (a rule this hf-janus does not know)",
                "trajectory_sentence": "Each step tries step sizes α and takes one that passes the run's acceptance "
                                       "test.", "tau_used": True}
    return {"acceptance_line": None if rule.name == "cosine" else _plain(f"{rule.name}: {rule.describe()}"),
            "trajectory_sentence": _plain(rule.card_sentence()), "tau_used": rule.uses_tau}


def rectified_adapter_subfolder(output: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The folder (under the published one) of the rectified adapter when it was kept beside the trained one under
    another name (a report ``output`` with ``adapter_name``): PEFT saves every adapter but ``"default"`` in a
    subfolder of its name."""
    name = (output or {}).get("adapter_name")
    return name if isinstance(name, str) and name and name != "default" else None


def template_variables(published: "PublishedReport", *, load_id: str) -> dict[str, Any]:
    """Everything the template shows, formatted."""
    rect = published.rectification
    cfg = rect.config
    steps = []
    for s in rect.steps:
        cbar = s.taken.mean_cosine if s.taken else None
        steps.append({"step": s.step, "alpha": _fmt(s.alpha, ".4g"), "cbar": _fmt(cbar, ".4f"),
                      "trials": len(s.trials), "note": "taken failing the acceptance test (step floor or step "
                      "limit)" if s.forced else "accepted"})
    total = rect.timings.get("total")
    if rect.converged:
        result = f"converged after {len(rect.steps)} step(s)"
    else:
        result = _plain(rect.stop_reason or "not converged")
    result += f", {rect.num_trials} trial(s), {rect.num_jacobian_evals} Jacobian evaluation(s)"
    if total is not None:
        result += f", {total:.1f} s"
    replay = published.replay
    if replay is None:
        replay_line = "not recorded"
    else:
        generated = replay.self_replay_line()
        replay_line = _code(replay.id) if replay.id else (_plain(generated) if generated else "in-memory samples")
        if replay.local and replay.id:
            replay_line += " (local)"
        if replay.split:
            replay_line += f", split {_code(replay.split)}"
        if replay.size is not None:
            replay_line += f", {replay.size} rows"
        if replay.fingerprint:
            replay_line += f", fingerprint {_code(replay.fingerprint[:23])}"
    residuals = [layer.residual for layer in rect.layers if layer.residual is not None]
    base = published.base_model
    subfolder = rectified_adapter_subfolder(rect.output) if published.kind == "adapter" else None
    name = (published.adapter or base).id if (published.adapter or base) else "model"
    return {
        "kind": _plain(published.kind),
        "title": "JANUS-rectified " + _plain(os.path.basename(name.rstrip('/')) or name),
        "base_model": {"id": _code(base.id)[1:-1]} if base else None,
        "adapter": {"id": _code(published.adapter.id)[1:-1],
                    "kind": _plain(published.adapter.kind) if published.adapter.kind else None}
        if published.adapter else None,
        "base_line": _ref_line(base),
        "adapter_line": _ref_line(published.adapter),
        "replay_line": replay_line,
        "repair_line": _plain(_repair_line(rect.repair)) if rect.repair is not None else None,
        # a repair that moved the model (not skipped, not back at the JANUS point)
        "repaired": rect.repair is not None and rect.repair.chosen not in (None, "janus"),
        "tau": _fmt(cfg.get("tau"), "g"),
        **_acceptance_variables(cfg),
        "beta": _fmt(cfg.get("beta"), "g"),
        "compression_rank": ("none (every token kept, exact)" if cfg.get("compression_rank") is None
                             else str(cfg["compression_rank"])),
        "settings_line": _settings_line(cfg),
        "m": f"{rect.num_samples}" + (f" ({rect.num_tokens} tokens)" if rect.num_tokens else ""),
        "result_line": result,
        "refactor_line": _refactor_line(published),
        "frontier_line": _frontier_line(published),
        "hf_janus_version": _plain(published.hf_janus_version),
        "num_layers": len(rect.layers),
        "steps": steps,
        "loss": {k: _fmt(rect.replay_loss.get(k), ".4f") for k in ("reference", "finetuned", "rectified")},
        "residual": (_fmt(max(residuals), ".3g") + (f" (measured against {_plain(rect.residual_jacobian)})"
                                                    if rect.residual_jacobian else ""))
        if residuals else None,
        "load_id": _quoted(load_id),
        "subfolder": _quoted(subfolder) if subfolder else None,
        "trained_adapter": _quoted((rect.output or {}).get("trained_adapter", "default")),
        "base_load_id": _quoted(base.id) if base else "<base model id or path>",
    }


def card_data(published: "PublishedReport", *, pipeline_tag: Optional[str] = None,
              model_name: Optional[str] = None) -> "ModelCardData":
    """The front matter: only Hub ids go into ``base_model``/``datasets`` (the Hub validates them); the base model
    card's licence; a frontier's scores of the chosen point as ``model-index`` (under ``model_name``)."""
    from huggingface_hub import ModelCardData

    from huggingface_hub.utils import HFValidationError, validate_repo_id

    def hub_id(ref: Any) -> Optional[str]:
        if ref is None or not ref.is_hub:
            return None
        try:
            validate_repo_id(ref.id)
        except HFValidationError:  # not a repo id the Hub would accept: keep it out of the front matter
            return None
        return ref.id

    base, replay = hub_id(published.base_model), hub_id(published.replay)
    from hf_janus.publish.provenance import LICENCE_KEYS

    declared = published.base_model.license if published.base_model is not None else None
    # a record is read from a file: only the licence entries, as strings, reach the front matter
    licence = ({k: v for k, v in declared.items() if k in LICENCE_KEYS and isinstance(v, str)}
               if isinstance(declared, Mapping) else {})
    results = eval_results(published.frontier)
    return ModelCardData(
        base_model=base,
        library_name="peft" if published.kind == "adapter" else "transformers",
        tags=list(JANUS_TAGS),
        datasets=[replay] if replay else None,
        pipeline_tag=pipeline_tag,
        eval_results=results or None,
        model_name=model_name if results else None,
        **licence,
    )


def eval_results(frontier: Any) -> list["EvalResult"]:
    """The chosen point's scores on each task the frontier scored, as the Hub's ``model-index`` entries (a task named
    by a file is named by the file's name); empty without a frontier record, or for entries of other types."""
    from huggingface_hub import EvalResult

    if not isinstance(frontier, Mapping):
        return []
    chosen, metrics = frontier.get("chosen"), frontier.get("metrics")
    scores = chosen.get("scores") if isinstance(chosen, Mapping) else None
    if not isinstance(scores, Mapping):
        return []
    metrics = metrics if isinstance(metrics, Mapping) else {}
    tasks = [task for key in ("past_tasks", "new_tasks") if isinstance(frontier.get(key), list)
             for task in frontier[key] if isinstance(task, str)]
    out = []
    for task in tasks:
        value = scores.get(task)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        name = os.path.basename(task) if os.sep in task else task
        out.append(EvalResult(task_type="text-generation", dataset_type=name, dataset_name=name,
                              metric_type=str(metrics.get(task) or "score"), metric_value=float(value)))
    return out


def _merge_data(existing: "ModelCardData", ours: "ModelCardData") -> None:
    """Add our front matter to ``existing`` in place: tags and datasets are unioned; ``library_name`` is ours
    (it decides how the Hub loads the repo); the rest (base model, pipeline tag, licence, evaluation results) fill
    in what is missing."""
    def as_list(value: Any) -> list[Any]:
        return [] if value is None else [value] if isinstance(value, str) else list(value)

    existing.tags = list(dict.fromkeys(as_list(existing.get("tags")) + as_list(ours.tags))) or None
    datasets = list(dict.fromkeys(as_list(existing.get("datasets")) + as_list(ours.datasets)))
    existing.datasets = datasets or None
    existing.library_name = ours.library_name
    for key in ("base_model", "pipeline_tag", "license", "license_name", "license_link", "eval_results",
                "model_name"):
        if existing.get(key) is None and getattr(ours, key, None) is not None:
            setattr(existing, key, getattr(ours, key))


def render_card(published: "PublishedReport", *, load_id: str, existing: Optional[str] = None,
                pipeline_tag: Optional[str] = None) -> "ModelCard":
    """The card for ``published``, merged into ``existing`` (the current README.md text) when given.

    Args:
        published: the record.
        load_id: the repo id or directory the usage snippet loads from.
        existing: the text of an existing README.md, whose metadata and text outside our block are kept.
        pipeline_tag: e.g. ``"text-generation"``.
    """
    from huggingface_hub import ModelCard

    data = card_data(published, pipeline_tag=pipeline_tag, model_name=os.path.basename(os.path.normpath(load_id)))
    old = ModelCard(existing, ignore_metadata_errors=True) if existing and existing.strip() else None
    foreign_text = bool(old is not None and _BLOCK_RE.sub("", old.text).strip())
    # A card of its own gets a top-level title; inside someone else's card our part is a section.
    ours = ModelCard.from_template(data, template_path=template_path(), h="##" if foreign_text else "#",
                                   **template_variables(published, load_id=load_id))
    if old is None:
        return ours
    block = _BLOCK_RE.search(ours.text)
    if block is None:  # pragma: no cover - the template always has the markers
        raise JanusError(f"the model card template {TEMPLATE_NAME} lacks the {BLOCK_BEGIN} ... {BLOCK_END} markers")
    _merge_data(old.data, data)
    if _BLOCK_RE.search(old.text):
        old.text = _BLOCK_RE.sub(lambda _: block.group(0), old.text, count=1)
    elif foreign_text:
        old.text = old.text.rstrip() + "\n\n" + block.group(0) + "\n"
    else:
        old.text = ours.text
    return old
