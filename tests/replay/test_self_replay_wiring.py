"""``SelfReplay`` where hf-janus takes replay: ``JanusCallback`` generates it from θ0 at train begin, before any
weight changes; ``JanusMerger`` and ``hf-janus merge --replay-prompts/--replay-self`` from the base model, never from
the adapted one."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers as tf
from merge_fixtures import char_tokenizer, load_base, save_base, train_adapter, write_jsonl
from testing_utils import build_tiny
from trainer_fixtures import FAST, collate, lora_config, make_trainer
from transformers import Trainer, TrainingArguments

from hf_janus import JanusCallback, JanusError, JanusMerger, SelfReplay
from hf_janus.cli import main
from hf_janus.demo import VOCAB, math_samples
from hf_janus.evaluation.candidates import DEFAULT_PEERS
from hf_janus.publish.provenance import describe_replay
from hf_janus.publish.record_file import REPORT_NAME
from hf_janus.replay.generation_cache import CACHE_ENV

PROMPTS = ["what is a cat?", "hi", "the sky is blue because", "name a fruit:"]
WATCHED = "model.layers.0.mlp.up_proj.weight"


def options(**kwargs) -> SelfReplay:
    kwargs = {"prompts": PROMPTS, "max_new_tokens": 4, "cache_dir": False, "progress": False, **kwargs}
    return SelfReplay(**kwargs)


class WatchedLlama(tf.LlamaForCausalLM):
    """Keeps a copy of one trained weight at every ``generate`` call: what the model held when it answered."""

    def __init__(self, config):
        super().__init__(config)
        self.seen = []

    def generate(self, *args, **kwargs):
        self.seen.append(self.get_parameter(WATCHED).detach().clone())
        return super().generate(*args, **kwargs)


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path, monkeypatch):
    """Generations that use the default cache folder write it here, not into the user's home."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "janus-cache"))


def test_callback_generates_from_theta0_before_training_changes_a_weight(tmp_path):
    built = build_tiny("llama", vocab=VOCAB)
    model = WatchedLlama(built.config)
    model.load_state_dict(built.state_dict())
    theta0 = copy.deepcopy(built)
    tok = char_tokenizer()
    janus = JanusCallback(options(tokenizer=tok), FAST)
    make_trainer(tmp_path, model, [janus]).train()

    assert len(model.seen) == 1 and torch.equal(model.seen[0], theta0.get_parameter(WATCHED))
    assert not torch.equal(model.get_parameter(WATCHED), theta0.get_parameter(WATCHED))  # it did train
    expected = options().generate(theta0, tok)
    assert janus.replay_samples == expected
    assert janus.report is not None and janus.report.num_samples == len(PROMPTS)
    # the record says the replay was θ0's own answers, to which prompts, decoded how, under which cache key
    generated = json.loads((tmp_path / "out" / REPORT_NAME).read_text())["replay"]["self_replay"]
    assert generated == expected.provenance and generated["prompts"] == "4 given prompts"
    assert generated["decoding"]["max_new_tokens"] == 4 and not generated["decoding"]["do_sample"]


def test_callback_on_a_peft_model_generates_from_its_initial_weights(tmp_path):
    from peft import get_peft_model

    base = build_tiny("llama", vocab=VOCAB)
    theta0 = copy.deepcopy(base)
    model = get_peft_model(base, lora_config())
    tok = char_tokenizer()
    janus = JanusCallback(options(tokenizer=tok), FAST)
    make_trainer(tmp_path, model, [janus]).train()
    assert janus.replay_samples == options().generate(theta0, tok)  # LoRA starts at B = 0: θ0 is the base
    assert janus.report is not None


def test_callback_uses_the_trainers_tokenizer(tmp_path):
    model = build_tiny("llama", vocab=VOCAB)
    theta0 = copy.deepcopy(model)
    tok = char_tokenizer()
    janus = JanusCallback(options(), FAST)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)
    Trainer(model=model, args=args, train_dataset=math_samples(0, 8, max_len=64), data_collator=collate,
            processing_class=tok, callbacks=[janus]).train()
    assert janus.replay_samples == options().generate(theta0, tok)


