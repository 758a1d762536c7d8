"""Multi-step adaptive JANUS rectification (paper, Algorithm 1) and the public :func:`rectify` entry point.

Data flow: model + replay -> :mod:`.capture` (compressed X, A per layer) -> :mod:`.ghost` (Gram, projection,
principal angles) -> new weights, a :class:`RectificationReport` and a :class:`~.result.RectificationResult`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from hf_janus.config import JanusConfig
from hf_janus.engine.capture import CaptureResult, capture_factors, model_device, replay_losses
from hf_janus.engine.compression import resolve_method
from hf_janus.engine.ghost import (
    GramEig,
    LayerJacobian,
    Workspace,
    eig_psd,
    mean_cosine,
    principal_cosines,
    project_with_jvp,
    tensor_cores,
)
from hf_janus.engine.layers import LayerRule, resolve_target_modules, rule_for
from hf_janus.engine.memory_plan import (
    CAPTURES_ALIVE,
    LayerShape,
    MemoryPlan,
    Workload,
    measure_in_use_and_capacity,
    model_dimensions,
    plan_memory,
)
from hf_janus.engine.report import LayerStats, RectificationReport, StepRecord, TrialRecord
from hf_janus.engine.result import LayerResult, RectificationResult
from hf_janus.engine.step_control import make_step_controller
from hf_janus.engine.store import FactorStore
from hf_janus.engine.timing import PhaseTimer
from hf_janus.errors import JanusError, RectificationError
from hf_janus.parallel.distributed import World
from hf_janus.parallel.sharding import (
    check_sharding,
    full_master_weight,
    full_shape,
    full_weight,
    passes_are_collective,
    reshard,
    write_full_,
)
from hf_janus.replay.prepare import check_vocabulary, prepare_replay

logger = logging.getLogger(__name__)

Reference = Union[nn.Module, Mapping[str, Tensor]]


@dataclass
class _Layer:
    """Everything the loop keeps about one target layer; weights in (d_out, d_in) layout."""

    name: str
    module: nn.Module
    rule: LayerRule
    # exact copy of the whole stored weight (native layout and dtype), for restoring; None where finetuned_exact,
    # written back, gives the stored weight bit for bit (no second copy of θ̂ is kept then)
    finetuned_backup: Optional[Tensor]
    # θ0, (d_out, d_in), in its own dtype: exact, and bf16 takes half the bytes of fp32. θ0, θ_t and the projection
    # live where the memory plan put them (the device, or the host when the device cannot hold them all).
    reference_matrix: Tensor
    current: Tensor  # θ_t, float32
    proj: Optional[Tensor] = None  # Δθ_t,proj, float32
    eig: Optional[GramEig] = None  # eigendecomposition of J_t J_tᵀ
    trial_eig: Optional[GramEig] = None
    path: str = "ghost"
    gram_rank0: int = 0
    jvp0: Optional[Tensor] = None  # J_0 (θ̂ - θ0), computed by the first projection, reused by the statistics
    current_jac: Optional[LayerJacobian] = None  # J_t with its materialized rows, kept for the trials of a step
    master_backup: Optional[Tensor] = None  # a ZeRO-3 optimizer's fp32 master copy of a low-precision weight
    # θ̂ as float32 (d_out, d_in) when the caller knows it more exactly than the model's weight holds it (an
    # adapter's update on a bf16 base: the model holds round(W + ΔW), whose difference from W is rounding noise
    # where ΔW is small), on the CPU
    finetuned_exact: Optional[Tensor] = None

    def reference(self, device: torch.device) -> Tensor:
        """θ0 as float32 (d_out, d_in) on ``device``; no copy for float32 weights already there."""
        return self.reference_matrix.to(device, torch.float32)

    @property
    def d_out(self) -> int:
        return self.current.shape[0]

    @property
    def d_in(self) -> int:
        return self.current.shape[1]

    def finetuned(self, device: torch.device) -> Tensor:
        """θ̂ as float32 (d_out, d_in) on ``device``: the exact one when given, else the model's weight."""
        if self.finetuned_exact is not None:
            return self.finetuned_exact.to(device, torch.float32)
        return self.rule.to_matrix(self.finetuned_backup).to(device, torch.float32)

    def stored_finetuned(self) -> Tensor:
        """θ̂ as the module stores it (native layout; the exact θ̂ is rounded to the weight's dtype on writing)."""
        if self.finetuned_backup is not None:
            return self.finetuned_backup
        return self.rule.from_matrix(self.finetuned_exact)

    def write(self, matrix: Tensor) -> None:
        self.rule.set_weight(self.module, matrix)

    def restore(self) -> None:
        write_full_(self.module.weight, self.stored_finetuned(), master=self.master_backup)


