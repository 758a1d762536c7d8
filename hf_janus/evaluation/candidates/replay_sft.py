"""Replay fine-tuning from θ̂, post hoc, at JANUS's budget: the repair the unsloth and LlamaFactory maintainers
recommend against forgetting ("mix general data"), done after the fact.

Starting at θ̂, the parameters fine-tuning changed take one optimizer step per replay batch, for ``passes`` passes
over the replay in its fixed order (the model in eval mode: no dropout, so the run is deterministic). ``budget=n``
sets ``passes`` to n times the Jacobian evaluations of JANUS at ``janus_tau`` (a JANUS evaluation and a replay pass
both touch every replay sample once, forward and backward), running that JANUS if no candidate did. ``steps=n``
sets it to the whole passes nearest n optimizer steps, so that a recipe measured at one replay size takes the same
training at another. The loss is the replay's next-token cross-entropy (``loss="ce"``, mean over the tokens that
carry loss), or the KL divergence ``KL(p_θ0 ‖ p_θ)`` of the next-token distributions at the same tokens
(``loss="kl"``; θ0's distributions are recomputed each step by holding θ0 for one forward pass, so a pass costs two
forward passes). Plain Adam (``torch.optim.Adam`` defaults but ``lr``) or SGD, on float32 copies of the parameters,
written back into the model's dtype after each step. With ``new_task_weight``, each step also fits the next
``new_task_batch_size`` samples of the new task (the frontier's ``new_task_samples``, in the order given) at that
weight of their cross-entropy, so that the passes keep the gain; the cost's pass counts leave that work out, its
seconds do not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hf_janus.engine.public import model_device
from hf_janus.engine.public import GIB
from hf_janus.engine.repair import token_kl
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.base import (BuildContext, Candidate, CandidateDiverged, Cost, Curve, Option,
                                                 PlotStyle, SpecContext, finite_positive, grid_product, measured,
                                                 parse_float, parse_int, parse_str, require)
from hf_janus.evaluation.candidates.registry import register
from hf_janus.evaluation.candidates.janus import Janus
from hf_janus.evaluation.candidates.replay_statistics import (holding, logits_of, new_task_batches, on_device,
                                                               replay_batches)
from hf_janus.model_modes import evaluation_mode
from hf_janus.replay.prepare import IGNORE_INDEX, loss_targets

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

DEFAULT_BUDGETS = (1.0, 2.0, 4.0)
LOSSES = ("ce", "kl")
OPTIMIZERS = ("adam", "sgd")
DEFAULT_LR = 1e-5
#: new-task samples fitted per replay step: a quarter of the default replay batch, since they are longer
DEFAULT_NEW_TASK_BATCH = 2
#: float32 bytes per changed parameter the optimizer keeps on the model's device: the master copy and its gradient,
#: and Adam's two moments
STATE_BYTES = {"adam": 16, "sgd": 8}

STEPS_OPTION = Option("steps", parse_int, None,
                      "optimizer steps (≥ 1), one per replay batch, taken as the nearest whole number of passes (at "
                      "least one), instead of passes")

#: the options of every replay-training kind that keep the gain by fitting the new task's samples too
NEW_TASK_OPTIONS = (
    Option("new_task_weight", parse_float, None,
           "also fit the new task's samples (frontier's new_task_samples) at this weight of their cross-entropy, "
           "so that the passes keep the gain (default: the replay alone)"),
    Option("new_task_batch_size", parse_int, None,
           f"new-task samples fitted per replay step (default {DEFAULT_NEW_TASK_BATCH})"))

REPLAY_SFT_CURVE = Curve("replay-sft", "replay SFT", PlotStyle("o", "C1", "replay fine-tuning", line="--"))


def replay_loss(model: torch.nn.Module, batch: Mapping[str, Tensor], loss: str,
                reference_logits: Optional[Tensor] = None, source: str = "replay") -> Tensor:
    """Mean over the tokens that carry loss of the next-token cross-entropy, or of ``KL(p_θ0 ‖ p_θ)`` given θ0's
    logits on the same batch; ``source`` names the batch's data in the error for a batch without such a token."""
    logits = logits_of(model, batch)[:, :-1].float()
    targets = loss_targets(batch).to(logits.device)
    counted = targets != IGNORE_INDEX
    if not counted.any():
        raise JanusError(f"a {source} batch has no token that carries loss; give its samples labels or drop them")
    if loss == "ce":
        return F.cross_entropy(logits[counted], targets[counted])
    return token_kl(logits[counted], reference_logits[:, :-1].float()[counted]).mean()


