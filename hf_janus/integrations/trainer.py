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
import functools
import inspect
import logging
import os
import weakref
from typing import Any, Optional

import torch
from torch import Tensor, nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_janus.adapters.live.rectify import PeftOutput, check_live_peft, rectify_live_peft
from hf_janus.adapters.peft_layers import is_peft_model
from hf_janus.engine.config import JanusConfig
from hf_janus.engine.rectifier import Rectifier
from hf_janus.engine.report import RectificationReport
from hf_janus.engine.repair import NEW_TASK_VALIDATION_MAX
from hf_janus.errors import JanusError, RectificationError
from hf_janus.integrations.snapshot import SNAPSHOT_NAME, Theta0Snapshot, weights_fingerprint
from hf_janus.engine.quantized import quantization_of
from hf_janus.parallel.sharding import check_sharding, is_sharded, is_zero3, is_zero3_param
from hf_janus.publish.record_file import REPORT_NAME
from hf_janus.replay.self_replay import SelfReplay

logger = logging.getLogger(__name__)

#: how many new-task samples each rank takes from the Trainer's train dataloader for the repair after JANUS (whole
#: batches, so the last one may take it past this)
NEW_TASK_SAMPLES = 256

# Trainer uploads these checkpoint folders whole (no ignore patterns), so θ0 must stay out of them.
_PUSHED_CHECKPOINTS = ("checkpoint", "all_checkpoints")


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP/DeepSpeed/compile wrappers (accelerate's own unwrapping, as the Trainer's)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def _checkpoints_pushed(args: TrainingArguments) -> bool:
    return bool(getattr(args, "push_to_hub", False)) and getattr(args, "hub_strategy", None) in _PUSHED_CHECKPOINTS


def _wait_for_everyone() -> None:
    """A barrier across data-parallel processes (a no-op in one process)."""
    from accelerate.utils import wait_for_everyone

    wait_for_everyone()


def _calling_trainer(building: bool = False) -> Any:
    """The ``Trainer`` whose method called the running callback event (a few frames up), or ``None``.

    Trainer hands itself to no callback: the events' keyword arguments carry its model, tokenizer, optimizer and
    data loaders, never the trainer, whose ``save_model``/``push_to_hub`` publish the record and whose ``train``
    must be guarded. ``building``: only a Trainer whose ``__init__`` is running (``on_init_end``, the one moment a
    callback given as ``Trainer(callbacks=[...])`` can reach it before ``train()`` is first called); otherwise
    also the one whose ``train()`` runs (``on_train_begin`` of a callback added with ``add_callback``).
    """
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        for _ in range(16):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and (not building or frame.f_code.co_name == "__init__"):
                return candidate
        return None
    finally:
        del frame  # a frame reference kept here would keep every local of the caller chain alive


