"""``JanusCallback``: snapshot θ0 when ``Trainer`` starts, rectify with JANUS when it ends.

Full fine-tuning of a plain model and PEFT training (LoRA and its variants: rsLoRA, DoRA, PiSSA, OLoRA, ...)
are covered, in one process or under DDP (each rank captures its share of the replay; every rank ends with
identical weights), including ``resume_from_checkpoint`` (the θ0 snapshot travels with every checkpoint).
For a PEFT model θ0 is the *effective* weight of each adapted layer at train begin (base + the adapter's
initial delta, which is non-zero for PiSSA-like inits). Full fine-tuning of a model sharded with FSDP2
(``fully_shard``, DTensor weights) or with DeepSpeed ZeRO-3 (partitioned parameters) works as under DDP: θ0
is gathered whole to the host. DeepSpeed ZeRO stages 0-2, FSDP1 and PEFT models sharded with FSDP2 or trained
with DeepSpeed are refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

import torch
from torch import Tensor, nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_janus.adapters.loading import _MUTATING_INITS
from hf_janus.config import JanusConfig
from hf_janus.errors import JanusError, RectificationError
from hf_janus.engine.layers import resolve_target_modules, rule_for
from hf_janus.adapters.live_peft import (
    adapted_linear_layers,
    check_adapter_writable,
    effective_weights,
    inner_model,
    is_peft_model,
    plain_view,
    record_rank_pattern,
    set_base_weight,
    validate_peft_output,
    write_lora,
)
from hf_janus.engine.rectifier import Rectifier
from hf_janus.engine.report import RectificationReport
from hf_janus.parallel.sharding import check_sharding, full_weight, is_sharded, is_zero3, is_zero3_param

logger = logging.getLogger(__name__)

# The leading "_" keeps it out of trainer.push_to_hub() uploads (Trainer ignores "_*" there).
SNAPSHOT_NAME = "_janus_theta0.safetensors"
REPORT_NAME = "janus_rectification.json"


def atomic_save_safetensors(tensors: dict[str, Tensor], path: str) -> None:
    """Write a safetensors file through a temporary name and ``os.replace``: never a half-written file."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _lora_state(module: nn.Module, adapter: str) -> dict[str, Any]:
    """What :func:`write_lora` may change in one layer, for putting it back after a failure."""
    state = {"A": module.lora_A[adapter], "B": module.lora_B[adapter], "r": module.r[adapter],
             "scaling": module.scaling[adapter],
             "A_weight": module.lora_A[adapter].weight.detach().clone(),
             "B_weight": module.lora_B[adapter].weight.detach().clone()}
    magnitude = getattr(module, "lora_magnitude_vector", {})
    if adapter in magnitude:
        state["magnitude"] = magnitude[adapter].weight.detach().clone()
    return state


def _restore_lora(module: nn.Module, state: dict[str, Any]) -> None:
    adapter = module.active_adapters[0]
    with torch.no_grad():
        module.lora_A[adapter], module.lora_B[adapter] = state["A"], state["B"]
        module.r[adapter], module.scaling[adapter] = state["r"], state["scaling"]
        state["A"].weight.copy_(state["A_weight"])
        state["B"].weight.copy_(state["B_weight"])
        if "magnitude" in state:
            module.lora_magnitude_vector[adapter].weight.copy_(state["magnitude"])


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