def non_finite(loss: Tensor, weights: Sequence[Tensor]) -> Optional[str]:
    """What of a training step is not finite, ``"loss"`` or ``"weights"``, or ``None``: one host sync a step, so that
    a diverging run stops at once rather than spending its remaining steps on NaN."""
    finite = torch.isfinite(loss.detach()).all()
    for w in weights:
        finite = finite & torch.isfinite(w.detach()).all()
    if bool(finite):
        return None
    return "loss" if not bool(torch.isfinite(loss.detach()).all()) else "weights"


def train_on_replay(builder: "WeightBuilder", passes: int, *, loss: str, optimizer: str, lr: float,
                    batch_size: int, new_task: Optional[Sequence[Mapping[str, Tensor]]] = None,
                    new_task_weight: float = 1.0) -> dict[str, Tensor]:
    """The changed parameters after ``passes`` passes of replay training from θ̂, float32, on the host. With
    ``new_task`` (labelled batches of what fine-tuning trained on, taken in turn, one per step), each step's loss also
    counts ``new_task_weight`` times their cross-entropy, so that the passes keep the gain. A step whose loss or
    weights are not finite stops the training with :class:`CandidateDiverged`."""
    names = list(builder.theta0)
    start = builder.finetuned
    params = [builder.params[k] for k in names]
    master = [start[k].detach().float().to(p.device).clone().requires_grad_(True)
              for k, p in zip(names, params)]
    opt = (torch.optim.Adam(master, lr=lr) if optimizer == "adam" else torch.optim.SGD(master, lr=lr))
    flags = [p.requires_grad for p in params]
    device = model_device(builder.model)
    batches = replay_batches(builder, batch_size)
    try:
        for p in params:
            p.requires_grad_(True)
        with holding(builder, start) as model, evaluation_mode(model):
            for step, batch in enumerate(itertools.chain.from_iterable(itertools.repeat(batches, passes))):
                batch = on_device(batch, device)
                reference = None
                if loss == "kl":
                    with holding(builder, builder.theta0), torch.no_grad():
                        reference = logits_of(model, batch)
                    builder.write({k: m.detach() for k, m in zip(names, master)})
                value = replay_loss(model, batch, loss, reference)
                if new_task:
                    fitted = on_device(new_task[step % len(new_task)], device)
                    value = value + new_task_weight * replay_loss(model, fitted, "ce", source="new-task")
                grads = torch.autograd.grad(value, params)
                for m, g in zip(master, grads):
                    m.grad = g.detach().float()
                opt.step()
                opt.zero_grad(set_to_none=True)
                what = non_finite(value, master)
                if what is not None:
                    raise CandidateDiverged(
                        f"replay training diverged: its {what} went non-finite at step {step + 1} of "
                        f"{passes * len(batches)} ({optimizer}, lr={lr:g}); lower lr")
                builder.write({k: m.detach() for k, m in zip(names, master)})
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
    return {k: m.detach().cpu().clone() for k, m in zip(names, master)}