def _guard_failed_training(trainer: Any, callback: "JanusCallback") -> None:
    """Make ``trainer.train()`` tell ``callback`` when it raises, then re-raise the same exception.

    Trainer calls no callback when training raises (no ``on_train_end``), so the instance's ``train`` is wrapped
    (the ``Trainer`` class is untouched), once per trainer whatever the number of callbacks.
    """
    guarded = getattr(trainer, "_janus_failure_guards", None)
    if guarded is None:
        guarded = []
        original = trainer.train

        @functools.wraps(original)
        def train(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException:  # Ctrl-C included: the snapshot must not outlive an interrupted run either
                for cb in guarded:
                    cb._after_failed_training(trainer)
                raise

        trainer.train = train
        trainer._janus_failure_guards = guarded
    if not any(cb is callback for cb in guarded):
        guarded.append(callback)


class JanusCallback(TrainerCallback):
    """Rectify the fine-tuned weights at the end of ``trainer.train()`` so the model forgets less.

    Args:
        replay: samples of the past task (``datasets.Dataset``, list of dicts or ``DataLoader``) with
            ``input_ids`` (and ``attention_mask``, optional ``labels``); a dataset with a ``text`` column
            is tokenized with the trainer's tokenizer. A :class:`~hf_janus.SelfReplay` is generated by the model
            itself at train begin, before the first optimizer step (θ0's answers, with the trainer's tokenizer
            unless it names its own); a run resumed from a checkpoint cannot generate it (the model no longer is θ0):
            pass the samples ``SelfReplay.generate`` gave instead.
        config: :class:`JanusConfig` (defaults to τ=0.95, β=0.7, r=32).
        snapshot: where θ0 is kept during training: ``"cpu"`` (host memory) or ``"disk"`` (a safetensors
            file in ``args.output_dir``). θ0 never stays on the accelerator. The file is removed when the run
            ends, and also when ``trainer.train()`` raises before train end (a failing training step, Ctrl-C):
            the callback wraps the ``train`` method of its trainer, which it knows from ``trainer=`` or, when
            given in ``Trainer(callbacks=[...])``, from the Trainer being built. Copies in checkpoints stay.
        on_error: ``"raise"`` (default) or ``"warn"``: on failure the model keeps its fine-tuned weights
            either way; ``"warn"`` logs the error and lets training finish normally.
        trainer: optional ``Trainer``; when given, the rectification steps are logged with ``trainer.log``
            so every reporting integration (wandb, tensorboard, ...) receives them. Required for
            ``peft_output="merged"`` (the merged model replaces ``trainer.model``). Publishing does not need
            it: the callback finds the Trainer that runs it (given in ``Trainer(callbacks=[...])`` or added with
            ``add_callback``), and ``trainer.save_model()``/``push_to_hub()`` after a rectifying ``train()``
            write the same record and card either way.
        peft_output: for a PEFT model, ``"adapter"`` (default) writes the rectified update back into the
            LoRA factors (truncated SVD per layer, see ``adapter_rank``) so ``trainer.save_model()`` saves an
            adapter; ``"merged"`` writes the rectified weights into the base layers and replaces
            ``trainer.model`` by the merged plain model, which ``trainer.save_model()`` then saves in full.
        adapter_rank: rank of each re-factorized layer: ``"same"`` (the adapter's own rank), an int,
            ``"auto"`` (smallest rank keeping ``adapter_energy`` of the layer's update) or a float energy.
        adapter_energy: energy threshold for ``adapter_rank="auto"``.
        new_adapter_name: with ``peft_output="adapter"``, write the rectified update into a new adapter of this
            name, made active, and keep the trained adapter unchanged beside it (as PEFT's
            ``reduce_intruder_dimension`` does): compare the two with ``model.set_adapter(name)`` without reloading;
            ``save_pretrained``/``trainer.save_model()`` write both (PEFT puts an adapter not named ``"default"`` in a
            subfolder of its name), and the record and card say which is which. Refused at train begin for an
            adapter whose init rewrites the base (PiSSA, OLoRA, CorDA, ...), and for a name the model already has.

    After training, ``callback.report`` is the :class:`RectificationReport`; its publication record
    (:class:`~hf_janus.publish.record_file.PublishedReport`, the document every ``janus_rectification.json`` holds)
    is written to ``args.output_dir/janus_rectification.json``, its figures are appended to
    ``trainer.state.log_history`` under ``janus/*`` keys, and ``trainer.save_model()``/``push_to_hub()`` add the
    record, the model card and the safetensors metadata to what they save.
    """

    def __init__(self, replay: Any, config: Optional[JanusConfig] = None, snapshot: str = "cpu",
                 peft_output: str = "adapter", adapter_rank: Any = "same", adapter_energy: float = 0.99,
                 on_error: str = "raise", trainer: Any = None, new_adapter_name: Optional[str] = None):
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error={on_error!r} is invalid: expected 'raise' or 'warn'")
        self.snapshot = Theta0Snapshot(snapshot)
        self.peft_output = PeftOutput(peft_output, adapter_rank, adapter_energy, new_adapter_name)
        self.replay = replay
        self.config = config if config is not None else JanusConfig()
        self.on_error = on_error
        self._trainer: Any = None
        # The Trainer found running this callback (weakly: the trainer holds the callback, not the reverse), for
        # publishing when none was given with trainer=.
        self._found: Optional[weakref.ref] = None
        self._guarded = False  # a trainer's train() will call _after_failed_training if it raises
        self._train_ended = False  # on_train_end was reached in the current run
        self.trainer = trainer
        self._tokenized: Any = None  # the replay as checked at train begin (tokenized once)
        self.report: Optional[RectificationReport] = None
        # the finished engine run, for inspection: released (Rectifier.release) once the callback is done with it
        self.rectifier: Optional[Rectifier] = None
        # The model after train end: the trainer's model, or the merged plain model (peft_output="merged").
        self.model: Optional[nn.Module] = None

    @property
    def trainer(self) -> Any:
        """The ``Trainer`` given to the callback (``None``: none given): its ``log`` receives the janus figures,
        its ``save_model``/``push_to_hub`` publish the record, and its ``train`` removes a disk θ0 snapshot when
        training fails."""
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Any) -> None:
        self._trainer = trainer
        if trainer is not None:
            _guard_failed_training(trainer, self)
            self._guarded = True

    @property
    def replay_samples(self) -> Any:
        """The replay as checked at train begin and rectified with at train end (for a :class:`SelfReplay`, θ0's
        generated samples, which a resumed run can be given as its replay); ``None`` before train begin."""
        return self._tokenized

    @property
    def snapshot_bytes(self) -> int:
        """Size of the θ0 snapshot."""
        return self.snapshot.nbytes

    def theta0(self) -> dict[str, Tensor]:
        """What the snapshot holds (loaded from disk when ``snapshot="disk"``): the pre-training weights of the
        target layers, ``"<layer>.weight"`` (with ``distill_steps``, also every other parameter that trains, by
        name); for adapted layers on a frozen base (PEFT's default, and every
        quantized base), the adapter's initial tensors instead: θ0 is rebuilt from them and the base at train end,
        in float32 (:func:`hf_janus.adapters.peft_layers.theta0_weights`)."""
        return self.snapshot.tensors()

    def _check_supported(self, model: nn.Module, args: TrainingArguments) -> Optional[dict[str, nn.Module]]:
        """Refuse unsupported setups before training; the adapted layers of a PEFT model (None otherwise)."""
        if self.config.distill_steps:
            quantized = any(quantization_of(m) is not None for m in model.modules())
            sharded = any(is_sharded(p) or is_zero3_param(p) for p in model.parameters())
            if quantized or sharded:
                raise JanusError(
                    "the repair after JANUS (distill_steps) trains the target layers' full weights, which it cannot "
                    f"on a {'quantized base' if quantized else 'model sharded with FSDP or ZeRO-3'}: set "
                    "distill_steps=0 (the JANUS point), or save the model or adapter and repair it with "
                    "JanusMerger(..., new_task_samples=...) or hf_janus.rectify(..., new_task=...) unsharded"
                )
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
        if not is_peft_model(model):
            return None
        if any(is_sharded(p) or is_zero3_param(p) for p in model.parameters()):
            raise JanusError(
                "JanusCallback does not support PEFT models sharded with FSDP or DeepSpeed ZeRO-3: save the "
                "adapter and rectify it with hf_janus.JanusMerger afterwards, or train with DDP"
            )
        if self.peft_output.format == "merged" and self.trainer is None:
            raise JanusError(
                "peft_output='merged' replaces trainer.model by the merged model, so the callback needs the "
                "trainer: JanusCallback(..., trainer=trainer) or set callback.trainer = trainer before train()"
            )
        return check_live_peft(model, self.config, self.peft_output)

    # ---- Trainer events -----------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        # The failure guard, and the trainer to publish through: the Trainer found this way does not become
        # self.trainer, which would also route the logs through trainer.log, a thing a user asks for with trainer=.
        if self._trainer is None:
            trainer = _calling_trainer(building=True)
            if trainer is not None:
                self._found = weakref.ref(trainer)
                _guard_failed_training(trainer, self)
                self._guarded = True

    def _publishing_trainer(self) -> Any:
        """The trainer whose ``save_model``/``push_to_hub`` publish the record: the one given, else the one found
        running this callback (``None`` when neither is known)."""
        if self._trainer is not None:
            return self._trainer
        return self._found() if self._found is not None else None

    def _after_failed_training(self, trainer: Any) -> None:
        """Called by a guarded ``trainer.train()`` that raised. Before train end that is a failed training: the
        working θ0 snapshot leaves ``output_dir`` (checkpoint copies stay, for resuming; a resumed run reads its
        θ0 from the checkpoint, so ``discard`` leaves that one alone). From train end on, ``on_train_end`` has
        dealt with the failure itself: a failed rectification keeps the file for a retry, and says so."""
        if self._train_ended or self.snapshot.place != "disk":
            return
        try:
            # No barrier: the other ranks may have died. The writer of the file removes it, as it wrote it.
            if trainer.args.process_index == 0:
                self.snapshot.discard(trainer.args.output_dir)
        except Exception as err:  # never mask the training error with a cleanup error
            logger.warning("JANUS: could not remove the θ0 snapshot %s after the failed run (%s: %s); delete it "
                           "before publishing that folder", os.path.join(trainer.args.output_dir, SNAPSHOT_NAME),
                           type(err).__name__, err)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Optional[nn.Module] = None, processing_class: Any = None, **kwargs: Any) -> None:
        self._train_ended = False
        if self._publishing_trainer() is None:  # added with add_callback after the Trainer was built
            trainer = _calling_trainer()
            self._found = weakref.ref(trainer) if trainer is not None else None
        # Everything that can be checked is checked here, before the first optimizer step: a refusal at train
        # end would cost the whole training run.
        check_sharding(model)  # before unwrapping: an FSDP1 wrapper would be peeled off like DDP's
        model = _unwrap(model)
        peft_layers = self._check_supported(model, args)
        try:
            self._check_replay(model, processing_class, resumed=state.global_step > 0,
                               progress=not args.disable_tqdm and state.is_local_process_zero)
        except JanusError as err:
            if self.on_error == "raise":
                raise
            logger.warning("JANUS: the rectification at train end will be skipped: %s", err)
        if state.global_step > 0:
            # Resumed: the weights now are mid-training, θ0 must come from the checkpoint.
            self.snapshot.resume(args.output_dir, state.global_step, weights_fingerprint(model))
            logger.info("JANUS: resumed at step %d with the θ0 snapshot from the checkpoint", state.global_step)
            return
        if _checkpoints_pushed(args):
            logger.warning("JANUS: hub_strategy=%r uploads every checkpoint folder whole, so the θ0 snapshot is kept "
                           "out of them (θ0 is never published): resuming this run will be refused. Use "
                           "hub_strategy='every_save' or 'end' to keep resuming possible", str(args.hub_strategy))
        if self.snapshot.place == "disk" and not self._guarded:
            logger.warning("JANUS: if training fails, the θ0 snapshot will stay in %s: the callback does not know its "
                           "Trainer (added with add_callback after the Trainer was built?), so it cannot see a failed "
                           "train(). Pass JanusCallback(..., trainer=trainer) or set callback.trainer = trainer before "
                           "train()", os.path.join(args.output_dir, SNAPSHOT_NAME))
        self.snapshot.take(model, peft_layers, self.config.target_modules, self.config.exclude_modules,
                           args.output_dir, is_writer=args.process_index == 0, outside=self.config.distill_steps > 0)
        if self.snapshot.place == "disk":
            _wait_for_everyone()  # the other ranks read the file rank 0 wrote

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder) and not _checkpoints_pushed(args):
            # the model still holds exactly the weights just saved in the folder
            self.snapshot.save_to_checkpoint(folder, weights_fingerprint(_unwrap(model)))

    def _discard_snapshot(self, args: TrainingArguments, state: TrainerState) -> None:
        if self.snapshot.place == "disk":
            _wait_for_everyone()  # every rank has read θ0 before rank 0 deletes the file
            if state.is_world_process_zero:
                self.snapshot.discard(args.output_dir)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: Optional[nn.Module] = None, processing_class: Any = None, **kwargs: Any) -> None:
        self._train_ended = True
        model = _unwrap(model)
        progress = not args.disable_tqdm and state.is_local_process_zero
        try:
            replay = self._tokenized if self._tokenized is not None else self._replay(processing_class)
            theta0 = self.theta0()
            new_task, validation = self._new_task_samples(), self._new_task_validation()
            if is_peft_model(model):
                run = rectify_live_peft(model, theta0, replay, self.config, self.peft_output, progress=progress,
                                        new_task=new_task, new_task_validation=validation)
                self.report, self.model, self.rectifier = run.report, run.model, run.rectifier
                if self.model is not model:  # merged: the trainer saves and pushes the plain model from now on
                    self.trainer.model = self.trainer.model_wrapped = self.model
            else:
                self.rectifier = Rectifier(model, theta0, replay, self.config, progress=progress, new_task=new_task,
                                           new_task_validation=validation)
                self.report = self.rectifier.run().report
                self.model = model
        except (JanusError, RectificationError) as err:
            if self.on_error == "raise":
                if self.snapshot.place == "disk":
                    logger.error("JANUS: the θ0 snapshot stays in %s for a retry with hf_janus.rectify; delete it "
                                 "before publishing that folder", os.path.join(args.output_dir, SNAPSHOT_NAME))
                raise
            logger.warning("JANUS rectification skipped, the model keeps its fine-tuned weights: %s", err)
            self._discard_snapshot(args, state)
            return
        finally:
            # the run's θ0, θ̂ and θ_t copies would otherwise stay alive through callback.rectifier while the user
            # evaluates, saves or pushes; its report stays
            if self.rectifier is not None:
                self.rectifier.release()
        self._discard_snapshot(args, state)
        self.report.output.setdefault("snapshot_mib", self.snapshot_bytes / 2**20)
        self._log(state)
        self._publish(args, state)

    # ---- helpers ------------------------------------------------------------------------------------
    def _publish(self, args: TrainingArguments, state: TrainerState) -> None:
        """Write the publication record into ``output_dir`` and make the trainer's ``save_model()`` and
        ``push_to_hub()`` add it, the card and the weight metadata to what they save: one document under
        ``janus_rectification.json`` whichever way the callback was constructed."""
        from hf_janus.integrations.trainer_publish import install_trainer_hooks
        from hf_janus.publish.provenance import describe_model, describe_replay
        from hf_janus.publish.record_file import build_report

        replay = self._tokenized if isinstance(self.replay, SelfReplay) else self.replay  # the rows replayed
        kind = "adapter" if is_peft_model(self.model) else "full"
        trainer = self._publishing_trainer()
        if trainer is not None:
            publication = install_trainer_hooks(trainer, lambda: self.report, replay=replay)
            if state.is_world_process_zero:
                publication.record(kind).save(os.path.join(args.output_dir, REPORT_NAME))
            return
        logger.warning(
            "JANUS: the callback could not find the Trainer that ran it, so trainer.save_model() and push_to_hub() "
            "will save the rectified weights without janus_rectification.json and the model card. Pass "
            "JanusCallback(..., trainer=trainer) or set callback.trainer = trainer before train(); or publish a "
            "saved folder with hf_janus.publish.files.write_publication_files(folder, callback.report)")
        if state.is_world_process_zero:
            record = build_report(self.report, kind=kind, base_model=describe_model(self.model),
                                  replay_info=describe_replay(replay) if replay is not None else None)
            record.save(os.path.join(args.output_dir, REPORT_NAME))

    def _check_replay(self, model: nn.Module, tokenizer: Any, resumed: bool = False, progress: bool = True) -> None:
        """Tokenize (if needed) and validate the replay now, as the rectification will read it; the tokenized
        replay is kept for train end. A :class:`SelfReplay` is generated here, while ``model`` still holds θ0."""
        from hf_janus.replay.prepare import check_vocabulary, prepare_replay

        self._tokenized = None  # not a previous run's
        if isinstance(self.replay, SelfReplay):
            replay = self._self_replay(model, tokenizer, resumed, progress)
        else:
            replay = self._replay(tokenizer)
        batches = prepare_replay(replay, self.config.replay_batch_size)
        check_vocabulary(batches, model, in_given_order=False)  # grouped by length
        self._tokenized = replay

    def _self_replay(self, model: nn.Module, tokenizer: Any, resumed: bool,
                     progress: bool) -> list[dict[str, list[int]]]:
        """θ0's answers: at train begin of a fresh run the model is θ0; a resumed one holds mid-training weights,
        from which only the cache (keyed by θ0's weights) could tell θ0's answers, so it is refused."""
        if resumed:
            raise JanusError(
                "JanusCallback(SelfReplay(...)) cannot generate θ0's answers when training resumes from a checkpoint: "
                "the model now holds mid-training weights. Generate the replay from the base model before training, "
                "samples = SelfReplay(...).generate(base_model, tokenizer), and pass JanusCallback(samples, ...)"
            )
        options = dataclasses.replace(self.replay, progress=self.replay.progress and progress)
        return options.generate(model, options.tokenizer if options.tokenizer is not None else tokenizer)

    def _replay(self, tokenizer: Any) -> Any:
        """Tokenize a text replay with the trainer's tokenizer; tokenized data is used as given."""
        replay = self.replay
        if isinstance(replay, SelfReplay):  # reached at train end only when train begin failed to generate it
            raise JanusError("the self-replay was not generated at train begin (see the warning then), and the model "
                             "no longer holds θ0 to generate it from")
        first = replay[0] if hasattr(replay, "__getitem__") and len(replay) else None
        if isinstance(first, dict) and "input_ids" not in first and "text" in first:
            if tokenizer is None:
                raise JanusError("the replay holds raw 'text' but the Trainer has no tokenizer: tokenize it first")
            return [dict(tokenizer(row["text"], truncation=True)) for row in replay]
        return replay

    def _new_task_samples(self) -> Optional[list[dict[str, Any]]]:
        """What the Trainer trained on, for the repair after JANUS (``config.distill_steps``): the first batches of
        the Trainer's own train dataloader (its dataset through its collator), every rank's, the same list on every
        rank. None without a repair, or when the callback does not know its Trainer (logged)."""
        if not self.config.distill_steps:
            return None
        trainer = self._publishing_trainer()
        if trainer is None or getattr(trainer, "train_dataset", None) is None:
            logger.warning("JANUS: distill_steps=%d but the callback does not know its Trainer's train dataset, so "
                           "the repair after JANUS is skipped; pass JanusCallback(..., trainer=trainer)",
                           self.config.distill_steps)
            return None
        return _first_samples(trainer.get_train_dataloader(), NEW_TASK_SAMPLES)

    def _new_task_validation(self) -> Optional[list[dict[str, Any]]]:
        """The Trainer's ``eval_dataset`` through its eval dataloader (the first of several): whole batches, until
        they hold :data:`~hf_janus.engine.repair.NEW_TASK_VALIDATION_MAX` samples a rank, for the repair's gain; None
        without a repair or an eval dataset (the repair then holds out every eighth train sample)."""
        trainer = self._publishing_trainer()
        evaluation = getattr(trainer, "eval_dataset", None)
        if not self.config.distill_steps or evaluation is None:
            return None
        name = next(iter(evaluation)) if isinstance(evaluation, dict) else None
        return _first_samples(trainer.get_eval_dataloader(name), NEW_TASK_VALIDATION_MAX)

    def _log(self, state: TrainerState) -> None:
        report = self.report
        entries = []
        for step in report.steps:
            for trial in step.trials:
                entries.append({"janus/step": step.step, "janus/alpha": trial.alpha,
                                "janus/mean_cosine": trial.mean_cosine, "janus/score": trial.score,
                                "janus/passed": int(bool(trial.passed)), "janus/taken": int(trial.taken),
                                "janus/replay_loss": trial.replay_loss})
        entries.append({
            "janus/replay_loss_reference": report.replay_loss["reference"],
            "janus/replay_loss_finetuned": report.replay_loss["finetuned"],
            "janus/replay_loss_rectified": report.replay_loss["rectified"],
            "janus/jacobian_evals": report.num_jacobian_evals,
            "janus/snapshot_mib": self.snapshot_bytes / 2**20,
            "janus/seconds": report.timings.get("total", 0.0),
        })
        repair = report.repair
        if repair is not None and repair.chosen is not None:
            chosen, janus = repair.validation["chosen"], repair.validation["janus"]
            figures = {"janus/repair_gain_kept": repair.gain_kept(), "janus/repair_b": repair.b,
                       "janus/repair_replay_nll_janus": janus.replay_nll, "janus/repair_replay_nll": chosen.replay_nll,
                       "janus/repair_replay_agreement": chosen.replay_agreement, "janus/repair_seconds": repair.seconds}
            # the JANUS point kept has no move, and a fine-tune without gain no share of it: the loggers take numbers
            entries.append({k: v for k, v in figures.items() if v is not None})
        for logs in entries:
            if self.trainer is not None:
                self.trainer.log(logs)
            else:
                state.log_history.append({**logs, "step": state.global_step})


def _first_samples(dataloader: Any, most: int) -> list[dict[str, Any]]:
    """The first batches of ``dataloader`` holding ``most`` samples (or all), on the host, every rank's in rank
    order, the same list on every rank."""
    batches: list[dict[str, Any]] = []
    for batch in dataloader:
        batches.append({k: batch[k].detach().cpu() for k in ("input_ids", "attention_mask", "labels")
                        if k in batch and batch[k] is not None})
        if sum(len(b["input_ids"]) for b in batches) >= most:
            break
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, batches)
        batches = [b for rank in gathered for b in rank]
    return batches
