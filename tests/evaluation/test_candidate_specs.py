"""Candidates as objects: the spec syntax and the registry, the frontier's default candidates, a frontier of the
post-hoc peers on a tiny model (with an injected scorer instead of lm-eval), and ``hf-janus frontier --candidates``."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from eval_fixtures import NEW, PAST, nll_scorer, tiny_frontier_setting, write_jsonl
from hf_janus import JanusConfig, load_report
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates import (DEFAULT_GRID, DEFAULT_PEERS, NEW_TASK_PEERS, DampedJanus, DgHard,
                                            Janus, JanusRepair, JanusToReference, Lines, ReplaySft, SpecContext, Wise,
                                            WiseThenJanus, default_candidates, default_peers, kinds, parse_candidates)
from hf_janus.evaluation.frontier_result import wise_margin
from hf_janus.evaluation.frontier_search import frontier



def test_spec_grammar_builds_the_kinds():
    got = parse_candidates("wise:0.25,0.5 janus:tau=0.9,0.95 damped-janus:damping=0.1 janus-to-reference:0.5",
                           SpecContext(tau=0.8))
    assert got == [Wise(0.25), Wise(0.5), Janus(0.9), Janus(0.95), DampedJanus(tau=0.8, damping=0.1),
                   JanusToReference(b=0.5, tau=0.8)]
    assert parse_candidates("janus", SpecContext(tau=0.7)) == [Janus(0.7)]  # τ left out: the config's
    # a grid over two options is every combination, the first varying slowest; repeats are dropped
    grid = parse_candidates(["wise-then-janus:a=0.5,0.75:tau=0.9,0.95", WiseThenJanus(a=0.5, tau=0.9)])
    assert [(c.a, c.tau) for c in grid] == [(0.5, 0.9), (0.5, 0.95), (0.75, 0.9), (0.75, 0.95)]
    assert parse_candidates("replay-sft:passes=4,8:loss=kl") == [ReplaySft(passes=4, loss="kl"),
                                                                 ReplaySft(passes=8, loss="kl")]
    budgets = parse_candidates("replay-sft", SpecContext(tau=0.9))
    assert [(c.budget, c.janus_tau, c.run_key()) for c in budgets] == [(1.0, 0.9, None), (2.0, 0.9, None),
                                                                      (4.0, 0.9, None)]
    repairs = parse_candidates("janus-repair janus-repair:steps=8:keep_gain=0.9:tau=0.9:schedule=linear",
                               SpecContext(tau=0.95))
    assert repairs == [JanusRepair(tau=0.95), JanusRepair(tau=0.9, steps=8, keep_gain=0.9, schedule="linear")]
    assert repairs[0].steps == 256 and repairs[0].run_key() != Janus(0.95).run_key()  # a rectification of its own
    assert repairs[1].changes() == {"tau": 0.9, "distill_steps": 8, "keep_gain": 0.9, "distill_lr": 1e-5,
                                    "distill_schedule": "linear", "new_task_weight": 1.0, "new_task_batch_size": 2}
    fitted = parse_candidates("replay-sft:passes=2:new_task_weight=1,0.5:new_task_batch_size=4")
    assert [(c.new_task_weight, c.new_task_batch_size) for c in fitted] == [(1.0, 4), (0.5, 4)]
    assert fitted[0].label.endswith("lr=1e-05, new task ×1)")
    assert "Each step also fits 4 of the new task's samples" in fitted[0].describe()
    assert fitted[0].artifact_key() != ReplaySft(passes=2).artifact_key()  # trained apart
    # steps= instead of passes= (no default passes then); replay-sft's default budgets only when neither is given
    assert parse_candidates("replay-sft:steps=64") == [ReplaySft(steps=64)]
    assert parse_candidates("input-null fisher:1 lines dg-hard")[-2:] == [Lines(0.0, 1.0), DgHard()]
    assert [c.energy for c in parse_candidates("input-null")] == [0.9, 0.99, 0.999]
    with pytest.raises(JanusError, match="no candidate kind is named 'input_null'.*'input-null'"):
        parse_candidates("input_null")  # one name per kind: its spec name is its JSON kind
    assert [k.name for k in kinds()][:3] == ["wise", "intruder", "janus"]


@pytest.mark.parametrize("spec,message", [
    ("wsie:0.5", "no candidate kind is named 'wsie': a candidate spec must be one of 'wise', "),
    ("wise:a=0.5:a=0.7", "given twice"),
    ("wise:b=0.5", "wise has no option 'b' \\(its options: a\\)"),
    ("wise:x", "wise: a='x' is not a valid value"),
    ("wise:1.0", "wise: a must be strictly between 0 and 1"),
    ("janus:tau=1", "janus: tau must be in \\[0, 1\\)"),
    ("damped-janus:0", "damping must be finite and > 0"),
    ("replay-sft:passes=2:budget=1", "one of passes=, steps= and budget=, not passes and budget"),
    ("replay-sft:steps=2:budget=1", "one of passes=, steps= and budget=, not steps and budget"),
    ("replay-sft:steps=2:janus_tau=0.9", "janus_tau names the JANUS run a budget= counts; with steps= it is unused"),
    ("replay-sft:steps=0", "replay-sft: steps must be a whole number ≥ 1"),
    ("janus-repair:steps=0", "janus-repair: steps must be a whole number ≥ 1"),
    ("janus-repair:keep_gain=1.5", "janus-repair: keep_gain must be in \\(0, 1\\]"),
    ("janus-repair:new_task_batch_size=0", "janus-repair: new_task_batch_size must be a whole number ≥ 1"),
    ("replay-sft:passes=0", "passes must be a whole number ≥ 1"),
    ("replay-sft:passes=2:loss=mse", "loss must be one of \\('ce', 'kl'\\)"),
    ("janus-repair:lr=0", "janus-repair: lr must be finite and > 0"),
    ("janus-repair:schedule=step", "janus-repair: schedule must be constant or linear or cosine"),
    ("janus-repair:new_task_weight=0", "new_task_weight must be finite and > 0"),
    ("replay-sft:passes=1:new_task_batch_size=0", "new_task_batch_size must be a whole number ≥ 1"),
    ("replay-sft:passes=1:optimizer=lbfgs", "optimizer must be one of \\('adam', 'sgd'\\)"),
    ("input-null:1", "energy must be strictly between 0 and 1"),
    ("input-null:0.9:tokens=some", "tokens must be one of"),
    ("regmean:0", "lam must be finite and > 0"),
    ("fisher:-1", "strength must be finite and > 0"),
    ("lines:alpha=0:beta=0", "other than a constant"),
    ("dg-hard:1", "dg-hard takes no options"),
    ("anchor", "always scored"),
    ("", "names no candidate"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(JanusError, match=message):
        parse_candidates(spec)


def test_the_kinds_keep_their_order_labels_and_run_keys():
    cands = parse_candidates("wise:0.5 intruder:0.5 janus:tau=0.9 damped-janus:damping=0.1 janus-to-reference:b=0.5 "
                             "janus-to-finetuned:b=0.5 wise-then-janus:a=0.7 intruder-then-janus:0.25",
                             SpecContext(tau=0.95))
    assert [c.label for c in cands] == [
        "WiSE-FT a=0.5", "intruder reduction λ=0.5", "JANUS τ=0.9", "JANUS τ=0.95, damping 0.1",
        "JANUS τ=0.95 → θ0 b=0.5", "JANUS τ=0.95 → θ̂ b=0.5", "WiSE-FT a=0.7 → JANUS τ=0.95",
        "intruder reduction λ=0.25 → JANUS τ=0.95"]
    assert [c.run_key() for c in cands] == [None, None, "tau=0.9", "tau=0.95,damping=0.1", "tau=0.95", "tau=0.95",
                                            "tau=0.95,a=0.7", "tau=0.95,intruder=0.25"]
    with pytest.raises(JanusError, match="janus-to-reference: b must be strictly between 0 and 1"):
        parse_candidates("janus-to-reference:b=1")


def test_the_default_candidates_are_every_kinds_own_grid_then_the_peers():
    """The default grid is each kind at the default its option declares (JANUS at three τ), in the legend's order;
    the peers follow, and JANUS with the repair after it only when the new task's samples are given."""
    from hf_janus.evaluation.candidates.janus import DEFAULT_TAUS

    grid = parse_candidates(DEFAULT_GRID, SpecContext(tau=0.9))
    expected = []
    for name in ("wise", "intruder", "janus", "damped-janus", "janus-to-reference", "janus-to-finetuned",
                 "wise-then-janus", "intruder-then-janus"):
        expected += parse_candidates(name if name != "janus" else "janus:tau=" + ",".join(map(str, DEFAULT_TAUS)),
                                     SpecContext(tau=0.9))
    assert grid == expected and len(grid) == 9 + 4 + 3 + 2 + 3 + 3 + 2 + 1
    assert default_candidates(False) == DEFAULT_GRID + " " + DEFAULT_PEERS == DEFAULT_GRID + " " + default_peers(False)
    assert default_candidates(True) == DEFAULT_GRID + " " + DEFAULT_PEERS + " " + NEW_TASK_PEERS


