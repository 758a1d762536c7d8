"""Step-size control: the adaptive controller against the paper's (Algorithm 1), and the evaluation/time budgets."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from testing_utils import random_replay

from hf_janus import JanusConfig, RectificationReport, rectify
from hf_janus.engine.acceptance import make_acceptance
from hf_janus.engine.config import PAPER
from hf_janus.errors import JanusError
from hf_janus.engine.capture import ReplayLosses, replay_losses
from hf_janus.engine.ghost import eig_psd
from hf_janus.engine.acceptance import acceptance_score
from hf_janus.engine.rectifier import Rectifier
from hf_janus.engine.observer import RunObserver
from hf_janus.engine.step_control import (
    AdaptiveStepController,
    PaperStepController,
    make_step_controller,
)
from hf_janus.replay.prepare import prepare_replay

TAU, BETA, MIN_ALPHA = 0.95, 0.7, 1e-3


def simulate(controller, gap_of_length, norms):
    """Drive a controller as the loop does, with 1 − c̄ = gap_of_length(α · norm) at each step's norm."""
    steps = []
    for step, norm in enumerate(norms):
        alpha = controller.start_step(norm, final=step == len(norms) - 1)
        trials, kept = [], None
        while True:
            cbar = 1.0 - gap_of_length(alpha * norm)
            decision = controller.decide(alpha, cbar, forced_ok=step == len(norms) - 1)
            trials.append((alpha, cbar))
            if decision.action == "accept":
                steps.append((alpha, cbar, trials))
                break
            if decision.action == "accept_kept":
                steps.append((kept[0], kept[1], trials))
                break
            if decision.keep:
                kept = (alpha, cbar)
            alpha = decision.alpha
    return steps


@pytest.mark.parametrize("k,p", [(0.02, 2.0), (0.5, 2.0), (3.0, 1.5), (40.0, 2.5), (0.3, 1.0)])
def test_adaptive_takes_the_papers_step_with_fewer_trials(k, p):
    """Where c̄ falls monotonically with the step length, both controllers accept the same grid point, the largest
    that passes; the adaptive one needs no more trials in total."""
    def gap(length):
        return min(0.9, k * length ** p)

    norms = [1.0, 0.8, 0.5, 0.45, 0.3, 0.2, 0.15, 0.1, 0.05, 0.02]
    paper = simulate(PaperStepController(TAU, BETA, MIN_ALPHA), gap, norms)
    adaptive = simulate(AdaptiveStepController(TAU, BETA, MIN_ALPHA), gap, norms)
    assert [s[0] for s in adaptive] == [s[0] for s in paper]
    for alpha, cbar, _ in adaptive[:-1]:
        assert cbar >= TAU or alpha * BETA < MIN_ALPHA
    assert sum(len(s[2]) for s in adaptive) <= sum(len(s[2]) for s in paper)


def test_adaptive_jumps_instead_of_shrinking_by_beta():
    """A trial far from τ is followed by the grid point the model predicts, not the next one down."""
    controller = AdaptiveStepController(TAU, BETA, MIN_ALPHA)
    assert controller.start_step(1.0) == 1.0
    decision = controller.decide(1.0, 0.0, forced_ok=False)  # gap 1 with p=2: about 0.22 of the length passes
    assert decision.action == "try" and decision.alpha < BETA ** 3


def test_paper_controller_is_algorithm_1():
    controller = make_step_controller("paper", TAU, 0.5, 0.3)
    assert controller.start_step(2.0) == 1.0
    assert controller.decide(1.0, 0.1, forced_ok=False).alpha == 0.5
    # 0.25 would fall below min_alpha: the trial at 0.5 is taken whatever c̄
    assert controller.decide(0.5, 0.1, forced_ok=False).action == "accept"
    assert controller.start_step(1.0, final=True) == 1.0
    with pytest.raises(ValueError, match="step_control"):
        make_step_controller("newton", TAU, BETA, MIN_ALPHA)