class JanusCallback(TrainerCallback):
    """Rectify the fine-tuned weights at the end of ``trainer.train()`` so the model forgets less.

    Args:
        replay: samples of the past task (``datasets.Dataset``, list of dicts or ``DataLoader``) with
            ``input_ids`` (and ``attention_mask``, optional ``labels``); a dataset with a ``text`` column
            is tokenized with the trainer's tokenizer.
        config: :class:`JanusConfig` (defaults to τ=0.95, β=0.7, r=32).
        snapshot: where θ0 is kept during training: ``"cpu"`` (host memory) or ``"disk"`` (a safetensors
            file in ``args.output_dir``). θ0 never stays on the accelerator.
        on_error: ``"raise"`` (default) or ``"warn"``: on failure the model keeps its fine-tuned weights
            either way; ``"warn"`` logs the error and lets training finish normally.
        trainer: optional ``Trainer``; when given, the rectification steps are logged with ``trainer.log``
            so every reporting integration (wandb, tensorboard, ...) receives them. Required for
            ``peft_output="merged"`` (the merged model replaces ``trainer.model``).
        peft_output: for a PEFT model, ``"adapter"`` (default) writes the rectified update back into the
            LoRA factors (truncated SVD per layer, see ``adapter_rank``) so ``trainer.save_model()`` saves an
            adapter; ``"merged"`` writes the rectified weights into the base layers and replaces
            ``trainer.model`` by the merged plain model, which ``trainer.save_model()`` then saves in full.
        adapter_rank: rank of each re-factorized layer: ``"same"`` (the adapter's own rank), an int,
            ``"auto"`` (smallest rank keeping ``adapter_energy`` of the layer's update) or a float energy.
        adapter_energy: energy threshold for ``adapter_rank="auto"``.

    After training, ``callback.report`` is the :class:`RectificationReport`; it is also written to
    ``args.output_dir/janus_rectification.json`` and its figures are appended to
    ``trainer.state.log_history`` under ``janus/*`` keys.
    """

    def __init__(self, replay: Any, config: Optional[JanusConfig] = None, snapshot: str = "cpu",
                 peft_output: str = "adapter", adapter_rank: Any = "same", adapter_energy: float = 0.99,
                 on_error: str = "raise", trainer: Any = None):
        if snapshot not in ("cpu", "disk"):
            raise ValueError(f"snapshot={snapshot!r} is invalid: expected 'cpu' or 'disk'")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error={on_error!r} is invalid: expected 'raise' or 'warn'")
        validate_peft_output(peft_output, adapter_rank)
        if not 0.0 < adapter_energy <= 1.0:
            raise ValueError(f"adapter_energy={adapter_energy!r} is invalid: expected a float in (0, 1]")
        self.peft_output = peft_output
        self.adapter_rank = adapter_rank
        self.adapter_energy = adapter_energy
        self.replay = replay
        self.config = config if config is not None else JanusConfig()
        self.snapshot = snapshot
        self.on_error = on_error
        self.trainer = trainer
        self.report: Optional[RectificationReport] = None
        self.rectifier: Optional[Rectifier] = None
        self.snapshot_bytes = 0
        self._theta0: Optional[dict[str, Tensor]] = None
        self._snapshot_path: Optional[str] = None
        # The model after train end: the trainer's model, or the merged plain model (peft_output="merged").
        self.model: Optional[nn.Module] = None

    # ---- θ0 -----------------------------------------------------------------------------------------
    def _check_supported(self, model: nn.Module, args: TrainingArguments) -> None:
        # args.fsdp alone is no reason to refuse: FSDP2 weights are handled, FSDP1 is caught by check_sharding.
        if getattr(args, "deepspeed", None):
            if is_peft_model(model):
                raise JanusError(
                    "JanusCallback does not support PEFT models trained with DeepSpeed: save the adapter and rectify "
                    "it with hf_janus.JanusMerger afterwards, or train with DDP"
                )
            if not is_zero3(model):
                raise JanusError(
                    "JanusCallback supports DeepSpeed with ZeRO stage 3 only (partitioned weights, gathered whole); "
                    "ZeRO stages 0-2 are not tested: use stage 3, or save the model and rectify it with "
                    "hf_janus.rectify afterwards, or train with DDP or FSDP2"
                )
        if is_peft_model(model):
            if any(is_sharded(p) or is_zero3_param(p) for p in model.parameters()):
                raise JanusError(
                    "JanusCallback does not support PEFT models sharded with FSDP or DeepSpeed ZeRO-3: save the "
                    "adapter and rectify it with hf_janus.JanusMerger afterwards, or train with DDP"
                )
            layers = self._peft_layers(model)
            if self.peft_output == "adapter":
                check_adapter_writable(layers)
                init = getattr(model.peft_config.get(model.active_adapter), "init_lora_weights", True)
                if isinstance(init, str) and init.lower().startswith(_MUTATING_INITS) and self.adapter_rank != "same":
                    raise JanusError(
                        f"the adapter was initialized with init_lora_weights={init!r}: it is saved relative to a "
                        "residual base that PEFT rebuilds at the adapter's own rank when loading, so its rank cannot "
                        "change. Keep adapter_rank='same', or use peft_output='merged'"
                    )
            elif self.trainer is None:
                raise JanusError(
                    "peft_output='merged' replaces trainer.model by the merged model, so the callback needs the "
                    "trainer: JanusCallback(..., trainer=trainer) or set callback.trainer = trainer before train()"
                )

    def _peft_layers(self, model: nn.Module) -> dict[str, nn.Module]:
        return adapted_linear_layers(model, self.config.target_modules, self.config.exclude_modules)

    def _take_snapshot(self, model: nn.Module, args: TrainingArguments) -> None:
        if is_peft_model(model):
            theta0 = effective_weights(self._peft_layers(model))
        else:
            targets = resolve_target_modules(model, self.config.target_modules, self.config.exclude_modules)
            check_sharding(model, {name: module.weight for name, module in targets.items()})
            # Under FSDP2 and ZeRO-3 every rank gathers every layer (a collective, same order on all ranks) and
            # keeps θ0 whole.
            theta0 = {f"{name}.weight": full_weight(module.weight).to("cpu", copy=True).contiguous()
                      for name, module in targets.items()}
        self.snapshot_bytes = sum(t.numel() * t.element_size() for t in theta0.values())
        if self.snapshot == "disk":
            self._snapshot_path = os.path.join(args.output_dir, SNAPSHOT_NAME)
            # One writer; the other data-parallel ranks read the same file (output_dir must be shared).
            if args.process_index == 0:
                atomic_save_safetensors(theta0, self._snapshot_path)
            _barrier()
            self._theta0 = None
        else:
            self._theta0 = theta0
        logger.info("JANUS: θ0 snapshot of %d layers, %.1f MiB, kept on %s", len(theta0), self.snapshot_bytes / 2**20,
                    self.snapshot)

    def _load_snapshot(self, path: str) -> None:
        from safetensors.torch import load_file

        theta0 = load_file(path, device="cpu")
        self.snapshot_bytes = sum(t.numel() * t.element_size() for t in theta0.values())
        if self.snapshot == "disk":
            self._snapshot_path, self._theta0 = path, None
        else:
            self._theta0 = theta0

    def theta0(self) -> dict[str, Tensor]:
        """The pre-training weights of the target layers (loaded from disk when ``snapshot="disk"``)."""
        if self._theta0 is not None:
            return self._theta0
        if self._snapshot_path is None:
            raise JanusError("no θ0 snapshot: JanusCallback.on_train_begin did not run")
        from safetensors.torch import load_file

        return load_file(self._snapshot_path, device="cpu")

    def _find_resume_snapshot(self, args: TrainingArguments, state: TrainerState) -> str:
        candidates = [os.path.join(args.output_dir, f"checkpoint-{state.global_step}", SNAPSHOT_NAME),
                      os.path.join(args.output_dir, SNAPSHOT_NAME)]
        for path in candidates:
            if os.path.isfile(path):
                return path
        raise JanusError(
            f"resuming at step {state.global_step}, but no θ0 snapshot ({SNAPSHOT_NAME}) was found in "
            f"{candidates[0]} or {candidates[1]}: the checkpoint was not written with JanusCallback. Start the run "
            "from scratch, or rectify afterwards with hf_janus.rectify and the original weights"
        )

    # ---- Trainer events -----------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        check_sharding(model)  # before unwrapping: an FSDP1 wrapper would be peeled off like DDP's
        model = _unwrap(model)
        self._check_supported(model, args)
        if state.global_step > 0:
            # Resumed: the weights now are mid-training, θ0 must come from the checkpoint.
            self._load_snapshot(self._find_resume_snapshot(args, state))
            logger.info("JANUS: resumed at step %d with the θ0 snapshot from the checkpoint", state.global_step)
        else:
            self._take_snapshot(model, args)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            atomic_save_safetensors(self.theta0(), os.path.join(folder, SNAPSHOT_NAME))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: Optional[nn.Module] = None, processing_class: Any = None, **kwargs: Any) -> None:
        model = _unwrap(model)
        progress = not args.disable_tqdm and state.is_local_process_zero
        try:
            replay = self._replay(processing_class)
            if is_peft_model(model):
                self._rectify_peft(model, replay, progress)
            else:
                self.rectifier = Rectifier(model, self.theta0(), replay, self.config, progress=progress)
                self.report = self.rectifier.run()
                self.model = model
        except (JanusError, RectificationError) as err:
            if self.on_error == "raise":
                raise
            logger.warning("JANUS rectification skipped, the model keeps its fine-tuned weights: %s", err)
            return
        self.report.output.setdefault("snapshot_mib", self.snapshot_bytes / 2**20)
        self._log(state)
        if state.is_world_process_zero:
            self.report.save(os.path.join(args.output_dir, REPORT_NAME))
        if self.trainer is not None:
            # trainer.save_model()/push_to_hub() then carry the record, the card and the safetensors metadata.
            from hf_janus.publish.hub import install_trainer_hooks

            install_trainer_hooks(self.trainer, lambda: self.report, replay=self.replay)

    def _rectify_peft(self, model: nn.Module, replay: Any, progress: bool) -> None:
        """Rectify the effective weights of the adapted layers, then write them back as configured.

        Everything that can fail (capture, projection, re-factorization) runs before the model is touched
        for good: on failure the tuner layers and their weights are exactly as training left them.
        """
        layers = self._peft_layers(model)
        theta0 = self.theta0()
        finetuned = effective_weights(layers)
        # Only the adapted layers moved during training: they are the targets, whatever "all-linear" says.
        config = dataclasses.replace(self.config, target_modules=list(layers), exclude_modules=None)
        with plain_view(model, finetuned) as plain:
            self.rectifier = Rectifier(plain, theta0, replay, config, progress=progress,
                                       keep_reference_factors=self.peft_output == "adapter")
            self.report = self.rectifier.run()
        rectified = {layer.name: layer.current.detach().float() for layer in self.rectifier.layers}
        if self.peft_output == "merged":
            self.model = self._merge(model, layers, rectified)
            self.report.output = {"format": "merged"}
            return
        self._write_adapter(model, layers, rectified, theta0, finetuned)
        self.model = model

    def _write_adapter(self, model: nn.Module, layers: dict[str, nn.Module], rectified: dict[str, Tensor],
                       theta0: dict[str, Tensor], finetuned: dict[str, Tensor]) -> None:
        written, originals = [], {}
        try:
            for layer in self.rectifier.layers:
                module = layers[layer.name]
                adapter = module.active_adapters[0]
                originals[layer.name] = _lora_state(module, adapter)
                rule = rule_for(module.get_base_layer())
                w_base = rule.to_matrix(module.get_base_layer().weight.detach()).float().to(layer.current.device)
                reference = layer.reference  # θ0 in (d_out, d_in), float32
                jac = self.rectifier.reference_jacobians.get(layer.name)
                original_delta = rule.to_matrix(finetuned[layer.name + ".weight"]).float().to(reference.device) - reference
                ref_norm = float(jac.jvp(original_delta).norm()) if jac is not None else None
                written.append(write_lora(
                    module, layer.name, rectified[layer.name], reference - w_base, rectified[layer.name] - reference,
                    self.adapter_rank, self.adapter_energy, jacobian=jac, reference_norm=ref_norm,
                ))
        except Exception:
            for name, state in originals.items():
                _restore_lora(layers[name], state)
            raise
        changed = {w.stats.name: w.stats.rank for w in written if w.rank_changed}
        if changed:
            record_rank_pattern(model, next(iter(layers.values())).active_adapters[0], changed)
        self.rectifier.reference_jacobians.clear()
        self.report.output = {
            "format": "adapter", "adapter_rank": self.adapter_rank, "adapter_energy": self.adapter_energy,
            "layers": [w.stats.to_dict() for w in written],
        }
        kept = [w.stats.kept_energy for w in written]
        logger.info("JANUS: rectified update written back into the adapter (%d layers, kept energy min %.4f)",
                    len(written), min(kept) if kept else 1.0)

    def _merge(self, model: nn.Module, layers: dict[str, nn.Module], rectified: dict[str, Tensor]) -> nn.Module:
        """Rectified weights into the base layers, every other adapter merged, PEFT wrappers removed."""
        with torch.no_grad():
            for name, module in layers.items():
                set_base_weight(module, rectified[name])
            # Adapted layers JANUS did not rectify (narrowed targets, embeddings) keep their fine-tuned value.
            from peft.tuners.tuners_utils import BaseTunerLayer

            for name, module in inner_model(model).named_modules():
                if isinstance(module, BaseTunerLayer) and name not in layers and hasattr(module, "merge"):
                    module.merge()
        merged = model.unload()
        trainer = self.trainer
        trainer.model = merged
        trainer.model_wrapped = merged
        logger.info("JANUS: rectified weights merged; trainer.model is now the plain %s", type(merged).__name__)
        return merged

    # ---- helpers ------------------------------------------------------------------------------------
    def _replay(self, tokenizer: Any) -> Any:
        """Tokenize a text replay with the trainer's tokenizer; tokenized data is used as given."""
        replay = self.replay
        first = replay[0] if hasattr(replay, "__getitem__") and len(replay) else None
        if isinstance(first, dict) and "input_ids" not in first and "text" in first:
            if tokenizer is None:
                raise JanusError("the replay holds raw 'text' but the Trainer has no tokenizer: tokenize it first")
            return [dict(tokenizer(row["text"], truncation=True)) for row in replay]
        return replay

    def _log(self, state: TrainerState) -> None:
        report = self.report
        entries = []
        for step in report.steps:
            for trial in step.trials:
                entries.append({"janus/step": step.step, "janus/alpha": trial.alpha,
                                "janus/mean_cosine": trial.mean_cosine, "janus/accepted": int(trial.accepted),
                                "janus/replay_loss": trial.replay_loss})
        entries.append({
            "janus/replay_loss_reference": report.replay_loss["reference"],
            "janus/replay_loss_finetuned": report.replay_loss["finetuned"],
            "janus/replay_loss_rectified": report.replay_loss["rectified"],
            "janus/jacobian_evals": report.num_jacobian_evals,
            "janus/snapshot_mib": self.snapshot_bytes / 2**20,
            "janus/seconds": report.timings.get("total", 0.0),
        })
        for logs in entries:
            if self.trainer is not None:
                self.trainer.log(logs)
            else:
                state.log_history.append({**logs, "step": state.global_step})
