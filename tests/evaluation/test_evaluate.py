"""hf_janus.evaluate and the local lm-eval tasks, checked against the same quantities computed directly."""

from __future__ import annotations

import os

import pytest
import torch

from testing_utils import build_tiny
from eval_fixtures import char_tokenizer, write_jsonl
from hf_janus.errors import JanusError
from hf_janus.evaluation import (ap_metrics, completion_task, evaluate, exact_match, normalize_answer, qa_task,
                                 task_dir, task_from_file)
from hf_janus.evaluation.harness import Scorer, resolve_tasks
from hf_janus.evaluation.scoring import first_line

pytest.importorskip("lm_eval")

QUESTIONS = ["what is up", "who is he", "where is it", "when is now", "why not", "how so"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    return build_tiny("llama", seed=0, vocab=len(tok)), build_tiny("llama", seed=1, vocab=len(tok))


def greedy_first_lines(model, tok, prompts, max_new_tokens=MAX_NEW):
    """What the task must read off the model: each prompt alone (no padding), greedy, first line."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        out.append(first_line(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)))
    return out


def completion_nll(model, tok, rows):
    """Σ −log p(" " + completion | prompt) over the rows / Σ bytes of " " + completion."""
    total, nbytes = 0.0, 0
    for row in rows:
        ctx = tok(row["prompt"])["input_ids"]
        cont = tok(" " + row["completion"])["input_ids"]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
        targets = ids[0, 1:]
        total -= float(logp[torch.arange(len(targets)), targets][len(ctx) - 1:].sum())
        nbytes += len((" " + row["completion"]).encode())
    return total / nbytes


def test_scoring_rules():
    assert normalize_answer("  The Eiffel-Tower!  ") == "eiffeltower"
    assert normalize_answer("an  apple, a pear") == "apple pear"
    assert exact_match("The Beatles.", ["beatles", "x"]) == 1.0 and exact_match("Beatle", ["beatles"]) == 0.0
    # accuracy-like: shares of the anchors' scores; loss-like: shares of the change
    ap = ap_metrics({"p": 40.0, "n": 30.0}, {"p": 80.0, "n": 10.0}, {"p": 20.0, "n": 60.0}, ["p"], ["n"],
                    {"p": True, "n": True})
    assert ap == {"ap1": 50.0, "ap2": 50.0, "ap": 50.0}
    ap = ap_metrics({"p": 1.5, "n": 2.0}, {"p": 1.0, "n": 3.0}, {"p": 3.0, "n": 1.0}, ["p"], ["n"],
                    {"p": False, "n": False})
    assert ap["ap1"] == pytest.approx(75.0) and ap["ap2"] == pytest.approx(50.0)
    assert ap_metrics({"p": 1.0}, {"p": 1.0}, {"p": 1.0}, ["p"], [], {"p": True})["ap2"] is None
    with pytest.raises(JanusError, match=r"from 2 at θ0 to 1\.5 at θ̂, so AP1 .* fine-tuning raised"):
        ap_metrics({"p": 1.0}, {"p": 2.0}, {"p": 1.5}, ["p"], [], {"p": False})  # no forgetting to undo
    with pytest.raises(JanusError, match=r"so AP2 .* fine-tuning lowered"):
        ap_metrics({"n": 1.0}, {"n": 2.0}, {"n": 2.5}, [], ["n"], {"n": False})  # nothing learned
    with pytest.raises(JanusError, match="scores 0"):
        ap_metrics({"p": 1.0}, {"p": 0.0}, {"p": 1.0}, ["p"], [], {"p": True})


def test_task_files_are_recognized_and_bad_ones_named(tmp_path):
    qa = write_jsonl(str(tmp_path / "nq.jsonl"), [{"question": "q", "answer": ["a"]}])
    wq = write_jsonl(str(tmp_path / "wq.jsonl"), [{"qText": "q?", "answers": ["a"]}])
    comp = write_jsonl(str(tmp_path / "gsm.jsonl"), [{"question": "1+1", "answer": "2"}])
    assert task_from_file(qa)["output_type"] == "generate_until"
    assert task_from_file(wq)["output_type"] == "generate_until"
    assert task_from_file(comp)["output_type"] == "loglikelihood"
    assert [s.name for s in resolve_tasks([qa, "nq_open"])] == ["janus_qa_nq", "nq_open"]
    with pytest.raises(JanusError, match="cannot tell the task"):
        task_from_file(write_jsonl(str(tmp_path / "x.jsonl"), [{"text": "t"}]))
    with pytest.raises(JanusError, match="line 2: not JSON"):
        with open(tmp_path / "bad.jsonl", "w") as fh:
            fh.write('{"question": "q", "answers": ["a"]}\n{oops\n')
        qa_task(tmp_path / "bad.jsonl")
    with pytest.raises(JanusError, match="non-empty list of strings"):
        qa_task(write_jsonl(str(tmp_path / "e.jsonl"), [{"question": "q", "answers": []}]))
    with pytest.raises(JanusError, match="does not exist"):
        completion_task(tmp_path / "missing.jsonl")
    with pytest.raises(JanusError, match="unique"):
        resolve_tasks([qa, qa])


def test_harness_scores_equal_direct_computation(tmp_path, tok, models):
    """Exact match through lm-eval equals greedy decoding done here; NLL per byte equals the direct sum."""
    m0, m1 = models
    prompts = [f"Q: {q}?\nA:" for q in QUESTIONS]
    said = greedy_first_lines(m0, tok, prompts)
    assert all(normalize_answer(s) for s in said), said  # non-empty answers, so a hit is not a blank match
    # half the questions carry the model's own answer (as the second reference), half a wrong one
    qa_rows = [{"question": q, "answers": ["zz", s] if i % 2 == 0 else ["zz"]}
               for i, (q, s) in enumerate(zip(QUESTIONS, said))]
    comp_rows = [{"prompt": f"Q: {i} plus {i}\nA:", "completion": f"it is {2 * i}"} for i in range(5)]
    qa = write_jsonl(str(tmp_path / "past.jsonl"), qa_rows)
    comp = write_jsonl(str(tmp_path / "new.jsonl"), comp_rows)

    result = evaluate(m0, m1, rectified=m0, past_tasks=[qa_task(qa, max_new_tokens=MAX_NEW)], new_tasks=[comp],
                      tokenizer=tok, batch_size=1)
    past, new = "janus_qa_past", "janus_completion_new"
    assert result.scores["reference"][past] == pytest.approx(0.5)
    assert result.metrics[past].startswith("exact_match") and result.higher_is_better == {past: True, new: False}
    for label, model in (("reference", m0), ("finetuned", m1)):
        assert result.scores[label][new] == pytest.approx(completion_nll(model, tok, comp_rows), rel=1e-5)
    direct1 = sum(exact_match(s, r["answers"]) for s, r in zip(greedy_first_lines(m1, tok, prompts), qa_rows))
    assert result.scores["finetuned"][past] == pytest.approx(direct1 / len(QUESTIONS))
    # AP rows: θ0 is 100% of itself on the past task, θ̂ 100% of itself on the new one
    assert result.ap["reference"]["ap1"] == pytest.approx(100.0)
    assert result.ap["rectified"] == result.ap["reference"]
    if result.scores["finetuned"][past] > 0:
        assert result.ap["finetuned"]["ap1"] == pytest.approx(100 * result.scores["finetuned"][past] / 0.5)
    assert result.ap["finetuned"]["ap2"] == pytest.approx(100.0) and result.ap["reference"]["ap2"] == pytest.approx(0.0)
    assert "| rectified |" in result.to_markdown()
    result.save(tmp_path / "eval.json")
    assert os.path.getsize(tmp_path / "eval.json") > 0


def test_shipped_yaml_tasks_read_local_files(tmp_path, tok, models):
    """janus_nq_open from task_dir(), with the file given as metadata, scores as the inline config does."""
    m0, _ = models
    prompts = [f"Q: {q}?\nA:" for q in QUESTIONS]
    said = greedy_first_lines(m0, tok, prompts, max_new_tokens=32)  # the YAML's budget
    qa = write_jsonl(str(tmp_path / "nq.jsonl"), [{"question": q, "answer": [s]} for q, s in zip(QUESTIONS[:3], said)]
                     + [{"question": q, "answer": ["zz"]} for q in QUESTIONS[3:]])
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    assert {"janus_nq_open.yaml", "janus_webqs.yaml", "janus_completion.yaml"} <= set(os.listdir(task_dir()))
    manager = TaskManager(include_path=task_dir(), metadata={"data_files": qa})
    out = simple_evaluate(model=HFLM(pretrained=m0, tokenizer=tok, batch_size=1), tasks=["janus_nq_open"],
                          task_manager=manager, bootstrap_iters=0, log_samples=False)
    assert out["results"]["janus_nq_open"]["exact_match,none"] == pytest.approx(0.5)


def test_unknown_task_and_missing_lm_eval_are_named(tok, models, monkeypatch):
    scorer = Scorer(resolve_tasks(["no_such_task_anywhere"]), tok, batch_size=1)
    with pytest.raises(JanusError, match="does not know a task"):
        scorer(models[0])
    import builtins

    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name.startswith("lm_eval"):
            raise ImportError("No module named 'lm_eval'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    with pytest.raises(JanusError, match=r"hf-janus\[eval\]"):
        Scorer(resolve_tasks(["x"]), tok)


def test_cli_eval_scores_saved_models(tmp_path, tok, models, capsys):
    """hf-janus eval on local directories (tokenizer found beside --reference), JSON output."""
    import json

    from hf_janus.cli import main

    rows = [{"prompt": "Q: 1\nA:", "completion": "one"}, {"prompt": "Q: 2\nA:", "completion": "two"}]
    comp = write_jsonl(str(tmp_path / "new.jsonl"), rows)
    # the "fine-tuned" model must have the lower new-task loss, or AP2 (a share of the loss drop) is undefined
    ordered = sorted(models, key=lambda m: -completion_nll(m, tok, rows))
    dirs = {}
    for label, model in zip(("base", "tuned"), ordered):
        dirs[label] = str(tmp_path / label)
        model.save_pretrained(dirs[label])
        tok.save_pretrained(dirs[label])
    out = str(tmp_path / "eval.json")
    assert main(["eval", "--reference", dirs["base"], "--finetuned", dirs["tuned"], "--model", f"again={dirs['base']}",
                 "--new-task", comp, "--batch-size", "2", "--output", out]) == 0
    data = json.load(open(out))
    assert data["new_tasks"] == ["janus_completion_new"]
    assert data["scores"]["again"] == data["scores"]["reference"]  # the same weights, read from disk twice
    assert data["ap"]["finetuned"]["ap2"] == pytest.approx(100.0) and data["ap"]["again"]["ap2"] == pytest.approx(0.0)
    assert "| again |" in capsys.readouterr().out
    assert main(["eval", "--reference", dirs["base"], "--finetuned", dirs["tuned"], "--model", "oops"]) == 2


def test_adapter_directory_is_scored_merged_on_its_base(tmp_path, tok, models):
    """A PEFT adapter given by directory is merged on the base its config names; scores equal the merged model's."""
    from peft import LoraConfig, get_peft_model

    base_dir = str(tmp_path / "base")
    models[0].save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    peft_model = get_peft_model(build_tiny("llama", seed=0, vocab=len(tok)),
                                LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.peft_config["default"].base_model_name_or_path = base_dir
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    merged = peft_model.merge_and_unload()
    comp = write_jsonl(str(tmp_path / "new.jsonl"), [{"prompt": "Q: 1\nA:", "completion": "one"},
                                                     {"prompt": "Q: 2\nA:", "completion": "two"}])
    result = evaluate(base_dir, str(tmp_path / "adapter"), others={"merged": merged}, new_tasks=[comp], batch_size=2)
    name = "janus_completion_new"
    assert result.scores["finetuned"][name] == pytest.approx(result.scores["merged"][name], rel=1e-6)
    assert result.scores["finetuned"][name] != pytest.approx(result.scores["reference"][name], rel=1e-6)