def test_config_validates_the_new_fields():
    with pytest.raises(ValueError, match="step_control"):
        JanusConfig(step_control="fast")
    with pytest.raises(ValueError, match="max_evaluations"):
        JanusConfig(max_evaluations=1)
    with pytest.raises(ValueError, match="max_seconds"):
        JanusConfig(max_seconds=-5)
    with pytest.raises(ValueError, match="ghost_matmul"):
        JanusConfig(ghost_matmul="bfloat16")
    assert JanusConfig.from_dict(JanusConfig(max_evaluations=7, step_control="paper").to_dict()).max_evaluations == 7


def test_the_papers_configuration_is_one_call_away():
    """JanusConfig.paper() is Algorithm 1 as published: it differs from the defaults in the fields where the project
    measured an equivalent, every method field is the paper's, and single fields can be overridden (and are
    validated)."""
    paper, default = JanusConfig.paper().to_dict(), JanusConfig().to_dict()
    assert {k for k in paper if paper[k] != default[k]} == {"compression", "step_control", "final_step"}
    assert set(JanusConfig.method_fields()) <= set(PAPER)
    assert JanusConfig.paper(tau=0.9).tau == 0.9 and JanusConfig.paper(tau=0.9).step_control == "paper"
    with pytest.raises(ValueError, match="step_control"):
        JanusConfig.paper(step_control="fast")


# ---- the loop, on a tiny model -------------------------------------------------------------------------

class DistanceCosines(RunObserver):
    """The run's hooks: the orientation comparison replaced by c̄ = 1 − scale · ‖θ_trial − θ_t‖² (monotone in α at
    every step)."""

    def __init__(self, scale):
        self.scale = scale

    def compare(self, loop, current_tag, trial_tag):
        moved = 0.0
        for layer in loop.layers:
            trial = loop.jacobians.jacobian(layer.name, trial_tag)  # the next step projects with it
            layer.trial_eig = eig_psd(trial.gram(), loop.config.gram_rcond)
            trial.release()
            written = layer.rule.to_matrix(layer.rule.weight(layer.module).detach()).to(torch.float32)
            moved += float((written - layer.current).square().sum())
        c = max(0.0, 1.0 - self.scale * moved)
        return c, {layer.name: c for layer in loop.layers}


def run(model, reference, replay, observer=None, **overrides):
    m = copy.deepcopy(model)
    config = JanusConfig(**{"tau": TAU, "compression_rank": 4, **overrides})
    rectifier = Rectifier(m, reference, replay, config, progress=False, observer=observer)
    report = rectifier.run().report
    return m, report, rectifier


def scale_for(model, reference):
    """A turning rate at which the first steps of the tiny model need several trials."""
    delta = sum(float((p.detach() - reference[name]).square().sum()) for name, p in model.named_parameters()
                if name in reference and p.dim() == 2)
    return 0.5 / delta


def test_adaptive_loop_reproduces_the_papers_weights_with_fewer_evaluations(tuned_llama):
    model, reference = tuned_llama
    distance = DistanceCosines(scale_for(model, reference))
    replay = random_replay(6)
    paper_model, paper, _ = run(model, reference, replay, distance, step_control="paper")
    adaptive_model, adaptive, _ = run(model, reference, replay, distance, step_control="adaptive")
    assert paper.converged and adaptive.converged and len(paper.steps) >= 3
    assert adaptive.alphas == paper.alphas
    assert adaptive.num_jacobian_evals < paper.num_jacobian_evals
    for key, value in paper_model.state_dict().items():
        assert torch.equal(adaptive_model.state_dict()[key], value), key
    for step in adaptive.steps:
        taken = [t for t in step.trials if t.taken]
        assert len(taken) == 1 and taken[0].alpha == step.alpha
        assert taken[0].mean_cosine >= TAU or step.forced


