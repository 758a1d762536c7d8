"""``RectifiedDelta``: the rectified update of every adapted layer, saved as a LoRA adapter (re-factorized by
truncated SVD) or as full weights, with the publication record, locally or on the Hub."""

from __future__ import annotations

import logging
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from hf_janus.adapters.low_rank import (
    DEFAULT_REFINE_ITERATIONS,
    RankSpec,
    RefactorStats,
    refactor_delta,
    validate_rank_spec,
)
from hf_janus.adapters.saved.effective import EffectiveModel
from hf_janus.adapters.saved.loading import PEFT_PREFIX
from hf_janus.adapters.saved.merge_report import MergeReport
from hf_janus.engine.config import JanusConfig
from hf_janus.engine.public import LayerJacobian, eig_psd
from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_output_dir, check_output_dir
from hf_janus.publish.files import write_publication_files
from hf_janus.publish.hub import push_folder
from hf_janus.publish.provenance import ReplayInfo, RepoRef
from hf_janus.publish.record_file import PublishedReport

logger = logging.getLogger(__name__)


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
    jvp0_norm: Optional[float] = None  # ||J0 ΔW|| of the original update


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
    def inputs(self) -> dict[str, Optional[str]]:
        """The local files and folders this result was made from, which its outputs must never overwrite."""
        replay = self.replay_info
        return {
            "base model": self.base_ref.id if self.base_ref.local else None,
            "adapter": self.adapter_ref.id if self.adapter_ref.local else None,
            "replay data": replay.id if replay is not None and replay.local else None,
        }

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
    def factorize(self, adapter_rank: RankSpec = "same", adapter_energy: float = 0.99, refine: bool = False,
                  refine_iterations: int = DEFAULT_REFINE_ITERATIONS, progress: bool = True,
                  ) -> tuple[dict[str, tuple[Tensor, Tensor]], list[RefactorStats]]:
        """LoRA factors ``{layer: (A, B)}`` (float64, CPU, ``B @ A ≈ ΔW_rect``) and per-layer statistics.

        Layers whose ``ΔW_rect`` is exactly zero get rank 0 under an energy rule and are left out.
        """
        validate_rank_spec(adapter_rank, adapter_energy)
        factors: dict[str, tuple[Tensor, Tensor]] = {}
        stats: list[RefactorStats] = []
        for name, layer in tqdm(self.layers.items(), desc="Re-factorizing into LoRA", disable=not progress,
                                leave=False):
            jac = layer.jacobian
            eig = eig_psd(jac.gram(), self.config.gram_rcond) if (jac is not None and refine) else None
            a, b, st = refactor_delta(
                layer.matrix, adapter_rank, energy=adapter_energy, same_rank=layer.own_rank, jacobian=jac, eig=eig,
                jvp0_norm=layer.jvp0_norm, refine=refine and jac is not None,
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
                "the adapter also trains the base layers' biases (bias != 'none'), which a re-factorized LoRA "
                "adapter does not hold (as peft.convert_to_lora); save the full weights instead (save_full / "
                "--format full), or train with bias='none' (lora_bias=True is kept)"
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
            lora_bias=bool(self._effective.lora_biases),
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
                bias = self._effective.lora_biases.get(f"{name}.bias")
                if bias is not None:  # lora_alpha = r: scaling 1, so lora_B.bias is the whole bias term
                    state[f"{key}.lora_B.bias"] = bias.to(dtype).contiguous()
        for module_name in self._effective.modules_to_save:
            module = self.model.get_submodule(module_name)
            for pname, param in module.state_dict().items():
                state[f"{PEFT_PREFIX}{module_name}.{pname}"] = param.detach().cpu().contiguous()
        return state

    def save_adapter(self, path: Union[str, os.PathLike], adapter_rank: RankSpec = "same",
                     adapter_energy: float = 0.99, refine: bool = False, *,
                     refine_iterations: int = DEFAULT_REFINE_ITERATIONS, overwrite: bool = False,
                     dtype: torch.dtype = torch.float32, progress: bool = True) -> str:
        """Save ``ΔW_rect`` as a standard LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

        Per layer, ``ΔW_rect ≈ B @ A`` by truncated SVD with ``lora_alpha = r`` (scaling 1), as
        ``peft.convert_to_lora``; ranks that differ from the most common one go to ``rank_pattern`` /
        ``alpha_pattern``.

        Args:
            path: output directory (written atomically; an existing non-empty one needs ``overwrite``).
            adapter_rank: the LoRA rank: ``"same"`` (each layer's rank in the original adapter: ``2r`` for a
                converted PiSSA adapter), an int (the same for every layer, clipped to ``min(d_out, d_in)``), ``"auto"``
                (smallest rank keeping ``adapter_energy`` of each layer's ``||ΔW_rect||²``) or a float in (0, 1]
                (an energy threshold, as ``convert_to_lora``).
            adapter_energy: the threshold for ``adapter_rank="auto"``.
            refine: alternate between the rank-k set and the null space of the past task's Jacobian
                (:func:`hf_janus.adapters.low_rank.refine_low_rank`) so that truncation gives back less of the repair.
            refine_iterations: iterations of that loop.
            dtype: dtype of the saved factors (float32 by default, as PEFT keeps adapter weights).

        Returns:
            The absolute output path. ``self.report.refactorization`` then holds per-layer kept energy and
            residuals ``||J0 ΔW_k|| / ||J0 ΔW||`` with and without refinement.
        """
        from safetensors.torch import save_file

        validate_rank_spec(adapter_rank, adapter_energy)
        self._check_adapter_representable()
        check_output_dir(path, overwrite, self.inputs)
        factors, stats = self.factorize(adapter_rank, adapter_energy, refine, refine_iterations, progress)
        for bias_key in self._effective.lora_biases:  # a layer whose update vanished still holds its LoRA bias
            name = bias_key.removesuffix(".bias")
            if name not in factors and name in self.layers:
                d_out, d_in = self.layers[name].matrix.shape
                factors[name] = (torch.zeros(1, d_in, dtype=torch.float64), torch.zeros(d_out, 1, dtype=torch.float64))
        if not factors:
            raise JanusError("every rectified layer update is zero: there is no adapter to save")
        config = self._lora_config({n: int(a.shape[0]) for n, (a, _) in factors.items()})
        state = self._adapter_state_dict(factors, dtype)
        self._report.refactorization = {
            "adapter_rank": adapter_rank, "adapter_energy": adapter_energy, "refine": refine,
            "refine_iterations": refine_iterations if refine else 0,
            "layers": [s.to_dict() for s in stats],
        }
        self._report.output_format = "adapter"
        with atomic_output_dir(path, overwrite, self.inputs) as tmp:
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
        if self._effective.quantized:
            raise JanusError(
                "save_full() is not available for a quantized base: its other layers are quantized and the adapted "
                "ones dense, a mixture no loader expects. Save the rectified adapter (save_adapter), or rectify "
                "against the full-precision base (without quantization_config) to get full weights"
            )
        check_output_dir(path, overwrite, self.inputs)
        shard = max_shard_size if max_shard_size is not None else self._max_shard_size
        self._report.output_format = "full"
        with atomic_output_dir(path, overwrite, self.inputs) as tmp:
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
        as ``adapter_rank``/``adapter_energy``/``refine``) or :meth:`save_full` (``format="full"``) into a temporary
        directory,
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
