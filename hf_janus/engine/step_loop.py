"""The multi-step loop of Algorithm 1: per step, project the remaining update onto the null space of the current
point's Jacobian, try step sizes (chosen by :mod:`.step_control`) until one is taken, and move there.

A trial is one Jacobian evaluation: its weights are written, captured, and compared with the current point's
(the mean principal-angle cosine c̄ over layers); the run's acceptance rule (:mod:`.acceptance`) turns that and
the replay losses into the score the controller decides on. The adaptive controller may keep a passing trial while
it probes a larger step, and fall back to it.

With ``lean`` (``JanusConfig.captures="two"``) at most two captures are alive, the current point's and the trial's:
θ0's capture is dropped once the loop leaves θ0, and a kept trial's factors are dropped while the larger step is
probed; a point whose factors are needed again is captured again (a *recapture*, deterministic, so the run takes
the same decisions and ends at the same weights).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

import torch

from hf_janus.engine.acceptance import TrialMeasurement, make_acceptance
from hf_janus.engine.budget import Budget
from hf_janus.engine.capture import ReplayLosses
from hf_janus.engine.config import JanusConfig
from hf_janus.engine.ghost import GramEig, eig_psd, mean_cosine, principal_cosines, project_with_jvp
from hf_janus.engine.jacobians import JacobianSource
from hf_janus.engine.memory_plan import MemoryPlan
from hf_janus.engine.observer import RunObserver
from hf_janus.engine.report import RectificationReport, StepRecord, TrialRecord
from hf_janus.engine.step_control import Decision, make_step_controller
from hf_janus.engine.store import FactorStore
from hf_janus.engine.target_layers import CURRENT, TargetLayers
from hf_janus.parallel.distributed import World

logger = logging.getLogger(__name__)

def undoing_final_step(alpha: float, cbar: float, trial_loss: float,
                       kept_loss: float) -> Optional[dict[str, float]]:
    """The record of an unchecked final step whose whole-replay loss is higher than at the last accepted point (NaN
    counts as higher), or None when it may be kept. Every rank answers the same: captures carry every rank's
    losses (:func:`~hf_janus.engine.capture.combine_ranks`)."""
    if trial_loss <= kept_loss:
        return None
    return {"alpha": alpha, "mean_cosine": cbar, "replay_loss": trial_loss, "kept_replay_loss": kept_loss}


class Taken(NamedTuple):
    """The trial a step moves to."""

    tag: str
    capture: ReplayLosses
    alpha: float
    score: float


@dataclass
class KeptTrial:
    """A passing trial held while the controller checks a larger step size: its capture stays in the store."""

    taken: Taken
    index: int  # in StepRecord.trials
    eigs: dict[str, Optional[GramEig]]

    def take(self, layers: TargetLayers, record: StepRecord) -> Taken:
        """Make this the accepted trial of the step: its row-space eigendecompositions become the layers'."""
        for layer in layers:
            layer.trial_eig = self.eigs[layer.name]
        record.trials[self.index].taken = True
        return self.taken


class LoopHost(Protocol):
    """What a step loop runs on (a :class:`~hf_janus.engine.rectifier.Rectifier`): the target layers, their
    Jacobians, the factor store, the ranks, the settings, the memory plan and the run's hooks, and its capture."""

    layers: TargetLayers
    jacobians: JacobianSource
    store: FactorStore
    world: World
    config: JanusConfig
    memory_plan: MemoryPlan
    observer: RunObserver

    def capture(self, tag: str) -> ReplayLosses: ...