def test_callback_refuses_before_training_when_theta0_cannot_answer(tmp_path):
    model = build_tiny("llama", vocab=VOCAB)
    before = copy.deepcopy(model.state_dict())
    trainer = make_trainer(tmp_path, model, [JanusCallback(options(), FAST)])  # no tokenizer anywhere
    with pytest.raises(JanusError, match="tokenizer"):
        trainer.train()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before any step


def test_callback_refuses_self_replay_on_resume(tmp_path):
    model = build_tiny("llama", vocab=VOCAB)
    tok = char_tokenizer()
    first = JanusCallback(options(tokenizer=tok), FAST)
    make_trainer(tmp_path, model, [first], max_steps=2, save_strategy="steps", save_steps=1).train()
    resumed = make_trainer(tmp_path, build_tiny("llama", vocab=VOCAB), [JanusCallback(options(tokenizer=tok), FAST)],
                           max_steps=3, save_strategy="steps", save_steps=1)
    with pytest.raises(JanusError, match="resumes from a checkpoint.*SelfReplay\\(...\\).generate"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    # the fix the message names: the samples of the first run, replayed as given
    again = JanusCallback(first.replay_samples, FAST)
    make_trainer(tmp_path, build_tiny("llama", vocab=VOCAB), [again], max_steps=3, save_strategy="steps",
                 save_steps=1).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert again.report is not None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("self-replay-merge")
    base = save_base(root / "base")
    return {"root": root, "base": base, "lora": train_adapter(base, root / "lora", "lora", steps=20, lr=5e-2)}


def _finetuned(saved):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(saved["base"]), saved["lora"]).merge_and_unload().eval()


def test_merger_generates_from_the_base_model_not_the_adapted_one(saved):
    tok = char_tokenizer()
    from_base = options().generate(load_base(saved["base"]), tok)
    from_finetuned = options().generate(_finetuned(saved), tok)
    assert from_base != from_finetuned  # else this test could not tell which model answered
    delta = JanusMerger(saved["base"], saved["lora"], options(), FAST, progress=False).run()
    assert delta.replay_info.fingerprint == describe_replay(from_base).fingerprint
    assert delta.report.rectification.num_samples == len(PROMPTS)


