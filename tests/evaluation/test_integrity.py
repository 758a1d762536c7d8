"""What the frontier refuses before any work, and what it reports instead of NaN: samples outside the model's
vocabulary are refused by position before a model is scored; replay training that diverges stops, is logged and is
reported as a diverged point (not chosen, not drawn, its figures null); every JSON written is strict."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from eval_fixtures import NEW, PAST, nll_scorer, tiny_frontier_setting
from hf_janus import JanusConfig
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates import FINETUNED, REFERENCE, Wise
from hf_janus.evaluation.candidates import replay_sft
from hf_janus.evaluation.candidates.replay_sft import non_finite
from hf_janus.evaluation.frontier_result import DIVERGED, SCORED, FrontierPoint, FrontierResult
from hf_janus.evaluation.frontier_search import frontier
from hf_janus.evaluation.harness import EvaluationResult
from hf_janus.evaluation.strict_json import finite_or_none


def strict_loads(text: str):
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def setting():
    return tiny_frontier_setting()


def run(setting, replay=None, **kwargs):
    tok, base, tuned, default_replay = setting
    return frontier(base, copy.deepcopy(tuned), default_replay if replay is None else replay, past_tasks=["past"],
                    new_tasks=["new"], config=JanusConfig(tau=0.9, max_steps=3), tokenizer=tok, progress=False,
                    **kwargs)


# ---- samples outside the vocabulary ------------------------------------------------------------------------------
def labelled(tok, text, **change):
    ids = tok(text)["input_ids"]
    sample = {"input_ids": list(ids), "labels": [-100] * 3 + list(ids[3:])}
    for key, (position, value) in change.items():
        sample[key][position] = value
    return sample


@pytest.mark.parametrize("samples, candidates, index, change, expected", [
    ("new_task", "wise:0.5", 2, {"input_ids": (4, 500)},
     "new-task sample 2 holds token id 500 in its input_ids, but the model has 72 tokens"),
    ("new_task", "replay-sft:passes=1:new_task_weight=1", 1, {"labels": (5, 999)},
     r"new-task sample 1 holds label 999 in its labels \(token ids, or -100 where no loss counts\)"),
    ("new_task", "replay-sft:passes=1:new_task_weight=1", 1, {"labels": (5, -7)}, "new-task sample 1 holds label -7"),
    ("replay", "janus:tau=0.9", 3, {"labels": (6, 999)}, "replay sample 3 holds label 999"),
    ("replay", "janus:tau=0.9", 0, {"input_ids": (2, 72)}, r"replay sample 0 holds token id 72 .* \(ids 0 to 71\)"),
], ids=["new-task-ids", "new-task-labels", "new-task-negative-label", "replay-labels", "replay-ids"])
def test_samples_outside_the_vocabulary_are_refused_by_position_before_any_work(setting, samples, candidates, index,
                                                                                 change, expected):
    tok = setting[0]
    texts = NEW[6:10] if samples == "new_task" else PAST[6:10]
    given = [labelled(tok, t, **(change if i == index else {})) for i, t in enumerate(texts)]
    scorer = nll_scorer(tok)
    kwargs = {"new_task_samples": given} if samples == "new_task" else {"replay": given}
    with pytest.raises(JanusError, match=expected) as err:
        run(setting, candidates=candidates, scorer=scorer,
            rectify_fn=lambda *a, **k: pytest.fail("JANUS ran before the samples were checked"), **kwargs)
    what = "new-task" if samples == "new_task" else "replay"
    assert f"(sample {index}, counting from 0 in the order given)" in str(err.value)
    assert f"tokenize the {what} samples with this model's tokenizer" in str(err.value)
    assert scorer.calls == 0


def test_samples_in_the_vocabulary_pass(setting):
    tok = setting[0]
    result = run(setting, candidates="wise:0.5", scorer=nll_scorer(tok),
                 new_task_samples=[labelled(tok, t) for t in NEW[6:9]])
    assert [p.status for p in result.points] == [SCORED] * 3


# ---- replay training that diverges -------------------------------------------------------------------------------
def test_a_non_finite_loss_or_weight_is_caught_each_step():
    weights = [torch.ones(3), torch.zeros(2, 2)]
    assert non_finite(torch.tensor(0.5), weights) is None
    assert non_finite(torch.tensor(float("nan")), weights) == "loss"
    assert non_finite(torch.tensor(0.5), [torch.ones(3), torch.tensor([[0.0, math.inf], [0.0, 0.0]])]) == "weights"


def test_diverging_replay_training_is_a_diverged_point_logged_unchosen_unplotted_and_null(setting, tmp_path, caplog,
                                                                                          monkeypatch):
    tok = setting[0]
    trainings = []
    train = replay_sft.train_on_replay

    def counted(*args, **kwargs):
        trainings.append(kwargs["lr"])
        return train(*args, **kwargs)

    monkeypatch.setattr(replay_sft, "train_on_replay", counted)
    spec = "wise:0.5 replay-sft:passes=2:lr=1e30 replay-sft:passes=1:lr=1e-4 replay-sft:passes=3:loss=kl:lr=1e30"
    with caplog.at_level("WARNING", logger="hf_janus.evaluation.frontier_search"):
        result = run(setting, candidates=spec, scorer=nll_scorer(tok))
    by = {p.label: p for p in result.points}
    diverged = [p for p in result.points if p.status == DIVERGED]
    assert [p.kind for p in diverged] == ["replay-sft", "replay-sft"]
    assert by["replay SFT 1 passes (CE, adam lr=0.0001)"].status == SCORED
    assert trainings == [1e30, 1e-4, 1e30]
    for p in diverged:
        assert p.scores == {"past": None, "new": None} and (p.ap1, p.ap2, p.ap) == (None, None, None)
        assert "replay training diverged" in p.reason and "lower lr" in p.reason
        assert any(p.label in r.getMessage() and "diverged" in r.getMessage() for r in caplog.records
                   if r.levelname == "WARNING")
    assert result.best.status == SCORED
    for criterion in ({}, {"min_ap2": 0.0}, {"min_ap1": 0.0}):
        assert result.select(**criterion).status == SCORED

    path = tmp_path / "frontier.json"
    result.save(path)
    saved = {p["label"]: p for p in strict_loads(path.read_text())["points"]}
    for p in diverged:
        assert saved[p.label]["status"] == "diverged" and saved[p.label]["ap1"] is None
        assert saved[p.label]["scores"] == {"past": None, "new": None}
    assert strict_loads(json.dumps(result.publication_record(), allow_nan=False))
    table = result.to_markdown()
    assert all(f"{p.label} (diverged)" in table for p in diverged)

    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    result.plot(tmp_path / "frontier.png")
    axes = figures[0].axes[0]
    legend = axes.get_legend_handles_labels()[1]
    assert "JANUS → replay SFT" not in legend
    drawn = [xy for line in axes.get_lines() for xy in line.get_xydata().tolist()]
    drawn += [xy for points in axes.collections for xy in points.get_offsets().tolist()]
    assert drawn and all(math.isfinite(x) and math.isfinite(y) for x, y in drawn)


# ---- strict JSON -------------------------------------------------------------------------------------------------
def test_non_finite_figures_are_written_as_null_and_never_chosen(tmp_path):
    nan, inf = float("nan"), float("inf")
    points = [FrontierPoint(REFERENCE, {"p": 1.0, "n": 0.0}, ap1=100.0, ap2=0.0, ap=50.0),
              FrontierPoint(FINETUNED, {"p": 0.0, "n": 1.0}, ap1=0.0, ap2=100.0, ap=50.0),
              FrontierPoint(Wise(0.5), {"p": nan, "n": inf}, ap1=nan, ap2=inf, ap=nan)]
    result = FrontierResult(points=points, past_tasks=["p"], new_tasks=["n"], metrics={}, higher_is_better={})
    assert result.select().label != "WiSE-FT a=0.5"
    result.save(tmp_path / "frontier.json")
    wise = strict_loads((tmp_path / "frontier.json").read_text())["points"][2]
    assert wise["scores"] == {"p": None, "n": None} and (wise["ap1"], wise["ap2"], wise["ap"]) == (None, None, None)

    evaluated = EvaluationResult(scores={"model": {"p": nan}}, metrics={"p": "acc"}, higher_is_better={"p": True},
                                 past_tasks=["p"], new_tasks=[], ap={"model": {"ap1": -inf}})
    evaluated.save(tmp_path / "eval.json")
    data = strict_loads((tmp_path / "eval.json").read_text())
    assert data["scores"] == {"model": {"p": None}} and data["ap"] == {"model": {"ap1": None}}
    assert finite_or_none({"a": [1.0, (nan, 2)], "b": "NaN"}) == {"a": [1.0, [None, 2]], "b": "NaN"}
