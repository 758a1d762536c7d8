"""Acceptance rules as registered objects: the registry, the interface every rule answers to, what a run records
of each trial (score, passed, taken), and reading reports written before those fields existed."""

from __future__ import annotations

import copy
import json
import math

import pytest
from testing_utils import random_replay

from hf_janus import JanusConfig, JanusError, RectificationReport, rectify
from hf_janus.engine.acceptance import (SCORE_THRESHOLD, AcceptanceRule, CosineAcceptance, LossAcceptance,
                                        TrialMeasurement, make_acceptance, register, rule_named, rule_names)
from hf_janus.engine.report import TrialRecord


def measurement(cbar=0.97, alpha=0.5, trial=1.1, current=1.0, reference=0.9, rise=1.0) -> TrialMeasurement:
    return TrialMeasurement(alpha=alpha, mean_cosine=cbar, trial_loss=trial, current_loss=current,
                            reference_loss=reference, rise=rise)


def test_the_built_in_rules_are_registered_and_the_config_names_them():
    assert rule_names()[:4] == ("cosine", "loss", "both", "loss-absolute")
    for name in rule_names():
        rule = make_acceptance(JanusConfig(acceptance=name))
        assert isinstance(rule, AcceptanceRule) and rule.name == name
        # its options are its own, named in acceptance_options' help; τ is the configuration's
        assert all(option.name in JanusConfig.__dataclass_fields__["acceptance_options"].metadata["help"]
                   for option in rule.options), name
        assert rule.uses_tau == (name in ("cosine", "both"))
        assert rule.describe() and rule.summary and rule.card_sentence()
    with pytest.raises(ValueError, match="'cosine' or 'loss' or 'both' or 'loss-absolute'"):
        JanusConfig(acceptance="kl")
    with pytest.raises(JanusError, match="no acceptance rule is named 'kl'.*register"):
        rule_named("kl")


def test_a_rule_reads_its_options_from_a_config_or_a_record():
    config = JanusConfig(acceptance="both", tau=0.9, acceptance_options={"tolerance": 0.2})
    for source in (config, config.to_dict()):
        rule = make_acceptance(source)
        assert (rule.tau, rule.tolerance) == (0.9, 0.2)
    assert make_acceptance({"tau": 0.8}).threshold == 0.8  # a record without the field: the paper's test


def test_the_paper_rule_scores_cbar_against_tau():
    rule = CosineAcceptance(tau=0.95)
    assert rule.threshold == 0.95 and not rule.needs_rise
    assert rule.score(measurement(cbar=0.97)) == 0.97
    assert rule.passes(0.95) and not rule.passes(0.9499) and not rule.passes(math.nan)
    assert rule.verdict(measurement(), 0.97) == "0.9700≥τ=0.95"
    assert rule.verdict(measurement(), 0.9) == "0.9000<τ=0.95"


def test_the_loss_rule_scores_the_share_of_its_allowance():
    rule = LossAcceptance(tolerance=0.25)
    assert rule.needs_rise and rule.threshold == SCORE_THRESHOLD
    # allowance 0.25 · α=0.5 · rise=1 = 0.125 (exact in binary): a rise of 0.125 is at it, 0.1251 past it
    at, past = rule.score(measurement(trial=1.125)), rule.score(measurement(trial=1.1251))
    assert rule.passes(at) and not rule.passes(past)
    assert rule.verdict(measurement(), at).startswith("1.00≤1")
    assert not rule.passes(rule.score(measurement(trial=math.nan)))


def test_registering_a_second_rule_under_a_taken_name_is_refused():
    class Impostor(CosineAcceptance):
        name = "cosine"

    with pytest.raises(JanusError, match="already registered"):
        register(Impostor)
    with pytest.raises(JanusError, match="must subclass"):
        register(dict)
    assert rule_named("cosine") is CosineAcceptance


@pytest.mark.parametrize("acceptance", ["cosine", "loss", "both"])
def test_every_trial_records_its_score_and_whether_it_passed(tuned_llama, acceptance):
    """score and passed are the rule's; taken is where the step moved: a taken trial passed unless the step was
    forced, and a step takes exactly one trial."""
    model, reference = tuned_llama
    options = {} if acceptance == "cosine" else {"tolerance": 0.01}  # the paper's test takes τ alone
    config = JanusConfig(compression_rank=4, tau=0.99, acceptance=acceptance, acceptance_options=options,
                         max_steps=4)
    report = rectify(copy.deepcopy(model), reference, random_replay(6, seed=9), config, progress=False)
    rule = make_acceptance(config)
    assert report.steps
    for step in report.steps:
        assert sum(t.taken for t in step.trials) == 1
        for trial in step.trials:
            assert trial.passed == rule.passes(trial.score)
            if acceptance == "cosine":
                assert trial.score == trial.mean_cosine
            if trial.taken:
                assert trial.passed or step.forced
    again = RectificationReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.to_dict() == report.to_dict()


@pytest.mark.parametrize("acceptance", ["cosine", "loss", "loss-absolute"])
def test_the_card_states_the_runs_acceptance_test(acceptance):
    """The card asks the rule: the paper's keeps its τ row; another rule gets its own row, and no τ row when it
    does not read τ; the forced-step note and the trajectory sentence name no cosine test it did not run."""
    from hf_janus.engine.report import StepRecord
    from hf_janus.publish.card import render_card
    from hf_janus.publish.record_file import PublishedReport

    config = JanusConfig(acceptance=acceptance,
                         acceptance_options={} if acceptance == "cosine" else {"tolerance": 0.25})
    rect = RectificationReport(config=config.to_dict(), steps=[StepRecord(step=0, alpha=0.5, forced=True, trials=[
        TrialRecord(0, 0.5, 0.9, {"l": 0.9}, True, 1.0, 0.9, False)])])
    card = str(render_card(PublishedReport(kind="full", rectification=rect), load_id="me/m"))
    rule = make_acceptance(config)
    assert ("| acceptance threshold τ | 0.95 |" in card) == (acceptance == "cosine")
    assert ("| acceptance test |" in card) == (acceptance != "cosine")
    assert "taken failing the acceptance test" in card
    if acceptance == "cosine":
        assert "stays below τ" in card
    else:
        assert "τ" not in card.split("## Step trajectory")[1].split("|")[0]
        # the other-settings row names its option
        assert f"acceptance={acceptance}, acceptance\\_options=\\(tolerance=0.25\\)" in card
        assert rule.name in card