def test_cli_merge_with_replay_prompts_and_replay_self(saved, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    fast = ["--tau", "0", "--compression-rank", "0", "--no-progress"]
    out = tmp_path / "from-prompts"
    assert main(["merge", "--base", saved["base"], "--adapter", saved["lora"], "--replay-prompts", prompts,
                 "--replay-samples", "3", "--output", str(out), *fast]) == 0
    record = json.loads((out / REPORT_NAME).read_text())
    expected = SelfReplay(prompts=PROMPTS[:3], progress=False).generate(load_base(saved["base"]), char_tokenizer())
    assert record["replay"]["fingerprint"] == describe_replay(expected).fingerprint
    generated = record["replay"]["self_replay"]
    assert generated["prompts"] == prompts and generated["num_samples"] == 3
    assert generated["cache_key"] == expected.provenance["cache_key"]
    card = (out / "README.md").read_text()
    assert f"θ0's own answers to {prompts}: 3 samples, greedy" in card.replace("\\", "")

    out = tmp_path / "data-free"
    assert main(["merge", "--base", saved["base"], "--adapter", saved["lora"], "--replay-self", "2",
                 "--output", str(out), *fast]) == 0
    record = json.loads((out / REPORT_NAME).read_text())["replay"]
    assert record["size"] == 2 and record["self_replay"]["prompts"] == "generic"

    # answers cut at a character of θ0's first answer, given as an escape, to prompts given as plain text
    first = expected[0]["input_ids"][len(char_tokenizer()(PROMPTS[0])["input_ids"]):]
    stop = char_tokenizer().decode(first[1:2])
    out = tmp_path / "stopped"
    assert main(["merge", "--base", saved["base"], "--adapter", saved["lora"], "--replay-prompts", prompts,
                 "--replay-samples", "3", "--replay-stop", f"\\u{ord(stop):04x}", "--replay-no-chat-template",
                 "--output", str(out), *fast]) == 0
    stopped = SelfReplay(prompts=PROMPTS[:3], progress=False, stop=[stop], chat_template=False).generate(
        load_base(saved["base"]), char_tokenizer())
    assert len(stopped[0]["input_ids"]) < len(expected[0]["input_ids"])
    assert json.loads((out / REPORT_NAME).read_text())["replay"]["fingerprint"] == describe_replay(stopped).fingerprint


@pytest.mark.parametrize("replay_args, message", [
    (["--replay", "x.jsonl", "--replay-self", "4"], "not both"),
    ([], "give the replay"),
    (["--replay-self", "0"], "--replay-self must be >= 1"),
    (["--replay-self", "2", "--replay-stop", "x"], "shape the answers to --replay-prompts"),
])
def test_cli_replay_choice_is_checked_before_loading(saved, tmp_path, capsys, replay_args, message):
    code = main(["merge", "--base", saved["base"], "--adapter", saved["lora"], *replay_args,
                 "--output", str(tmp_path / "out"), "--no-progress"])
    assert code == 2 and message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow  # four lm-eval scorings
def test_frontier_generates_from_the_reference_not_the_finetuned_model(tmp_path):
    pytest.importorskip("lm_eval")
    from eval_fixtures import char_tokenizer as eval_tokenizer
    from eval_fixtures import train_on_texts
    from eval_fixtures import write_jsonl as write_task

    from hf_janus import frontier, rectify

    past_texts, new_texts = ([f"the cat sat on mat {i}" for i in range(6)],
                             [f"{i} plus {i} is {2 * i}" for i in range(6)])
    tok = eval_tokenizer()
    base = build_tiny("llama", vocab=len(tok))
    train_on_texts(base, past_texts, tok, steps=40, lr=1e-2)
    tuned = copy.deepcopy(base)
    train_on_texts(tuned, new_texts, tok, steps=25, lr=1e-2, seed=1)
    past = write_task(str(tmp_path / "past.jsonl"), [{"prompt": t[:8], "completion": t[9:]} for t in past_texts])
    new = write_task(str(tmp_path / "new.jsonl"), [{"prompt": t[:6], "completion": t[7:]} for t in new_texts])
    replayed = []

    def recording(model, reference, replay, *args, **kwargs):
        replayed.append(replay)
        return rectify(model, reference, replay, *args, **kwargs)

    replay = options(prompts=["the cat", "the cat sat on", "1 plus 1"], tokenizer=tok)
    frontier(base, copy.deepcopy(tuned), replay, past_tasks=[past], new_tasks=[new],
             candidates="wise:0.5 janus:tau=0.9 " + DEFAULT_PEERS, tokenizer=tok, batch_size=2, progress=False,
             rectify_fn=recording)
    from_base, from_tuned = replay.generate(base, tok), replay.generate(tuned, tok)
    assert from_base != from_tuned  # else this test could not tell which model answered
    assert replayed and all(r == from_base for r in replayed)


def test_a_callback_given_no_replay_replays_theta0s_answers_to_the_generic_prompts(tmp_path):
    """No past-task data: JanusCallback() is JanusCallback(SelfReplay()), θ0 answering the package's prompts."""
    model = build_tiny("llama", vocab=VOCAB)
    janus = JanusCallback(config=FAST)
    assert isinstance(janus.replay, SelfReplay) and janus.replay.describe() == SelfReplay().describe()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)
    Trainer(model=model, args=args, train_dataset=math_samples(0, 8, max_len=64), data_collator=collate,
            processing_class=char_tokenizer(), callbacks=[janus]).train()
    generated = json.loads((tmp_path / "out" / REPORT_NAME).read_text())["replay"]["self_replay"]
    assert generated["prompts"] == "generic" and janus.report.num_samples == len(janus.replay_samples) > 0