@pytest.mark.parametrize("step_control", ["adaptive", "paper"])
def test_every_accepted_step_passes_or_is_flagged(tuned_llama, step_control):
    """On the real orientation test: each step keeps exactly one trial, with c̄ ≥ τ unless it is flagged forced."""
    model, reference = tuned_llama
    m, report, rectifier = run(model, reference, random_replay(6), tau=0.99, step_control=step_control,
                               max_steps=6)
    assert report.steps
    for step in report.steps:
        taken = [t for t in step.trials if t.taken]
        assert len(taken) == 1 and taken[0].alpha == step.alpha
        assert (taken[0].mean_cosine >= 0.99) != step.forced
    if step_control == "paper":  # Algorithm 1: 1, β, β², ... and only the last trial is taken
        for step in report.steps:
            assert [t.alpha for t in step.trials] == [BETA ** i for i in range(len(step.trials))] or \
                all(math.isclose(t.alpha, BETA ** i) for i, t in enumerate(step.trials))
            assert step.trials[-1].taken
    consistent(m, rectifier, report, random_replay(6))


def consistent(model, rectifier, report, replay):
    """The model holds θ_rect of the result, and the report's rectified replay loss is that model's."""
    for name, layer in rectifier.result.layers.items():
        module = model.get_submodule(name)
        assert torch.equal(module.weight.detach().to(torch.float32), layer.rectified), name
    loss = replay_losses(model, prepare_replay(replay, JanusConfig().replay_batch_size)).loss
    assert math.isclose(loss, report.replay_loss["rectified"], rel_tol=1e-5)


@pytest.mark.parametrize("step_control", ["adaptive", "paper"])
def test_evaluation_budget_stops_at_the_last_accepted_point(tuned_llama, caplog, step_control):
    model, reference = tuned_llama
    distance = DistanceCosines(scale_for(model, reference))
    replay = random_replay(6)
    _, full, _ = run(model, reference, replay, distance, step_control=step_control)
    for budget in range(2, full.num_jacobian_evals):
        with caplog.at_level(logging.WARNING, logger="hf_janus.engine.rectifier"):
            caplog.clear()
            m, report, rectifier = run(model, reference, replay, distance, step_control=step_control,
                                       max_evaluations=budget)
        assert report.num_jacobian_evals == budget
        assert report.stopped_early and not report.converged and "max_evaluations" in report.stop_reason
        assert "max_evaluations" in caplog.text
        # the steps taken are the unbudgeted run's first ones
        assert report.alphas == full.alphas[:len(report.steps)]
        consistent(m, rectifier, report, replay)
    m, report, _ = run(model, reference, replay, distance, step_control=step_control,
                       max_evaluations=full.num_jacobian_evals)
    assert not report.stopped_early and report.converged


def test_time_budget_before_any_step_leaves_theta0_and_says_so(tuned_llama, caplog):
    model, reference = tuned_llama
    replay = random_replay(6)
    with caplog.at_level(logging.WARNING, logger="hf_janus.engine.rectifier"):
        m, report, rectifier = run(model, reference, replay, max_seconds=1e-9)
    assert report.stopped_early and report.steps == [] and report.num_jacobian_evals == 1
    assert "max_seconds" in report.stop_reason and "max_seconds" in caplog.text and "θ0" in caplog.text
    for name in rectifier.result.layers:
        assert torch.equal(m.get_submodule(name).weight.detach(), reference[name + ".weight"])
    consistent(m, rectifier, report, replay)
    assert RectificationReport.from_dict(report.to_dict()).stopped_early


def test_report_and_log_show_the_controller(tuned_llama):
    model, reference = tuned_llama
    report = rectify(copy.deepcopy(model), reference, random_replay(4), JanusConfig(compression_rank=4), progress=False)
    assert report.config["step_control"] == "adaptive" and report.config["max_evaluations"] is None


def test_progress_bar_shows_what_the_wait_depends_on(tuned_llama, capsys):
    model, reference = tuned_llama
    rectify(copy.deepcopy(model), reference, random_replay(4), JanusConfig(compression_rank=4, tau=0.99, max_steps=4),
            progress=True)
    err = capsys.readouterr().err
    for field in ("JANUS rectification", "eval", "step=", "trial=", "alpha=", "cos=", "τ=0.99", "loss="):
        assert field in err, field


# ---- acceptance on the replay loss (issue 22, item 3) ---------------------------------------------------------

