"""``acceptance="loss-absolute"`` (hf_janus/engine/acceptance/loss_absolute.py): the rule added as one module, and
its test. The replay loss of every trial the loop takes on its own stays within ``tolerance`` times the
fine-tune's rise of θ0's, however many steps the run takes."""

from __future__ import annotations

import copy

from testing_utils import random_replay

from hf_janus import JanusConfig, rectify
from hf_janus.engine.acceptance import LossAbsoluteAcceptance, TrialMeasurement, make_acceptance


def test_it_passes_exactly_below_the_reference_loss_plus_the_allowance():
    rule = make_acceptance(JanusConfig(acceptance="loss-absolute", acceptance_options={"tolerance": 0.1}))
    assert isinstance(rule, LossAbsoluteAcceptance) and rule.needs_rise
    # θ0 at 1.0, the fine-tune raised it by 2: the bound is 1.2, whatever the current point and α
    for current, alpha in ((1.0, 1.0), (1.15, 0.01)):
        def score(loss):
            return rule.score(TrialMeasurement(alpha=alpha, mean_cosine=0.0, trial_loss=loss, current_loss=current,
                                               reference_loss=1.0, rise=2.0))
        assert rule.passes(score(1.2)) and rule.passes(score(0.5)) and not rule.passes(score(1.2001))
    assert "θ0's + 0.1" in rule.describe()


def test_a_run_keeps_the_replay_loss_within_the_bound(tuned_llama):
    model, reference = tuned_llama
    tol = 0.2
    config = JanusConfig(compression_rank=4, acceptance="loss-absolute", acceptance_options={"tolerance": tol},
                         max_steps=6)
    report = rectify(copy.deepcopy(model), reference, random_replay(6, seed=9), config, progress=False)
    loss = report.replay_loss
    rise = loss["finetuned"] - loss["reference"]
    assert rise > 0 and report.steps
    for step in report.steps:
        if not step.forced:
            assert step.taken.replay_loss <= loss["reference"] + tol * rise * (1 + 1e-9), step
    # the run repaired part of the forgetting: it did not take θ̂'s loss back
    assert loss["rectified"] < loss["finetuned"]