def _reference_weight(reference: Reference, name: str, module: nn.Module, rule: LayerRule) -> Tensor:
    """θ0 of one layer in the module's native layout."""
    if isinstance(reference, nn.Module):
        ref_module = dict(reference.named_modules()).get(name)
        ref_rule = rule_for(ref_module) if ref_module is not None else None
        if ref_rule is None:
            raise JanusError(
                f"the reference model has no linear layer {name!r}: pass the pre-fine-tuning model of the same "
                f"architecture as {type(module).__name__}'s owner, or a state dict of its weights"
            )
        # a quantized reference (the base a model was fine-tuned from, loaded in 4 or 8 bits): θ0 is its
        # dequantized weight, in the model's layout
        weight = rule.from_matrix(ref_rule.weight(ref_module)) if ref_rule.quantized else ref_module.weight
    elif isinstance(reference, Mapping):
        key = name + ".weight" if name + ".weight" in reference else name
        if key not in reference:
            missing = [name + ".weight"]
            sample = ", ".join(list(reference)[:3])
            raise JanusError(
                f"reference state dict is missing key(s) {missing}: it must hold the weight of every target layer, "
                f"keyed '<module name>.weight' as in model.state_dict() (found e.g. {sample or 'nothing'})"
            )
        weight = reference[key]
        if not isinstance(weight, Tensor):
            raise JanusError(f"reference[{key!r}] is a {type(weight).__name__}, expected a torch.Tensor")
    else:
        raise JanusError(
            f"reference must be a model with the same architecture or a state dict, got {type(reference).__name__}"
        )
    if not (weight.is_floating_point() or weight.is_meta):
        raise JanusError(f"reference weight of {name!r} has dtype {weight.dtype}: θ0 must be the layer's floating-point "
                         "weights (a state dict of the model before fine-tuning)")
    if full_shape(weight) != full_shape(module.weight):
        raise JanusError(
            f"reference weight of {name!r} has shape {full_shape(weight)} but the model's is "
            f"{full_shape(module.weight)}: the reference does not match this model's architecture"
        )
    return full_weight(weight)  # the reference model may be sharded too


@dataclass
class _KeptTrial:
    """A passing trial held while the controller checks a larger step size: its capture stays in the store."""

    tag: str
    trial: CaptureResult
    alpha: float
    score: float  # its acceptance score (_acceptance_score)
    index: int  # in StepRecord.trials
    eigs: dict[str, Optional[GramEig]]

    def take(self, layers: list[_Layer], record: StepRecord) -> tuple[str, CaptureResult, float, float]:
        """Make this the accepted trial of the step: its row-space eigendecompositions become the layers'."""
        for layer in layers:
            layer.trial_eig = self.eigs[layer.name]
        record.trials[self.index].accepted = True
        return self.tag, self.trial, self.alpha, self.score


class _Budget:
    """``JanusConfig.max_evaluations`` / ``max_seconds``: whether another Jacobian evaluation still fits."""

    def __init__(self, max_evaluations: Optional[int], max_seconds: Optional[float],
                 clock: Callable[[], float] = time.perf_counter):
        self.max_evaluations, self.max_seconds, self.clock = max_evaluations, max_seconds, clock
        self.start = clock()
        self.reason: Optional[str] = None
        self.knob = ""

    def exhausted(self, evaluations: int) -> bool:
        if self.reason is not None:
            return True
        if self.max_evaluations is not None and evaluations >= self.max_evaluations:
            self.reason = f"budget: max_evaluations={self.max_evaluations} reached"
            self.knob = "JanusConfig.max_evaluations (--max-evaluations)"
        elif self.max_seconds is not None:
            elapsed = self.clock() - self.start
            # Stop before a trial that would end past the limit, not after it: one evaluation can take minutes.
            if elapsed + elapsed / max(evaluations, 1) > self.max_seconds:
                self.reason = (f"budget: max_seconds={self.max_seconds:g} would be exceeded by the next evaluation "
                               f"({elapsed:.0f} s spent)")
                self.knob = "JanusConfig.max_seconds (--max-seconds)"
        return self.reason is not None


_CURRENT = "θ_t"  # Rectifier._held: the model holds the current point, not a trial

# The step controller's threshold for the loss-based acceptance tests (_acceptance_score maps a pass to score >= it).
SCORE_THRESHOLD = 0.5


def _check_finite(tensor: Tensor, what: str) -> None:
    if not torch.isfinite(tensor).all():
        raise JanusError(f"{what} contains NaN/Inf values; rectification needs finite weights")


def _storage_of(tensor: Tensor) -> Optional[int]:
    """Where a tensor's data lives, to tell a caller's tensor from the model's own; None where that cannot be read
    (meta tensors, FSDP's DTensors, ZeRO-3's partitioned parameters: none of them is a caller's plain tensor)."""
    if tensor.is_meta:
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _given_finetuned(finetuned: Mapping[str, Tensor], name: str, stored: Tensor) -> Tensor:
    """The caller's exact θ̂ of one layer (Rectifier's ``finetuned``), checked against the model's weight."""
    key = name + ".weight"
    weight = finetuned.get(key)
    if not isinstance(weight, Tensor):
        raise JanusError(f"finetuned has no tensor {key!r}: it must hold θ̂ of every target layer, keyed "
                         "'<module name>.weight' in the module's layout")
    if tuple(weight.shape) != tuple(stored.shape) or not weight.is_floating_point():
        raise JanusError(f"finetuned[{key!r}] is a {weight.dtype} tensor of shape {tuple(weight.shape)}; the "
                         f"layer's weight is {tuple(stored.shape)}: pass θ̂ in the module's layout")
    _check_finite(weight, f"fine-tuned weight of {name!r}")
    return weight


