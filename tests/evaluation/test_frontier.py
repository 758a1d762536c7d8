"""hf_janus.frontier: candidates, the WiSE-FT margin, the choice, and an end-to-end run on a tiny model whose
every point is checked against weights and scores computed here."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from testing_utils import build_tiny
from eval_fixtures import char_tokenizer, train_on_texts, write_jsonl
from hf_janus import JanusConfig, load_report, rectify
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates import (DEFAULT_PEERS, FINETUNED, REFERENCE, Cost, Janus, SpecContext, Wise,
                                            parse_candidates)
from hf_janus.evaluation.frontier_result import FrontierPoint, FrontierResult, wise_margin
from hf_janus.evaluation.frontier_search import frontier
from hf_janus.evaluation.harness import Scorer, resolve_tasks

pytest.importorskip("lm_eval")

PAST = [f"the cat sat on mat {i}" for i in range(12)]
NEW = [f"{i} plus {i} is {2 * i}" for i in range(12)]


def point(candidate, ap1, ap2, evals=0):
    return FrontierPoint(candidate, {}, ap1=ap1, ap2=ap2, ap=(ap1 + ap2) / 2, cost=Cost(jacobian_evaluations=evals))


def test_candidates_order_and_validation():
    cands = parse_candidates("wise:0.5 janus:tau=0.9,0.95 janus-to-reference:b=0.5 janus-to-finetuned:b=0.5 "
                             "wise-then-janus:a=0.7", SpecContext(tau=0.95))
    assert [c.name for c in cands] == ["wise", "janus", "janus", "janus-to-reference", "janus-to-finetuned",
                                       "wise-then-janus"]
    assert (REFERENCE.a, FINETUNED.a) == (0.0, 1.0) and cands[-1].a == 0.7 and cands[-1].tau == 0.95
    for spec, message in (("wise:0,0.5", "strictly between 0 and 1"), ("janus:tau=1", "tau must be in"),
                          ("damped-janus:damping=0", "damping must be finite and > 0"),
                          ("damped-janus:damping=-0.1", "damping must be"), ("damped-janus:damping=inf", "damping")):
        with pytest.raises(JanusError, match=message):
            parse_candidates(spec)
    damped = parse_candidates("janus:tau=0.9 damped-janus:damping=0.01,0.1", SpecContext(tau=0.95))
    assert [(c.name, c.tau, c.record().get("damping")) for c in damped] == [("janus", 0.9, None),
                                                                            ("damped-janus", 0.95, 0.01),
                                                                            ("damped-janus", 0.95, 0.1)]


def test_wise_margin_and_selection():
    pts = [point(REFERENCE, 100, 0), point(FINETUNED, 0, 100), point(Wise(0.6), 60, 60),
           point(Janus(0.9), 70, 80, evals=12), point(Janus(0.95), 90, 50, evals=20)]
    # the curve at AP2=80 runs from (60, 60) to (100, 0): 60 - 60·(20/40) = 30
    assert wise_margin(pts, 70, 80) == pytest.approx(40.0)
    assert wise_margin(pts, 90, 50) == pytest.approx(90 - (100 - 40 * 50 / 60))
    assert wise_margin(pts, 50, 120) is None
    result = FrontierResult(points=pts, past_tasks=["p"], new_tasks=["n"], metrics={}, higher_is_better={})
    assert result.select(min_ap2=75).label == "JANUS τ=0.9"
    assert result.select(min_ap1=85).label == "JANUS τ=0.95"
    assert result.select().label == "JANUS τ=0.9" and result.criterion == "max AP"
    with pytest.raises(JanusError, match="no point keeps AP2 ≥ 101"):
        result.select(min_ap2=101)
    with pytest.raises(JanusError, match="holds no weights"):
        result.save_pretrained("/nonexistent/x")


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """θ0 that has learned PAST, θ̂ fine-tuned from it on NEW, JSONL tasks for both, and the replay."""
    tok = char_tokenizer()
    base = build_tiny("llama", seed=0, vocab=len(tok))
    train_on_texts(base, PAST, tok, steps=40, lr=1e-2)
    tuned = copy.deepcopy(base)
    train_on_texts(tuned, NEW, tok, steps=25, lr=1e-2, seed=1)
    folder = tmp_path_factory.mktemp("frontier")
    past = write_jsonl(str(folder / "past.jsonl"), [{"prompt": t[:8], "completion": t[9:]} for t in PAST[:6]])
    new = write_jsonl(str(folder / "new.jsonl"), [{"prompt": t[:6], "completion": t[7:]} for t in NEW[:6]])
    replay = [{"input_ids": tok(t)["input_ids"]} for t in PAST[6:]]
    return tok, base, tuned, past, new, replay, folder


def test_frontier_end_to_end(setting, tmp_path):
    tok, base, tuned, past, new, replay, _ = setting
    model = copy.deepcopy(tuned)
    theta_hat = {k: v.clone() for k, v in model.state_dict().items()}
    config = JanusConfig(tau=0.9, max_steps=4)
    result = frontier(base, model, replay, past_tasks=[past], new_tasks=[new], config=config, tokenizer=tok,
                      candidates="wise:0.5 janus:tau=0.9 damped-janus:damping=0.1 janus-to-reference:b=0.5 "
                                 "janus-to-finetuned:b=0.5 wise-then-janus:a=0.5 " + DEFAULT_PEERS,
                      batch_size=2, progress=False)
    assert all(torch.equal(v, theta_hat[k]) for k, v in model.state_dict().items())  # θ̂ again
    labels = [p.label for p in result.points]
    assert labels[:5] == ["θ0 (reference)", "θ̂ (fine-tuned)", "WiSE-FT a=0.5", "JANUS τ=0.9",
                          "JANUS τ=0.9, damping 0.1"]
    by = {p.label: p for p in result.points}
    assert by["θ0 (reference)"].ap1 == pytest.approx(100) and by["θ0 (reference)"].ap2 == pytest.approx(0)
    assert by["θ̂ (fine-tuned)"].ap1 == pytest.approx(0) and by["θ̂ (fine-tuned)"].ap2 == pytest.approx(100)

    # JANUS point: the same rectification done here scores the same
    scorer = Scorer(resolve_tasks([past, new]), tok, batch_size=2)
    alone = copy.deepcopy(tuned)
    report = rectify(alone, base, replay, JanusConfig(tau=0.9, max_steps=4), progress=False)
    assert by["JANUS τ=0.9"].jacobian_evaluations == report.num_jacobian_evals > 0
    assert {n: r.score for n, r in scorer(alone).items()} == pytest.approx(by["JANUS τ=0.9"].scores, rel=1e-6)
    # the damped point is a rectification with that damping, scored the same
    damped = copy.deepcopy(tuned)
    report = rectify(damped, base, replay, JanusConfig(tau=0.9, max_steps=4, damping=0.1), progress=False)
    point_d = by["JANUS τ=0.9, damping 0.1"]
    assert (point_d.kind, point_d.option("damping"), point_d.jacobian_evaluations) == ("damped-janus", 0.1,
                                                                            report.num_jacobian_evals)
    assert {n: r.score for n, r in scorer(damped).items()} == pytest.approx(point_d.scores, rel=1e-6)
    assert result.reports["tau=0.9,damping=0.1"]["config"]["damping"] == 0.1
    # hybrid weights are the stated interpolations of θ0, θ_J and θ̂
    builder = result._builder
    cands = {p.label: p.candidate for p in result.points}
    janus_w = builder.weights(cands["JANUS τ=0.9"])
    to0 = builder.weights(cands["JANUS τ=0.9 → θ0 b=0.5"])
    for k, w0 in builder.theta0.items():
        assert torch.allclose(janus_w[k], alone.get_parameter(k).float(), atol=1e-6)
        assert torch.allclose(to0[k], w0 + 0.5 * (janus_w[k] - w0))
        assert torch.allclose(builder.weights(cands["WiSE-FT a=0.5"])[k], w0 + 0.5 * (builder.finetuned[k] - w0))
    for k in builder.theta0:
        assert torch.allclose(builder.weights(point_d)[k], damped.get_parameter(k).float(), atol=1e-6)
    assert "wise-then-janus" in {p.kind for p in result.points} and len(result.reports) == 3
    for p in result.points:
        if p.kind not in ("anchor", "wise"):
            assert p.above_wise is None or p.above_wise == pytest.approx(wise_margin(result.points, p.ap1, p.ap2))

    # outputs: JSON, markdown, PNG, and the chosen model with its record
    chosen = result.select(min_ap2=50.0)
    assert chosen.ap2 >= 50.0 and all(p.ap1 <= chosen.ap1 for p in result.points if p.ap2 >= 50.0)
    result.save(tmp_path / "frontier.json")
    assert json.load(open(tmp_path / "frontier.json"))["criterion"] == "max AP1 with AP2 ≥ 50"
    assert "**→**" in result.to_markdown()
    # a hybrid reuses its JANUS run: its cost is marked as charged there, in the point, the table and the JSON
    by_label = {p.label: p for p in result.points}
    assert not by_label["JANUS τ=0.9"].cost.reused and by_label["JANUS τ=0.9 → θ0 b=0.5"].cost.reused
    assert "| shared |" in next(line for line in result.to_markdown().splitlines() if "τ=0.9 → θ0 b=0.5" in line)
    saved = {p["label"]: p for p in json.load(open(tmp_path / "frontier.json"))["points"]}
    assert saved["JANUS τ=0.9 → θ0 b=0.5"]["build_reused"] and not saved["JANUS τ=0.9"]["build_reused"]
    result.plot(tmp_path / "frontier.png")
    assert open(tmp_path / "frontier.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    out = result.save_pretrained(tmp_path / "chosen")
    record = load_report(out)
    assert record.frontier["chosen"]["label"] == chosen.label and record.kind == "full"
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out)
    want = builder.weights(chosen)
    for k, w in want.items():
        assert torch.equal(saved.get_parameter(k).float(), w)
    assert all(torch.equal(v, theta_hat[k]) for k, v in model.state_dict().items())


def test_frontier_failure_leaves_the_model_as_it_was(setting):
    tok, base, tuned, past, new, replay, _ = setting
    model = copy.deepcopy(tuned)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        frontier(base, model, replay, past_tasks=[past], new_tasks=[new], candidates="wise:0.5 janus:tau=0.9",
                 tokenizer=tok, batch_size=2, progress=False, rectify_fn=failing)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(JanusError, match="identical"):
        frontier(base, copy.deepcopy(base), replay, past_tasks=[past], new_tasks=[new], tokenizer=tok,
                 progress=False)


def test_cli_frontier_writes_table_plot_and_chosen_model(setting, tmp_path, capsys):
    from hf_janus.cli import main

    tok, base, tuned, past, new, _, folder = setting
    dirs = {}
    for label, model in (("base", base), ("tuned", tuned)):
        dirs[label] = str(tmp_path / label)
        model.save_pretrained(dirs[label])
        tok.save_pretrained(dirs[label])
    replay = write_jsonl(str(tmp_path / "data" / "replay.jsonl"), [{"text": t} for t in PAST[6:]])
    out, chosen = str(tmp_path / "frontier"), str(tmp_path / "chosen")
    argv = ["frontier", "--reference", dirs["base"], "--finetuned", dirs["tuned"], "--replay", replay,
            "--text-field", "text", "--past-task", past, "--new-task", new,
            "--candidates", "wise:0.5 janus:tau=0.9 fisher:strength=1",
            "--max-steps", "3", "--batch-size", "2", "--min-ap1", "10", "--output", out,
            "--save", chosen, "--no-progress"]
    assert main(argv) == 0
    assert "Chosen (max AP2 with AP1 ≥ 10)" in capsys.readouterr().out
    data = json.load(open(f"{out}/frontier.json"))
    assert [p["kind"] for p in data["points"]] == ["anchor", "anchor", "wise", "janus", "fisher"]
    assert data["reports"]["tau=0.9"]["config"]["max_steps"] == 3
    assert os.path.getsize(f"{out}/frontier.png") > 0 and os.path.isfile(f"{out}/frontier.md")
    record = load_report(chosen)
    assert record.frontier["criterion"] == "max AP2 with AP1 ≥ 10"
    assert "How this model was chosen" in open(f"{chosen}/README.md").read()
    # a second run may not write over the chosen model without --overwrite, and fails before any work
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err


def test_frontier_is_the_function_on_every_import_path():
    """The module is ``frontier_search``; ``frontier`` is the function however it is imported."""
    import hf_janus
    import hf_janus.evaluation
    from hf_janus.evaluation import frontier_search

    assert hf_janus.frontier is hf_janus.evaluation.frontier is frontier_search.frontier is frontier
    with pytest.raises(ModuleNotFoundError):  # no module shadows the function under its name
        import hf_janus.evaluation.frontier  # noqa: F401
