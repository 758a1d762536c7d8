"""The configuration of a JANUS rectification, beside the engine it configures, with the engine's choices.

This module imports nothing from the engine but the acceptance rules' registry (:mod:`hf_janus.engine.acceptance`,
which imports nothing from the engine itself): the engine's modules read their choice constants from here, and the
command line (``hf_janus.cli``) and the configuration reference (``docs/reference/configuration.md``, written by
``docs/generate_config_reference.py``) read each field's ``metadata["help"]``, its one description.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from hf_janus.engine.acceptance import make_acceptance, rule_named, rule_names
from hf_janus.engine.constraints import constraint_named, constraint_names, make_constraint
from hf_janus.kinds import describe_options, is_int, is_real, parse_options
from hf_janus.serialization import known_fields

#: ``JanusConfig.step_control``: how each trial's step size is chosen (:mod:`hf_janus.engine.step_control`).
STEP_CONTROLS = ("adaptive", "paper")
#: ``JanusConfig.final_step``: what the unchecked final step at ``max_steps`` may do.
FINAL_STEPS = ("guarded", "paper")
#: ``JanusConfig.acceptance``: the test a trial step must pass, the rules registered when this module was imported
#: (the built-ins; validation asks the registry itself, so a rule registered later is valid too).
ACCEPTANCES = rule_names()
#: ``JanusConfig.constraint``: the per-sample functions whose Jacobian is kept, the constraints registered when this
#: module was imported (:mod:`hf_janus.engine.constraints`; validation asks the registry itself).
CONSTRAINTS = constraint_names()
#: ``JanusConfig.captures``: how many Jacobian captures a run keeps alive (:mod:`hf_janus.engine.memory_plan`).
CAPTURE_SCHEDULES = ("auto", "all", "two")
#: ``JanusConfig.factor_dtype``: the storage dtype of the compressed Jacobian factors (:mod:`hf_janus.engine.store`).
FACTOR_DTYPES = ("auto", "float32", "bfloat16")
#: The sequence compressions (:mod:`hf_janus.engine.compression`); ``JanusConfig.compression`` adds ``"auto"``.
COMPRESSION_METHODS = ("exact", "randomized")
COMPRESSION_CHOICES = ("auto", *COMPRESSION_METHODS)
#: ``JanusConfig.distill_lr`` where the fine-tune's learning rate is not known (the callback takes a tenth of the
#: Trainer's: the rule both real-model runs were measured at, full weights and a LoRA's factors)
DEFAULT_DISTILL_LR = 1e-5
#: the same where the merger trains a saved LoRA's own factors: a tenth of the LoRA rate the real-model runs used
DEFAULT_ADAPTER_DISTILL_LR = 1e-4
#: the distillation's learning rate is the fine-tune's divided by this, where the callback knows it
REPAIR_LR_DIVISOR = 10
#: ``JanusConfig.distill_schedule``: how the distillation's learning rate runs over its steps
#: (:data:`hf_janus.engine.repair.SCHEDULES`)
DISTILL_SCHEDULES = ("constant", "linear", "cosine")
#: ``JanusConfig.ghost_matmul``: the dtype of the ghost math's large products (:mod:`hf_janus.engine.ghost`).
GHOST_MATMULS = ("float32", "float64")

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


#: what :class:`JanusConfig` says of keys people reach for that it does not have (PEFT's names for a LoRA's rank)
_ADAPTER_RANK_HINT = ("JanusConfig sets JANUS, not the adapter: the rank of JANUS's compression of the Jacobian "
                      "factors is compression_rank; a LoRA's rank is chosen where the adapter is written: "
                      "JanusCallback(adapter_rank=...), RectifiedDelta.save_adapter(adapter_rank=...), "
                      "hf-janus merge --adapter-rank")
FIELD_HINTS = {name: _ADAPTER_RANK_HINT for name in ("r", "rank", "lora_r", "lora_rank", "adapter_rank")}


def _refuse_unknown_fields(cls: type) -> type:
    """``cls(...)`` with a keyword that is not a field raises a :class:`~hf_janus.errors.JanusError` naming the field
    meant (the dataclass's own ``__init__`` raises a bare ``TypeError``)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        known_fields(cls, kwargs, strict=True, hints=FIELD_HINTS)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_refuse_unknown_fields
@dataclass
class JanusConfig:
    """Hyper-parameters of JANUS (JAcobian NUll Space) rectification; the defaults are the paper's (τ=0.95,
    β=0.7, r=32).

    Each field is described once, in its ``metadata["help"]``: the command line's options, this docstring's
    list below and the configuration reference are all made from it.
    """

    tau: float = field(default=0.95, metadata={"main": True,
        "help": "acceptance threshold τ on the mean cosine c̄ of the principal angles between the Jacobian row "
                "spaces at the current point and at the trial point, averaged over layers (0 = single-step "
                "JANUS)"})
    beta: float = field(default=0.7, metadata={
        "help": "step-size decay β after a rejected trial, in (0, 1): the step sizes tried lie on the grid 1, β, "
                "β², ..."})
    compression_rank: Optional[int] = field(default=32, metadata={"main": True,
        "help": "rank r of the sequence-level SVD compression of the captured inputs and output gradients (None, "
                "or 0 on the command line: no compression, every token kept: exact, more memory); not a LoRA's "
                "rank, which is adapter_rank where an adapter is written",
        "zero_is_none": True})
    compression: str = field(default="auto", metadata={"internal": True,
        "help": "how the rank-r approximation is computed: exact (per-sample QR + SVD: the optimum, as in the "
                "paper), randomized (batched subspace iteration, close to the optimum, much faster on accelerators) "
                "or auto (exact on the CPU, randomized on accelerators)", "choices": COMPRESSION_CHOICES})
    target_modules: Union[str, Sequence[str]] = field(default="all-linear", metadata={
        "help": "layers to rectify: all-linear (every nn.Linear and GPT-2 Conv1D except the output head), a list "
                "of module names or name suffixes (e.g. [\"q_proj\", \"v_proj\"]), or a regular expression matched "
                "against full names",
        "nargs": "+"})
    exclude_modules: Optional[Union[str, Sequence[str]]] = field(default=None, metadata={
        "help": "layers never rectified: names, suffixes or a regular expression (the output embedding, lm_head, "
                "is never part of all-linear)", "nargs": "+"})
    replay_batch_size: int = field(default=8, metadata={
        "help": "replay samples per forward/backward pass (a list or Dataset of samples is grouped by length "
                "first, so that batches carry little padding)"})
    max_steps: int = field(default=50, metadata={
        "help": "most rectification steps; the last allowed step is taken at α=1 unchecked (the remaining "
                "update in one step, kept as final_step says), and the report's stop reason says "
                "'max_steps reached'"})
    final_step: str = field(default="guarded", metadata={"method": True,
        "help": "the unchecked final step at max_steps: guarded (kept only if the replay loss there is no higher "
                "than at the last accepted point; otherwise that point is returned and "
                "report.discarded_final_step says what was left out) or paper (always kept, as Algorithm 1)",
        "choices": FINAL_STEPS})
    min_alpha: float = field(default=1e-3, metadata={"internal": True,
        "help": "smallest step size α tried; a step that would shrink below it is taken at min_alpha and flagged "
                "forced in the report"})
    step_control: str = field(default="adaptive", metadata={"method": True,
        "help": "how the step size α of each trial is chosen (the acceptance test, c̄ ≥ τ on the whole replay by "
                "default, is the same): adaptive (the paper's grid point, the largest α on 1, β, β², ... that "
                "passes, found by jumping to the point predicted from the trials so far and trying the point above "
                "only when it is predicted to pass: most steps cost one or two trials) or paper (Algorithm 1: α=1 "
                "at every step, shrunk by β until accepted)", "choices": STEP_CONTROLS})
    max_evaluations: Optional[int] = field(default=None, metadata={
        "help": "budget in Jacobian evaluations (θ0's capture counts as one): when the next trial would exceed "
                "it, the loop stops at the last accepted point (θ0 if none), the report says stopped_early and a "
                "warning names this knob (None, or 0 on the command line: no budget)",
        "type": int, "zero_is_none": True})
    max_seconds: Optional[float] = field(default=None, metadata={
        "help": "budget in seconds: the loop stops at the last accepted point before a trial that would end past "
                "it, estimated from the mean evaluation time so far; passes captures='two' repeats are not "
                "charged, so that both schedules evaluate the same trials (None, or 0 on the command line: no "
                "budget)",
        "type": float, "zero_is_none": True})
    gram_dtype: torch.dtype = field(default=torch.float64, metadata={"internal": True,
        "help": "dtype in which the Gram matrices and JVPs are accumulated and the eigendecompositions run",
        "choices": tuple(_DTYPES)})
    ghost_matmul: str = field(default="float32", metadata={"internal": True,
        "help": "dtype of the ghost math's large products (Gram blocks, JVPs, VJPs): float32 (TF32 tensor cores on "
                "CUDA; sums in gram_dtype and a refinement sweep keep the projection accurate; faster) or float64 "
                "(the slow reference path)", "choices": GHOST_MATMULS})
    gram_rcond: float = field(default=1e-10, metadata={"internal": True,
        "help": "relative cutoff below which Gram eigenvalues count as zero (a pseudo-inverse: rank-deficient "
                "Jacobians are fine)"})
    damping: float = field(default=0.0, metadata={"method": True,
        "help": "Tikhonov damping of the projection ΔW - Jᵀ(JJᵀ + λI)⁻¹JΔW, with λ = damping · the largest "
                "eigenvalue of each layer's Gram: a share λ/(σ² + λ) of the update along a Jacobian direction of "
                "singular value σ is kept instead of none (0 = the paper's exact projection; an experiment of "
                "the stability-plasticity study, see the forgetting benchmark; the acceptance test does not "
                "depend on it; the model card names it, as every setting that departs from the paper's)"})
    materialize_max_bytes: int = field(default=1 << 30, metadata={"internal": True,
        "help": "largest per-layer per-sample gradient tensor materialized where that is cheaper than the ghost "
                "path; also the most bytes of the current point's materialized gradients kept, over all layers, "
                "for the trials of a step (on a CPU up to 256 MiB of released buffers are also kept for reuse)"})
    cache: str = field(default="memory", metadata={
        "help": "memory, or a directory: compressed captures stay in host memory up to the memory plan's budget "
                "(half of the memory available by default) and spill there as safetensors files beyond it"})
    captures: str = field(default="auto", metadata={"internal": True,
        "help": "how many Jacobian captures the run keeps alive: all (θ0's for the whole run, the current "
                "point's, a passing trial the adaptive controller keeps while it probes a larger step, and the "
                "trial's: up to four, no pass repeated), two (the current point's and the trial's: θ0's is dropped "
                "after the first step and taken again for the statistics at the end, a kept trial's is dropped and "
                "taken again only if the loop goes on from it; one or a few more forward/backward passes, counted "
                "in the report's recaptures and not charged to max_seconds, and the same result) or auto (all "
                "when the memory plan fits them in memory, else two)", "choices": CAPTURE_SCHEDULES})
    factor_dtype: str = field(default="auto", metadata={"internal": True,
        "help": "storage dtype of the compressed Jacobian factors: float32 (as computed), bfloat16 (half the "
                "memory and disk, as the paper's float16 cache; on a tiny Llama the same decisions and a rectified "
                "update within 1e-3 of the float32 one, relative to |ΔW|: tests/engine/test_memory_plan.py; θ0 is "
                "then captured once more in float32, so that the report's residuals are measured against the "
                "float32 J0, not the rounded one the projection used) or auto (float32 unless the memory plan "
                "finds no schedule for it, then bfloat16, logged and recorded in the report's memory_plan)",
        "choices": FACTOR_DTYPES})
    seed: int = field(default=0, metadata={
        "help": "seed for anything random (the replay order is never shuffled: samples are grouped by length)"})
    acceptance: str = field(default="cosine", metadata={"method": True,
        "help": "the test a trial step must pass, a rule registered in hf_janus.engine.acceptance: "
                + "; ".join(f"{name}: {rule_named(name).summary}" for name in ACCEPTANCES),
        "choices": ACCEPTANCES})
    acceptance_options: dict[str, Any] = field(default_factory=dict, metadata={"method": True,
        "cli": "--acceptance-options", "type": parse_options, "metavar": "NAME=VALUE[,...]",
        "help": "the options of the acceptance rule, by name, as its kind declares them (unset: their defaults); "
                + describe_options(rule_named(name) for name in ACCEPTANCES)})
    constraint: str = field(default="loss", metadata={"method": True,
        "help": "the per-sample functions of the replay whose Jacobian JANUS keeps unchanged: "
                + "; ".join(f"{name}: {constraint_named(name).summary}" for name in CONSTRAINTS),
        "choices": CONSTRAINTS})
    constraint_options: dict[str, Any] = field(default_factory=dict, metadata={"method": True,
        "cli": "--constraint-options", "type": parse_options, "metavar": "NAME=VALUE[,...]",
        "help": "the options of the constraint, by name, as its kind declares them (unset: their defaults); "
                + describe_options(constraint_named(name) for name in CONSTRAINTS)})
    distill_steps: int = field(default=0, metadata={"main": True,
        "help": "the repair after JANUS: optimizer steps on the replay's KL divergence to θ0 that also fit the new "
                "task's samples (new_task_weight), from the JANUS point, after which the farthest point on the line "
                "back toward θ0 that keeps keep_gain of the new task's gain is taken, measured on held-out slices; "
                "needs the new task's samples (0 = off: the paper's method alone)"})
    keep_gain: float = field(default=0.95, metadata={"main": True,
        "help": "with distill_steps: the share of the fine-tune's new-task gain (its loss drop from θ0 to θ̂ on "
                "the held-out new-task samples) the chosen point must keep, in (0, 1]"})
    distill_lr: Optional[float] = field(default=None, metadata={"type": float, "metavar": "LR",
        "help": "with distill_steps: the Adam learning rate of the distillation (none: a tenth of the fine-tune's "
                "learning rate where JanusCallback knows it, the Trainer's; elsewhere "
                f"{DEFAULT_DISTILL_LR:g}, a tenth of a usual full fine-tune's, or {DEFAULT_ADAPTER_DISTILL_LR:g} where "
                "the merger trains a LoRA's own factors)"})
    distill_schedule: str = field(default="constant", metadata={
        "help": "with distill_steps: the distillation's learning rate over its steps: constant, or decayed from "
                "distill_lr to 0 along a line (linear) or a half cosine (cosine), as a Trainer's schedules",
        "choices": DISTILL_SCHEDULES})
    distill_replay_batch_size: int = field(default=8, metadata={
        "help": "with distill_steps: the replay samples in each distillation step, beside new_task_batch_size "
                "new-task samples (the replay's rows in JANUS's order, batched anew: JANUS's own batches stay "
                "replay_batch_size)"})
    new_task_weight: float = field(default=1.0, metadata={
        "help": "with distill_steps: the weight of the new task's cross-entropy beside the replay's KL in each "
                "distillation step (what keeps the gain while the past behaviour returns)"})
    new_task_batch_size: int = field(default=2, metadata={
        "help": "with distill_steps: the new task's samples fitted in each distillation step, beside one replay "
                "batch (they are usually longer than the replay's, so they set a step's cost)"})

    def __post_init__(self) -> None:
        if isinstance(self.gram_dtype, str):
            name = self.gram_dtype.replace("torch.", "")
            if name not in _DTYPES:
                raise ValueError(f"gram_dtype must be one of {sorted(_DTYPES)}, got {self.gram_dtype!r}")
            self.gram_dtype = _DTYPES[name]
        if isinstance(self.target_modules, tuple):
            self.target_modules = list(self.target_modules)
        for name in ("acceptance_options", "constraint_options"):  # its own copy: a dict given is not shared
            if isinstance(getattr(self, name), Mapping):
                setattr(self, name, dict(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field outside its valid range."""
        _check(isinstance(self.tau, (int, float)) and 0.0 <= self.tau <= 1.0, "tau", self.tau, "a float in [0, 1]")
        _check(self.captures in CAPTURE_SCHEDULES, "captures", self.captures,
               " or ".join(repr(c) for c in CAPTURE_SCHEDULES))
        _check(self.factor_dtype in FACTOR_DTYPES, "factor_dtype", self.factor_dtype,
               " or ".join(repr(c) for c in FACTOR_DTYPES))
        _check(isinstance(self.acceptance, str) and self.acceptance in rule_names(), "acceptance", self.acceptance,
               " or ".join(repr(c) for c in rule_names()) + " (or a rule registered with "
               "hf_janus.engine.acceptance.register)")
        _check(isinstance(self.acceptance_options, dict) and all(isinstance(k, str) for k in self.acceptance_options),
               "acceptance_options", self.acceptance_options, "a dict of the acceptance rule's options by name")
        make_acceptance(self)  # the rule's own options, checked by its kind
        _check(isinstance(self.constraint, str) and self.constraint in constraint_names(), "constraint",
               self.constraint, " or ".join(repr(c) for c in constraint_names()) + " (or a constraint registered "
               "with hf_janus.engine.constraints.register)")
        _check(isinstance(self.constraint_options, dict) and all(isinstance(k, str) for k in self.constraint_options),
               "constraint_options", self.constraint_options, "a dict of the constraint's options by name")
        make_constraint(self)  # the constraint's own options, checked by its kind
        _check(isinstance(self.beta, (int, float)) and 0.0 < self.beta < 1.0, "beta", self.beta, "a float in (0, 1)")
        _check(
            self.compression_rank is None or (is_int(self.compression_rank) and self.compression_rank >= 1),
            "compression_rank", self.compression_rank, "None or an int >= 1",
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
        _check(is_int(self.replay_batch_size) and self.replay_batch_size >= 1,
               "replay_batch_size", self.replay_batch_size, "an int >= 1")
        _check(is_int(self.max_steps) and self.max_steps >= 1, "max_steps", self.max_steps, "an int >= 1")
        _check(isinstance(self.min_alpha, (int, float)) and 0.0 < self.min_alpha <= 1.0,
               "min_alpha", self.min_alpha, "a float in (0, 1]")
        _check(self.step_control in STEP_CONTROLS, "step_control", self.step_control,
               " or ".join(repr(c) for c in STEP_CONTROLS))
        _check(self.final_step in FINAL_STEPS, "final_step", self.final_step, " or ".join(repr(c) for c in FINAL_STEPS))
        _check(self.max_evaluations is None or (is_int(self.max_evaluations) and self.max_evaluations >= 2),
               "max_evaluations", self.max_evaluations, "None or an int >= 2 (θ0's capture and one trial)")
        _check(self.max_seconds is None or (is_real(self.max_seconds) and self.max_seconds > 0),
               "max_seconds", self.max_seconds, "None or a number of seconds > 0")
        _check(self.gram_dtype in (torch.float64, torch.float32), "gram_dtype", self.gram_dtype,
               "torch.float64 or torch.float32")
        _check(self.ghost_matmul in GHOST_MATMULS, "ghost_matmul", self.ghost_matmul,
               " or ".join(repr(c) for c in GHOST_MATMULS))
        _check(isinstance(self.gram_rcond, (int, float)) and 0.0 <= self.gram_rcond < 1.0,
               "gram_rcond", self.gram_rcond, "a float in [0, 1)")
        _check(is_real(self.damping) and self.damping >= 0.0, "damping", self.damping, "a float >= 0")
        _check(is_int(self.materialize_max_bytes) and self.materialize_max_bytes >= 0,
               "materialize_max_bytes", self.materialize_max_bytes, "an int >= 0")
        _check(isinstance(self.cache, (str, os.PathLike)) and str(self.cache) != "",
               "cache", self.cache, "'memory' or a directory path")
        _check(is_int(self.seed), "seed", self.seed, "an int")
        _check(is_int(self.distill_steps) and self.distill_steps >= 0, "distill_steps", self.distill_steps,
               "an int >= 0 (0 = no repair after JANUS)")
        _check(is_real(self.keep_gain) and 0.0 < self.keep_gain <= 1.0, "keep_gain", self.keep_gain,
               "a float in (0, 1]")
        _check(self.distill_lr is None or (is_real(self.distill_lr) and self.distill_lr > 0), "distill_lr",
               self.distill_lr, "None or a float > 0")
        _check(self.distill_schedule in DISTILL_SCHEDULES, "distill_schedule", self.distill_schedule,
               " or ".join(repr(c) for c in DISTILL_SCHEDULES))
        _check(is_real(self.new_task_weight) and self.new_task_weight >= 0, "new_task_weight",
               self.new_task_weight, "a float >= 0")
        _check(is_int(self.distill_replay_batch_size) and self.distill_replay_batch_size >= 1,
               "distill_replay_batch_size", self.distill_replay_batch_size, "an int >= 1")
        _check(is_int(self.new_task_batch_size) and self.new_task_batch_size >= 1, "new_task_batch_size",
               self.new_task_batch_size, "an int >= 1")

    @classmethod
    def paper(cls, **overrides: Any) -> "JanusConfig":
        """The configuration of the paper's Algorithm 1, as published (:data:`PAPER`): the exact compression, α=1
        at every step shrunk by β until accepted, the last step kept unchecked, the per-sample loss's Jacobian, no
        repair after JANUS. The defaults differ where the project measured a faster or safer equivalent
        (``step_control``, ``final_step``, ``compression`` on accelerators). ``overrides`` change single fields,
        e.g. ``JanusConfig.paper(target_modules=["q_proj", "v_proj"])``."""
        return cls(**{**PAPER, **overrides})

    @property
    def repair_lr(self) -> float:
        """The distillation's learning rate: ``distill_lr``, or :data:`DEFAULT_DISTILL_LR` when it is None."""
        return self.distill_lr if self.distill_lr is not None else DEFAULT_DISTILL_LR

    def after_fine_tune(self, learning_rate: Optional[float]) -> "JanusConfig":
        """This configuration with ``distill_lr`` a tenth of the fine-tune's ``learning_rate`` when it is None and
        the rate is known (a learning rate the user set is kept)."""
        if self.distill_lr is not None or not is_real(learning_rate) or learning_rate <= 0:
            return self
        return dataclasses.replace(self, distill_lr=learning_rate / REPAIR_LR_DIVISOR)

    @classmethod
    def method_fields(cls) -> tuple[str, ...]:
        """The fields that change the method itself (what the model card names when they differ from the defaults),
        in declaration order: those whose metadata says ``"method": True``."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("method"))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gram_dtype"] = str(self.gram_dtype).replace("torch.", "")
        out["cache"] = str(self.cache)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JanusConfig":
        return cls(**known_fields(cls, data, strict=True, hints=FIELD_HINTS))

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


def _check(ok: bool, name: str, value: Any, valid: str) -> None:
    if not ok:
        raise ValueError(f"JanusConfig.{name}={value!r} is invalid: expected {valid}")


def _fields_docstring(cls: type) -> str:
    """The ``Args:`` section of a dataclass's docstring, made from its fields' ``metadata["help"]``."""
    import textwrap

    lines = ["", "    Args:"]
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help")
        if text:
            text = text if text.endswith(".") else text + "."
            lines += textwrap.wrap(f"{f.name}: {text}", width=116, initial_indent=" " * 8,
                                   subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n"


JanusConfig.__doc__ = (JanusConfig.__doc__ or "").rstrip() + "\n" + _fields_docstring(JanusConfig)


#: :meth:`JanusConfig.paper`: the paper's Algorithm 1 and its settings (τ=0.95, β=0.7, r=32, m=256 replay samples
#: are the caller's), every other field at its default
PAPER: dict[str, Any] = dict(tau=0.95, beta=0.7, compression_rank=32, compression="exact", step_control="paper",
                             final_step="paper", acceptance="cosine", acceptance_options={}, constraint="loss",
                             constraint_options={}, damping=0.0, distill_steps=0)
