"""``JanusCallback`` with the repair after JANUS (``JanusConfig(distill_steps=...)``): the new task's samples are the
Trainer's own train dataloader, the model ends at the point the repair chose, a LoRA comes out a LoRA, and what the
repair cannot train is refused before the first step."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from peft import get_peft_model
from testing_utils import build_tiny
from trainer_fixtures import FAST, lora_config, make_trainer, pretrained_llama, replay_data

from hf_janus import JanusCallback, JanusError
from hf_janus.demo import math_samples
from hf_janus.engine.repair import NEW_TASK_VALIDATION_MAX
from hf_janus.publish.record_file import REPORT_NAME

REPAIR = dataclasses.replace(FAST, distill_steps=6, distill_lr=1e-3, keep_gain=0.5)


def test_the_callback_repairs_with_the_trainers_own_samples(tmp_path):
    model = pretrained_llama()
    janus = JanusCallback(replay_data(), REPAIR)
    trainer = make_trainer(tmp_path, model, [janus], max_steps=6)
    janus.trainer = trainer
    trainer.train()
    repair = janus.report.repair
    assert repair is not None and repair.steps == 6
    assert repair.validation_samples["new_task"] == 32 // 8  # every eighth of the Trainer's 32 GSM8K samples
    assert repair.chosen is not None and "repair after JANUS" in janus.report.summary()
    # a full fine-tune: the snapshot held θ0 of the embeddings and norms too, which the repair moved back
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(repair.outside_parameters)
    record = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert record["repair"]["chosen"] == repair.chosen
    # its figures go where the Trainer's logs go
    logged = next(entry for entry in trainer.state.log_history if "janus/repair_replay_nll" in entry)
    assert logged["janus/repair_replay_nll"] == repair.validation["chosen"].replay_nll
    assert logged["janus/repair_seconds"] == repair.seconds
    trainer.save_model(str(tmp_path / "saved"))
    assert "repair after JANUS" in (tmp_path / "saved" / "README.md").read_text()


def test_the_trainers_eval_dataset_measures_the_gain(tmp_path):
    """Given an eval_dataset, the repair measures the gain on it (through the Trainer's eval dataloader, at most
    NEW_TASK_VALIDATION_MAX samples) and fits every train sample it took."""
    model = pretrained_llama()
    janus = JanusCallback(replay_data(), REPAIR)
    trainer = make_trainer(tmp_path, model, [janus], max_steps=6)
    trainer.eval_dataset = math_samples(32, 24, max_len=64)  # GSM8K problems the fine-tune did not train on
    janus.trainer = trainer
    trainer.train()
    repair = janus.report.repair
    assert repair.validation_samples["new_task"] == NEW_TASK_VALIDATION_MAX
    assert repair.gain_measured_on == "the new task's validation samples" and repair.chosen is not None


def test_a_lora_comes_out_a_lora(tmp_path):
    model = get_peft_model(pretrained_llama(), lora_config())
    janus = JanusCallback(replay_data(), REPAIR)
    trainer = make_trainer(tmp_path, model, [janus], max_steps=6)
    janus.trainer = trainer
    trainer.train()
    assert janus.report.repair is not None
    assert janus.report.output["format"] == "adapter"
    assert janus.report.repair.outside_parameters == []  # the base is frozen: only the adapter changed
    assert all("lora_A" in n or "lora_B" in n for n, p in model.named_parameters() if p.requires_grad)


def test_a_quantized_base_is_refused_before_training(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    path = tmp_path / "base"
    build_tiny("llama").save_pretrained(path)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    model = get_peft_model(base, lora_config())
    trainer = make_trainer(tmp_path, model, [JanusCallback(replay_data(), REPAIR, on_error="raise")], max_steps=1)
    weight = next(p for n, p in model.named_parameters() if "lora_B" in n).detach().clone()
    with pytest.raises(JanusError, match="distill_steps.*quantized base"):
        trainer.train()
    assert torch.equal(next(p for n, p in model.named_parameters() if "lora_B" in n), weight)
