"""The repair after JANUS: distillation toward θ0 that keeps the new task, then the point it chooses itself.

JANUS keeps the replay's losses to first order; what the first order misses (θ0's answers are often near-ties that a
small move flips) a few hundred optimizer steps bring back: each step lowers the KL divergence ``KL(p_θ0 ‖ p_θ)`` of
the next-token distributions on a replay batch and, at ``new_task_weight``, the cross-entropy of a batch of the new
task's samples, so that the gain is kept while the past behaviour returns. The point trains from the JANUS point
in a :class:`RepairSpace` (Adam on float32 copies, written back into the model's dtype after each step; the model in
eval mode, so the run is deterministic): the target layers' weights and every other parameter fine-tuning changed
whose θ0 the reference gives (a full fine-tune's embeddings, tied head and norms: :func:`changed_outside`), or a LoRA
adapter's own factors. θ0's logits are those of θ0 in every one of
these parameters: with the others left at θ̂ the KL would pull toward a model that has already forgotten part of
what θ0 answered.

The point is then chosen without an evaluation harness, on held-out slices: every eighth replay sample and every
eighth new-task sample (at most :data:`NEW_TASK_VALIDATION_MAX` of these; or the new task's validation samples, when
given) are kept out of the training. Along the line ``θ0 + b(θ_T − θ0)``, the points whose new-task loss keeps at
least ``keep_gain`` of the fine-tune's gain (``L(θ0) − L(θ̂)`` on the new-task slice) are feasible. The gain kept
falls as the point moves toward θ0, so the line is bisected (on a grid of 0.01) for the farthest feasible move, which
is taken (the JANUS point when no move keeps the gain). The report says which point, why, and the validation figures
of θ0, θ̂, the JANUS point, the trained point and the chosen one.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from hf_janus.engine.capture import forward_logits, model_device
from hf_janus.engine.memory_plan import REPAIR_REFERENCE_CACHE_BYTES
from hf_janus.engine.report import PointFigures, RepairReport
from hf_janus.engine.repair_space import RepairSpace
from hf_janus.errors import JanusError
from hf_janus.model_modes import checkpointed_layers, evaluation_mode
from hf_janus.parallel.distributed import World
from hf_janus.replay.prepare import IGNORE_INDEX, counted_tokens, loss_targets

logger = logging.getLogger(__name__)

#: one sample in this many, of the replay and of the new task's samples, is held out to choose the point
VALIDATION_EVERY = 8
#: new-task samples held out at most: each point the choice scores runs all of them, and the new task's samples are
#: the long ones (the gain is a difference between points on the same samples, so a few dozen measure it)
NEW_TASK_VALIDATION_MAX = 16
#: the moves toward θ0 tried, ``b`` in ``θ0 + b(θ_T − θ0)``: a fine grid, since the bisection scores only about
#: log2(len) of them, and a coarse one stops short of the farthest move that keeps the gain
MOVES = tuple(round(1.0 - 0.01 * i, 2) for i in range(100))
#: ``JanusConfig.distill_schedule``: the learning rate's factor at step ``k`` of ``n``, as a function of ``k / n``
#: (the decaying ones reach 0 only after the last step, which still moves)
SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda done: 1.0,
    "linear": lambda done: 1.0 - done,
    "cosine": lambda done: 0.5 * (1.0 + math.cos(math.pi * done)),
}


def split_validation(batches: list[dict[str, Tensor]], most: Optional[int] = None,
                     ) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """(training, held-out) batches: every :data:`VALIDATION_EVERY`-th sample, counted across batches in their
    order, is held out, the first ``most`` of them when given (none when there are fewer samples than
    :data:`VALIDATION_EVERY`: then nothing can be held out)."""
    train, held = [], []
    seen = 0
    for batch in batches:
        rows = int(batch["input_ids"].shape[0])
        index = torch.arange(seen, seen + rows)
        out = (index % VALIDATION_EVERY) == VALIDATION_EVERY - 1
        if most is not None:
            out &= index // VALIDATION_EVERY < most
        seen += rows
        for mask, into in ((~out, train), (out, held)):
            if mask.any():
                into.append({k: v[mask] for k, v in batch.items()})
    return train, held


def check_samples(replay: list[dict[str, Tensor]], new_task: list[dict[str, Tensor]],
                  new_task_validation: Optional[list[dict[str, Tensor]]] = None) -> None:
    """Refuse, before any work, replay or new-task batches too few to hold a sample out and train on the rest (the
    new task's are not split when its validation samples are given)."""
    splits = [("replay", replay)] + ([("new-task", new_task)] if new_task_validation is None else [])
    for name, batches in splits:
        train, held = split_validation(batches)
        if not train or not held:
            raise JanusError(f"the repair after JANUS holds out one {name} sample in {VALIDATION_EVERY} to choose "
                             f"its point, and {name} has too few samples for that: give at least "
                             f"{VALIDATION_EVERY} {name} samples, or set distill_steps=0")


def changed_outside(model: torch.nn.Module, reference: Any, targets: Mapping[str, torch.nn.Module],
                    ) -> dict[str, Tensor]:
    """θ0 of every floating-point parameter outside the target layers' weights that fine-tuning changed and whose θ0
    ``reference`` (a model or a state dict) gives with the same shape, by name; each a copy on the host in the
    parameter's dtype. Tied parameters count once (``named_parameters`` lists them once)."""
    if isinstance(reference, torch.nn.Module):
        given = dict(reference.named_parameters())
    elif isinstance(reference, Mapping):
        given = reference
    else:
        return {}
    weights = {f"{name}.weight" for name in targets}
    out = {}
    for name, param in model.named_parameters():
        theta0 = given.get(name)
        if (name in weights or not param.is_floating_point() or not isinstance(theta0, Tensor)
                or theta0.shape != param.shape):
            continue
        theta0 = theta0.detach().to("cpu", param.dtype)
        if not torch.equal(theta0, param.detach().to("cpu")):
            out[name] = theta0.clone()
    return out


def keeps_positions(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs), so that its output head runs
    only where a token carries loss."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def counted_logits(model: torch.nn.Module, batch: dict[str, Tensor], keep_positions: bool,
                   ) -> tuple[Tensor, Tensor]:
    """Float32 next-token logits ``(N, vocab)`` and targets ``(N,)`` of the batch's N tokens that carry loss, in
    row-major order. With ``keep_positions`` the output head runs at those positions only: the head of a small model
    is a fifth of its forward, and its float32 logits at every position the largest tensor of a step."""
    targets = loss_targets(batch).to(batch["input_ids"].device)
    counted = targets != IGNORE_INDEX
    if keep_positions:
        # the logit at position t predicts token t + 1: the last position predicts nothing that is counted
        mask = torch.cat([counted, counted.new_zeros(counted.shape[0], 1)], dim=1)
        logits = forward_logits(model, batch, logits_to_keep=mask)
        return logits.reshape(-1, logits.shape[-1]).float(), targets[counted]
    return forward_logits(model, batch)[:, :-1].float()[counted], targets[counted]