class ReplayTraining:
    """What the replay-training kinds share, as a base before :class:`Candidate` (or a JANUS-based kind): their
    options' checks, the optimizer state check, the cost of their passes, and the weights :meth:`train` makes, kept
    once per candidate."""

    name: ClassVar[str]
    passes: Optional[int]
    steps: Optional[int]
    loss: str
    optimizer: str
    lr: float
    batch_size: Optional[int]
    new_task_weight: Optional[float]
    new_task_batch_size: int

    def train(self, builder: "WeightBuilder", context: BuildContext) -> tuple[dict[str, Tensor], Cost]:
        """The trained values of the changed parameters, and what making them cost (its seconds are measured)."""
        raise NotImplementedError

    def check_training(self) -> None:
        """Refuse ``passes`` and ``steps`` (when given), ``loss``, ``optimizer``, ``lr`` and ``batch_size`` that
        name no training, saying which option and what it takes."""
        name = self.name
        if self.passes is not None:
            require(int(self.passes) == self.passes and self.passes >= 1, name, "passes", self.passes,
                    "a whole number ≥ 1")
        if self.steps is not None:
            require(int(self.steps) == self.steps and self.steps >= 1, name, "steps", self.steps,
                    "a whole number ≥ 1")
        require(self.loss in LOSSES, name, "loss", self.loss, f"one of {LOSSES}")
        require(self.optimizer in OPTIMIZERS, name, "optimizer", self.optimizer, f"one of {OPTIMIZERS}")
        require(finite_positive(self.lr), name, "lr", self.lr, "finite and > 0")
        if self.batch_size is not None:
            require(int(self.batch_size) == self.batch_size and self.batch_size >= 1, name, "batch_size",
                    self.batch_size, "a whole number ≥ 1")
        if self.new_task_weight is not None:
            require(finite_positive(self.new_task_weight), name, "new_task_weight", self.new_task_weight,
                    "finite and > 0")
        require(int(self.new_task_batch_size) == self.new_task_batch_size and self.new_task_batch_size >= 1, name,
                "new_task_batch_size", self.new_task_batch_size, "a whole number ≥ 1")

    def passes_for(self, builder: "WeightBuilder", batch_size: int) -> Optional[int]:
        """``passes``, or with ``steps`` the whole passes nearest that many steps over the replay's batches of
        ``batch_size`` (at least one)."""
        if self.steps is None:
            return self.passes
        return max(1, round(self.steps / len(replay_batches(builder, batch_size))))

    def training_length(self, card: bool = False) -> str:
        """``passes`` or ``steps`` as the label (or, with ``card``, the model card) says them."""
        if self.steps is None:
            return f"{self.passes} passes"
        return (f"about {self.steps} optimizer steps (the nearest whole number of passes over the replay)" if card
                else f"{self.steps} steps")

    def trained(self, builder: "WeightBuilder", passes: int, batch_size: int) -> dict[str, Tensor]:
        """:func:`train_on_replay` with this candidate's settings, fitting the new task's samples too when
        ``new_task_weight`` is set."""
        new_task = (None if self.new_task_weight is None
                    else new_task_batches(builder, self.new_task_batch_size))
        return train_on_replay(builder, passes, loss=self.loss, optimizer=self.optimizer, lr=self.lr,
                               batch_size=batch_size, new_task=new_task,
                               new_task_weight=self.new_task_weight or 1.0)

    def new_task_label(self) -> str:
        return "" if self.new_task_weight is None else f", new task ×{self.new_task_weight:g}"

    def new_task_note(self) -> str:
        if self.new_task_weight is None:
            return ""
        return (f" Each step also fits {self.new_task_batch_size} of the new task's samples (their cross-entropy, "
                f"weight {self.new_task_weight:g}), so that the passes keep the gain.")

    def passes_cost(self, passes: int, jacobian_evaluations: int = 0) -> Cost:
        """``passes`` passes over the replay: one backward each, and a second forward (θ0's) with ``loss="kl"``."""
        return Cost(jacobian_evaluations=jacobian_evaluations,
                    forward_passes=float(passes * (2 if self.loss == "kl" else 1)), backward_passes=float(passes))

    def artifact_key(self) -> str:
        return f"{self.name}:{self!r}"

    def state_bytes(self, builder: "WeightBuilder") -> int:
        """What training keeps on the model's device besides the model: float32 optimizer state for each changed
        parameter, and the gradient autograd returns in the parameter's dtype."""
        return sum(p.numel() * (STATE_BYTES[self.optimizer] + builder.params[k].element_size())
                   for k, p in builder.finetuned.items())

    def check(self, builder: "WeightBuilder") -> None:
        super().check(builder)  # type: ignore[misc]
        if self.new_task_weight is not None and builder.new_task is None:
            raise JanusError(f"{self.name}: new_task_weight fits the new task's samples too, but none were given; "
                             "pass new_task_samples= to frontier (hf-janus frontier --new-task-samples FILE), or "
                             "drop new_task_weight")
        if self.new_task_weight is not None:  # made now, so that unlabelled samples are refused before any work
            new_task_batches(builder, self.new_task_batch_size)
        device = model_device(builder.model)
        need, free = self.state_bytes(builder), builder.free_memory(device)
        if free is not None and need > free:
            raise JanusError(
                f"{self.name} needs {need / GIB:.1f} GiB on {device} for its {self.optimizer} state over the "
                f"{sum(p.numel() for p in builder.finetuned.values()):,} changed parameters but {free / GIB:.1f} GiB "
                "are free there; drop it from the candidates, use optimizer=sgd (half the state), or "
                "run the frontier where more memory is free")

    def prepare(self, builder: "WeightBuilder", context: BuildContext) -> Cost:
        key = self.artifact_key()
        if isinstance(builder.artifacts.get(key), CandidateDiverged):  # the candidates sharing a training share this
            raise builder.artifacts[key]
        if key in builder.artifacts:
            return Cost(reused=True)

        def work() -> Cost:
            try:
                builder.artifacts[key], cost = self.train(builder, context)
            except CandidateDiverged as err:
                builder.artifacts[key] = err
                raise
            return cost

        return measured(builder, work)

    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        return {**{k: v.float() for k, v in builder.finetuned.items()}, **builder.artifacts[self.artifact_key()]}


