"""``JanusCallback``: snapshot θ0 when ``Trainer`` starts, rectify with JANUS when it ends.

This version covers full fine-tuning of a plain (non-PEFT) model, in one process or under DDP (each rank
captures its share of the replay; every rank ends with identical weights), including
``resume_from_checkpoint`` (the θ0 snapshot travels with every checkpoint). PEFT models, FSDP and DeepSpeed
are refused with a clear error until they are supported.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from torch import Tensor, nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .config import JanusConfig
from .errors import JanusError, RectificationError
from .layers import resolve_target_modules
from .rectifier import Rectifier
from .report import RectificationReport

logger = logging.getLogger(__name__)

SNAPSHOT_NAME = "janus_theta0.safetensors"
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
            so every reporting integration (wandb, tensorboard, ...) receives them.

    After training, ``callback.report`` is the :class:`RectificationReport`; it is also written to
    ``args.output_dir/janus_rectification.json`` and its figures are appended to
    ``trainer.state.log_history`` under ``janus/*`` keys.
    """

    def __init__(self, replay: Any, config: Optional[JanusConfig] = None, snapshot: str = "cpu",
                 on_error: str = "raise", trainer: Any = None):
        if snapshot not in ("cpu", "disk"):
            raise ValueError(f"snapshot={snapshot!r} is invalid: expected 'cpu' or 'disk'")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error={on_error!r} is invalid: expected 'raise' or 'warn'")
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

    # ---- θ0 -----------------------------------------------------------------------------------------
    def _check_supported(self, model: nn.Module, args: TrainingArguments) -> None:
        try:
            from peft import PeftModel
        except ImportError:  # pragma: no cover
            PeftModel = ()
        if isinstance(model, PeftModel):
            raise JanusError(
                "JanusCallback does not support PEFT models yet: train, save the adapter, then rectify it with "
                "hf_janus.JanusMerger (or the `hf-janus merge` command)"
            )
        if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
            raise JanusError(
                "JanusCallback does not support FSDP or DeepSpeed sharded weights yet; save the model and rectify it "
                "with hf_janus.rectify afterwards"
            )

    def _take_snapshot(self, model: nn.Module, args: TrainingArguments) -> None:
        targets = resolve_target_modules(model, self.config.target_modules, self.config.exclude_modules)
        theta0 = {f"{name}.weight": module.weight.detach().to("cpu", copy=True).contiguous()
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
        try:
            replay = self._replay(processing_class)
            self.rectifier = Rectifier(model, self.theta0(), replay, self.config,
                                       progress=not args.disable_tqdm and state.is_local_process_zero)
            self.report = self.rectifier.run()
        except (JanusError, RectificationError) as err:
            if self.on_error == "raise":
                raise
            logger.warning("JANUS rectification skipped, the model keeps its fine-tuned weights: %s", err)
            return
        self._log(state)
        if state.is_world_process_zero:
            self.report.save(os.path.join(args.output_dir, REPORT_NAME))

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