# ---- frontiers on a tiny model, scored by an injected scorer ------------------------------------------------------
@pytest.fixture(scope="module")
def setting():
    return tiny_frontier_setting()


def run(setting, **kwargs):
    tok, base, tuned, replay = setting
    return frontier(base, copy.deepcopy(tuned), replay, past_tasks=["past"], new_tasks=["new"],
                    config=JanusConfig(tau=0.9, max_steps=3), tokenizer=tok, progress=False,
                    scorer=nll_scorer(tok), **kwargs)


def comparable(point) -> dict:
    return {k: v for k, v in point.to_dict().items() if k not in ("seconds", "build_seconds", "peak_memory_bytes")}


def test_the_default_frontier_is_the_default_spec_with_its_peers_left_out_where_they_cannot_run(setting):
    """With no candidates the frontier scores the default grid (intruder reduction left out: not an adapter) and the
    peers that beat JANUS on a benchmark run, so that it can choose them; a named spec is scored as given."""
    by_default = run(setting)
    expected = [c for c in parse_candidates(default_candidates(False), SpecContext(tau=0.9)) if not c.lora_only]
    assert [p.candidate for p in by_default.points][2:] == expected
    assert [p.kind for p in by_default.points][-4:] == ["replay-sft", "fisher", "input-null", "input-null"]
    sft = by_default.points[-4]
    assert sft.cost.backward_passes == 4 * by_default.reports["tau=0.9"]["num_jacobian_evals"]
    assert by_default.best is not None and by_default.criterion == "max AP"
    assert [p.kind for p in run(setting, candidates="wise:0.5").points] == ["anchor", "anchor", "wise"]


