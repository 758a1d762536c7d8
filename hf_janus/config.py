"""Configuration of a JANUS rectification run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from hf_janus.engine.capture import CONSTRAINTS
from hf_janus.engine.compression import COMPRESSION_CHOICES
from hf_janus.engine.ghost import GHOST_MATMULS
from hf_janus.engine.step_control import FINAL_STEPS, STEP_CONTROLS
from hf_janus.serialization import known_fields

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class JanusConfig:
    """Hyper-parameters of JANUS (JAcobian NUll Space) rectification.

    Each field's ``metadata["help"]`` is its short description, from which the command line builds its options.

    Args:
        tau: acceptance threshold on the mean cosine of the principal angles between the Jacobian row
            spaces at the current point and at the trial point, averaged over layers. ``0`` gives
            single-step JANUS.
        beta: step-size decay factor applied after a rejected trial, in ``(0, 1)``.
        rank: rank ``r`` of the sequence-level SVD compression of the captured inputs and output
            gradients; ``None`` keeps every token (exact, more memory).
        compression: how that rank-r approximation is computed. ``"exact"``: QR + SVD of the core, the
            optimum (the paper's). ``"randomized"``: randomized subspace iteration, batched matrix products,
            within 1% of the optimum's error (tests/test_compression.py) and exact when a sample has at most
            ``rank + 16`` tokens; on a GPU it avoids one slow LAPACK call per sample and layer. ``"auto"`` (default):
            exact on the CPU, randomized on accelerators.
        target_modules: ``"all-linear"`` (every ``nn.Linear``/GPT-2 ``Conv1D`` except the output head),
            a list of module names or name suffixes, or a regular expression matched against full names.
        exclude_modules: names, suffixes or a regular expression of modules never rectified; the output
            embedding (``lm_head``) is always excluded from ``"all-linear"``.
        replay_batch_size: how many replay samples go through one forward/backward pass.
        max_steps: upper bound on rectification steps; when it is reached the remaining update is
            projected in one unchecked step (kept as ``final_step`` says) and the report says so.
        final_step: what the unchecked final step at ``max_steps`` may do. ``"guarded"`` (default): it is kept
            only if the replay loss there is no higher than at the last accepted point; otherwise that point is
            returned and ``report.discarded_final_step`` says what was left out, so the forced step never undoes
            the work. ``"paper"``: always kept, as the paper's Algorithm 1 (all of the update's remaining
            projection, whatever it costs on the replay).
        min_alpha: smallest step size tried; a step that would shrink below it is taken at ``min_alpha``
            and flagged in the report.
        step_control: how the step size α of each trial is chosen (the acceptance test c̄ ≥ τ on the whole
            replay is the same for both). ``"adaptive"`` (default): looks for the paper's step (the largest α on
            the grid 1, β, β², ... that passes) but jumps to the grid point predicted from the trials already made
            (``hf_janus.engine.step_control``), so that most steps cost one or two trials.
            ``"paper"``: the paper's Algorithm 1, α=1 at every step, shrunk by β until accepted.
        max_evaluations: budget in Jacobian evaluations (the capture at θ0 counts as one). When the next trial
            would exceed it, the loop stops at the last accepted point (θ0 if no step was accepted yet), the report
            says ``stopped_early`` and a warning names this knob. ``None``: no budget.
        max_seconds: budget in seconds of :meth:`Rectifier.run`; the loop stops at the last accepted point before
            a trial that would end past it (estimated from the mean evaluation time so far). ``None``: no budget.
        gram_dtype: dtype in which the Gram matrices and JVPs are accumulated and the eigendecompositions run.
        ghost_matmul: dtype of the ghost math's large matrix products (Gram blocks, JVPs, VJPs, materialized
            per-sample gradients). ``"float32"`` (default): float32 products (TF32 tensor cores on CUDA), sums
            accumulated in ``gram_dtype`` and one refinement sweep of each projection with a ``gram_dtype`` residual,
            which keeps the projection's null-space residual within 1e-6 of ``J ΔW`` (held on tiny layers by
            tests/test_ghost_explicit.py); about 1.7x faster on a CPU, far more on GPUs. ``"float64"``: every
            product in float64 (the slow reference path).
        gram_rcond: relative cutoff below which Gram eigenvalues count as zero (pseudo-inverse).
        damping: Tikhonov damping of the projection, relative to the largest eigenvalue of each layer's Gram: the
            update becomes ``ΔW - Jᵀ (J Jᵀ + λI)⁻¹ J ΔW`` with ``λ = damping · max eig(J Jᵀ)``, which keeps a share
            ``λ / (σ² + λ)`` of the update along a Jacobian direction of singular value σ instead of none. ``0``
            (default): the paper's exact null-space projection. An experiment of the stability-plasticity study
            (the forgetting benchmark's README); the acceptance test does not depend on it.
        materialize_max_bytes: largest per-layer per-sample gradient tensor the engine may materialize
            when that path is cheaper than the ghost path; also the most bytes of materialized gradients
            of the current point kept, over all layers, for the trials of a step. On CPU up to 256 MiB of
            released gradient buffers are also held for reuse between captures (``ghost.Workspace``).
        cache: ``"memory"`` or a directory where compressed captures are stored between passes.
        seed: seed for anything random (replay order is never shuffled; samples are grouped by length).
        acceptance: the test a trial step must pass (an experiment of the well-fit-past-task study). ``"cosine"``
            (default): the paper's, mean principal-angle cosine c̄ ≥ τ. ``"loss"``: the whole-replay loss, which each
            trial's capture measures anyway, rose from the current point by at most ``loss_tolerance · α`` times the
            fine-tune's rise. ``"both"``: both tests.
        loss_tolerance: with ``acceptance="loss"`` or ``"both"``, the share of the fine-tune's replay-loss rise that a
            step of size α may add, times α.
        constraint: the per-sample function of the replay whose Jacobian JANUS keeps unchanged. ``"loss"`` (default):
            the paper's, the summed next-token loss (at ``constraint_temperature``). ``"target_logit"``: the summed
            logit of each target token (the "ground-truth logit" of Orthogonal Gradient Descent, Farajtabar et al.,
            2020), whose gradient does not vanish where the past task is well fit. ``"logit_projections"``: per sample,
            ``constraint_projections`` sums of the logits projected on fixed random directions (OGD's output
            constraint; ``m · k`` Jacobian rows, ``k`` backward passes per replay batch). Both are experiments of the
            well-fit-past-task study, see the forgetting benchmark's README.
        constraint_projections: with ``constraint="logit_projections"``, the number ``k`` of random directions.
        constraint_temperature: softmax temperature T of the per-sample replay loss whose Jacobian JANUS keeps
            unchanged (``J₀ΔW = 0``). 1 (default) is the paper's loss. T > 1 softens confident predictions so
            they keep a gradient where the past task is well fit (an experiment of the well-fit-past-task
            study; the replay loss reported and compared stays at T = 1).
    """

    tau: float = field(default=0.95, metadata={
        "help": "acceptance threshold τ on the mean principal-angle cosine (0 = single-step JANUS)"})
    beta: float = field(default=0.7, metadata={"help": "step-size decay β after a rejected trial, in (0, 1)"})
    rank: Optional[int] = field(default=32, metadata={
        "help": "sequence compression rank r of the Jacobian factors (0 = no compression, every token kept)",
        "cli": "--compression-rank", "zero_is_none": True})
    compression: str = field(default="auto", metadata={
        "help": "how the rank-r compression is computed: exact (QR + SVD), randomized, or auto (exact on CPU, "
                "randomized on accelerators)", "choices": COMPRESSION_CHOICES})
    target_modules: Union[str, Sequence[str]] = field(default="all-linear", metadata={
        "help": "layers to rectify: all-linear, or module names/suffixes", "nargs": "+"})
    exclude_modules: Optional[Union[str, Sequence[str]]] = field(default=None, metadata={
        "help": "layers never rectified (names/suffixes)", "nargs": "+"})
    replay_batch_size: int = field(default=8, metadata={"help": "replay samples per forward/backward"})
    max_steps: int = field(default=50, metadata={"help": "maximum rectification steps"})
    final_step: str = field(default="guarded", metadata={
        "help": "the unchecked final step at max_steps: guarded (kept only if the replay loss is no higher than at "
                "the last accepted point) or paper (always kept)", "choices": FINAL_STEPS})
    min_alpha: float = field(default=1e-3, metadata={"help": "smallest step size α tried"})
    step_control: str = field(default="adaptive", metadata={
        "help": "how each trial's step size is chosen: adaptive (predicted from the trials so far) or paper "
                "(α=1, shrunk by β)", "choices": STEP_CONTROLS})
    max_evaluations: Optional[int] = field(default=None, metadata={
        "help": "budget of Jacobian evaluations; the loop stops at the last accepted point (0 = none)",
        "type": int, "zero_is_none": True})
    max_seconds: Optional[float] = field(default=None, metadata={
        "help": "budget in seconds; the loop stops at the last accepted point (0 = none)",
        "type": float, "zero_is_none": True})
    gram_dtype: torch.dtype = field(default=torch.float64, metadata={
        "help": "dtype of the Gram matrices and their eigendecompositions", "choices": tuple(_DTYPES)})
    ghost_matmul: str = field(default="float32", metadata={
        "help": "dtype of the ghost math's large products: float32 (TF32 on CUDA; float64 accumulation and a "
                "refinement sweep) or float64", "choices": GHOST_MATMULS})
    gram_rcond: float = field(default=1e-10, metadata={
        "help": "relative cutoff below which Gram eigenvalues count as zero"})
    damping: float = field(default=0.0, metadata={
        "help": "damping λ of the projection ΔW - Jᵀ(JJᵀ+λI)⁻¹JΔW, relative to the largest Gram eigenvalue of each "
                "layer (0 = the paper's exact projection)"})
    materialize_max_bytes: int = field(default=1 << 30, metadata={
        "help": "largest per-layer per-sample gradient tensor materialized when cheaper than the ghost path"})
    cache: str = field(default="memory", metadata={
        "help": "memory, or a directory where compressed captures are kept between passes"})
    seed: int = field(default=0, metadata={"help": "seed for anything random"})
    acceptance: str = field(default="cosine", metadata={
        "help": "the test a trial step must pass: cosine (c̄ ≥ τ, the paper's), loss (the replay loss rises by at most "
                "loss_tolerance·α of the fine-tune's rise) or both", "choices": ("cosine", "loss", "both")})
    loss_tolerance: float = field(default=0.05, metadata={
        "help": "acceptance=loss/both: share of the fine-tune's replay-loss rise a step of size α may add, times α"})
    constraint: str = field(default="loss", metadata={
        "help": "the per-sample function whose Jacobian is kept: loss (the paper's), target_logit or "
                "logit_projections",
        "choices": CONSTRAINTS})
    constraint_projections: int = field(default=4, metadata={
        "help": "constraint=logit_projections: random logit directions per replay sample (Jacobian rows per sample)"})
    constraint_temperature: float = field(default=1.0, metadata={
        "help": "softmax temperature of the replay loss whose per-sample Jacobian is kept (1 = the paper's)"})

    def __post_init__(self) -> None:
        if isinstance(self.gram_dtype, str):
            name = self.gram_dtype.replace("torch.", "")
            if name not in _DTYPES:
                raise ValueError(f"gram_dtype must be one of {sorted(_DTYPES)}, got {self.gram_dtype!r}")
            self.gram_dtype = _DTYPES[name]
        if isinstance(self.target_modules, tuple):
            self.target_modules = list(self.target_modules)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field outside its valid range."""
        _check(isinstance(self.tau, (int, float)) and 0.0 <= self.tau <= 1.0, "tau", self.tau, "a float in [0, 1]")
        _check(_is_real(self.constraint_temperature) and self.constraint_temperature > 0, "constraint_temperature",
               self.constraint_temperature, "a float > 0")
        _check(self.acceptance in ("cosine", "loss", "both"), "acceptance", self.acceptance,
               "'cosine', 'loss' or 'both'")
        _check(_is_real(self.loss_tolerance) and self.loss_tolerance > 0, "loss_tolerance", self.loss_tolerance,
               "a float > 0")
        _check(self.constraint in CONSTRAINTS, "constraint", self.constraint, " or ".join(repr(c) for c in CONSTRAINTS))
        _check(_is_int(self.constraint_projections) and self.constraint_projections >= 1, "constraint_projections",
               self.constraint_projections, "an int >= 1")
        _check(self.constraint == "loss" or self.constraint_temperature == 1.0, "constraint_temperature",
               self.constraint_temperature, "1 unless constraint='loss' (a temperature scales only the loss)")
        _check(isinstance(self.beta, (int, float)) and 0.0 < self.beta < 1.0, "beta", self.beta, "a float in (0, 1)")
        _check(
            self.rank is None or (_is_int(self.rank) and self.rank >= 1),
            "rank", self.rank, "None or an int >= 1",
        )
        _check(self.compression in COMPRESSION_CHOICES, "compression", self.compression,
               "'auto', 'exact' or 'randomized'")
        _check(
            isinstance(self.target_modules, str)
            or (isinstance(self.target_modules, list) and len(self.target_modules) > 0
                and all(isinstance(t, str) for t in self.target_modules)),
            "target_modules", self.target_modules, "'all-linear', a regex string or a non-empty list of names",
        )
        _check(
            self.exclude_modules is None or isinstance(self.exclude_modules, (str, list, tuple)),
            "exclude_modules", self.exclude_modules, "None, a regex string or a list of names",
        )
        _check(_is_int(self.replay_batch_size) and self.replay_batch_size >= 1,
               "replay_batch_size", self.replay_batch_size, "an int >= 1")
        _check(_is_int(self.max_steps) and self.max_steps >= 1, "max_steps", self.max_steps, "an int >= 1")
        _check(isinstance(self.min_alpha, (int, float)) and 0.0 < self.min_alpha <= 1.0,
               "min_alpha", self.min_alpha, "a float in (0, 1]")
        _check(self.step_control in STEP_CONTROLS, "step_control", self.step_control,
               " or ".join(repr(c) for c in STEP_CONTROLS))
        _check(self.final_step in FINAL_STEPS, "final_step", self.final_step, " or ".join(repr(c) for c in FINAL_STEPS))
        _check(self.max_evaluations is None or (_is_int(self.max_evaluations) and self.max_evaluations >= 2),
               "max_evaluations", self.max_evaluations, "None or an int >= 2 (θ0's capture and one trial)")
        _check(self.max_seconds is None or (_is_real(self.max_seconds) and self.max_seconds > 0),
               "max_seconds", self.max_seconds, "None or a number of seconds > 0")
        _check(self.gram_dtype in (torch.float64, torch.float32), "gram_dtype", self.gram_dtype,
               "torch.float64 or torch.float32")
        _check(self.ghost_matmul in GHOST_MATMULS, "ghost_matmul", self.ghost_matmul,
               " or ".join(repr(c) for c in GHOST_MATMULS))
        _check(isinstance(self.gram_rcond, (int, float)) and 0.0 <= self.gram_rcond < 1.0,
               "gram_rcond", self.gram_rcond, "a float in [0, 1)")
        _check(_is_real(self.damping) and self.damping >= 0.0, "damping", self.damping, "a float >= 0")
        _check(_is_int(self.materialize_max_bytes) and self.materialize_max_bytes >= 0,
               "materialize_max_bytes", self.materialize_max_bytes, "an int >= 0")
        _check(isinstance(self.cache, (str, os.PathLike)) and str(self.cache) != "",
               "cache", self.cache, "'memory' or a directory path")
        _check(_is_int(self.seed), "seed", self.seed, "an int")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gram_dtype"] = str(self.gram_dtype).replace("torch.", "")
        out["cache"] = str(self.cache)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JanusConfig":
        return cls(**known_fields(cls, data, strict=True))

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json_string(cls, text: str) -> "JanusConfig":
        return cls.from_dict(json.loads(text))

    def save(self, path: Union[str, os.PathLike]) -> None:
        from hf_janus.io_utils import atomic_write_text

        atomic_write_text(path, self.to_json_string() + "\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "JanusConfig":
        """Read a config saved by :meth:`save`; a file that is not a JSON object raises ``ValueError`` naming it."""
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        try:
            data = json.loads(text)
        except ValueError as err:
            raise ValueError(f"the config file {os.fspath(path)!r} is not JSON ({err}); write it with "
                             "JanusConfig.save, or as a JSON object of JanusConfig fields") from err
        if not isinstance(data, dict):
            raise ValueError(f"the config file {os.fspath(path)!r} holds a JSON {type(data).__name__}, not an object "
                             "of JanusConfig fields")
        return cls.from_dict(data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, value: Any, valid: str) -> None:
    if not ok:
        raise ValueError(f"JanusConfig.{name}={value!r} is invalid: expected {valid}")
