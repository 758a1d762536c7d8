"""Rectify a saved PEFT adapter with JANUS and save the result as a LoRA adapter or as full weights.

    merger = JanusMerger("org/base", "org/adapter", replay="org/past-task:train")
    delta = merger.run()                      # ΔW_rect per adapted layer, the rectified model, the report
    delta.save_adapter("out-adapter", rank="same", refine=True)
    delta.save_full("out-full")

:class:`JanusMerger` builds the effective model with :mod:`hf_janus.adapters.loading` (base loaded once, the adapter
merged into it layer by layer by PEFT, ``θ0`` = the base weights of the adapted layers only), runs
:class:`hf_janus.Rectifier` on exactly the adapted linear layers, and returns a :class:`RectifiedDelta`.
:meth:`RectifiedDelta.save_adapter` re-factorizes each ``ΔW_rect`` with :mod:`hf_janus.adapters.refactor` into a
standard LoRA adapter that stock ``PeftModel.from_pretrained`` loads; :meth:`RectifiedDelta.save_full`
writes base + ``ΔW_rect`` with ``save_pretrained``. Every output is written atomically (temporary directory
+ rename) and published with :mod:`hf_janus.publish.hub`: ``janus_rectification.json`` (base model and adapter with
their Hub commits, the replay dataset's id/split/fingerprint/size, the rectification report and the
:class:`MergeReport` extras under ``merge``), a model card ``README.md`` and a short form of the record in the
safetensors ``__metadata__`` of the weight files. :meth:`RectifiedDelta.push_to_hub` uploads the same files.

Which layers are rectified: only layers the adapter changes. ``config.target_modules`` can narrow that set
(``"all-linear"``, the default, means every adapted linear layer, an adapted ``lm_head`` included) and
``config.exclude_modules`` removes layers from it; it never adds layers the adapter does not touch. Adapted
layers left out, adapted embeddings, ``modules_to_save`` and trained biases keep their fine-tuned values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from hf_janus.adapters.loading import PEFT_PREFIX, DTypeLike, EffectiveModel, load_effective_model
from hf_janus.config import JanusConfig
from hf_janus.errors import JanusError
from hf_janus.engine.ghost import LayerJacobian, eig_psd
from hf_janus.publish.hub import REPORT_NAME  # noqa: F401 - re-exported: callers import it from here
from hf_janus.publish.hub import (
    PublishedReport,
    ReplayInfo,
    RepoRef,
    describe_replay,
    push_folder,
    resolve_repo,
    write_publication_files,
)
from hf_janus.io_utils import atomic_output_dir, atomic_write_text, check_output_dir
from hf_janus.engine.layers import resolve_target_modules, rule_for
from hf_janus.engine.rectifier import Rectifier
from hf_janus.adapters.refactor import DEFAULT_REFINE_ITERATIONS, RankSpec, RefactorStats, refactor_delta, validate_rank_spec
from hf_janus.replay.sources import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_NUM_SAMPLES,
    load_replay_dataset,
    parse_replay_spec,
    tokenize_replay,
)
from hf_janus.engine.report import RectificationReport

logger = logging.getLogger(__name__)

MERGE_SCHEMA_VERSION = 1
# MergeReport fields that janus_rectification.json stores outside its "merge" section.
_MERGE_FIELDS_ELSEWHERE = ("base_model", "adapter", "rectification", "base_revision", "adapter_revision", "replay",
                           "output_format", "adapter_kind", "peft_type")


# ---- report ----------------------------------------------------------------------------------------------
@dataclass
class MergeReport:
    """What :class:`JanusMerger` did: inputs, layers, the engine's report and, after ``save_adapter``, the
    per-layer re-factorization statistics (kept energy, residuals with and without refinement)."""

    base_model: str
    adapter: str
    adapter_kind: str
    peft_type: str
    rectification: RectificationReport
    rectified_layers: list[str]
    unrectified_layers: list[str] = field(default_factory=list)  # adapted, kept at their fine-tuned value
    modules_to_save: list[str] = field(default_factory=list)
    base_revision: Optional[str] = None
    adapter_revision: Optional[str] = None
    replay: Optional[str] = None
    output_format: Optional[str] = None  # "adapter" or "full" once saved
    refactorization: Optional[dict[str, Any]] = None  # {"rank", "energy", "refine", "layers": [RefactorStats]}
    schema_version: int = MERGE_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rectification"] = self.rectification.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MergeReport":
        """Read :meth:`to_dict` output, or a published ``janus_rectification.json`` (see :mod:`hf_janus.publish.hub`)."""
        if "hf_janus_version" in data:
            return cls.from_published(PublishedReport.from_dict(data))
        data = dict(data)
        data["rectification"] = RectificationReport.from_dict(data["rectification"])
        return cls(**data)

    def merge_section(self) -> dict[str, Any]:
        """The ``merge`` field of ``janus_rectification.json``: what the rest of the document does not hold."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in _MERGE_FIELDS_ELSEWHERE}
        return json.loads(json.dumps(out))  # a detached copy: later saves must not rewrite a built record

    @classmethod
    def from_published(cls, published: PublishedReport) -> "MergeReport":
        """The :class:`MergeReport` inside a :class:`~hf_janus.publish.hub.PublishedReport` written by the merger."""
        if published.merge is None or published.adapter is None or published.base_model is None:
            raise JanusError(
                f"this janus_rectification.json{f' ({published.source})' if published.source else ''} was not "
                "written by JanusMerger (no merge section); read it with hf_janus.load_report"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        extras = {k: v for k, v in published.merge.items() if k in known and k not in _MERGE_FIELDS_ELSEWHERE}
        return cls(
            base_model=published.base_model.id, adapter=published.adapter.id,
            adapter_kind=published.adapter.kind or "", peft_type=published.adapter.peft_type or "",
            rectification=published.rectification, base_revision=published.base_model.revision,
            adapter_revision=published.adapter.revision,
            replay=published.replay.source if published.replay is not None else None,
            output_format=published.kind, **extras,
        )

    def save(self, path: Union[str, os.PathLike]) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "MergeReport":
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def summary(self) -> str:
        lines = [
            f"adapter {self.adapter!r} ({self.adapter_kind}) on base {self.base_model!r}: "
            f"{len(self.rectified_layers)} layer(s) rectified"
            + (f", {len(self.unrectified_layers)} adapted layer(s) kept as fine-tuned"
               if self.unrectified_layers else ""),
            self.rectification.summary(),
        ]
        if self.refactorization:
            layers = self.refactorization["layers"]
            ranks = [s["rank"] for s in layers]
            kept = [s["kept_energy"] for s in layers]
            lines.append(
                f"LoRA re-factorization (rank={self.refactorization['rank']!r}): ranks {min(ranks)}..{max(ranks)}, "
                f"kept energy min {min(kept):.4f}"
            )
            for key, label in (("residual", "residual ||J0 ΔW_k||/||J0 ΔW||"),
                               ("leak", "repair given back ||J0 (ΔW_k − ΔW_rect)||/||J0 ΔW||")):
                trunc = [s[f"{key}_truncated"] for s in layers if s[f"{key}_truncated"] is not None]
                if trunc:
                    line = f"  {label}: max {max(trunc):.3g} truncated"
                    refined = [s[f"{key}_refined"] for s in layers if s[f"{key}_refined"] is not None]
                    if refined:
                        line += f", {max(refined):.3g} refined"
                    lines.append(line)
        return "\n".join(lines)


# ---- the result ------------------------------------------------------------------------------------------
@dataclass
class LayerDelta:
    """``ΔW_rect`` of one adapted layer in factor layout (``B @ A`` layout: ``(d_out, d_in)`` for linear
    layers, ``(dim, num_embeddings)`` for embeddings, as PEFT's LoRA factors them)."""

    name: str
    layer_type: str  # "linear" or "embedding"
    matrix: Tensor  # float32, CPU
    rectified: bool
    own_rank: Optional[int]
    fan_in_fan_out: bool = False
    jacobian: Optional[LayerJacobian] = None  # J0, for residuals and refinement
    reference_norm: Optional[float] = None  # ||J0 ΔW|| of the original update


class RectifiedDelta:
    """The rectified update of every adapted layer, the rectified model (base + ``ΔW_rect``) and the report.

    Returned by :meth:`JanusMerger.run`. ``model`` is the plain (non-PEFT) rectified model;
    :meth:`delta` gives ``ΔW_rect`` of one layer; :meth:`save_adapter`, :meth:`save_full` and
    :meth:`push_to_hub` write it out.
    """

    def __init__(self, model: nn.Module, effective: EffectiveModel, layers: dict[str, LayerDelta],
                 report: MergeReport, config: JanusConfig, tokenizer: Any = None,
                 max_shard_size: Optional[int] = None, *, base_ref: Optional[RepoRef] = None,
                 adapter_ref: Optional[RepoRef] = None, replay_info: Optional[ReplayInfo] = None):
        self.model = model
        self.layers = layers
        self.config = config
        self.tokenizer = tokenizer
        self._report = report
        self._effective = effective
        self._max_shard_size = max_shard_size
        # Provenance, resolved once by JanusMerger.run while the Hub (or its cache) was just used.
        self.base_ref = base_ref or RepoRef(id=report.base_model, revision=report.base_revision,
                                            local=os.path.exists(report.base_model))
        self.adapter_ref = adapter_ref or RepoRef(id=report.adapter, revision=report.adapter_revision,
                                                  local=os.path.exists(report.adapter), kind=report.adapter_kind,
                                                  peft_type=report.peft_type)
        self.replay_info = replay_info

    @property
    def report(self) -> MergeReport:
        """The :class:`MergeReport` (updated by :meth:`save_adapter` with re-factorization statistics)."""
        return self._report

    @property
    def layer_names(self) -> list[str]:
        return list(self.layers)

    def delta(self, name: str) -> Tensor:
        """``ΔW_rect`` of layer ``name`` (float32): ``(d_out, d_in)`` for linear layers (GPT-2 ``Conv1D`` too),
        the stored ``(num_embeddings, dim)`` layout for embeddings."""
        if name not in self.layers:
            raise KeyError(f"{name!r} is not an adapted layer; adapted layers: {', '.join(self.layers)}")
        layer = self.layers[name]
        return layer.matrix.T.clone() if layer.layer_type == "embedding" else layer.matrix.clone()

    # ---- re-factorization ------------------------------------------------------------------------------
    def factorize(self, rank: RankSpec = "same", energy: float = 0.99, refine: bool = False,
                  refine_iterations: int = DEFAULT_REFINE_ITERATIONS, progress: bool = True,
                  ) -> tuple[dict[str, tuple[Tensor, Tensor]], list[RefactorStats]]:
        """LoRA factors ``{layer: (A, B)}`` (float64, CPU, ``B @ A ≈ ΔW_rect``) and per-layer statistics.

        Layers whose ``ΔW_rect`` is exactly zero get rank 0 under an energy rule and are left out.
        """
        validate_rank_spec(rank, energy)
        factors: dict[str, tuple[Tensor, Tensor]] = {}
        stats: list[RefactorStats] = []
        for name, layer in tqdm(self.layers.items(), desc="Re-factorizing into LoRA", disable=not progress,
                                leave=False):
            jac = layer.jacobian
            eig = eig_psd(jac.gram(), self.config.gram_rcond) if (jac is not None and refine) else None
            a, b, st = refactor_delta(
                layer.matrix, rank, energy=energy, same_rank=layer.own_rank, jacobian=jac, eig=eig,
                reference_norm=layer.reference_norm, refine=refine and jac is not None,
                refine_iterations=refine_iterations, rcond=self.config.gram_rcond, name=name,
            )
            stats.append(st)
            if st.rank > 0:
                factors[name] = (a.cpu(), b.cpu())
        return factors, stats

    def _check_adapter_representable(self) -> None:
        eff = self._effective
        other = [n for n, info in eff.layers.items() if info.layer_type == "other"]
        if other:
            kinds = sorted({eff.layers[n].module_type for n in other})
            raise JanusError(
                f"the adapter also changes layer(s) a LoRA adapter cannot hold ({', '.join(other[:3])}: "
                f"{', '.join(kinds)}); save the full weights instead (save_full / --format full)"
            )
        if eff.changes_bias:
            raise JanusError(
                "the adapter also trains biases (bias != 'none' or lora_bias=True), which a re-factorized LoRA "
                "adapter does not hold (as peft.convert_to_lora); save the full weights instead (save_full / "
                "--format full)"
            )

    def _lora_config(self, ranks: dict[str, int]) -> Any:
        from peft import LoraConfig

        counts = Counter(ranks.values())
        default_rank = max(counts, key=lambda r: (counts[r], r))
        pattern = {n: k for n, k in ranks.items() if k != default_rank}
        src_config = self._effective.adapter.config
        return LoraConfig(
            r=default_rank, lora_alpha=default_rank, rank_pattern=pattern, alpha_pattern=dict(pattern),
            target_modules=sorted(ranks), use_rslora=False, use_dora=False, init_lora_weights=True,
            fan_in_fan_out=any(self.layers[n].fan_in_fan_out for n in ranks), bias="none",
            modules_to_save=list(getattr(src_config, "modules_to_save", None) or []) or None,
            base_model_name_or_path=self._effective.base_model, revision=self._effective.base_revision,
            task_type=getattr(src_config, "task_type", None), inference_mode=True,
        )

    def _adapter_state_dict(self, factors: dict[str, tuple[Tensor, Tensor]], dtype: torch.dtype) -> dict[str, Tensor]:
        state: dict[str, Tensor] = {}
        for name, (a, b) in factors.items():
            key = PEFT_PREFIX + name
            if self.layers[name].layer_type == "embedding":
                state[f"{key}.lora_embedding_A"] = a.to(dtype).contiguous()
                state[f"{key}.lora_embedding_B"] = b.to(dtype).contiguous()
            else:
                state[f"{key}.lora_A.weight"] = a.to(dtype).contiguous()
                state[f"{key}.lora_B.weight"] = b.to(dtype).contiguous()
        for module_name in self._effective.modules_to_save:
            module = self.model.get_submodule(module_name)
            for pname, param in module.state_dict().items():
                state[f"{PEFT_PREFIX}{module_name}.{pname}"] = param.detach().cpu().contiguous()
        return state

    def save_adapter(self, path: Union[str, os.PathLike], rank: RankSpec = "same", energy: float = 0.99,
                     refine: bool = False, *, refine_iterations: int = DEFAULT_REFINE_ITERATIONS,
                     overwrite: bool = False, dtype: torch.dtype = torch.float32, progress: bool = True) -> str:
        """Save ``ΔW_rect`` as a standard LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

        Per layer, ``ΔW_rect ≈ B @ A`` by truncated SVD with ``lora_alpha = r`` (scaling 1), as
        ``peft.convert_to_lora``; ranks that differ from the most common one go to ``rank_pattern`` /
        ``alpha_pattern``.

        Args:
            path: output directory (written atomically; an existing non-empty one needs ``overwrite``).
            rank: ``"same"`` (each layer's rank in the original adapter: ``2r`` for a converted PiSSA
                adapter), an int (the same for every layer, clipped to ``min(d_out, d_in)``), ``"auto"``
                (smallest rank keeping ``energy`` of each layer's ``||ΔW_rect||²``) or a float in (0, 1]
                (an energy threshold, as ``convert_to_lora``).
            energy: the threshold for ``rank="auto"``.
            refine: alternate between the rank-k set and the null space of the past task's Jacobian
                (:func:`hf_janus.adapters.refactor.refine_low_rank`) so that truncation gives back less of the repair.
            refine_iterations: iterations of that loop.
            dtype: dtype of the saved factors (float32 by default, as PEFT keeps adapter weights).

        Returns:
            The absolute output path. ``self.report.refactorization`` then holds per-layer kept energy and
            residuals ``||J0 ΔW_k|| / ||J0 ΔW||`` with and without refinement.
        """
        from safetensors.torch import save_file

        validate_rank_spec(rank, energy)
        self._check_adapter_representable()
        check_output_dir(path, overwrite)
        factors, stats = self.factorize(rank, energy, refine, refine_iterations, progress)
        if not factors:
            raise JanusError("every rectified layer update is zero: there is no adapter to save")
        config = self._lora_config({n: int(a.shape[0]) for n, (a, _) in factors.items()})
        state = self._adapter_state_dict(factors, dtype)
        self._report.refactorization = {
            "rank": rank, "energy": energy, "refine": refine,
            "refine_iterations": refine_iterations if refine else 0,
            "layers": [s.to_dict() for s in stats],
        }
        self._report.output_format = "adapter"
        with atomic_output_dir(path, overwrite) as tmp:
            save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
            config.save_pretrained(tmp)
            self._publish(tmp, "adapter", os.fspath(path))
        logger.info("saved the rectified adapter (%d layer(s)) to %s", len(factors), path)
        return os.path.abspath(path)

    # ---- full weights ------------------------------------------------------------------------------------
    def save_full(self, path: Union[str, os.PathLike], *, overwrite: bool = False,
                  max_shard_size: Union[int, str, None] = None) -> str:
        """Save base + ``ΔW_rect`` with ``save_pretrained`` (safetensors), sharded like the base model
        (``max_shard_size`` overrides), with the base model's tokenizer when it has one."""
        check_output_dir(path, overwrite)
        shard = max_shard_size if max_shard_size is not None else self._max_shard_size
        self._report.output_format = "full"
        with atomic_output_dir(path, overwrite) as tmp:
            kwargs: dict[str, Any] = {}
            if shard is not None:
                kwargs["max_shard_size"] = shard
            self.model.save_pretrained(tmp, **kwargs)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
            # Inside the temporary directory: the shards get their metadata before the output appears.
            self._publish(tmp, "full", os.fspath(path))
        logger.info("saved the rectified model to %s", path)
        return os.path.abspath(path)

    def published_report(self, kind: str) -> PublishedReport:
        """The ``janus_rectification.json`` record of this result saved as ``kind`` (``"adapter"``/``"full"``)."""
        self._report.output_format = kind
        return PublishedReport(kind=kind, rectification=self._report.rectification, base_model=self.base_ref,
                               adapter=self.adapter_ref, replay=self.replay_info, merge=self._report.merge_section())

    def _publish(self, folder: str, kind: str, load_id: str) -> None:
        write_publication_files(folder, self.published_report(kind), repo_id=load_id)

    def push_to_hub(self, repo_id: str, format: str = "adapter", private: Optional[bool] = None,
                    token: Union[str, bool, None] = None, commit_message: Optional[str] = None,
                    revision: Optional[str] = None, **save_kwargs: Any) -> str:
        """Upload the rectified result to the Hub repo ``repo_id`` (created if needed) in one commit.

        The output is first written as by :meth:`save_adapter` (``format="adapter"``, with ``save_kwargs`` such
        as ``rank``/``energy``/``refine``) or :meth:`save_full` (``format="full"``) into a temporary directory,
        with ``janus_rectification.json``, the model card and the safetensors metadata, then uploaded with
        :func:`hf_janus.publish.hub.push_folder`. ``revision`` is a branch (created from ``main`` if missing).

        Returns:
            The ``huggingface_hub.CommitInfo`` of the commit (a ``str``: its URL; ``.oid`` is the sha).

        Raises:
            JanusError: a bad ``format``, or a Hub failure (authentication, unreachable Hub, ...), with the fix.
        """
        if format not in ("adapter", "full"):
            raise JanusError(f"format must be 'adapter' or 'full', got {format!r}")
        with tempfile.TemporaryDirectory(prefix="hf-janus-push-") as tmp:
            out = os.path.join(tmp, "out")
            if format == "adapter":
                self.save_adapter(out, **save_kwargs)
            else:
                self.save_full(out, **save_kwargs)
            return push_folder(out, repo_id, private=private, token=token, revision=revision,
                               commit_message=commit_message or f"JANUS-rectified {format} of {self._report.adapter}")


def push_folder_to_hub(folder: Union[str, os.PathLike], repo_id: str, *, private: Optional[bool] = None,
                       token: Union[str, bool, None] = None, revision: Optional[str] = None,
                       commit_message: str = "Upload JANUS-rectified weights") -> str:
    """Create ``repo_id`` if needed and upload ``folder`` in one commit; returns the commit URL (a
    ``CommitInfo``). Kept for the command line; see :func:`hf_janus.publish.hub.push_folder`."""
    return push_folder(folder, repo_id, private=private, token=token, revision=revision,
                       commit_message=commit_message)


# ---- the merger ------------------------------------------------------------------------------------------
def _base_max_shard_size(base_model: str, revision: Optional[str], model: nn.Module) -> Optional[int]:
    """A ``max_shard_size`` that shards like the base checkpoint: its largest shard, in bytes, or one file."""
    try:
        from transformers.utils import cached_file

        index = cached_file(base_model, "model.safetensors.index.json", revision=revision,
                            _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
    except Exception:  # pragma: no cover - no way to tell; transformers' default then
        return None
    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    if not index:
        return 2 * total + (1 << 20)  # the base is one file: keep it one file
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh).get("weight_map", {})
    except (OSError, ValueError):
        return None
    sizes: Counter = Counter()
    for key, filename in weight_map.items():
        tensor = state.get(key)
        if tensor is not None:
            sizes[filename] += tensor.numel() * tensor.element_size()
    return max(sizes.values()) if sizes else None


def _select_targets(effective: EffectiveModel, config: JanusConfig) -> list[str]:
    """The adapted linear layers to rectify, narrowed by ``config.target_modules``/``exclude_modules``."""
    linear = effective.linear_layers
    if not linear:
        raise JanusError(
            f"adapter {effective.adapter.name!r} changes no linear layer (only "
            f"{', '.join(sorted({l.module_type for l in effective.layers.values()}))}); JANUS rectifies linear layers"
        )
    candidates = linear
    if config.target_modules != "all-linear":
        chosen = resolve_target_modules(effective.model, config.target_modules)
        candidates = [n for n in linear if n in chosen]
    if candidates and config.exclude_modules:
        try:
            kept = resolve_target_modules(effective.model, candidates, config.exclude_modules)
        except JanusError:  # everything excluded: said below, with the adapted layers named
            kept = {}
        candidates = [n for n in candidates if n in kept]
    if not candidates:
        raise JanusError(
            f"none of the adapted layers ({', '.join(linear[:4])}{', ...' if len(linear) > 4 else ''}) is selected "
            f"by target_modules={config.target_modules!r} / exclude_modules={config.exclude_modules!r}"
        )
    return candidates


class JanusMerger:
    """Rectify a saved PEFT adapter against forgetting of a past task (JANUS), from the Hub or from disk.

    Args:
        base_model: Hub repo id or local directory of the base model the adapter was trained on.
        adapter: Hub repo id or local directory of the PEFT adapter (LoRA, rsLoRA, rank/alpha patterns,
            DoRA, PiSSA converted or not, LoHa, LoKr, IA3, ... anything PEFT can merge).
        replay: past-task samples: a list of dicts / ``datasets.Dataset`` / ``DataLoader`` as
            :func:`hf_janus.rectify` takes, or a string: a Hub dataset id, a jsonl/json/parquet/csv file or
            a ``datasets`` directory, optionally ``SOURCE:SPLIT`` (tokenized with the base model's
            tokenizer, see :mod:`hf_janus.replay.sources`).
        config: :class:`JanusConfig`. Its ``target_modules``/``exclude_modules`` can only narrow the set
            of adapted layers (see the module docstring).
        revision: revision of the adapter repo (``base_revision`` for the base model).
        torch_dtype: dtype to load the base model in (default: the checkpoint's); float32 is the most
            exact for rectification.
        device: device for the model and the Jacobian computations.
        initial_adapter: for an unconverted PiSSA-like adapter with a randomized/data-dependent init, the
            adapter saved right after initialization (see :mod:`hf_janus.adapters.loading`).
        allow_base_mismatch: warn instead of failing when the adapter names a different base model.
        tokenizer: tokenizer for string replay (default: the base model's).
        replay_format, text_field, prompt_field, response_field, max_length, num_samples, replay_split:
            how string replay is read (:func:`hf_janus.replay.sources.load_replay`).
        token: Hub token (default: the logged-in one).
        progress: show progress bars.
    """

    def __init__(self, base_model: Union[str, os.PathLike], adapter: Union[str, os.PathLike], replay: Any,
                 config: Optional[JanusConfig] = None, revision: Optional[str] = None,
                 torch_dtype: DTypeLike = None, device: Union[str, torch.device, None] = None, *,
                 base_revision: Optional[str] = None, initial_adapter: Union[str, os.PathLike, None] = None,
                 allow_base_mismatch: bool = False, tokenizer: Any = None, replay_format: str = "auto",
                 text_field: str = "text", prompt_field: str = "prompt", response_field: str = "response",
                 max_length: int = DEFAULT_MAX_LENGTH, num_samples: Optional[int] = DEFAULT_NUM_SAMPLES,
                 replay_split: Optional[str] = None, token: Union[str, bool, None] = None, progress: bool = True):
        if config is not None and not isinstance(config, JanusConfig):
            raise JanusError(f"config must be a JanusConfig, got {type(config).__name__}")
        if replay is None:
            raise JanusError("replay is None: pass samples of the past task (a dataset id, file, Dataset or list)")
        if isinstance(replay, (list, tuple)) and len(replay) == 0:
            raise JanusError("replay is empty: JANUS needs samples of the past task (typically ~256)")
        self.base_model = os.fspath(base_model)
        self.adapter = os.fspath(adapter)
        self.replay = replay
        self.config = config if config is not None else JanusConfig()
        self.revision = revision
        self.base_revision = base_revision
        self.torch_dtype = torch_dtype
        self.device = device
        self.initial_adapter = initial_adapter
        self.allow_base_mismatch = allow_base_mismatch
        self.tokenizer = tokenizer
        self.replay_kwargs = dict(format=replay_format, text_field=text_field, prompt_field=prompt_field,
                                  response_field=response_field, max_length=max_length, num_samples=num_samples,
                                  split=replay_split)
        self.token = token
        self.progress = progress

    def _load_tokenizer(self) -> Any:
        if self.tokenizer is not None:
            return self.tokenizer
        try:
            from transformers import AutoTokenizer

            kwargs: dict[str, Any] = {"revision": self.base_revision} if self.base_revision else {}
            if self.token is not None:
                kwargs["token"] = self.token
            return AutoTokenizer.from_pretrained(self.base_model, **kwargs)
        except Exception as err:  # a base without tokenizer files is fine for pre-tokenized replay
            logger.info("no tokenizer for %r (%s: %s)", self.base_model, type(err).__name__, err)
            return None

    def _load_replay(self, tokenizer: Any) -> tuple[Any, ReplayInfo]:
        """The replay samples and their description (id, split, fingerprint, size) for the published record."""
        if not isinstance(self.replay, (str, os.PathLike)):
            return self.replay, describe_replay(self.replay)
        # hf_janus.replay.sources.load_replay, unrolled to keep the dataset for its fingerprint and size.
        source = os.fspath(self.replay)
        kwargs = dict(self.replay_kwargs)
        split = kwargs.pop("split")
        name, spec_split = parse_replay_spec(source)
        if split is not None and spec_split is not None and split != spec_split:
            raise JanusError(f"replay {source!r} names split {spec_split!r} but split={split!r} was also given")
        dataset = load_replay_dataset(name, split or spec_split, token=self.token)
        samples = tokenize_replay(dataset, tokenizer, source=source, **kwargs)
        return samples, describe_replay(dataset, source=source, split=split or spec_split, token=self.token)

    def run(self) -> RectifiedDelta:
        """Load, merge, rectify. The replay is read first, so that bad replay fails before the model loads."""
        tokenizer = self._load_tokenizer()
        replay, replay_info = self._load_replay(tokenizer)
        effective = load_effective_model(
            self.base_model, self.adapter, revision=self.revision, base_revision=self.base_revision,
            torch_dtype=self.torch_dtype, device=self.device, initial_adapter=self.initial_adapter,
            allow_base_mismatch=self.allow_base_mismatch, token=self.token, progress=self.progress,
        )
        targets = _select_targets(effective, self.config)
        config = dataclasses.replace(self.config, target_modules=list(targets), exclude_modules=None)
        reference = {k: v for k, v in effective.reference.items() if k[: -len(".weight")] in targets}
        rectifier = Rectifier(effective.model, reference, replay, config, progress=self.progress,
                              keep_reference_factors=True)
        del reference
        rect_report = rectifier.run()

        layers: dict[str, LayerDelta] = {}
        with torch.no_grad():
            for layer in rectifier.layers:
                jac = rectifier.reference_jacobians.get(layer.name)
                original = layer.finetuned() - layer.reference
                info = effective.layers[layer.name]
                layers[layer.name] = LayerDelta(
                    name=layer.name, layer_type="linear", matrix=(layer.current - layer.reference).float().cpu(),
                    rectified=True, own_rank=info.rank, fan_in_fan_out=info.fan_in_fan_out, jacobian=jac,
                    reference_norm=float(jac.jvp(original).norm()) if jac is not None else None,
                )
                effective.reference.pop(layer.name + ".weight", None)
            for name, info in effective.layers.items():
                if name in layers or info.layer_type == "other":
                    continue
                weight = effective.model.get_submodule(name).weight.detach()
                ref = effective.reference.pop(name + ".weight")
                if info.layer_type == "linear":
                    rule = rule_for(effective.model.get_submodule(name))
                    matrix = rule.to_matrix(weight).float().cpu() - rule.to_matrix(ref).float()
                else:  # embedding: PEFT factors its (num_embeddings, dim) update as (B @ A)ᵀ
                    matrix = (weight.float().cpu() - ref.float()).T.contiguous()
                layers[name] = LayerDelta(name=name, layer_type=info.layer_type, matrix=matrix, rectified=False,
                                          own_rank=info.rank, fan_in_fan_out=info.fan_in_fan_out)
        del rectifier
        unrectified = [n for n in effective.layers if n not in targets]
        replay_name = os.fspath(self.replay) if isinstance(self.replay, (str, os.PathLike)) else None
        report = MergeReport(
            base_model=self.base_model, adapter=self.adapter, adapter_kind=effective.adapter.kind,
            peft_type=effective.adapter.peft_type, rectification=rect_report, rectified_layers=list(targets),
            unrectified_layers=unrectified, modules_to_save=list(effective.modules_to_save),
            base_revision=self.base_revision, adapter_revision=self.revision, replay=replay_name,
        )
        if unrectified:
            logger.info("adapted layer(s) kept at their fine-tuned value: %s", ", ".join(unrectified))
        shard = _base_max_shard_size(self.base_model, self.base_revision, effective.model)
        base_ref = resolve_repo(self.base_model, self.base_revision, token=self.token)
        adapter_ref = resolve_repo(self.adapter, self.revision, token=self.token, local_path=effective.adapter.path)
        adapter_ref.kind, adapter_ref.peft_type = effective.adapter.kind, effective.adapter.peft_type
        return RectifiedDelta(effective.model, effective, layers, report, config, tokenizer, shard,
                              base_ref=base_ref, adapter_ref=adapter_ref, replay_info=replay_info)


def merge_adapter(base_model: Union[str, os.PathLike], adapter: Union[str, os.PathLike], replay: Any,
                  config: Optional[JanusConfig] = None, **kwargs: Any) -> RectifiedDelta:
    """Shorthand for ``JanusMerger(base_model, adapter, replay, config, **kwargs).run()``."""
    return JanusMerger(base_model, adapter, replay, config, **kwargs).run()