def test_with_new_task_samples_the_default_peers_add_the_repair_after_janus(setting):
    """Given the new task's samples, the default peers also hold JANUS with the repair after it: the engine's own
    stage (one rectification with distill_steps, which chooses its point); without the samples the default is the
    peers alone."""
    tok, base, tuned, _ = setting
    replay = [{"input_ids": tok(t)["input_ids"]} for t in PAST]  # the repair holds one sample in eight out
    new_task = [{"input_ids": tok(t)["input_ids"]} for t in NEW]
    mine = (tok, base, tuned, replay)
    by_default = run(mine, candidates="wise:0.5 janus:tau=0.9 " + default_peers(True), new_task_samples=new_task)
    assert default_peers(True) == DEFAULT_PEERS + " " + NEW_TASK_PEERS and default_peers(False) == DEFAULT_PEERS
    assert [p.kind for p in by_default.points][-5:] == ["replay-sft", "fisher", "input-null", "input-null",
                                                        "janus-repair"]
    repaired = by_default.points[-1]
    assert repaired.candidate == JanusRepair(tau=0.9)
    report = by_default.reports[repaired.candidate.run_key()]
    assert report["config"]["distill_steps"] == 256 and report["repair"]["steps"] == 256
    assert report["repair"]["chosen"] is not None and report["repair"]["validation_samples"] == {
        "replay": 1, "new_task": 1}
    # the plain JANUS point is JANUS alone, although the config of its run is the same but for the repair
    assert "repair" not in by_default.reports["tau=0.9"] or by_default.reports["tau=0.9"]["repair"] is None
    # the 12 replay samples are two steps' batches of JanusConfig's distill_replay_batch_size, 8: 256 steps are
    # 256 x 8 / 12 replay passes
    assert repaired.cost.backward_passes == pytest.approx(256 * 8 / 12)
    with pytest.raises(JanusError, match="janus-repair fits the new task's samples .* none were given"):
        run(mine, candidates="janus-repair")
    with pytest.raises(JanusError, match="holds out one replay sample in 8 .* give at least 8 replay samples"):
        run(setting, candidates="janus-repair", new_task_samples=new_task)