class StepLoop:
    """Runs the steps of one rectification on its target layers; ``phase`` says what it is doing (for errors)."""

    def __init__(self, host: LoopHost, report: RectificationReport, budget: Budget, bar: Any):
        """``host``: the rectification's pieces; ``report``: filled as the loop goes; ``budget``: the evaluation
        and time budgets; ``bar``: the progress bar (tqdm)."""
        self.layers, self.jacobians, self.capture, self.store = host.layers, host.jacobians, host.capture, host.store
        self.world, self.config, self.report, self.budget, self.bar = host.world, host.config, report, budget, bar
        plan = host.memory_plan
        #: where the projections live between uses (the memory plan's choice)
        self.proj_home = self.jacobians.device if plan.placements["proj"] == "device" else torch.device("cpu")
        #: captures="two": at most two captures alive (see the module's docstring)
        self.lean = plan.captures == "two"
        #: the run's hooks (:mod:`.observer`): what tests use to script a trial's comparison or c̄
        self.observer = host.observer
        #: the run's acceptance rule (``config.acceptance``): scores trials, describes itself to logs and the bar
        self.rule = make_acceptance(self.config)
        self.controller = make_step_controller(self.config.step_control, self.rule.threshold, self.config.beta,
                                               self.config.min_alpha)
        self.reference_loss = math.nan  # θ0's whole-replay loss, set by run()
        #: the newest trial's measurements (what the progress bar shows against the rule)
        self.last_measurement: Optional[TrialMeasurement] = None
        self.phase = "starting the step loop"

    # ---- the loop ----------------------------------------------------------------------------------------
    def run(self, base: ReplayLosses, rise: float) -> ReplayLosses:
        """Step from θ0 (captured as ``base``) until converged, ``max_steps`` or a budget; ``rise``: the fine-tune's
        replay-loss rise (the loss rules' unit). Returns the capture of θ_t, which the model holds on return."""
        cfg, report = self.config, self.report
        self.reference_loss = base.loss
        current_tag, last = "c0", base
        for step in range(cfg.max_steps):
            if self.budget.exhausted(report.num_jacobian_evals):
                break
            self.phase = f"projecting the update at step {step}"
            self.ensure_captured(current_tag)
            self.project_all(current_tag)
            if step == 0:
                self._note_gram_ranks()
            record, taken = self._run_step(step, current_tag, last, rise)
            if taken is None:
                # The budget ran out inside the step, or its unchecked final step was left out: θ_t, the last
                # accepted point, is what the model keeps.
                self._end_without_step()
                break
            record.alpha, record.forced = taken.alpha, not self.rule.passes(taken.score)  # NaN counts as forced
            report.steps.append(record)
            self.release_current()
            self.layers.move_to(taken.tag, taken.alpha)
            if current_tag != "c0" or self.lean:  # lean: θ0's capture is taken again for the statistics
                self.store.drop(current_tag)
            current_tag, last = taken.tag, taken.capture
            if taken.alpha == 1.0:
                report.converged = not record.forced
                report.stop_reason = ("converged" if report.converged
                                      else "max_steps reached: final step taken unchecked")
                break
            if record.forced:
                logger.warning("JANUS step %d: step size would fall below min_alpha=%g; took α=%.4g failing the "
                               "acceptance test (%s; score %.4f against %.3g, mean cosine %.4f)", step,
                               cfg.min_alpha, taken.alpha, self.rule.describe(), taken.score, self.rule.threshold,
                               record.taken.mean_cosine if record.taken else math.nan)
        # Whatever ended the loop (convergence, a budget, a left-out final step), the model holds θ_t from here.
        self.layers.hold_current()
        self._note_budget_stop()
        return last

    def _run_step(self, step: int, current_tag: str, last: ReplayLosses,
                  rise: float) -> tuple[StepRecord, Optional[Taken]]:
        """The trials of one step, until one is taken (returned) or none can be (None)."""
        final = step == self.config.max_steps - 1
        proj_norm = math.sqrt(sum(float(layer.proj.norm()) ** 2 for layer in self.layers))
        # Every replica must try the same step sizes: rank 0's choice is the one taken.
        alpha = self.world.from_rank0(self.controller.start_step(proj_norm, final=final))
        record = StepRecord(step=step, alpha=alpha)
        kept: Optional[KeptTrial] = None  # a passing trial held while a larger α is checked
        while True:
            if self.budget.exhausted(self.report.num_jacobian_evals):
                # the budget ends the step, but a passing trial may be at hand
                return record, (kept.take(self.layers, record) if kept is not None else None)
            trial, decision = self._evaluate(step, alpha, current_tag, last, rise, record, final)
            if trial is None:  # the unchecked final step was left out
                self._drop(kept)
                return record, None
            if decision.action == "try":
                if decision.keep:
                    self._drop(kept)
                    kept = KeptTrial(trial, len(record.trials) - 1,
                                     {layer.name: layer.trial_eig for layer in self.layers})
                    if self.lean:  # its eigendecompositions are kept; its factors are captured again if needed
                        self.store.drop(trial.tag)
                else:
                    self.store.drop(trial.tag)
                self._show_trial(record, None)
                alpha = self.world.from_rank0(decision.alpha)
                continue
            if decision.action == "accept_kept":
                if kept is None:
                    raise RuntimeError("the step controller fell back to a kept trial, but none is kept in this step")
                self.store.drop(trial.tag)
                taken = kept.take(self.layers, record)
            else:
                self._drop(kept)
                taken = trial
            steps_left = self.config.max_steps - step - 1
            self._show_trial(record, self.controller.estimated_remaining_evaluations(taken.alpha, steps_left))
            return record, taken

    def _evaluate(self, step: int, alpha: float, current_tag: str, last: ReplayLosses, rise: float,
                  record: StepRecord, final: bool) -> tuple[Optional[Taken], Decision]:
        """One trial: write, capture, compare, score, decide; recorded in ``record``. The trial comes back as None
        when it was the unchecked final step and would undo part of the repair (then left out)."""
        cfg = self.config
        tag = f"s{step}t{len(record.trials)}"
        self.phase = f"evaluating trial α={alpha:.4g} at step {step}"
        self.layers.write_trial(alpha, tag)
        capture = self.capture(tag)
        self.report.num_jacobian_evals += 1
        cbar, per_layer = self.observer.compare(self, current_tag, tag)
        cbar = float(self.observer.trial_cosine(step, alpha, cbar))
        cbar = self.world.from_rank0(cbar)  # every replica must take the same decision
        measured = TrialMeasurement(alpha=alpha, mean_cosine=cbar, trial_loss=capture.loss, current_loss=last.loss,
                                    reference_loss=self.reference_loss, rise=rise)
        self.last_measurement = measured
        score = self.rule.score(measured)
        passed = self.rule.passes(score)
        decision = self.controller.decide(alpha, score, forced_ok=final)
        taken = decision.action == "accept"
        if taken and final and not passed and cfg.final_step == "guarded":
            self.report.discarded_final_step = undoing_final_step(alpha, cbar, capture.loss, last.loss)
            if self.report.discarded_final_step is not None:
                record.trials.append(TrialRecord(step, alpha, cbar, per_layer, False, capture.loss, score, passed))
                self.store.drop(tag)
                self._show_trial(record, 0)
                return None, decision
        record.trials.append(TrialRecord(step, alpha, cbar, per_layer, taken, capture.loss, score, passed))
        logger.info("JANUS step %d trial α=%.4g: %s %s (mean cosine %.5f) -> %s; replay loss %.5f", step, alpha,
                    self.rule.name, self.rule.verdict(measured, score), cbar, decision.action
                    if decision.action != "try" else ("keep, try larger" if decision.keep else "shrink"),
                    capture.loss)
        return Taken(tag, capture, alpha, score), decision

    def _drop(self, kept: Optional[KeptTrial]) -> None:
        if kept is not None:
            self.store.drop(kept.taken.tag)

    def ensure_captured(self, tag: str) -> None:
        """Capture the point the model holds again as ``tag`` when its factors were dropped (lean schedule)."""
        if self.store.has(tag):
            return
        if self.layers.held != CURRENT:
            raise RuntimeError(f"capture {tag!r} is needed again but the model does not hold that point")
        self.phase = f"capturing {tag} again (captures='two')"
        with self.budget.not_charged():
            self.capture(tag)
        self.report.recaptures += 1

    def _end_without_step(self) -> None:
        found = self.report.discarded_final_step
        if found is not None:
            self.report.stop_reason = (
                f"max_steps reached: the unchecked final step (α={found['alpha']:.4g}, mean cosine "
                f"{found['mean_cosine']:.4f}) raised the replay loss to {found['replay_loss']:.5g}, above "
                f"{found['kept_replay_loss']:.5g} at the last accepted point, which is returned "
                "(final_step='paper' keeps it)")
            logger.warning("JANUS: %s", self.report.stop_reason)
        self.release_current()
        for layer in self.layers:
            layer.proj, layer.trial_eig = None, None

    def _note_budget_stop(self) -> None:
        report, budget = self.report, self.budget
        if budget.reason is None:
            return
        report.stopped_early = True
        report.stop_reason = budget.reason
        logger.warning("JANUS stopped early: %s after %d Jacobian evaluation(s) and %d accepted step(s). The model "
                       "holds the last accepted point%s. Raise %s to let it finish.", budget.reason,
                       report.num_jacobian_evals, len(report.steps),
                       "" if report.steps else " (θ0: no step was accepted, so the target layers lost the whole "
                       "fine-tuning update)", budget.knob)

    def _note_gram_ranks(self) -> None:
        for layer in self.layers:
            layer.gram_rank0 = layer.eig.rank
            if layer.eig.rank >= layer.d_in * layer.d_out:
                logger.warning(
                    "JANUS: the replay's Jacobian of %s has rank %d = d_in·d_out: its null space is empty, so the "
                    "whole fine-tuning update of this layer is removed. Replay fewer samples than the layer has "
                    "weights, or exclude the layer (exclude_modules)", layer.name, layer.eig.rank)

    # ---- projecting and comparing all layers ----------------------------------------------------------------
    def project_all(self, tag: str) -> None:
        """Δθ_proj of every layer at the point captured as ``tag`` (θ_t), from θ̂ − θ_t."""
        # Every trial of this step compares against J_t: layers on the materialized path keep their per-sample
        # gradients until the step ends (as many as fit in materialize_max_bytes, in total) instead of
        # rebuilding them for each trial.
        cfg, device = self.config, self.jacobians.device
        budget = cfg.materialize_max_bytes
        with self.jacobians.ghost_phase():
            for layer in self.layers:
                jac = self.jacobians.jacobian(layer.name, tag)
                layer.path = jac.path
                if layer.eig is None:
                    layer.eig = eig_psd(jac.gram(), cfg.gram_rcond, cfg.damping)
                delta = layer.finetuned(device) - layer.current.to(device)
                proj, jvp = project_with_jvp(jac, delta, layer.eig)
                layer.proj = proj.to(self.proj_home, torch.float32)
                if tag == "c0" and layer.jvp0 is None:
                    # θ_t = θ0 here, so this JVP is J_0 (θ̂ - θ0), the statistics' denominator.
                    layer.jvp0 = jvp
                if jac.path == "materialized" and jac.materialized_bytes <= budget:
                    budget -= jac.materialized_bytes
                    layer.current_jac = jac
                else:
                    jac.release()

    def release_current(self) -> None:
        """Free the current point's Jacobians kept for the step's trials."""
        self.layers.release_current_jacobians()

    def compare_all(self, current_tag: str, trial_tag: str) -> tuple[float, dict[str, Optional[float]]]:
        """c̄, the mean over layers of the mean principal-angle cosine between the row spaces of the Jacobians at
        ``current_tag`` and ``trial_tag``, and each layer's (None where neither point constrains the layer)."""
        cfg = self.config
        per_layer: dict[str, Optional[float]] = {}
        with self.jacobians.ghost_phase():
            for layer in self.layers:
                cached = layer.current_jac is not None
                cur = layer.current_jac if cached else self.jacobians.jacobian(layer.name, current_tag)
                trial = self.jacobians.jacobian(layer.name, trial_tag)
                layer.trial_eig = eig_psd(trial.gram(), cfg.gram_rcond, cfg.damping)
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

    # ---- progress --------------------------------------------------------------------------------------------
    def _show_trial(self, record: StepRecord, remaining: Optional[int]) -> None:
        """The newest trial on the progress bar: what a user needs to estimate the wait. The bar counts Jacobian
        evaluations; its total (hence tqdm's remaining time) is re-estimated after every accepted step."""
        trial, bar, rule = record.trials[-1], self.bar, self.rule
        if remaining is not None:
            bar.total = self.report.num_jacobian_evals + remaining
        bar.update(1)
        fields = {"step": record.step, "trial": len(record.trials), "alpha": f"{trial.alpha:.3g}"}
        if rule.bar_key != "cos":  # c̄ is measured whatever the rule: shown beside a rule that does not judge it
            fields["cos"] = f"{trial.mean_cosine:.4f}"
        fields[rule.bar_key] = rule.verdict(self.last_measurement, trial.score)
        fields["loss"] = f"{trial.replay_loss:.4f}"
        bar.set_postfix(fields)