@pytest.mark.parametrize("acceptance", ["loss", "both"])
@pytest.mark.parametrize("step_control", ["adaptive", "paper"])
def test_loss_acceptance_accepts_exactly_the_trials_within_the_allowance(tuned_llama, acceptance, step_control):
    """acceptance='loss': a trial passes iff its replay loss rose from the current point by at most
    tolerance·α·(fine-tune's rise); 'both' also needs c̄ ≥ τ. Checked on every trial of a real run."""
    model, reference = tuned_llama
    tol, tau = 0.01, 0.99
    replay = random_replay(6, seed=9)  # a replay whose loss the fine-tune raised
    m, report, rectifier = run(model, reference, replay, tau=tau, acceptance=acceptance,
                               acceptance_options={"tolerance": tol}, step_control=step_control, max_steps=6)
    rise = report.replay_loss["finetuned"] - report.replay_loss["reference"]
    assert rise > 0 and report.steps
    current, checked = report.replay_loss["reference"], 0
    for step in report.steps:
        for trial in step.trials:
            within = trial.replay_loss - current <= tol * trial.alpha * rise * (1 + 1e-9)
            passes = within and (acceptance == "loss" or trial.mean_cosine >= tau)
            if trial.taken and not step.forced:
                assert passes, (step.step, trial)
            if not trial.taken and step_control == "paper":
                assert not passes, (step.step, trial)  # Algorithm 1 shrinks only after a failure
            checked += 1
        current = step.taken.replay_loss
    assert checked >= 1
    if acceptance == "both":  # the cosine part rejects large steps here (the loss part alone takes α=1 at once)
        assert any(not t.taken for s in report.steps for t in s.trials)
    consistent(m, rectifier, report, replay)


def test_an_undefined_cosine_fails_both_tests(tuned_llama):
    """acceptance='both': a trial whose c̄ is undefined (NaN: no constraint at either point) fails, whatever its loss."""
    model, reference = tuned_llama
    _, report, rectifier = run(model, reference, random_replay(6, seed=9), tau=0.99, acceptance="both", max_steps=2)
    base = ReplayLosses("c0", torch.tensor([2.0], dtype=torch.float64), torch.tensor([1]))
    lower = ReplayLosses("t", torch.tensor([1.0], dtype=torch.float64), torch.tensor([1]))
    config = rectifier.config
    assert acceptance_score(config, 1.0, 0.5, lower.loss, base.loss, rise=1.0) >= 0.5  # loss and cosine both pass
    assert not acceptance_score(config, math.nan, 0.5, lower.loss, base.loss, rise=1.0) >= 0.5
    assert not acceptance_score(config, 0.5, 0.5, lower.loss, base.loss, rise=1.0) >= 0.5  # c̄ < τ


@pytest.mark.parametrize("acceptance", ["loss", "both"])
def test_an_undefined_replay_loss_fails_the_loss_tests(acceptance):
    """Issue 39 item 9: a NaN replay loss fails acceptance='both' even where c̄ passes (it scored 0.9 before)."""
    config = JanusConfig(tau=0.95, acceptance=acceptance)
    for trial, current, rise in ((math.nan, 2.0, 1.0), (1.0, math.nan, 1.0), (1.0, 2.0, math.nan)):
        assert not acceptance_score(config, 0.999, 0.5, trial, current, rise) >= 0.5, (trial, current, rise)
    assert acceptance_score(config, 0.999, 0.5, 1.0, 2.0, 1.0) >= 0.5  # the same trial with a defined loss passes


def test_cosine_acceptance_is_the_paper_test():
    """The default acceptance has no loss allowance to be given: it takes τ alone, and an option is refused."""
    assert make_acceptance(JanusConfig(tau=0.99)).threshold == 0.99
    with pytest.raises(JanusError, match="'cosine' has no option 'tolerance'.*it takes no options"):
        JanusConfig(acceptance_options={"tolerance": 10.0})


def test_config_validates_the_acceptance_fields():
    with pytest.raises(ValueError, match="acceptance"):
        JanusConfig(acceptance="kl")
    with pytest.raises(ValueError, match=r"acceptance_options\['tolerance'\]=0 .*'loss'"):
        JanusConfig(acceptance="loss", acceptance_options={"tolerance": 0})
    with pytest.raises(JanusError, match="did you mean 'tolerance'"):
        JanusConfig(acceptance="both", acceptance_options={"tolerence": 0.1})