def test_a_frontier_of_the_post_hoc_peers(setting, tmp_path):
    tok, base, tuned, replay = setting
    spec = ("wise:0.5 janus:0.9 replay-sft:passes=2:lr=1e-3 input-null:0.9,0.99 regmean:0.01 fisher:1 lines "
            "dg-hard")
    result = run(setting, candidates=spec)
    kinds_seen = [p.kind for p in result.points]
    assert kinds_seen == ["anchor", "anchor", "wise", "janus", "replay-sft", "input-null", "input-null", "regmean",
                          "fisher", "lines", "dg-hard"]
    builder, scorer = result._builder, nll_scorer(tok)
    for p in result.points:  # each point's scores are its weights' scores
        with builder.applied(p) as model:
            assert {n: r.score for n, r in scorer(model).items()} == pytest.approx(p.scores, rel=1e-6)
    by = {p.kind: p for p in result.points}
    costs = {k: (p.cost.jacobian_evaluations, p.cost.forward_passes, p.cost.backward_passes) for k, p in by.items()}
    assert costs["replay-sft"] == (0, 2.0, 2.0) and costs["regmean"] == (0, 0.0, 0.0)  # the Grams were shared
    assert costs["fisher"] == (0, 1.0, 1.0) and costs["janus"][0] > 0 and costs["lines"] == (0, 0.0, 0.0)
    assert [p.cost.forward_passes for p in result.points if p.kind == "input-null"] == [1.0, 0.0]
    # what building took at its peak, on the CPU the process's resident memory (a kind that builds nothing, or a
    # point built from an earlier one's Grams: none, and the latter says its cost is that point's)
    first_null, second_null = [p for p in result.points if p.kind == "input-null"]
    assert all(p.cost.peak_memory_bytes > 0 for p in (by["janus"], by["replay-sft"], by["fisher"], first_null))
    assert not first_null.cost.reused and second_null.cost.reused and by["regmean"].cost.reused
    assert second_null.cost.peak_memory_bytes is None and not by["fisher"].cost.reused
    assert by["wise"].cost.peak_memory_bytes is None and "build peak GiB" in result.to_markdown()
    # the layer-by-layer peers touch the layers JANUS rectifies: the output head keeps θ̂, as under JANUS
    assert "lm_head.weight" in builder.theta0 and "lm_head" not in builder.target_layers
    for kind in ("input-null", "regmean", "dg-hard", "janus"):
        assert torch.equal(builder.weights(by[kind])["lm_head.weight"], builder.finetuned["lm_head.weight"].float())
    # LiNeS (α=0, β=1) returns the embeddings, before the first block, to θ0 and keeps the head's update
    lines = builder.weights(by["lines"])
    assert torch.equal(lines["model.embed_tokens.weight"], builder.theta0["model.embed_tokens.weight"].float())
    assert torch.equal(lines["lm_head.weight"], builder.finetuned["lm_head.weight"].float())
    # every point off a curve gets its margin over it; WiSE-FT points are the baseline and get none
    curves = {"wise", "replay-sft", "input-null", "regmean", "fisher", "lines"}
    assert set(by["janus"].above) == curves and set(by["dg-hard"].above) == curves
    assert set(by["fisher"].above) == curves - {"fisher"} and by["wise"].above == {}
    for name in curves:
        assert by["janus"].above[name] == wise_margin(result.points, by["janus"].ap1, by["janus"].ap2, name)
    table = result.to_markdown()
    assert "AP1 vs replay SFT" in table and "AP1 vs input null space" in table and "| 2/2 |" in table
    result.plot(tmp_path / "peers.png")
    assert open(tmp_path / "peers.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    # the JSON holds each point's options under "options" only, and the chosen peer's record and card say what it is
    result.save(tmp_path / "frontier.json")
    point = json.load(open(tmp_path / "frontier.json"))["points"][4]
    assert {"kind", "title", "ap1", "ap2", "label", "above_wise",
            "above_intruder", "jacobian_evaluations", "options", "forward_passes", "description"} <= set(point)
    assert point["options"]["passes"] == 2 and "tau" not in point and "tau" not in point["options"]
    result.chosen = kinds_seen.index("fisher")
    out = result.save_pretrained(tmp_path / "chosen")
    assert load_report(out).frontier["chosen"]["kind"] == "fisher"
    card = open(tmp_path / "chosen" / "README.md").read()
    assert "diagonal-Fisher-weighted interpolation" in card and "involves no JANUS step" in card
    assert "replay fine-tuning" in card  # the candidates' titles, from the record


def test_kinds_not_defined_for_the_fine_tuning_are_refused(setting):
    with pytest.raises(JanusError, match="intruder needs a saved LoRA adapter"):
        run(setting, candidates="intruder:0.5")


def test_the_new_task_samples_are_what_fine_tuning_trained_on_not_a_self_replay(setting):
    from hf_janus import SelfReplay

    with pytest.raises(JanusError, match="a SelfReplay, but θ0's answers are not the new task"):
        run(setting, candidates="wise:0.5", new_task_samples=SelfReplay(prompts=["two plus two is"]))


def test_cli_takes_a_candidate_spec(setting, tmp_path, capsys):
    from hf_janus.cli import main

    tok, base, tuned, _ = setting
    dirs = {}
    for label, model in (("base", base), ("tuned", tuned)):
        dirs[label] = str(tmp_path / label)
        model.save_pretrained(dirs[label])
        tok.save_pretrained(dirs[label])
    past = write_jsonl(str(tmp_path / "past.jsonl"), [{"prompt": t[:8], "completion": t[9:]} for t in PAST[:4]])
    new = write_jsonl(str(tmp_path / "new.jsonl"), [{"prompt": t[:6], "completion": t[7:]} for t in NEW[:4]])
    replay = write_jsonl(str(tmp_path / "data" / "replay.jsonl"), [{"text": t} for t in PAST[6:]])
    out = str(tmp_path / "frontier")
    argv = ["frontier", "--reference", dirs["base"], "--finetuned", dirs["tuned"], "--replay", replay,
            "--text-field", "text", "--past-task", past, "--new-task", new, "--batch-size", "2", "--no-progress",
            "--output", out]
    assert main(argv + ["--candidates", "wise:0.5 lines:alpha=0.5:beta=0.5"]) == 0
    data = json.load(open(f"{out}/frontier.json"))
    assert [p["label"] for p in data["points"]] == ["θ0 (reference)", "θ̂ (fine-tuned)", "WiSE-FT a=0.5",
                                                    "LiNeS α=0.5 β=0.5"]
    assert main(argv + ["--candidates", "wise:2"]) == 2
    assert "wise: a must be strictly between 0 and 1" in capsys.readouterr().err
    # the replay training that also fits the new task's samples, given by file; refused without them
    fitted = ["--candidates", "replay-sft:passes=1:lr=0.01:new_task_weight=1:new_task_batch_size=2"]
    assert main(argv + fitted) == 2
    assert "new_task_weight fits the new task's samples too, but none were given" in capsys.readouterr().err
    samples = write_jsonl(str(tmp_path / "data" / "new_train.jsonl"), [{"text": t} for t in NEW[6:]])
    assert main(argv + fitted + ["--new-task-samples", samples]) == 0
    point = json.load(open(f"{out}/frontier.json"))["points"][2]
    assert point["label"] == "replay SFT 1 passes (CE, adam lr=0.01, new task ×1)"
    assert point["options"]["new_task_weight"] == 1.0