def _on(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


class Repair:
    """Distil the model from the JANUS point toward θ0 while fitting the new task, then choose the point, in a
    :class:`RepairSpace`; the model ends at the chosen point."""

    def __init__(self, space: RepairSpace, replay: list[dict[str, Tensor]], new_task: list[dict[str, Tensor]],
                 config: Any, world: World, progress: bool = True,
                 new_task_validation: Optional[list[dict[str, Tensor]]] = None,
                 reference_cache_bytes: int = REPAIR_REFERENCE_CACHE_BYTES,
                 autocast: Optional[Callable[[], AbstractContextManager]] = None):
        """``replay`` and ``new_task``: the whole batches, the same on every rank (each rank takes its rows);
        ``new_task_validation``: held-out new-task batches to measure the gain on, instead of a slice of
        ``new_task``; ``reference_cache_bytes``: the most bytes of θ0's logits kept between passes (0: θ0 runs at
        every step); ``autocast``: the context the training passes run in, as fine-tuning's did (a Trainer's mixed
        precision, ``accelerator.autocast``); θ0's logits and the figures the choice compares are computed at the
        weights' own precision."""
        self.space, self.config, self.world, self.progress = space, config, world, progress
        self.autocast = autocast if autocast is not None else nullcontext
        #: the autocast dtype the training passes ran at (None: the weights' own) and the layers they checkpointed
        self.pass_precision: Optional[str] = None
        self.checkpointed = 0
        self.gradients_checked = False
        self.model = space.model
        self.device = model_device(self.model)
        self.keep_positions = keeps_positions(self.model)
        #: θ0's logits per training replay batch, by index, and their bytes
        self.reference_cache: dict[int, Tensor] = {}
        self.cached_bytes, self.reference_cache_bytes = 0, reference_cache_bytes
        check_samples(replay, new_task, new_task_validation)
        self.replay_train, self.replay_held = split_validation(replay)
        if new_task_validation is None:
            self.new_train, self.new_held = split_validation(new_task, NEW_TASK_VALIDATION_MAX)
            self.gain_measured_on = "every eighth new-task sample, held out"
        else:
            self.new_train, self.new_held = new_task, new_task_validation
            self.gain_measured_on = "the new task's validation samples"

    # ---- figures ------------------------------------------------------------------------------------------
    def _share(self, batch: dict[str, Tensor]) -> Optional[dict[str, Tensor]]:
        """This rank's rows of ``batch`` on the model's device (every row in one process), None when it has none:
        the ranks split each batch, so that a step sees the samples one process would."""
        rows = torch.arange(self.world.rank, int(batch["input_ids"].shape[0]), self.world.size)
        return _on({k: v[rows] for k, v in batch.items()}, self.device) if len(rows) else None

    @torch.no_grad()
    def _figures(self, new_task: bool = True, replay: bool = True) -> PointFigures:
        """The held-out figures of the point the model holds, summed over every rank's rows: the new task's loss
        (what the choice compares) and the replay's NLL and agreement, each left None when not asked for."""
        sums = torch.zeros(5, dtype=torch.float64)  # new-task loss, its tokens, replay NLL, agreement, tokens
        slices = ((self.new_held, 0),) * new_task + ((self.replay_held, 2),) * replay
        for batches, offset in slices:
            for whole in batches:
                batch = self._share(whole)
                if batch is None:
                    continue
                logits, targets = counted_logits(self.model, batch, self.keep_positions)
                if not len(targets):
                    continue
                sums[offset] += float(F.cross_entropy(logits, targets, reduction="sum"))
                if offset == 0:
                    sums[1] += len(targets)
                else:
                    sums[3] += int((logits.argmax(-1) == targets).sum())
                    sums[4] += len(targets)
        sums = self.world.sum_(sums)
        tokens, replay_tokens = max(float(sums[1]), 1.0), max(float(sums[4]), 1.0)
        figures = PointFigures()
        if new_task:
            figures.new_task_loss = float(sums[0]) / tokens
        if replay:
            figures.replay_nll = float(sums[2]) / replay_tokens
            figures.replay_agreement = float(sums[3]) / replay_tokens
        return figures

    def _figures_at(self, point: list[Tensor], new_task: bool = True, replay: bool = True) -> PointFigures:
        self.space.write(point)
        return self._figures(new_task, replay)

    # ---- training -----------------------------------------------------------------------------------------
    def _train(self, start: list[Tensor], reference: list[Tensor]) -> tuple[list[Tensor], Optional[str]]:
        """θ_T after ``distill_steps`` steps from ``start``, and why it stopped early (None when it did not)."""
        cfg = self.config
        master = [s.detach().float().to(self.device).clone().requires_grad_(True) for s in start]
        # the fused kernel: a full fine-tune's Adam step, tensor by tensor, is a large share of a step's time
        optimizer = torch.optim.Adam(master, lr=cfg.repair_lr,
                                     fused=self.device.type in ("cpu", "cuda") or None)
        factor = SCHEDULES[cfg.distill_schedule]
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: factor(k / cfg.distill_steps))
        weights = self.space.trained_tensors()
        as_point = self.space.gradient_layouts()
        flags = [w.requires_grad for w in weights]
        bar = tqdm(total=cfg.distill_steps, desc="JANUS repair: distillation", unit="step",
                   disable=not self.progress, leave=False)
        # the layers the user trained under gradient checkpointing checkpoint the training passes (found once for
        # the run: a walk over every module)
        with checkpointed_layers(self.model) as checkpointed:
            self.checkpointed = len(checkpointed)
            try:
                for w in weights:
                    w.requires_grad_(True)
                for step in range(cfg.distill_steps):
                    fitted = self.new_train[step % len(self.new_train)]
                    loss, grads = self._gradients(step % len(self.replay_train), fitted, reference, master, weights)
                    for m, g, layout in zip(master, grads, as_point):
                        m.grad = self.world.sum_(layout(g).float())
                    # a step that makes a weight non-finite makes the next step's loss non-finite: the loss is checked
                    # at every step, the weights (a pass over all of them) once after the last
                    if not bool(torch.isfinite(loss)):
                        return start, f"the distillation diverged at step {step + 1} (lr {cfg.repair_lr:g})"
                    optimizer.step()
                    schedule.step()
                    optimizer.zero_grad(set_to_none=True)
                    bar.update(1)
            finally:
                for w, flag in zip(weights, flags):
                    w.requires_grad_(flag)
                bar.close()
        if not all(bool(torch.isfinite(m).all()) for m in master):
            return start, f"the distillation diverged at step {cfg.distill_steps} (lr {cfg.repair_lr:g})"
        return [m.detach() for m in master], None

    def _gradients(self, index: int, fitted: dict[str, Tensor], reference: list[Tensor],
                   master: list[Tensor], weights: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """This rank's share of one step's loss (the mean over the whole batches' counted tokens of the KL to θ0 on
        the training replay batch ``index``, plus ``new_task_weight`` times the new task's cross-entropy) and its
        gradients in the weights' layout: summed over the ranks they are one process's."""
        replay = self.replay_train[index]
        replay_tokens = _counted(replay)
        fitted_tokens = _counted(fitted)
        mine_replay, mine_fitted = self._share(replay), self._share(fitted)
        loss = torch.zeros((), device=self.device)
        grads = [torch.zeros_like(w) for w in weights]
        if mine_replay is None and mine_fitted is None:
            return self.world.sum_(loss), grads
        reference_logits = self._reference_logits(index, mine_replay, reference) if mine_replay is not None else None
        self.space.write([m.detach() for m in master])
        with torch.enable_grad(), self.autocast():
            if torch.is_autocast_enabled(self.device.type):
                self.pass_precision = str(torch.get_autocast_dtype(self.device.type)).replace("torch.", "")
            total = torch.zeros((), device=self.device)
            if mine_replay is not None:
                logits, _ = counted_logits(self.model, mine_replay, self.keep_positions)
                total = total + token_kl(logits, reference_logits).sum() / replay_tokens
            if mine_fitted is not None and self.config.new_task_weight:
                logits, targets = counted_logits(self.model, mine_fitted, self.keep_positions)
                total = total + self.config.new_task_weight * F.cross_entropy(
                    logits, targets, reduction="sum") / fitted_tokens
            if total.requires_grad:
                grads = list(torch.autograd.grad(total, weights, allow_unused=True))
                self._check_reached(grads)
                grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, weights)]
        return self.world.sum_(total.detach()), grads

    def _check_reached(self, grads: list[Optional[Tensor]]) -> None:
        """Refuse, at the first step, to train tensors the loss sends no gradient to (a layer whose forward keeps its
        weight frozen): the steps would leave them where they are while the report said they trained."""
        if self.gradients_checked:
            return
        self.gradients_checked = True
        names = self.space.tensor_names()
        missing = [names[i] for i, g in enumerate(grads) if g is None]
        if missing:
            raise JanusError(f"the repair after JANUS gets no gradient for {missing[0]!r} (and {len(missing) - 1} "
                             "more): its forward keeps the weight frozen, so it cannot be trained; set "
                             "distill_steps=0 (the JANUS point)")

    @torch.no_grad()
    def _reference_logits(self, index: int, batch: dict[str, Tensor], reference: list[Tensor]) -> Tensor:
        """θ0's logits at the counted tokens of this rank's share of training replay batch ``index``: computed once
        and kept while they fit in ``reference_cache_bytes``, since every pass over the replay asks for the same
        ones; otherwise θ0 is written and run again each time."""
        cached = self.reference_cache.get(index)
        if cached is not None:
            return cached
        self.space.write(reference)
        logits = counted_logits(self.model, batch, self.keep_positions)[0]
        if self.cached_bytes + logits.numel() * logits.element_size() <= self.reference_cache_bytes:
            self.reference_cache[index] = logits
            self.cached_bytes += logits.numel() * logits.element_size()
        return logits

    # ---- the run ------------------------------------------------------------------------------------------
    def run(self) -> RepairReport:
        cfg = self.config
        started = time.perf_counter()
        report = RepairReport(steps=cfg.distill_steps, lr=cfg.repair_lr, schedule=cfg.distill_schedule,
                              new_task_weight=cfg.new_task_weight, replay_batch_size=cfg.distill_replay_batch_size,
                              new_task_batch_size=cfg.new_task_batch_size, keep_gain=cfg.keep_gain,
                              gain_measured_on=self.gain_measured_on,
                              validation_samples={"replay": sum(len(b["input_ids"]) for b in self.replay_held),
                                                  "new_task": sum(len(b["input_ids"]) for b in self.new_held)})
        reference, finetuned, janus = self.space.points(self.device)
        try:
            chosen = self._run(report, reference, janus, finetuned)
        except BaseException:
            self.space.undo()
            raise
        self.space.keep(chosen)
        report.trained, report.outside_parameters = self.space.trained, list(self.space.outside_names)
        report.autocast_dtype, report.checkpointed_layers = self.pass_precision, self.checkpointed
        report.seconds = time.perf_counter() - started
        return report

    def _run(self, report: RepairReport, reference: list[Tensor], janus: list[Tensor],
             finetuned: list[Tensor]) -> list[Tensor]:
        """Train, score and choose; the point chosen."""
        with evaluation_mode(self.model):
            figures = {"reference": self._figures_at(reference), "finetuned": self._figures_at(finetuned),
                       "janus": self._figures_at(janus)}
            trained, stopped = self._train(janus, reference)
            if stopped is not None:
                logger.warning("JANUS repair: %s; the JANUS point is kept", stopped)
                report.chosen, report.reason = "janus", stopped + "; the JANUS point is kept"
                chosen = janus
            else:
                figures["trained"] = self._figures_at(trained)
                chosen = self._choose(report, figures, reference, janus, trained)
            report.validation = {**figures, "chosen": figures[_figure_key(report)]}
        return chosen

    def _choose(self, report: RepairReport, figures: dict[str, PointFigures], reference: list[Tensor],
                janus: list[Tensor], trained: list[Tensor]) -> list[Tensor]:
        """The farthest move toward θ0 that keeps ``keep_gain`` of the gain; the JANUS point when none does.

        The JANUS point is not weighed against the moves on the replay slice: its held-out NLL of θ0's answers can
        fall below θ0's own (the projection sharpens answers it keeps) while it agrees with fewer of their tokens
        than the distilled point, so a lower NLL there does not say it keeps θ0's behaviour better."""
        keep = self.config.keep_gain
        ref_loss, ft_loss = figures["reference"].new_task_loss, figures["finetuned"].new_task_loss
        gain = ref_loss - ft_loss
        floor = ref_loss - keep * gain if gain > 0 else float("inf")  # no gain to keep: every point is feasible
        figures["b=1"] = figures["trained"]

        def moved(b: float) -> list[Tensor]:
            return self.space.moved(b, reference, trained)

        def kept(index: int) -> bool:
            """Whether the move ``MOVES[index]`` keeps the gain, scoring it the first time it is asked (its weights
            are not kept: the memory plan counts one point being scored)."""
            name = f"b={MOVES[index]:g}"
            if name not in figures:
                figures[name] = self._figures_at(moved(MOVES[index]), replay=False)
            return figures[name].new_task_loss <= floor

        # the gain kept falls as the point moves toward θ0: bisect for the farthest move that keeps it, scoring
        # a handful of points where walking the grid would score them all (each scores every held-out sample)
        if not kept(0):
            report.chosen, report.b = "janus", None
            report.reason = (f"no move toward θ0 from the distilled point keeps {keep:.0%} of the new task's gain on "
                             "the held-out slice; the JANUS point is kept")
            return janus
        lo, hi = 0, len(MOVES)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if kept(mid) else (lo, mid)
        best = f"b={MOVES[lo]:g}"
        report.chosen, report.b = best, MOVES[lo]
        report.reason = (f"the farthest move toward θ0 that keeps ≥ {keep:.0%} of the new task's gain on the held-out "
                         "slice" if gain > 0 else
                         "fine-tuning did not lower the held-out new-task loss, so no gain limits the move: the "
                         "farthest move toward θ0")
        for name in [k for k in figures if k.startswith("b=") and k != best]:
            del figures[name]  # the report keeps the chosen move's figures, not the whole search
        point = moved(report.b)
        if figures[best].replay_nll is None:  # the search scored the new task alone: the replay's figures now
            on_replay = self._figures_at(point, new_task=False)
            figures[best].replay_nll, figures[best].replay_agreement = on_replay.replay_nll, on_replay.replay_agreement
        return point


def _figure_key(report: RepairReport) -> str:
    return report.chosen if report.chosen is not None else "janus"


def _counted(batch: dict[str, Tensor]) -> int:
    """The whole batch's tokens that carry loss (at least 1, so that a batch without any divides by 1)."""
    return max(counted_tokens([batch]), 1)


def token_kl(logits: Tensor, reference_logits: Tensor) -> Tensor:
    """``KL(p_θ0 ‖ p_θ)`` of the next-token distributions, one value per row of the ``(tokens, vocab)`` logits."""
    log_p = F.log_softmax(logits, dim=-1)
    log_p0 = F.log_softmax(reference_logits, dim=-1)
    return (log_p0.exp() * (log_p0 - log_p)).sum(-1)