class Rectifier:
    """Runs Algorithm 1 on one model. Use :func:`rectify` unless you need the pieces."""

    def __init__(self, model: nn.Module, reference: Reference, replay: Any, config: Optional[JanusConfig] = None,
                 progress: bool = True, keep_reference_factors: bool = False,
                 factor_dtype: Optional[torch.dtype] = None, memory_budget_bytes: Optional[int] = None,
                 cosine_override: Optional[Callable[[int, float, float], float]] = None,
                 clock: Callable[[], float] = time.perf_counter, finetuned: Optional[Mapping[str, Tensor]] = None):
        """See :func:`rectify` for the first four arguments.

        Args:
            keep_reference_factors: keep each layer's θ0 Jacobian in :attr:`result` (``LayerResult.jacobian``)
                after :meth:`run`, for callers that post-process ΔW_rect (adapter re-factorization) and measure
                ``||J0 ΔW||``.
            factor_dtype: storage dtype of the compressed factors (default: float32 as computed);
                ``torch.bfloat16`` halves their memory, as the paper's float16 cache, at bf16 precision.
            memory_budget_bytes: with ``config.cache`` a directory, how many bytes of factors to keep in
                host memory before spilling to disk (default: half the available host memory).
            cosine_override: called as ``cosine_override(step, alpha, measured)`` after each trial's comparison,
                with the model holding the trial; what it returns replaces the measured mean cosine c̄ in the
                acceptance test and the report. For tests and experiments that drive the loop through chosen c̄
                landscapes; the comparison itself still runs (the next step projects with the trial's row space).
            clock: the time source of ``config.max_seconds`` (seconds, monotonic).
            finetuned: θ̂ of every target layer, keyed ``"<layer name>.weight"`` in the module's layout, when the
                caller knows it more exactly than the model's weights hold it: an adapter's update on a bf16 base
                (the model holds round(W + ΔW), and round(W + ΔW) − W is rounding noise where ΔW is small). ΔW is
                then ``finetuned − reference`` in float32, the model still runs the captures in its own dtype, and
                the caller keeps the float32 θ_rect (``result.layers[name].rectified``); the statistics measure it.
        """
        self.cosine_override = cosine_override
        self.clock = clock
        self._held: Optional[str] = None  # what the target layers hold: see _write_trial
        self.model = model
        self.keep_reference_factors = keep_reference_factors
        #: Set by :meth:`run`: the report and, per layer, θ0, θ̂, θ_rect (and J0 with keep_reference_factors).
        self.result: Optional[RectificationResult] = None
        self.config = config if config is not None else JanusConfig()
        if not isinstance(self.config, JanusConfig):
            raise JanusError(f"config must be a JanusConfig, got {type(self.config).__name__}")
        self.progress = progress
        self.device = model_device(model)
        modules = resolve_target_modules(model, self.config.target_modules, self.config.exclude_modules)
        check_sharding(model, {name: module.weight for name, module in modules.items()})
        self.batches = prepare_replay(replay, self.config.replay_batch_size)
        try:
            embeddings = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):  # not a language model: nothing to check ids against
            embeddings = None
        check_vocabulary(self.batches, getattr(embeddings, "num_embeddings", None))
        if isinstance(factor_dtype, str):
            factor_dtype = getattr(torch, factor_dtype.replace("torch.", ""))
        #: Where θ0, θ_t, the projection and the factors live, and the predicted peaks (also in the report).
        self.memory_plan = self._plan_memory(modules, factor_dtype, theta0_borrowed=isinstance(reference, Mapping),
                                             backup_kept=finetuned is None)
        self.layers = self._build_layers(modules, reference, finetuned)
        self.timer = PhaseTimer(self.device)
        self.workspace = Workspace()
        factors = self.memory_plan.placements["factors"]
        self.store = FactorStore(self.config.cache, self.device, factor_dtype=factor_dtype,
                                 memory_budget_bytes=(memory_budget_bytes if memory_budget_bytes is not None
                                                      else self.memory_plan.factor_host_budget),
                                 offload=factors == "host")
        # Under data parallelism each rank captures its share of the replay; factors are then gathered.
        self.world = World.detect(self.device)
        self.local_batches = self.world.shard(self.batches)
        # FSDP and ZeRO-3 all-gather weights inside every forward and backward, so all ranks must run as many
        # passes: a rank with a shorter share repeats a batch and discards what it measured.
        collective = passes_are_collective(model)
        self.idle_batches = self.batches[:1] * self.world.shortfall(self.batches) if collective else []

    def _plan_memory(self, modules: dict[str, nn.Module], factor_dtype: Optional[torch.dtype],
                     theta0_borrowed: bool, backup_kept: bool) -> MemoryPlan:
        """The memory plan (:mod:`.memory_plan`), before anything is allocated; refuses a run that cannot fit."""
        cfg = self.config
        shapes = []
        for module in modules.values():
            rule = rule_for(module)
            # a quantized layer is refused by _build_layers; its shape still counts here
            shapes.append(LayerShape(*rule.matrix_shape(module), 2 if rule.quantized else module.weight.element_size()))
        floats = [p for p in self.model.parameters() if p.is_floating_point()]
        work = Workload(
            layers=shapes, num_samples=sum(int(b["input_ids"].shape[0]) for b in self.batches),
            rows_per_sample=cfg.constraint_projections if cfg.constraint == "logit_projections" else 1,
            batch_size=max(int(b["input_ids"].shape[0]) for b in self.batches),
            seq_len=max(int(b["input_ids"].shape[1]) for b in self.batches), rank=cfg.rank,
            activation_itemsize=floats[0].element_size() if floats else 4,
            factor_itemsize=torch.empty((), dtype=factor_dtype or torch.float32).element_size(),
            matmul_itemsize=torch.empty((), dtype=getattr(torch, cfg.ghost_matmul)).element_size(),
            materialize_max_bytes=cfg.materialize_max_bytes, captures_alive=CAPTURES_ALIVE[cfg.step_control],
            tempered=cfg.constraint_temperature != 1.0,
            randomized=resolve_method(cfg.compression, self.device) == "randomized",
            theta0_borrowed=theta0_borrowed, backup_kept=backup_kept,
            **model_dimensions(self.model, shapes))
        in_use, capacity = measure_in_use_and_capacity(self.device)
        plan = plan_memory(work, self.device, cfg.cache, in_use, capacity)
        logger.info(plan.summary())
        if not plan.fits:
            raise JanusError(f"JANUS would run out of memory: {plan.notes[0]}. Nothing was changed.")
        return plan

    def _home(self, piece: str) -> torch.device:
        """Where the memory plan keeps ``piece`` between uses."""
        return self.device if self.memory_plan.placements[piece] == "device" else torch.device("cpu")

    def _build_layers(self, modules: dict[str, nn.Module], reference: Reference,
                      finetuned: Optional[Mapping[str, Tensor]]) -> list[_Layer]:
        reshard(self.model)
        layers = []
        self._model_storages = {_storage_of(p) for p in self.model.parameters()} - {None}
        # Under FSDP and ZeRO-3 each read below is a collective: every rank walks the same layers in the same order.
        for name, module in modules.items():
            rule = rule_for(module)
            if rule.quantized:
                raise JanusError(
                    f"layer {name!r} is quantized ({rule.name}): rectify() writes rectified weights into the model's "
                    "layers, and requantizing would round the update away. For a LoRA adapter trained on a quantized "
                    "base (QLoRA) use JanusCallback or JanusMerger, which write the update into the adapter; or load "
                    "the model unquantized, or leave these layers out with exclude_modules"
                )
            stored = full_weight(module.weight)
            _check_finite(stored, f"fine-tuned weight of {name!r}")
            ref = _reference_weight(reference, name, module, rule)
            _check_finite(ref, f"reference weight of {name!r}")
            # A state dict's tensors are the caller's and nothing here writes into θ0: no copy, unless one
            # shares storage with the model (θ0 = model.state_dict() itself), whose weights every trial overwrites.
            # A reference model's weights are copied: they can change under the result that holds them.
            owned = isinstance(reference, Mapping) and _storage_of(ref) not in self._model_storages | {None}
            ref_matrix = rule.to_matrix(ref).to(self._home("theta0"), copy=not owned)
            exact, backup = None, stored.clone().cpu()
            if finetuned is not None:
                exact = _given_finetuned(finetuned, name, stored)
                exact = rule.to_matrix(exact).to("cpu", torch.float32)
                if _storage_of(exact) in self._model_storages | {None}:
                    exact = exact.clone()
                if torch.equal(rule.from_matrix(exact).to(stored.dtype), backup):
                    backup = None
            layers.append(_Layer(
                name=name, module=module, rule=rule, finetuned_backup=backup,
                reference_matrix=ref_matrix, current=ref_matrix.to(self._home("current"), torch.float32, copy=True),
                master_backup=full_master_weight(module.weight), finetuned_exact=exact,
            ))
        return layers

    # ---- capture -------------------------------------------------------------------------------------
    def _capture(self, tag: str) -> CaptureResult:
        self.workspace.clear()  # held gradient buffers would add to the forward/backward's peak
        targets = {layer.name: (layer.module, layer.d_in, layer.d_out) for layer in self.layers}
        cfg = self.config
        kinds = dict(compression=cfg.compression, temperature=cfg.constraint_temperature, constraint=cfg.constraint,
                     projections=cfg.constraint_projections, seed=cfg.seed)
        result = capture_factors(self.model, targets, self.local_batches, self.store, tag, cfg.rank, self.timer,
                                 **kinds)
        if self.idle_batches:
            capture_factors(self.model, targets, self.idle_batches, self.store, "_idle", cfg.rank, self.timer, **kinds)
            self.store.drop("_idle")
        return self._combine_ranks(result)

    def _combine_ranks(self, result: CaptureResult) -> CaptureResult:
        """Give every rank the factors and losses of all replay samples, in rank order."""
        if not self.world.active:
            return result
        with self.timer.phase("communication"):
            for layer in self.layers:
                if self.store.has(result.tag, layer.name):
                    x, a = self.store.get(result.tag, layer.name)
                else:
                    x = torch.zeros(0, 0, layer.d_in, device=self.device)
                    a = torch.zeros(0, 0, layer.d_out, device=self.device)
                self.store.replace(result.tag, layer.name, *self.world.gather_factors(x, a))
            return self._combine_losses(result)

    def _jacobian(self, layer: _Layer, tag: str, pooled: bool = True, exact: bool = False) -> LayerJacobian:
        """The layer's Jacobian at capture ``tag``; ``exact``: every product in ``gram_dtype`` (for the callers that
        measure residuals on the result), otherwise in ``config.ghost_matmul``."""
        x, a = self.store.get(tag, layer.name)
        matmul = self.config.gram_dtype if exact else getattr(torch, self.config.ghost_matmul)
        return LayerJacobian(x.to(self.device), a.to(self.device), dtype=self.config.gram_dtype,
                             path=None, max_bytes=self.config.materialize_max_bytes,
                             workspace=self.workspace if pooled else None, matmul_dtype=matmul)

    @contextmanager
    def _ghost_phase(self) -> Iterator[None]:
        with self.timer.phase("ghost"), tensor_cores(self.device, getattr(torch, self.config.ghost_matmul)):
            yield

    def _write_all(self, alpha: Optional[float] = None) -> None:
        reshard(self.model)
        for layer in self.layers:
            current = layer.current.to(self.device)
            layer.write(current if alpha is None else current + alpha * layer.proj.to(self.device))

    # What the target layers hold is decided here only: θ_t (_CURRENT), a trial's tag, or None (unknown).
    def _write_trial(self, alpha: float, tag: str) -> None:
        """Write the trial point θ_t + α·Δθ_proj, to be captured as ``tag``."""
        self._held = None
        self._write_all(alpha)
        self._held = tag

    def _hold_current(self) -> None:
        """Make the model hold θ_t, unless it already does."""
        if self._held != _CURRENT:
            self._write_all()
            self._held = _CURRENT

    def _move_to(self, tag: str, alpha: float) -> None:
        """Take the trial ``tag`` at step size ``alpha``: θ_t ← θ_t + α·Δθ_proj, and the model holds the new θ_t.

        The model holds the taken trial only when it was the last one written; after a fall-back to a kept trial
        it holds the failed larger probe, so θ_t is written now, before a budget or anything else can end the loop.
        """
        self._release_current()
        for layer in self.layers:
            # in place (no second θ_t-sized tensor), rounded as the trial written by _write_trial was
            layer.current.add_(alpha * layer.proj.to(layer.current.device))
            layer.proj, layer.eig, layer.trial_eig = None, layer.trial_eig, None
        if self._held == tag:
            self._held = _CURRENT
        self._hold_current()

    def _warn_empty_null_spaces(self) -> None:
        for layer in self.layers:
            layer.gram_rank0 = layer.eig.rank
            if layer.eig.rank >= layer.d_in * layer.d_out:
                logger.warning(
                    "JANUS: the replay's Jacobian of %s has rank %d = d_in·d_out: its null space is empty, so the "
                    "whole fine-tuning update of this layer is removed. Replay fewer samples than the layer has "
                    "weights, or exclude the layer (exclude_modules)", layer.name, layer.eig.rank)

    # ---- the algorithm ------------------------------------------------------------------------------
    def _project_all(self, tag: str) -> None:
        # Every trial of this step compares against J_t: layers on the materialized path keep their per-sample
        # gradients until the step ends (as many as fit in materialize_max_bytes, in total) instead of
        # rebuilding them for each trial.
        budget = self.config.materialize_max_bytes
        with self._ghost_phase():
            for layer in self.layers:
                jac = self._jacobian(layer, tag)
                layer.path = jac.path
                if layer.eig is None:
                    layer.eig = eig_psd(jac.gram(), self.config.gram_rcond, self.config.damping)
                delta = layer.finetuned(self.device) - layer.current.to(self.device)
                proj, jvp = project_with_jvp(jac, delta, layer.eig)
                layer.proj = proj.to(self._home("proj"), torch.float32)
                if tag == "c0" and layer.jvp0 is None:
                    # θ_t = θ0 here, so this JVP is J_0 (θ̂ - θ0), the statistics' denominator.
                    layer.jvp0 = jvp
                if jac.path == "materialized" and jac.materialized_bytes <= budget:
                    budget -= jac.materialized_bytes
                    layer.current_jac = jac
                else:
                    jac.release()

    def _release_current(self) -> None:
        for layer in self.layers:
            if layer.current_jac is not None:
                layer.current_jac.release()
                layer.current_jac = None

    def _compare_all(self, current_tag: str, trial_tag: str) -> tuple[float, dict[str, Optional[float]]]:
        per_layer: dict[str, Optional[float]] = {}
        with self._ghost_phase():
            for layer in self.layers:
                cached = layer.current_jac is not None
                cur = layer.current_jac if cached else self._jacobian(layer, current_tag)
                trial = self._jacobian(layer, trial_tag)
                layer.trial_eig = eig_psd(trial.gram(), self.config.gram_rcond, self.config.damping)
                if layer.eig.rank == 0 and layer.trial_eig.rank == 0:
                    per_layer[layer.name] = None  # no constraint at either point: nothing to keep here
                elif layer.eig.rank == 0 or layer.trial_eig.rank == 0:
                    # The row space appeared or vanished (e.g. the trial's gradients overflowed to nothing): as far
                    # from "barely turned" as it gets, never a pass.
                    per_layer[layer.name] = 0.0
                else:
                    per_layer[layer.name] = mean_cosine(
                        principal_cosines(layer.eig, layer.trial_eig, cur.cross_gram(trial)))
                if not cached:
                    cur.release()
                trial.release()
        known = [c for c in per_layer.values() if c is not None]
        # With no layer constrained at either point c̄ is undefined (NaN): it fails the test instead of passing it.
        return (sum(known) / len(known) if known else math.nan), per_layer

    def run(self) -> RectificationReport:
        cfg = self.config
        report = RectificationReport(config=cfg.to_dict())
        start = time.perf_counter()
        budget = _Budget(cfg.max_evaluations, cfg.max_seconds, self.clock)
        bar = tqdm(desc="JANUS rectification", unit="eval", disable=not self.progress, leave=False)
        phase = "measuring the fine-tuned replay loss"
        try:
            with self.timer.phase("forward_backward"):
                finetuned_loss = replay_losses(self.model, self.local_batches)
                if self.idle_batches:
                    replay_losses(self.model, self.idle_batches)
            if self.world.active:
                finetuned_loss = self._combine_losses(finetuned_loss)
            phase = "capturing the Jacobian at the reference weights"
            self._held = None
            self._hold_current()
            base = self._capture("c0")
            report.num_jacobian_evals = 1
            bar.update(1)
            report.num_samples, report.num_tokens = base.num_samples, int(base.sample_tokens.sum())
            current_tag, last_capture = "c0", base
            # The controller sees the acceptance score: c̄ against τ, or (acceptance="loss"/"both") a score that passes
            # the controller's threshold exactly when the loss test (and the τ test) pass; see _acceptance_score.
            threshold = cfg.tau if cfg.acceptance == "cosine" else SCORE_THRESHOLD
            controller = make_step_controller(cfg.step_control, threshold, cfg.beta, cfg.min_alpha)
            # the fine-tune's replay-loss rise, the loss tests' unit (the paper's test does not need it)
            rise = finetuned_loss.loss - base.loss if cfg.acceptance != "cosine" else math.nan
            for step in range(cfg.max_steps):
                if budget.exhausted(report.num_jacobian_evals):
                    break
                phase = f"projecting the update at step {step}"
                self._project_all(current_tag)
                if step == 0:
                    self._warn_empty_null_spaces()
                final_allowed = step == cfg.max_steps - 1
                proj_norm = math.sqrt(sum(float(layer.proj.norm()) ** 2 for layer in self.layers))
                # Every replica must try the same step sizes: rank 0's choice is the one taken.
                alpha = self.world.from_rank0(controller.start_step(proj_norm, final=final_allowed))
                record = StepRecord(step=step, alpha=alpha)
                kept: Optional[_KeptTrial] = None  # a passing trial held while a larger α is checked
                taken: Optional[tuple[str, CaptureResult, float, float]] = None  # (tag, capture, α, score)
                while True:
                    if budget.exhausted(report.num_jacobian_evals):
                        if kept is not None:  # the budget ends the step, but a passing trial is at hand
                            taken = kept.take(self.layers, record)
                        break
                    tag = f"s{step}t{len(record.trials)}"
                    phase = f"evaluating trial α={alpha:.4g} at step {step}"
                    self._write_trial(alpha, tag)
                    trial = self._capture(tag)
                    report.num_jacobian_evals += 1
                    cbar, per_layer = self._compare_all(current_tag, tag)
                    if self.cosine_override is not None:
                        cbar = float(self.cosine_override(step, alpha, cbar))
                    cbar = self.world.from_rank0(cbar)  # every replica must take the same decision
                    score = self._acceptance_score(cbar, alpha, trial, last_capture, rise)
                    decision = controller.decide(alpha, score, forced_ok=final_allowed)
                    accepted = decision.action == "accept"
                    if accepted and final_allowed and not score >= threshold and cfg.final_step == "guarded":
                        report.discarded_final_step = self._undoing_final_step(alpha, cbar, trial, last_capture)
                    if report.discarded_final_step is not None:
                        # The unchecked final step would undo part of the repair: the last accepted point is kept.
                        record.trials.append(TrialRecord(step, alpha, cbar, per_layer, False, trial.loss))
                        self.store.drop(tag)
                        if kept is not None:
                            self.store.drop(kept.tag)
                        self._show_trial(bar, report, record, cfg.tau, 0)
                        break
                    record.trials.append(TrialRecord(step, alpha, cbar, per_layer, accepted, trial.loss))
                    logger.info("JANUS step %d trial α=%.4g: mean cosine %.5f (τ=%.3g) -> %s; replay loss %.5f",
                                step, alpha, cbar, cfg.tau, decision.action if decision.action != "try"
                                else ("keep, try larger" if decision.keep else "shrink"), trial.loss)
                    if decision.action == "try":
                        if decision.keep:
                            if kept is not None:
                                self.store.drop(kept.tag)
                            kept = _KeptTrial(tag, trial, alpha, score, len(record.trials) - 1,
                                              {layer.name: layer.trial_eig for layer in self.layers})
                        else:
                            self.store.drop(tag)
                        self._show_trial(bar, report, record, cfg.tau, None)
                        alpha = self.world.from_rank0(decision.alpha)
                        continue
                    if decision.action == "accept_kept":
                        if kept is None:
                            raise RuntimeError("the step controller fell back to a kept trial, but none is kept "
                                               "in this step")
                        self.store.drop(tag)
                        taken = kept.take(self.layers, record)
                    else:
                        if kept is not None:
                            self.store.drop(kept.tag)
                        taken = (tag, trial, alpha, score)
                    self._show_trial(bar, report, record, cfg.tau,
                                     controller.estimated_remaining_evaluations(taken[2], cfg.max_steps - step - 1))
                    break
                if taken is None:
                    # The budget ran out inside the step, or its unchecked final step was left out: θ_t, the last
                    # accepted point, is what the model keeps (written after the loop).
                    if report.discarded_final_step is not None:
                        found = report.discarded_final_step
                        report.stop_reason = (
                            f"max_steps reached: the unchecked final step (α={found['alpha']:.4g}, mean cosine "
                            f"{found['mean_cosine']:.4f}) raised the replay loss to {found['replay_loss']:.5g}, above "
                            f"{found['kept_replay_loss']:.5g} at the last accepted point, which is returned "
                            "(final_step='paper' keeps it)")
                        logger.warning("JANUS: %s", report.stop_reason)
                    self._release_current()
                    for layer in self.layers:
                        layer.proj, layer.trial_eig = None, None
                    break
                tag, trial, alpha, score = taken
                record.alpha, record.forced = alpha, not score >= threshold  # NaN (undefined) counts as forced
                report.steps.append(record)
                self._move_to(tag, alpha)
                if current_tag != "c0":
                    self.store.drop(current_tag)
                current_tag, last_capture = tag, trial
                if alpha == 1.0:
                    report.converged = not record.forced
                    report.stop_reason = "converged" if report.converged else "max_steps reached: final step taken unchecked"
                    break
                if record.forced:
                    logger.warning("JANUS step %d: step size would fall below min_alpha=%g; took α=%.4g failing the "
                                   "acceptance test (%s; mean cosine %.4f, τ=%.3g)", step, cfg.min_alpha, alpha,
                                   cfg.acceptance, record.taken.mean_cosine if record.taken else math.nan, cfg.tau)
            # Whatever ended the loop (convergence, a budget, a left-out final step), the model holds θ_t from here.
            self._hold_current()
            if budget.reason is not None:
                report.stopped_early = True
                report.stop_reason = budget.reason
                logger.warning("JANUS stopped early: %s after %d Jacobian evaluation(s) and %d accepted step(s). The "
                               "model holds the last accepted point%s. Raise %s to let it finish.", budget.reason,
                               report.num_jacobian_evals, len(report.steps),
                               "" if report.steps else " (θ0: no step was accepted, so the target layers lost the "
                               "whole fine-tuning update)", budget.knob)
            if self.world.active:
                # θ_rect is rank 0's: whole matrices travel, since under FSDP each rank holds a different slice.
                phase = "synchronizing the rectified weights across ranks"
                for layer in self.layers:
                    on_device = layer.current.to(self.world.device)
                    self.world.broadcast_(on_device)
                    layer.current.copy_(on_device)
                self._held = None
                self._hold_current()
            phase = "computing per-layer statistics"
            report.layers = self._layer_stats()
            report.memory_plan = self.memory_plan.to_dict()
            jacobians = {layer.name: self._jacobian(layer, "c0", pooled=False, exact=True)
                         for layer in self.layers} if self.keep_reference_factors else {}
            report.replay_loss = {"reference": base.loss, "finetuned": finetuned_loss.loss, "rectified": last_capture.loss}
        except BaseException as err:
            self._restore()
            if isinstance(err, (KeyboardInterrupt, SystemExit, JanusError)):
                logger.error("JANUS rectification stopped while %s; the model was restored to its fine-tuned weights",
                             phase)
                raise
            hint = ""
            if isinstance(err, torch.OutOfMemoryError) or (
                    isinstance(err, RuntimeError) and "out of memory" in str(err).lower()):
                hint = " Lower replay_batch_size or rank, or set cache to a directory."
            raise RectificationError(
                f"JANUS rectification failed while {phase}: {type(err).__name__}: {err}. The model was restored "
                f"to its fine-tuned weights.{hint}"
            ) from err
        finally:
            self._release_current()
            self.workspace.clear()
            bar.close()
            self.store.close()
        self.timer.add("io", self.store.io_seconds)
        self.timer.add("total", time.perf_counter() - start)
        report.timings = self.timer.as_dict()
        self.result = RectificationResult(report, {
            layer.name: LayerResult(name=layer.name, rule=layer.rule, reference_weight=layer.reference_matrix,
                                    finetuned_weight=(layer.finetuned_backup if layer.finetuned_exact is None
                                                      else layer.rule.from_matrix(layer.finetuned_exact)),
                                    rectified=layer.current,
                                    jacobian=jacobians.get(layer.name))
            for layer in self.layers})
        logger.info(report.summary())
        return report

    @staticmethod
    def _show_trial(bar: Any, report: RectificationReport, record: StepRecord, tau: float,
                    remaining: Optional[int]) -> None:
        """The newest trial on the progress bar: what a user needs to estimate the wait. The bar counts Jacobian
        evaluations; its total (hence tqdm's remaining time) is re-estimated after every accepted step."""
        trial = record.trials[-1]
        if remaining is not None:
            bar.total = report.num_jacobian_evals + remaining
        bar.update(1)
        bar.set_postfix(step=record.step, trial=len(record.trials), alpha=f"{trial.alpha:.3g}",
                        cos=f"{trial.mean_cosine:.4f}{'≥' if trial.mean_cosine >= tau else '<'}τ={tau:g}",
                        loss=f"{trial.replay_loss:.4f}")

    def _acceptance_score(self, cbar: float, alpha: float, trial: CaptureResult, current: CaptureResult,
                          rise: float) -> float:
        """What the step controller compares with its threshold (``config.acceptance``).

        ``"cosine"``: c̄ itself, against τ (the paper's test). ``"loss"``: the trial passes when the whole-replay
        loss rose from the current point by at most ``loss_tolerance · α`` times the fine-tune's rise (the update's
        share this step moves); the ratio of the rise to that allowance is mapped to ``1 − ratio · (1 −`` the
        threshold ``)`` so that it passes exactly when the ratio is at most 1, and the adaptive controller's model of
        the gap in α applies unchanged. ``"both"``: the larger of the loss ratio and the cosine's ``(1 − c̄)/(1 − τ)``.
        Undefined (NaN) fails.
        """
        cfg = self.config
        if cfg.acceptance == "cosine":
            return cbar
        # a replay the fine-tune did not hurt still gets a small allowance, so that the loop can move
        allowed = cfg.loss_tolerance * alpha * max(rise, 1e-3 * abs(current.loss), 1e-12)
        ratio = (trial.loss - current.loss) / allowed
        if cfg.acceptance == "both":
            cosine = (1.0 - cbar) / (1.0 - cfg.tau) if cfg.tau < 1.0 else (0.0 if cbar >= 1.0 else math.inf)
            # not max(): max(ratio, nan) is ratio, which would let an undefined c̄ pass
            ratio = ratio if cosine <= ratio else cosine
        if not math.isfinite(ratio):
            return -math.inf
        return 1.0 - ratio * (1.0 - SCORE_THRESHOLD)

    def _undoing_final_step(self, alpha: float, cbar: float, trial: CaptureResult,
                            current: CaptureResult) -> Optional[dict[str, float]]:
        """The record of an unchecked final step whose whole-replay loss is higher than at the last accepted point
        (NaN counts as higher), or None when it may be kept; the same answer on every rank (captures carry every
        rank's losses, see _combine_ranks)."""
        trial_loss, kept_loss = trial.loss, current.loss
        if trial_loss <= kept_loss:
            return None
        return {"alpha": alpha, "mean_cosine": cbar, "replay_loss": trial_loss, "kept_replay_loss": kept_loss}

    def _combine_losses(self, result: CaptureResult) -> CaptureResult:
        """Per-sample replay losses of every rank, in rank order."""
        losses = self.world.gather_vector(result.sample_loss.to(self.world.device)).cpu()
        tokens = self.world.gather_vector(result.sample_tokens.double().to(self.world.device)).cpu()
        return CaptureResult(result.tag, losses, tokens.round().long())

    def _layer_stats(self) -> list[LayerStats]:
        stats, rounded = [], []
        with self._ghost_phase():
            for layer in self.layers:
                jac = self._jacobian(layer, "c0")
                reference = layer.reference(self.device)
                delta = layer.finetuned(self.device) - reference
                # the caller of an exact θ̂ keeps θ_t itself; otherwise the model's (possibly rounded) weights count
                written = (layer.current.to(self.device) if layer.finetuned_exact is not None
                           else layer.rule.weight(layer.module).detach())
                rect = written.to(torch.float32) - reference
                before = float((layer.jvp0 if layer.jvp0 is not None else jac.jvp(delta)).norm())
                after = float(jac.precise_jvp(rect).norm())
                if (written.dtype in (torch.bfloat16, torch.float16) and layer.master_backup is None
                        and before > 0 and after > 0.05 * before):
                    unrounded = float(jac.precise_jvp(layer.current.to(self.device) - reference).norm())
                    if unrounded < 0.5 * after:
                        rounded.append((layer.name, after / before, unrounded / before, written.dtype))
                jac.release()
                stats.append(LayerStats(
                    name=layer.name, shape=[layer.d_out, layer.d_in], path=layer.path,
                    delta_norm=float(delta.norm()), rect_delta_norm=float(rect.norm()),
                    residual=(after / before) if before > 0 else None, gram_rank=layer.gram_rank0,
                ))
        if rounded:
            name, as_written, unrounded, dtype = max(rounded, key=lambda r: r[1])
            logger.warning(
                "%d of %d rectified layers lost much of the rectification to %s rounding of the written weights "
                "(worst: %s, residual ||J0 ΔW_rect|| / ||J0 ΔW|| = %.3g as written, %.3g before rounding): the "
                "correction is smaller than the weights' resolution. Rectify a float32 copy (model.float()) and "
                "save that, or keep the update as an adapter.",
                len(rounded), len(self.layers), str(dtype).replace("torch.", ""), name, as_written, unrounded)
        return stats

    def _restore(self) -> None:
        self._held = None
        reshard(self.model, after_error=True)
        for layer in self.layers:
            layer.restore()


def rectify(model: nn.Module, reference: Reference, replay: Any, config: Optional[JanusConfig] = None, *,
            progress: bool = True) -> RectificationReport:
    """Rectify a fine-tuned model in place so that it forgets less of a past task.

    Args:
        model: the fine-tuned model (θ̂). Its target linear layers are overwritten with the rectified
            weights; every other parameter keeps its fine-tuned value.
        reference: θ0, the weights before fine-tuning: a model with the same architecture, or a state
            dict holding ``"<layer name>.weight"`` for every target layer (native layout).
        replay: samples of the past task: a ``datasets.Dataset`` or list of dicts with ``input_ids``,
            optional ``attention_mask`` and ``labels`` (-100 = ignored; without labels every non-padding
            token counts), or a ``DataLoader`` yielding such batches.
        config: :class:`JanusConfig`; defaults to the paper's settings (τ=0.95, β=0.7, r=32).
        progress: show a tqdm progress bar over trials.

    Returns:
        A :class:`RectificationReport`. On failure the model is restored to θ̂ exactly and a
        :class:`~hf_janus.errors.RectificationError` (or :class:`~hf_janus.errors.JanusError` for bad input)
        says what happened.
    """
    return Rectifier(model, reference, replay, config, progress=progress).run()