@register
@dataclass(frozen=True)
class ReplaySft(ReplayTraining, Candidate):
    """θ̂ trained further on the replay for ``passes`` passes (or ``budget`` × JANUS's Jacobian evaluations, or
    about ``steps`` optimizer steps)."""

    passes: Optional[int] = None
    budget: Optional[float] = None
    steps: Optional[int] = None
    loss: str = "ce"
    optimizer: str = "adam"
    lr: float = DEFAULT_LR
    batch_size: Optional[int] = None  # None: the JanusConfig's replay_batch_size
    new_task_weight: Optional[float] = None  # None: the replay alone
    new_task_batch_size: int = DEFAULT_NEW_TASK_BATCH
    #: τ of the JANUS run whose evaluations ``budget`` counts (None: the JanusConfig's); not ``tau``, which the
    #: frontier's JSON reserves for points built from a JANUS run
    janus_tau: Optional[float] = None

    name: ClassVar[str] = "replay-sft"
    title: ClassVar[str] = "replay fine-tuning"
    options: ClassVar[tuple[Option, ...]] = (
        Option("budget", parse_float, DEFAULT_BUDGETS,
               "passes as a multiple (> 0) of the Jacobian evaluations of JANUS at tau (default grid 1, 2, 4)"),
        Option("passes", parse_int, None, "passes over the replay (≥ 1), instead of budget"),
        STEPS_OPTION,
        Option("loss", parse_str, ("ce",), "'ce' (the replay's cross-entropy) or 'kl' (KL to θ0's next-token "
                                           "distributions)"),
        Option("optimizer", parse_str, ("adam",), "'adam' or 'sgd'"),
        Option("lr", parse_float, (DEFAULT_LR,), "learning rate (> 0)"),
        Option("batch_size", parse_int, None, "replay samples per step (default: the JanusConfig's "
                                              "replay_batch_size)"),
        Option("janus_tau", parse_float, None,
               "the τ of the JANUS run whose evaluations budget counts (default: the JanusConfig's τ)"),
        *NEW_TASK_OPTIONS)
    style: ClassVar[PlotStyle] = REPLAY_SFT_CURVE.style
    curve: ClassVar[Optional[Curve]] = REPLAY_SFT_CURVE

    def __post_init__(self) -> None:
        if sum(v is not None for v in (self.passes, self.budget, self.steps)) != 1:
            raise JanusError("replay-sft takes passes=, steps= or budget= (a multiple of JANUS's Jacobian "
                             f"evaluations), exactly one, got passes={self.passes!r}, steps={self.steps!r}, "
                             f"budget={self.budget!r}")
        if self.budget is not None:
            require(finite_positive(self.budget), self.name, "budget", self.budget, "finite and > 0")
            if self.janus_tau is not None:
                require(0.0 <= float(self.janus_tau) < 1.0, self.name, "janus_tau", self.janus_tau, "in [0, 1)")
        self.check_training()

    @classmethod
    def expand(cls, values: Mapping[str, Sequence[Any]], context: SpecContext) -> list[Candidate]:
        """The spec's grid; ``budget``'s default grid only when neither ``passes`` nor ``steps`` is given, and
        ``tau`` (the JANUS run the budget counts) only with a budget."""
        values = dict(values)
        given = [name for name in ("passes", "steps", "budget") if name in values]
        if len(given) > 1:
            raise JanusError(f"replay-sft takes one of passes=, steps= and budget=, not {' and '.join(given)}: "
                             "passes counts replay passes, steps optimizer steps, budget multiples of JANUS's "
                             "Jacobian evaluations")
        if given and given[0] != "budget":
            if "janus_tau" in values:
                raise JanusError(f"replay-sft: janus_tau names the JANUS run a budget= counts; with {given[0]}= it "
                                 "is unused")
        else:
            values.setdefault("budget", DEFAULT_BUDGETS)
            values.setdefault("janus_tau", (context.tau,))
        return [cls(**combo) for combo in grid_product(values)]

    @property
    def label(self) -> str:
        tau = "" if self.janus_tau is None else f" τ={self.janus_tau:g}"
        length = self.training_length() if self.budget is None else f"×{self.budget:g} JANUS{tau} budget"
        return f"replay SFT {length} ({self.loss.upper()}, {self.optimizer} lr={self.lr:g}{self.new_task_label()})"

    def describe(self) -> str:
        target = ("the replay's next-token cross-entropy" if self.loss == "ce"
                  else "the KL divergence to θ0's next-token distributions on the replay")
        return (f"It is θ̂ trained further on the replay ({self.optimizer}, lr {self.lr:g}, "
                + (self.training_length(card=True) if self.budget is None else
                   f"{self.budget:g} × the Jacobian evaluations of JANUS"
                   + ("" if self.janus_tau is None else f" at τ={self.janus_tau:g}") + " in passes")
                + f") on {target} (no JANUS step)." + self.new_task_note())

    def train(self, builder: "WeightBuilder", context: BuildContext) -> tuple[dict[str, Tensor], Cost]:
        batch_size = self.batch_size or context.config.replay_batch_size
        passes, evaluations = self.passes_for(builder, batch_size), 0
        if passes is None:
            janus = Janus(context.config.tau if self.janus_tau is None else self.janus_tau)
            evaluations = janus.prepare(builder, context).jacobian_evaluations
            passes = max(1, round(self.budget * builder.reports[janus.run_key()].num_jacobian_evals))
        trained = self.trained(builder, passes, batch_size)
        return trained, self.passes_cost(passes, evaluations)
