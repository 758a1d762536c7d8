"""The frontier's choice added beside the trained LoRA adapter (``FrontierResult.add_adapter``), as PEFT's
``reduce_intruder_dimension`` adds its result: the new adapter holds the chosen point's weights, the trained one is
unchanged, both save and reload; a model that is not the scored adapter is refused."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from eval_fixtures import char_tokenizer, train_on_texts, write_jsonl
from peft import LoraConfig, PeftModel, get_peft_model
from testing_utils import build_tiny
from transformers import AutoModelForCausalLM

from hf_janus import JanusConfig, JanusError, frontier
from hf_janus.adapters.peft_layers import adapted_linear_layers, effective_weights

PAST = [f"the cat sat on mat {i}" for i in range(12)]
NEW = [f"{i} plus {i} is {2 * i}" for i in range(12)]
FULL_RANK = 64  # ≥ every tiny layer's smaller side: the re-factorization is exact


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A base that learned PAST, a LoRA trained on NEW from it (both saved), and the frontier over the adapter."""
    folder = tmp_path_factory.mktemp("frontier-adapter")
    tok = char_tokenizer()
    base = build_tiny("llama", seed=0, vocab=len(tok))
    train_on_texts(base, PAST, tok, steps=30, lr=1e-2)
    base_dir = os.fspath(folder / "base")
    base.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    train_on_texts(lora, NEW, tok, steps=20, lr=1e-2, seed=1)
    adapter_dir = os.fspath(folder / "adapter")
    lora.save_pretrained(adapter_dir)
    past = write_jsonl(str(folder / "past.jsonl"), [{"prompt": t[:8], "completion": t[9:]} for t in PAST[:6]])
    new = write_jsonl(str(folder / "new.jsonl"), [{"prompt": t[:6], "completion": t[7:]} for t in NEW[:6]])
    replay = [{"input_ids": tok(t)["input_ids"]} for t in PAST[6:]]
    result = frontier(base_dir, adapter_dir, replay, past_tasks=[past], new_tasks=[new],
                      config=JanusConfig(tau=0.9, max_steps=2), candidates="wise:0.5 janus:tau=0.9", tokenizer=tok,
                      batch_size=2, progress=False)
    return result, base_dir, adapter_dir


def load(base_dir, adapter_dir):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)


@pytest.mark.parametrize("label", ["JANUS τ=0.9", "WiSE-FT a=0.5"])
def test_chosen_point_becomes_an_adapter_beside_the_trained_one(scored, tmp_path, label):
    result, base_dir, adapter_dir = scored
    result.chosen = next(i for i, p in enumerate(result.points) if p.label == label)
    model = load(base_dir, adapter_dir)
    trained = {k: v.clone() for k, v in effective_weights(adapted_linear_layers(model)).items()}
    written = result.add_adapter(model, "frontier", rank=FULL_RANK)
    assert model.active_adapters == ["frontier"] and written["trained_adapter"] == "default"
    want = result._builder.weights(result.best)
    got = effective_weights(adapted_linear_layers(model))
    for key, w in got.items():  # Linear layers: the stored layout is the (d_out, d_in) matrix
        torch.testing.assert_close(w, want[key], rtol=0, atol=1e-5)
    assert min(layer["kept_energy"] for layer in written["layers"]) > 1 - 1e-9
    model.set_adapter("default")
    assert all(torch.equal(w, trained[k]) for k, w in effective_weights(adapted_linear_layers(model)).items())

    model.save_pretrained(tmp_path / "both")
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "both" / "frontier",
                                      adapter_name="frontier")
    for key, w in effective_weights(adapted_linear_layers(again)).items():
        torch.testing.assert_close(w, want[key], rtol=0, atol=1e-5)


def test_refuses_another_adapter_and_a_taken_name(scored):
    result, base_dir, adapter_dir = scored
    result.select()
    other = load(base_dir, adapter_dir)
    with torch.no_grad():
        next(p for n, p in other.named_parameters() if "lora_B" in n).add_(0.5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(JanusError, match="not the fine-tuned weight the frontier scored"):
        result.add_adapter(other)
    model = load(base_dir, adapter_dir)
    result.add_adapter(model, "repaired")
    with pytest.raises(JanusError, match="active adapter is not the fine-tuned weight"):
        result.add_adapter(model, "again")  # "repaired" is active now
    model.set_adapter("default")
    with pytest.raises(JanusError, match="already has an adapter named 'repaired'"):
        result.add_adapter(model, "repaired")
    assert other.state_dict().keys() == before.keys() and list(other.peft_config) == ["default"]
