"""The frontier's choice added beside the trained LoRA adapter (``FrontierResult.add_adapter``), as PEFT's
``reduce_intruder_dimension`` adds its result: the new adapter holds the chosen point's weights, the trained one is
unchanged, both save and reload; a model that is not the scored adapter is refused."""

from __future__ import annotations

import os

import pytest
import torch
from eval_fixtures import saved_lora_setting
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hf_janus import JanusConfig, JanusError, frontier
from hf_janus.adapters.peft_layers import adapted_linear_layers, effective_weights

FULL_RANK = 64  # ≥ every tiny layer's smaller side: the re-factorization is exact


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A base that learned PAST, a LoRA trained on NEW from it (both saved), and the frontier over the adapter."""
    s = saved_lora_setting(os.fspath(tmp_path_factory.mktemp("frontier-adapter")), ["q_proj", "v_proj"],
                           base_steps=30, lora_steps=20)
    result = frontier(s["base_dir"], s["adapter_dir"], s["replay"], past_tasks=[s["past"]], new_tasks=[s["new"]],
                      config=JanusConfig(tau=0.9, max_steps=2), candidates="wise:0.5 janus:tau=0.9",
                      tokenizer=s["tok"], batch_size=2, progress=False)
    return result, s["base_dir"], s["adapter_dir"]


def load(base_dir, adapter_dir):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)


@pytest.mark.parametrize("label", ["JANUS τ=0.9", "WiSE-FT a=0.5"])
def test_chosen_point_becomes_an_adapter_beside_the_trained_one(scored, tmp_path, label):
    result, base_dir, adapter_dir = scored
    result.chosen = next(i for i, p in enumerate(result.points) if p.label == label)
    model = load(base_dir, adapter_dir)
    trained = {k: v.clone() for k, v in effective_weights(adapted_linear_layers(model)).items()}
    written = result.add_adapter(model, "frontier", adapter_rank=FULL_RANK)
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
