"""The self-replay cache serves θ0's answers only to θ0: its key covers every weight byte and the tokenizer, an entry
that is damaged or does not answer the prompts it is stored for is generated again with a warning, a cache folder
that cannot be used never fails the run; and prompts that cannot be answered are refused before any generation."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from merge_fixtures import char_tokenizer
from testing_utils import build_tiny

from hf_janus import JanusError
from hf_janus.publish.provenance import describe_replay
from hf_janus.replay.generation_cache import model_fingerprint, tokenizer_digest, weights_digest
from hf_janus.replay.prepare import check_vocabulary, prepare_replay
from test_self_replay import PROMPTS, counting_copy, options


def _unsampled_index(numel: int, sampled: int = 64) -> int:
    """An element that a fingerprint of ``sampled`` evenly spaced values per tensor never reads."""
    seen = {i * (numel - 1) // (sampled - 1) for i in range(sampled)}
    return next(i for i in range(numel) if i not in seen)


def test_one_changed_value_anywhere_is_another_key(model, tok, tmp_path):
    changed = counting_copy(model)
    embeddings = changed.model.embed_tokens.weight
    with torch.no_grad():
        embeddings.view(-1)[_unsampled_index(embeddings.numel())] += 1e-3  # one re-trained embedding value
    assert weights_digest(changed) != weights_digest(model)
    assert model_fingerprint(changed, tok) != model_fingerprint(model, tok)

    cached = options(prompts=PROMPTS, cache_dir=tmp_path)
    cached.generate(counting_copy(model), tok)
    cached.generate(changed, tok)
    assert changed.generate_calls == 1  # not served the first model's answers
    assert len(os.listdir(tmp_path)) == 2


def test_the_key_covers_bfloat16_weights_and_buffers(model):
    half = model.to(torch.bfloat16)
    before = weights_digest(half)
    with torch.no_grad():
        half.model.layers[1].input_layernorm.weight[3] += 1
    assert weights_digest(half) != before
    half.register_buffer("extra", torch.zeros(3))
    changed = weights_digest(half)
    half.extra[1] = 1.0
    assert weights_digest(half) != changed


def test_a_tokenizer_that_decodes_the_same_ids_otherwise_is_another_key(model, tok, tmp_path):
    from tokenizers import decoders

    other = char_tokenizer()
    other.backend_tokenizer.decoder = decoders.Replace("a", "\n")  # same ids, another text: stops cut elsewhere
    assert other("name a fruit:")["input_ids"] == tok("name a fruit:")["input_ids"]
    assert tokenizer_digest(other) != tokenizer_digest(tok)
    theta0 = counting_copy(model)
    options(prompts=PROMPTS, cache_dir=tmp_path, stop=["\n"]).generate(theta0, tok)
    options(prompts=PROMPTS, cache_dir=tmp_path, stop=["\n"]).generate(theta0, other)
    assert theta0.generate_calls == 2


def _entry(tmp_path):
    (name,) = os.listdir(tmp_path)
    return tmp_path / name


def _damage_bytes(path):
    path.write_bytes(path.read_bytes()[:20] + b"\xff" + path.read_bytes()[20:])


def _damage_folder(path):
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("damage", [_damage_bytes, _damage_folder], ids=["invalid-utf8", "a-folder"])
def test_an_unreadable_entry_is_a_warning_and_generated_again(model, tok, tmp_path, caplog, damage):
    theta0 = counting_copy(model)
    cached = options(prompts=PROMPTS, cache_dir=tmp_path)
    first = cached.generate(theta0, tok)
    damage(_entry(tmp_path))
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        assert cached.generate(theta0, tok) == first
    assert theta0.generate_calls == 2
    assert "generating it again" in caplog.text


def _samples(entry):
    return json.loads(entry.read_text())["samples"]


MALFORMED = {
    "shortened": lambda s: s[:-1],
    "empty": lambda s: [],
    "prompt-length-too-long": lambda s: [{**s[0], "prompt_length": 999}, *s[1:]],
    "prompt-length-negative": lambda s: [{**s[0], "prompt_length": -2}, *s[1:]],
    "string-ids": lambda s: [{**s[0], "input_ids": [str(t) for t in s[0]["input_ids"]]}, *s[1:]],
    "out-of-vocabulary": lambda s: [{**s[0], "input_ids": s[0]["input_ids"] + [10**6]}, *s[1:]],
    "another-prompt": lambda s: [s[1], s[0], *s[2:]],
    "too-long-an-answer": lambda s: [{**s[0], "input_ids": s[0]["input_ids"] + [5] * 10}, *s[1:]],
    "not-a-list": lambda s: {"0": s[0]},
}


@pytest.mark.parametrize("change", MALFORMED.values(), ids=MALFORMED.keys())
def test_an_entry_that_does_not_answer_its_prompts_is_generated_again(model, tok, tmp_path, caplog, change):
    theta0 = counting_copy(model)
    cached = options(prompts=PROMPTS, cache_dir=tmp_path)
    first = cached.generate(theta0, tok)
    entry = _entry(tmp_path)
    data = json.loads(entry.read_text())
    data["samples"] = change(data["samples"])
    entry.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        again = cached.generate(theta0, tok)
    assert again == first and theta0.generate_calls == 2
    assert "generating it again" in caplog.text
    assert _samples(entry) == [{"input_ids": s["input_ids"], "prompt_length": s["labels"].count(-100)}
                               for s in first]  # replaced by the good entry


def test_a_cache_folder_that_cannot_be_used_is_a_warning(model, tok, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        samples = options(prompts=PROMPTS, cache_dir=blocker).generate(model, tok)
    assert len(samples) == len(PROMPTS) and "could not write the self-replay cache" in caplog.text


def test_a_generated_replay_says_where_it_came_from(model, tok):
    generated = options(prompts=PROMPTS[:2], do_sample=True, samples_per_prompt=2, temperature=0.7,
                        stop=["?"]).generate(model, tok)
    info = describe_replay(generated)
    assert info.self_replay == generated.provenance
    assert info.self_replay["prompts"] == "2 given prompts" and info.self_replay["num_samples"] == 4
    assert info.self_replay["decoding"] == {"do_sample": True, "max_new_tokens": 5, "stop": ["?"],
                                            "chat_template": True, "temperature": 0.7, "top_p": None,
                                            "top_k": None, "seed": 0}
    assert info.self_replay["cache_key"]
    line = info.self_replay_line()
    assert line.startswith("θ0's own answers to 2 given prompts: 4 samples, sampled (temperature 0.7, seed 0)")
    assert "stopped at '?'" in line
    assert describe_replay([dict(s) for s in generated]).self_replay is None  # plain samples say nothing


def test_a_bare_prompt_string_is_refused_with_the_fix(model, tok):
    with pytest.raises(JanusError, match=r"neither an existing file.*pass a list: prompts=\['What is 2\+2\?'\]"):
        options(prompts="What is 2+2?").generate(model, tok)


def test_an_answer_budget_past_the_context_is_refused_before_generating(tok):
    gpt2 = build_tiny("gpt2")  # learned positions: 64 of them
    with pytest.raises(JanusError, match=r"prompt 2 has \d+ tokens.*context of 64 tokens.*max_new_tokens"):
        options(prompts=PROMPTS, max_new_tokens=60).generate(gpt2, tok)


def test_labels_outside_the_vocabulary_are_refused(model):
    batches = prepare_replay([{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 3], "labels": [-100, 2, 999]}], 1,
                             group_by_length=False)
    with pytest.raises(JanusError, match="new-task sample 1 holds label 999.*48 tokens.*tokenize"):
        check_vocabulary(batches, model, what="new-task")
    check_vocabulary(batches[:1], model)
