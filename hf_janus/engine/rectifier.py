"""Multi-step adaptive JANUS rectification (the paper's Algorithm 1) on one model, and :func:`rectify`.

Data flow: model + replay -> :mod:`.capture` (compressed X, A per layer) -> :mod:`.ghost` (Gram, projection,
principal angles) -> new weights, a :class:`RectificationReport` and a :class:`~.result.RectificationResult`.
The :class:`Rectifier` sets a run up (replay, memory plan, target layers, factor store) and runs its phases: the
fine-tuned replay loss, the capture at θ0, the step loop (:mod:`.step_loop`), the synchronization across ranks
and the statistics (:mod:`.statistics`); on any failure it puts θ̂ back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Callable, NoReturn, Optional, Union

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from hf_janus.engine.budget import Budget
from hf_janus.engine.capture import (
    ReplayLosses,
    capture_factors,
    combine_losses,
    combine_ranks,
    model_device,
    replay_losses,
)
from hf_janus.engine.compression import resolve_method
from hf_janus.engine.config import JanusConfig
from hf_janus.engine.constraints import make_constraint
from hf_janus.engine.jacobians import JacobianSource
from hf_janus.engine.layers import resolve_target_modules, rule_for
from hf_janus.engine.machine_memory import check_cache_directory
from hf_janus.engine.memory_plan import (
    CAPTURES_ALIVE,
    LayerShape,
    MemoryPlan,
    Workload,
    heap_retention,
    model_dimensions,
    plan_schedule,
)
from hf_janus.engine.repair import Repair, changed_outside, check_samples
from hf_janus.engine.repair_space import RepairSpace, WeightSpace
from hf_janus.engine.report import REFERENCE_JACOBIAN, RectificationReport, RepairReport, rounded_reference
from hf_janus.engine.result import LayerResult, RectificationResult
from hf_janus.engine.statistics import layer_statistics
from hf_janus.engine.observer import RunObserver
from hf_janus.engine.step_loop import StepLoop
from hf_janus.engine.store import FactorStore
from hf_janus.engine.target_layers import Reference, TargetLayers, WeightSource, build_target_layer, storage_of
from hf_janus.engine.timing import PhaseTimer
from hf_janus.errors import JanusError, RectificationError
from hf_janus.parallel.distributed import World
from hf_janus.parallel.sharding import check_sharding, is_sharded, is_zero3_param, passes_are_collective, reshard
from hf_janus.replay.prepare import check_vocabulary, counted_tokens, prepare_replay, rebatch, samples_without_loss
from hf_janus.replay.resolve import resolve_new_task, resolve_replay
from hf_janus.replay.sources import ReplayOptions

logger = logging.getLogger(__name__)

__all__ = ["Rectifier", "Reference", "WeightSource", "rectify"]


class Rectifier:
    """Runs Algorithm 1 on one model: ``Rectifier(...).run()`` returns the :class:`RectificationResult`. Use
    :func:`rectify` unless you need the pieces."""

    # No autograd graph is built outside the captures (which enable grad for their backward passes): θ0 or θ̂ handed
    # over as tensors that require grad would otherwise make every projection record its operands.
    @torch.no_grad()
    def __init__(self, model: nn.Module, reference: Union[WeightSource, Reference], replay: Any,
                 config: Optional[JanusConfig] = None, progress: bool = True, keep_reference_factors: bool = False,
                 factor_dtype: Optional[Union[torch.dtype, str]] = None, memory_budget_bytes: Optional[int] = None,
                 observer: Optional[RunObserver] = None, new_task: Any = None, new_task_validation: Any = None,
                 repair_autocast: Optional[Callable[[], AbstractContextManager]] = None, defer_repair: bool = False,
                 repair_numel: Optional[int] = None):
        """See :func:`rectify` for the first four arguments.

        Args:
            reference: θ0, as in :func:`rectify`, or a :class:`~hf_janus.engine.target_layers.WeightSource`: θ0
                with an exact float32 θ̂ (``finetuned``) or layers whose θ0 and θ̂ are rebuilt when needed
                (``rebuilt``), which adapters use.
            keep_reference_factors: keep each layer's θ0 Jacobian in the result (``LayerResult.jacobian``), for
                callers that post-process ΔW_rect (adapter re-factorization) and measure ``||J0 ΔW||``.
            factor_dtype: storage dtype of the compressed factors, over ``config.factor_dtype`` (which the
                memory plan resolves): ``torch.bfloat16`` halves their memory, as the paper's float16 cache, at bf16
                precision.
            memory_budget_bytes: with ``config.cache`` a directory, how many bytes of factors to keep in
                host memory before spilling to disk (default: what the memory plan leaves).
            observer: the run's hooks (:class:`~hf_janus.engine.observer.RunObserver`): the clock of
                ``config.max_seconds``, each capture, each trial's comparison and c̄. For tests and experiments that
                drive the loop through chosen landscapes; the default changes nothing.
            new_task: samples of what fine-tuning trained on, with labels, as ``replay`` takes them: the repair
                after JANUS (``config.distill_steps``) fits them and measures the gain it keeps on them.
            new_task_validation: held-out samples of the new task (a Trainer's ``eval_dataset``), on which the
                repair measures the gain instead of every eighth of ``new_task`` (all of which it then fits).
            repair_autocast: the context the repair's training passes run in, as fine-tuning's did (a Trainer's
                mixed precision: ``trainer.accelerator.autocast``); JANUS runs at the weights' own precision.
            defer_repair: :meth:`run` stops at the JANUS point and the caller runs :meth:`repair` in a space of its
                own (a LoRA adapter trains its factors once the JANUS point is written into them). The new-task
                samples are read and checked here all the same.
            repair_numel: with ``defer_repair``, the elements the caller's space trains (an adapter's factors), for
                the memory plan; None: the target layers' weights.
        """
        self.model, self.progress, self.keep_reference_factors = model, progress, keep_reference_factors
        self.repair_autocast, self.defer_repair, self.repair_numel = repair_autocast, defer_repair, repair_numel
        self.observer = observer if observer is not None else RunObserver()
        #: Set by :meth:`run` (which also returns it): the report and, per layer, θ0, θ̂, θ_rect (and J0).
        self.result: Optional[RectificationResult] = None
        self.config = config if config is not None else JanusConfig()
        if not isinstance(self.config, JanusConfig):
            raise JanusError(f"config must be a JanusConfig, got {type(self.config).__name__}")
        self.device = model_device(model)
        modules = resolve_target_modules(model, self.config.target_modules, self.config.exclude_modules)
        check_sharding(model, {name: module.weight for name, module in modules.items()})
        self.batches = prepare_replay(replay, self.config.replay_batch_size)
        check_vocabulary(self.batches, model, in_given_order=False)  # grouped by length
        self._read_new_task(new_task, new_task_validation, modules)
        # an explicit dtype wins over config.factor_dtype (the memory plan resolves "auto")
        factor_dtype = (self.config.factor_dtype if factor_dtype is None
                        else str(factor_dtype).replace("torch.", ""))
        self.world = World.detect(self.device)
        weights = WeightSource.of(reference)  # not kept: the layers hold what they need of it
        #: θ0 of the parameters outside the target layers that fine-tuning changed, for the repair after JANUS
        self.outside = ({} if self.new_task_batches is None
                        else changed_outside(model, weights.reference, modules))
        #: Where θ0, θ_t, the projection and the factors live, and the predicted peaks (also in the report).
        self.memory_plan = self._plan_memory(modules, factor_dtype, reference_borrowed=weights.reference_borrowed,
                                             backup_kept=weights.finetuned is None and not weights.rebuilt,
                                             reference_held=weights.held(set(modules)) != set())
        #: The target layers (θ0, θ̂, θ_t of each) and which point the model holds.
        self.layers = self._build_layers(modules, weights)
        self.timer = PhaseTimer(self.device)
        self.workspace = self.observer.make_workspace()
        chosen = self.memory_plan.factor_dtype
        self.store = FactorStore(self.config.cache, self.device, factor_dtype=None if chosen == "float32" else chosen,
                                 memory_budget_bytes=(memory_budget_bytes if memory_budget_bytes is not None
                                                      else self.memory_plan.factor_host_budget),
                                 offload=self.memory_plan.placements["factors"] == "host",
                                 host_blocks=False if self.world.active else None)
        self.jacobians = JacobianSource(self.store, self.device, self.config, self.workspace, self.timer,
                                        self.observer)
        # Under data parallelism each rank captures its share of the replay; factors are then gathered.
        self.local_batches = self.world.shard(self.batches)
        # FSDP and ZeRO-3 all-gather weights inside every forward and backward, so all ranks must run as many
        # passes: a rank with a shorter share repeats a batch and discards what it measured.
        collective = passes_are_collective(model)
        self.idle_batches = self.batches[:1] * self.world.shortfall(self.batches) if collective else []

    def _read_new_task(self, new_task: Any, validation: Any, modules: dict[str, nn.Module]) -> None:
        """The repair's samples, checked against the replay now, before any work (``new_task_batches`` and
        ``new_task_validation``, None without a repair), and why a repair asked for is skipped."""
        #: why a repair asked for (``config.distill_steps``) is not run, for the report; None otherwise
        self.repair_skipped: Optional[str] = None
        self.new_task_batches = self._new_task_batches(new_task, modules)
        self.new_task_validation = (None if self.new_task_batches is None or validation is None
                                    else self._labelled(validation, "new-task validation",
                                                        "give some, or none to hold out every eighth new-task sample"))
        #: the replay as each distillation step takes it (JANUS's batches are sized for its captures)
        self.repair_batches = (None if self.new_task_batches is None
                               else rebatch(self.batches, self.config.distill_replay_batch_size))
        if self.repair_batches is not None:
            check_samples(self.repair_batches, self.new_task_batches, self.new_task_validation)

    def _new_task_batches(self, new_task: Any, modules: dict[str, nn.Module]) -> Optional[list[dict[str, Tensor]]]:
        """The new task's batches for the repair after JANUS (every rank holds them all and takes its rows of each),
        None when there is no repair. Everything the repair cannot do is refused here, before any work."""
        if not self.config.distill_steps:
            return None
        if new_task is None:
            self.repair_skipped = ("no new-task samples were given, so the gain the repair must keep cannot be "
                                   "measured: the JANUS point is kept (pass new_task=, JanusCallback(..., "
                                   "trainer=trainer), or hf-janus merge --new-task-samples)")
            logger.warning("JANUS: distill_steps=%d but %s", self.config.distill_steps, self.repair_skipped)
            return None
        for name, module in modules.items():
            rule = rule_for(module)
            if self.defer_repair:  # the caller's space trains other tensors than these weights
                break
            if rule.quantized or is_sharded(module.weight) or is_zero3_param(module.weight):
                raise JanusError(f"the repair after JANUS (distill_steps) trains the target layers' weights, and "
                                 f"{name} is {'quantized' if rule.quantized else 'sharded (FSDP2 or ZeRO-3)'}: set "
                                 "distill_steps=0, or rectify the saved adapter or model with JanusMerger / rectify")
        return self._labelled(new_task, "new-task", "give what fine-tuning trained on, or set distill_steps=0")

    def _labelled(self, samples: Any, what: str, fix: str) -> list[dict[str, Tensor]]:
        """New-task samples batched in their order, refused unless there are some (``fix`` says what to do) and each
        is in the vocabulary and has a token that carries loss."""
        if hasattr(samples, "__len__") and len(samples) == 0:
            raise JanusError(f"the {what} samples are empty: {fix}")
        batches = prepare_replay(samples, self.config.new_task_batch_size, group_by_length=False)
        check_vocabulary(batches, self.model, what=what)
        unlabelled = samples_without_loss(batches)
        if unlabelled:
            raise JanusError(f"{len(unlabelled)} {what} sample(s) have no token that carries loss (the first at "
                             f"{unlabelled[0]}, counting from 0): give them labels or drop them")
        return batches

    def _plan_memory(self, modules: dict[str, nn.Module], factor_dtype: str,
                     reference_borrowed: bool, backup_kept: bool, reference_held: bool) -> MemoryPlan:
        """The memory plan (:mod:`.memory_plan`), before anything is allocated; refuses a run that cannot fit."""
        cfg = self.config
        shapes = []
        for module in modules.values():
            rule = rule_for(module)
            # a quantized layer is refused by _build_layers; its shape still counts here
            shapes.append(LayerShape(*rule.matrix_shape(module), 2 if rule.quantized else module.weight.element_size()))
        floats = [p for p in self.model.parameters() if p.is_floating_point()]
        constraint = make_constraint(cfg)
        work = Workload(
            layers=shapes, num_samples=sum(int(b["input_ids"].shape[0]) for b in self.batches),
            rows_per_sample=constraint.rows_per_sample,
            batch_size=max(int(b["input_ids"].shape[0]) for b in self.batches),
            seq_len=max(int(b["input_ids"].shape[1]) for b in self.batches), rank=cfg.compression_rank,
            activation_itemsize=floats[0].element_size() if floats else 4,
            matmul_itemsize=torch.empty((), dtype=getattr(torch, cfg.ghost_matmul)).element_size(),
            materialize_max_bytes=cfg.materialize_max_bytes, captures_alive=CAPTURES_ALIVE[cfg.step_control],
            logits_copies=constraint.logits_copies,
            randomized=resolve_method(cfg.compression, self.device) == "randomized",
            reference_borrowed=reference_borrowed, backup_kept=backup_kept, reference_held=reference_held,
            heap_retention=heap_retention(),
            # a step's two passes, the replay batch's and the new-task batch's, are alive together for its backward
            repair_tokens=(max((b["input_ids"].numel() for b in self.new_task_batches), default=0)
                           + max(b["input_ids"].numel() for b in self.repair_batches)
                           if self.new_task_batches is not None else 0),
            repair_outside_numel=sum(t.numel() for t in self.outside.values()),
            repair_replay_tokens=counted_tokens(self.batches) if self.new_task_batches is not None else 0,
            repair_numel=self.repair_numel,
            **model_dimensions(self.model, shapes))
        check_cache_directory(cfg.cache)
        in_use, capacity = self.observer.measure_memory(self.device, cfg.cache)
        capacity = self.world.shared_capacity(in_use, capacity)
        plan = plan_schedule(work, self.device, cfg.cache, in_use, capacity, cfg.captures, cfg.step_control,
                             factor_dtype)
        logger.info(plan.summary())
        if not plan.fits:
            raise JanusError(f"JANUS would run out of memory: {plan.notes[0]}. Nothing was changed.")
        return plan

    def _home(self, piece: str) -> torch.device:
        """Where the memory plan keeps ``piece`` between uses."""
        return self.device if self.memory_plan.placements[piece] == "device" else torch.device("cpu")

    def _build_layers(self, modules: dict[str, nn.Module], weights: WeightSource) -> TargetLayers:
        reshard(self.model)
        storages = {storage_of(p) for p in self.model.parameters()} - {None}
        # Under FSDP and ZeRO-3 each read is a collective: every rank walks the same layers in the same order.
        layers = [build_target_layer(name, module, weights, storages, self._home("theta0"), self._home("current"))
                  for name, module in modules.items()]
        return TargetLayers(self.model, layers, self.device)

    def capture(self, tag: str) -> ReplayLosses:
        """One Jacobian evaluation at the point the model holds: every target layer's compressed factors, stored as
        ``tag`` (every rank's samples, in rank order), and the per-sample replay losses."""
        self.observer.capturing(tag)
        self.workspace.clear()  # held gradient buffers would add to the forward/backward's peak
        targets = {layer.name: (layer.module, layer.d_in, layer.d_out) for layer in self.layers}
        cfg = self.config
        kinds = dict(compression=cfg.compression, constraint=make_constraint(cfg))
        result = capture_factors(self.model, targets, self.local_batches, self.store, tag, cfg.compression_rank,
                                 self.timer,
                                 **kinds)
        if self.idle_batches:
            capture_factors(self.model, targets, self.idle_batches, self.store, "_idle", cfg.compression_rank,
                            self.timer, **kinds)
            self.store.drop("_idle")
        shapes = {layer.name: (layer.d_in, layer.d_out) for layer in self.layers}
        return self.observer.captured(tag, combine_ranks(self.world, self.store, result, shapes, self.device,
                                                         self.timer))

    def make_loop(self, report: Optional[RectificationReport] = None, budget: Optional[Budget] = None,
                  bar: Any = None) -> StepLoop:
        """The step loop over this rectifier's layers, captures and store (what :meth:`run` runs). Given alone, for
        callers that drive its phases themselves (benchmarks, tests): a fresh report, no budget, no progress bar."""
        report = report if report is not None else RectificationReport(config=self.config.to_dict())
        budget = budget if budget is not None else Budget(None, None, self.observer.clock)
        bar = bar if bar is not None else tqdm(disable=True)
        return StepLoop(self, report, budget, bar)

    @torch.no_grad()
    def run(self) -> RectificationResult:
        """Rectify: the model's target layers end at θ_rect (on failure, at θ̂ exactly, and an error says why).
        Returns the :class:`RectificationResult` (also kept as :attr:`result`); its ``report`` says what was done."""
        start = time.perf_counter()
        report = RectificationReport(config=self.config.to_dict())
        budget = Budget(self.config.max_evaluations, self.config.max_seconds, self.observer.clock)
        bar = tqdm(desc="JANUS rectification", unit="eval", disable=not self.progress, leave=False)
        loop = self.make_loop(report, budget, bar)
        loop.phase = "measuring the fine-tuned replay loss"
        try:
            finetuned_loss = self._finetuned_loss()
            loop.phase = "capturing the Jacobian at the reference weights"
            self.layers.rewrite_current()
            base = self.capture("c0")
            report.num_jacobian_evals = 1
            bar.update(1)
            report.num_samples, report.num_tokens = base.num_samples, int(base.sample_tokens.sum())
            # the fine-tune's replay-loss rise, the loss rules' unit (the paper's test does not need it)
            rise = finetuned_loss.loss - base.loss if loop.rule.needs_rise else math.nan
            last = loop.run(base, rise)
            if self.world.active:
                loop.phase = "synchronizing the rectified weights across ranks"
                self._synchronize()
            self._reference_for_statistics(loop, report)
            loop.phase = "computing per-layer statistics"
            report.layers = layer_statistics(self.layers, self.jacobians)
            report.memory_plan = self.memory_plan.to_dict()
            report.replay_loss = {"reference": base.loss, "finetuned": finetuned_loss.loss, "rectified": last.loss}
            jacobians = ({layer.name: self.jacobians.jacobian(layer.name, "c0", pooled=False, exact=True)
                          for layer in self.layers} if self.keep_reference_factors else {})
            if self.new_task_batches is not None and not self.defer_repair:
                loop.phase = "repairing after JANUS (distillation)"
                loop.release_current()
                self.store.close()  # the captures are read; the distillation needs their memory
                with self.timer.phase("repair"):
                    report.repair = self.repair(WeightSpace(self.layers, self.outside))
            elif self.repair_skipped is not None:
                report.repair = RepairReport(keep_gain=self.config.keep_gain, reason=self.repair_skipped)
        except BaseException as err:
            self._fail(err, loop.phase)
        finally:
            loop.release_current()
            self.workspace.clear()
            bar.close()
            self.store.close()
        self.timer.add("io", self.store.io_seconds)
        self.timer.add("total", time.perf_counter() - start)
        report.timings = self.timer.as_dict()
        self.result = RectificationResult(report, {
            layer.name: LayerResult(name=layer.name, rule=layer.rule, weights=layer.weights, rectified=layer.current,
                                    jacobian=jacobians.get(layer.name))
            for layer in self.layers})
        logger.info(report.summary())
        return self.result

    def repair(self, space: RepairSpace) -> RepairReport:
        """The repair after JANUS (``config.distill_steps``) on this run's replay and new-task samples, in
        ``space``, from the point the model holds; the model ends at the point it chose. :meth:`run` calls it in the
        target layers' weights; with ``defer_repair`` the caller does, after :meth:`run`, and on a failure puts back
        what it changed itself."""
        if self.new_task_batches is None:
            raise JanusError("the repair after JANUS needs distill_steps > 0 and new-task samples")
        return Repair(space, self.repair_batches, self.new_task_batches, self.config, self.world,
                      progress=self.progress,
                      new_task_validation=self.new_task_validation, autocast=self.repair_autocast).run()

    def release(self) -> None:
        """Free the tensors the run keeps after it ends: θ0, θ̂ (and its backup), θ_t, the kept Jacobians and any
        factors, in :attr:`layers` and in :attr:`result`'s layers (which callers that need them read before). The
        report stays (``result.report``, ``result.layers`` empty), and so do :attr:`local_batches`, the replay's
        token ids. For callers that keep the rectifier after the run, as the Trainer callback does: otherwise its
        copies of the target layers (possibly on the accelerator) would outlive the run."""
        if self.result is not None:
            self.result.release()
            # a new result: a caller's reference to the old one keeps its layers, this rectifier no longer does
            self.result = RectificationResult(self.result.report)
        self.layers.release_current_jacobians()
        self.layers = TargetLayers(self.model, [], self.device)
        self.outside = {}
        self.store.close()
        self.workspace.clear()

    def _reference_for_statistics(self, loop: StepLoop, report: RectificationReport) -> None:
        """Make sure θ0's capture (tag ``"c0"``), against which the residuals are measured, is stored in float32.

        captures="two" dropped it after the first step: it is taken again. Factors stored below float32 (bf16) would
        measure ΔW_rect against the same rounded J0 its projection removed, a residual near zero whatever the
        rectification left along the true J0: θ0 is captured again in float32 (one more pass, in the memory of the
        captures dropped first) and J0 ΔW is measured on it too. Where the dropped captures' page-locked memory
        cannot be given back (an older torch), a float32 capture would be pinned beside it: the residuals are then
        measured against J0 in the factors' dtype, and the report says so."""
        dtype = self.store.factor_dtype
        rounded = dtype is not None and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps
        exact = rounded and self.store.host_cache_releasable()
        report.residual_jacobian = REFERENCE_JACOBIAN
        if rounded and not exact:
            report.residual_jacobian = rounded_reference(dtype)
            logger.warning("JANUS: this torch cannot give pinned host memory back (torch.accelerator."
                           "empty_host_cache), so θ0 is not captured again in float32 for the statistics: the "
                           "residuals are measured against %s", report.residual_jacobian)
        if self.store.has("c0") and not exact:
            return
        loop.phase = "capturing θ0 again for the statistics" + (" in float32" if exact else "")
        if exact:
            loop.release_current()
            for tag in sorted(self.store.captures):
                self.store.drop(tag)
            self.store.release_cached_host_memory()
            self.store.keep_exact("c0")
            for layer in self.layers:
                layer.jvp0 = None  # measured on the rounded J0: the statistics measure it again on the float32 one
        self.layers.write_reference("c0")
        self.capture("c0")
        report.recaptures += 1
        self.layers.hold_current()

    def _finetuned_loss(self) -> ReplayLosses:
        with self.timer.phase("forward_backward"):
            finetuned_loss = replay_losses(self.model, self.local_batches)
            if self.idle_batches:
                replay_losses(self.model, self.idle_batches)
        return combine_losses(self.world, finetuned_loss) if self.world.active else finetuned_loss

    def _synchronize(self) -> None:
        """θ_rect is rank 0's: whole matrices travel, since under FSDP each rank holds a different slice."""
        for layer in self.layers:
            on_device = layer.current.to(self.world.device)
            self.world.broadcast_(on_device)
            layer.current.copy_(on_device)
        self.layers.rewrite_current()

    def _fail(self, err: BaseException, phase: str) -> NoReturn:
        """Put θ̂ back, then raise: bad input and interruptions as they are, anything else as a
        :class:`RectificationError` that says in which phase it happened."""
        self.layers.restore()
        if isinstance(err, (KeyboardInterrupt, SystemExit, JanusError)):
            logger.error("JANUS rectification stopped while %s; the model was restored to its fine-tuned weights",
                         phase)
            raise err
        hint = ""
        if isinstance(err, torch.OutOfMemoryError) or (
                isinstance(err, RuntimeError) and "out of memory" in str(err).lower()):
            hint = " Lower replay_batch_size or compression_rank, or set cache to a directory."
        raise RectificationError(
            f"JANUS rectification failed while {phase}: {type(err).__name__}: {err}. The model was restored "
            f"to its fine-tuned weights.{hint}"
        ) from err


def rectify(model: nn.Module, reference: Reference, replay: Any, config: Optional[JanusConfig] = None, *,
            progress: bool = True, finetuned: Optional[Mapping[str, Tensor]] = None,
            new_task: Any = None, new_task_validation: Any = None, tokenizer: Any = None,
            replay_options: Optional[ReplayOptions] = None) -> RectificationReport:
    """Rectify a fine-tuned model in place so that it forgets less of a past task.

    Args:
        model: the fine-tuned model (θ̂). Its target linear layers are overwritten with the rectified
            weights; every other parameter keeps its fine-tuned value, except with the repair after JANUS
            (``config.distill_steps``), which also trains and moves back toward θ0 every other parameter fine-tuning
            changed whose θ0 ``reference`` holds.
        reference: θ0, the weights before fine-tuning: a model with the same architecture, or a state
            dict holding ``"<layer name>.weight"`` for every target layer (native layout).
        replay: samples of the past task: a ``datasets.Dataset`` or list of dicts with ``input_ids``,
            optional ``attention_mask`` and ``labels`` (-100 = ignored; without labels every non-padding
            token counts), or a ``DataLoader`` yielding such batches; or anything
            :func:`~hf_janus.replay.resolve.resolve_replay` reads: rows of text (with ``tokenizer``), a file or
            dataset id, or replay that θ0 generates, generated by ``reference`` when it is a model (never by the
            fine-tuned model; for a state-dict reference generate it first with the model that holds θ0).
        config: :class:`JanusConfig`; defaults to the paper's settings (τ=0.95, β=0.7, r=32).
        progress: show a tqdm progress bar over trials.
        finetuned: θ̂ of every target layer (``"<layer name>.weight"``), when it is known more exactly than the
            model holds it, e.g. float32 θ0 + ΔW of an adapter merged into a bf16 model: ΔW is then taken from it
            (see :class:`Rectifier`). The model receives θ_rect rounded to its dtype.
        new_task: samples of what fine-tuning trained on (labelled, as ``replay`` takes them), for the repair after
            JANUS (``config.distill_steps``): it fits them, and keeps ``config.keep_gain`` of their gain.
        new_task_validation: held-out samples of the new task, for the repair's gain instead of every eighth of
            ``new_task`` (which it then fits whole).
        tokenizer: for replay or new-task samples given as text (a file, dataset id or rows of text).
        replay_options: how replay given by name or as rows of text is read (:class:`~hf_janus.ReplayOptions`, as
            ``JanusMerger`` reads it).

    Returns:
        A :class:`RectificationReport`. On failure the model is restored to θ̂ exactly and a
        :class:`~hf_janus.errors.RectificationError` (or :class:`~hf_janus.errors.JanusError` for bad input)
        says what happened.
    """
    generator = reference if isinstance(reference, nn.Module) else None
    replay = resolve_replay(replay, reference=generator, tokenizer=tokenizer, options=replay_options,
                            progress=progress).samples
    new_task, new_task_validation = (resolve_new_task(samples, tokenizer=tokenizer)
                                     for samples in (new_task, new_task_validation))
    weights = WeightSource(reference, finetuned=finetuned)
    return Rectifier(model, weights, replay, config, progress=progress, new_task=new_task,
                     new_task_validation=new_task_validation).run().report
