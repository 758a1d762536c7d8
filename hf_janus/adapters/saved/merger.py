"""Rectify a saved PEFT adapter with JANUS and save the result as a LoRA adapter or as full weights.

    merger = JanusMerger("org/base", "org/adapter", replay="org/past-task:train")
    delta = merger.run()                      # ΔW_rect per adapted layer, the rectified model, the report
    delta.save_adapter("out-adapter", adapter_rank="same", refine=True)
    delta.save_full("out-full")

:class:`JanusMerger` builds the effective model with :mod:`hf_janus.adapters.saved.effective` (base loaded once, the
adapter merged into it layer by layer by PEFT, ``θ0`` = the base weights of the adapted layers only), runs
:class:`hf_janus.Rectifier` on exactly the adapted linear layers, and returns a :class:`RectifiedDelta`.
:meth:`RectifiedDelta.save_adapter` re-factorizes each ``ΔW_rect`` with :mod:`hf_janus.adapters.low_rank` into a
standard LoRA adapter that stock ``PeftModel.from_pretrained`` loads; :meth:`RectifiedDelta.save_full`
writes base + ``ΔW_rect`` with ``save_pretrained``. Every output is written atomically (temporary directory
+ rename) and published with :mod:`hf_janus.publish`: ``janus_rectification.json`` (base model and adapter with
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
from collections import Counter
from typing import Any, Optional, Union

import torch
from torch import nn

from hf_janus.adapters.saved.delta import LayerDelta, RectifiedDelta
from hf_janus.adapters.saved.effective import EffectiveModel, load_effective_model
from hf_janus.adapters.saved.factor_repair import factor_numel, factor_repair_blocker, repair_in_factors
from hf_janus.adapters.saved.loading import DTypeLike, describe_quantization, load_base_model
from hf_janus.adapters.saved.merge_report import MergeReport
from hf_janus.engine.config import DEFAULT_ADAPTER_DISTILL_LR, JanusConfig
from hf_janus.engine.layers import rule_for, select_layers
from hf_janus.engine.rectifier import Rectifier, WeightSource
from hf_janus.engine.result import RectificationResult
from hf_janus.errors import JanusError
from hf_janus.io_utils import is_local
from hf_janus.publish.provenance import ReplayInfo, describe_replay, resolve_repo
from hf_janus.replay.resolve import resolve_new_task, resolve_replay
from hf_janus.replay.sources import ReplayOptions

logger = logging.getLogger(__name__)


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
            f"{', '.join(sorted({layer.module_type for layer in effective.layers.values()}))}); "
            "JANUS rectifies linear layers"
        )
    return select_layers(linear, config.target_modules, config.exclude_modules)


class JanusMerger:
    """Rectify a saved PEFT adapter against forgetting of a past task (JANUS), from the Hub or from disk.

    Args:
        base_model: Hub repo id or local directory of the base model the adapter was trained on.
        adapter: Hub repo id or local directory of the PEFT adapter (LoRA, rsLoRA, rank/alpha patterns,
            DoRA, PiSSA converted or not, LoHa, LoKr, IA3, ... anything PEFT can merge).
        replay: past-task samples: a list of dicts / ``datasets.Dataset`` / ``DataLoader`` as
            :func:`hf_janus.rectify` takes, or a string: a Hub dataset id, a jsonl/json/parquet/csv file or
            a ``datasets`` directory, optionally ``SOURCE:SPLIT`` (tokenized with the base model's
            tokenizer, see :mod:`hf_janus.replay.sources`), or a :class:`~hf_janus.SelfReplay`: the base model
            (θ0, never the adapted model) answers its prompts, with the base model's tokenizer.
        config: :class:`JanusConfig`. Its ``target_modules``/``exclude_modules`` can only narrow the set
            of adapted layers (see the module docstring).
        revision: revision of the adapter repo (``base_revision`` for the base model).
        torch_dtype: dtype to load the base model in (default: the checkpoint's). The update is rectified in
            float32 whatever it is; only full weights saved in bf16 or fp16 are rounded to it.
        device: device for the model and the Jacobian computations.
        initial_adapter: for an unconverted PiSSA-like adapter with a randomized/data-dependent init, the
            adapter saved right after initialization (see :mod:`hf_janus.adapters.saved.effective`).
        allow_base_mismatch: warn instead of failing when the adapter names a different base model.
        tokenizer: tokenizer for string replay (default: the base model's).
        replay_options: how string replay is read and tokenized (:class:`~hf_janus.replay.sources.ReplayOptions`:
            format, columns, ``max_length``, ``num_samples``, split).
        token: Hub token (default: the logged-in one).
        progress: show progress bars.
        quantization_config: load the base quantized, as ``from_pretrained`` takes it (a
            ``BitsAndBytesConfig``): rectify a QLoRA adapter against the quantized base it was trained on. The
            result can then be saved as an adapter only (see docs/guides/adapters-and-qlora.md).
        new_task_samples: what the adapter was trained on, for the repair after JANUS (``config.distill_steps``):
            samples as ``replay`` takes them (labelled; a file or dataset id is read with ``replay_options``, and
            prompt/response data counts the response only). The repair fits them and keeps ``config.keep_gain`` of
            their gain; without them it is skipped (logged, and the record and card say so). A plain LoRA's repair
            trains its own factors at its rank (:mod:`hf_janus.adapters.saved.factor_repair`; ``distill_lr``
            defaults to ``DEFAULT_ADAPTER_DISTILL_LR`` there), other kinds' the adapted layers' dense weights.
        new_task_validation: samples of the new task that training never saw (a Trainer's ``eval_dataset``), read as
            ``new_task_samples`` is, to measure the gain the repair keeps on; without them every eighth of
            ``new_task_samples`` is held out, on which the gain kept runs above a test set's.
        allow_pickle: accept weights stored only as a pickle (``adapter_model.bin`` of the adapter or of
            ``initial_adapter``, ``pytorch_model.bin`` of the base). They are refused by default, because
            unpickling can run code; with ``True`` they are read with torch's restricted unpickler
            (``torch.load(weights_only=True)``). Safetensors files are always preferred when both exist.
    """

    def __init__(self, base_model: Union[str, os.PathLike], adapter: Union[str, os.PathLike], replay: Any,
                 config: Optional[JanusConfig] = None, revision: Optional[str] = None,
                 torch_dtype: DTypeLike = None, device: Union[str, torch.device, None] = None, *,
                 base_revision: Optional[str] = None, initial_adapter: Union[str, os.PathLike, None] = None,
                 allow_base_mismatch: bool = False, tokenizer: Any = None,
                 replay_options: Optional[ReplayOptions] = None, token: Union[str, bool, None] = None,
                 progress: bool = True, quantization_config: Any = None, allow_pickle: bool = False,
                 new_task_samples: Any = None, new_task_validation: Any = None):
        if config is not None and not isinstance(config, JanusConfig):
            raise JanusError(f"config must be a JanusConfig, got {type(config).__name__}")
        if replay is None:
            raise JanusError("replay is None: pass samples of the past task (a dataset id, file, Dataset or list)")
        if isinstance(replay, (list, tuple)) and len(replay) == 0:
            raise JanusError("replay is empty: JANUS needs samples of the past task (typically ~256)")
        if not isinstance(allow_pickle, bool):  # a truthy string such as "no" must not open the pickle path
            raise JanusError(f"allow_pickle must be True or False, got {allow_pickle!r}")
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
        self.replay_options = replay_options if replay_options is not None else ReplayOptions()
        self.token = token
        self.progress = progress
        self.quantization_config = quantization_config
        self.allow_pickle = allow_pickle
        self.new_task_samples = new_task_samples
        if new_task_validation is not None and new_task_samples is None:
            raise JanusError("new_task_validation measures the gain of the repair after JANUS, which fits "
                             "new_task_samples: give those too (--new-task-samples)")
        self.new_task_validation = new_task_validation

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
        """The replay samples and their description (id, split, fingerprint, size) for the published record. θ0's
        answers, for a :class:`~hf_janus.SelfReplay`, come from the base model loaded on its own (the adapted model
        is θ̂), freed before the adapter is merged, so that the two never share memory."""
        def base() -> Any:
            return load_base_model(self.base_model, self.base_revision, self.torch_dtype, self.device, self.token,
                                   self.quantization_config, allow_pickle=self.allow_pickle)

        resolved = resolve_replay(self.replay, reference=base, tokenizer=tokenizer, options=self.replay_options,
                                  token=self.token, progress=self.progress)
        return resolved.samples, describe_replay(resolved.described, source=resolved.source, split=resolved.split,
                                                 token=self.token)

    def _load_new_task(self, tokenizer: Any) -> tuple[Any, Any]:
        """The new task's samples and validation samples for the repair, read as a replay given by name is; None
        without a repair."""
        if not self.config.distill_steps:
            return None, None
        return tuple(resolve_new_task(samples, tokenizer=tokenizer, options=self.replay_options, token=self.token)
                     for samples in (self.new_task_samples, self.new_task_validation))

    def _repairs_in_factors(self, effective: EffectiveModel, new_task: Any) -> bool:
        """Whether the repair after JANUS trains the adapter's own factors (a plain LoRA), not the dense weights."""
        if not self.config.distill_steps or new_task is None:
            return False
        blocker = factor_repair_blocker(effective)
        if blocker is not None:
            logger.info("JANUS: the repair trains the adapted layers' dense weights, not the adapter's factors: %s",
                        blocker)
        return blocker is None

    def run(self) -> RectifiedDelta:
        """Load, merge, rectify. The replay is read first, so that bad replay fails before the model loads."""
        base = os.path.expanduser(os.fspath(self.base_model))
        if is_local(base) and not os.path.isdir(base):
            # Checked first: a missing base would otherwise surface as "no tokenizer" for text replay.
            raise JanusError(f"base model {os.fspath(self.base_model)!r} is not a directory: pass the folder the base "
                             "model was saved to (save_pretrained), or its Hub repo id")
        tokenizer = self._load_tokenizer()
        replay, replay_info = self._load_replay(tokenizer)
        new_task, new_task_validation = self._load_new_task(tokenizer)
        effective = load_effective_model(
            self.base_model, self.adapter, revision=self.revision, base_revision=self.base_revision,
            torch_dtype=self.torch_dtype, device=self.device, initial_adapter=self.initial_adapter,
            allow_base_mismatch=self.allow_base_mismatch, token=self.token, progress=self.progress,
            quantization_config=self.quantization_config, allow_pickle=self.allow_pickle,
        )
        targets = _select_targets(effective, self.config)
        config = dataclasses.replace(self.config, target_modules=list(targets), exclude_modules=None)
        reference = {k: v for k, v in effective.reference.items() if k[: -len(".weight")] in targets}
        # ΔW in float32 from PEFT's float32 merge, not from the model's weights (rounded on a bf16 base)
        finetuned = {k: v for k, v in effective.finetuned.items() if k[: -len(".weight")] in targets}
        in_factors = self._repairs_in_factors(effective, new_task)
        if in_factors and config.distill_lr is None:  # a LoRA's factors train at a LoRA's rate
            config = dataclasses.replace(config, distill_lr=DEFAULT_ADAPTER_DISTILL_LR)
        rectifier = Rectifier(effective.model, WeightSource(reference, finetuned=finetuned), replay, config,
                              progress=self.progress, keep_reference_factors=True, new_task=new_task,
                              new_task_validation=new_task_validation, defer_repair=in_factors,
                              repair_numel=factor_numel(effective, targets) if in_factors else None)
        del reference, finetuned
        result = rectifier.run()
        rect_report = result.report
        repaired = repair_in_factors(effective, rectifier, result) if in_factors else None
        del rectifier

        layers = _layer_deltas(effective, result)
        del result
        if repaired is not None:
            rect_report.repair = repaired.report
            for name, delta in repaired.deltas.items():
                layers[name].matrix = delta
        unrectified = [n for n in effective.layers if n not in targets]
        replay_name = os.fspath(self.replay) if isinstance(self.replay, (str, os.PathLike)) else None
        report = MergeReport(
            base_model=self.base_model, adapter=self.adapter, adapter_kind=effective.adapter.kind,
            peft_type=effective.adapter.peft_type, rectification=rect_report, rectified_layers=list(targets),
            unrectified_layers=unrectified, modules_to_save=list(effective.modules_to_save),
            base_revision=self.base_revision, adapter_revision=self.revision, replay=replay_name,
            base_quantization=describe_quantization(self.quantization_config),
        )
        if unrectified:
            logger.info("adapted layer(s) kept at their fine-tuned value: %s", ", ".join(unrectified))
        shard = _base_max_shard_size(self.base_model, self.base_revision, effective.model)
        base_ref = resolve_repo(self.base_model, self.base_revision, token=self.token, licence=True)
        adapter_ref = resolve_repo(self.adapter, self.revision, token=self.token, local_path=effective.adapter.path)
        adapter_ref.kind, adapter_ref.peft_type = effective.adapter.kind, effective.adapter.peft_type
        return RectifiedDelta(effective.model, effective, layers, report, config, tokenizer, shard,
                              base_ref=base_ref, adapter_ref=adapter_ref, replay_info=replay_info)


def _layer_deltas(effective: EffectiveModel, result: RectificationResult) -> dict[str, LayerDelta]:
    """ΔW_rect of every rectified layer and ΔW of every other adapted layer (linear or embedding), float32, on
    the CPU; θ0 of each leaves ``effective`` as its delta is formed."""
    layers: dict[str, LayerDelta] = {}
    with torch.no_grad():
        for name, layer in result.layers.items():
            info = effective.layers[name]
            layers[name] = LayerDelta(
                name=name, layer_type="linear", matrix=layer.rect_delta().float().cpu(), rectified=True,
                own_rank=info.rank, fan_in_fan_out=info.fan_in_fan_out, jacobian=layer.jacobian,
                jvp0_norm=layer.jvp0_norm(),
            )
            effective.reference.pop(name + ".weight", None)
        for name, info in effective.layers.items():
            if name in layers or info.layer_type == "other":
                continue
            delta = effective.delta(name)  # float32, native layout, from the exact θ̂ where there is one
            effective.reference.pop(name + ".weight")
            if info.layer_type == "linear":
                matrix = rule_for(effective.model.get_submodule(name)).to_matrix(delta).contiguous()
            else:  # embedding: PEFT factors its (num_embeddings, dim) update as (B @ A)ᵀ
                matrix = delta.T.contiguous()
            layers[name] = LayerDelta(name=name, layer_type=info.layer_type, matrix=matrix, rectified=False,
                                      own_rank=info.rank, fan_in_fan_out=info.fan_in_fan_out)
    return layers
