"""``JanusCallback`` with the repair after JANUS (``JanusConfig(distill_steps=...)``): the new task's samples are the
Trainer's own train dataloader, the model ends at the point the repair chose, a LoRA comes out a LoRA, and what the
repair cannot train is refused before the first step."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from peft import get_peft_model
from transformers import TrainerCallback
from trainer_fixtures import FAST, lora_config, make_trainer, pretrained_llama, replay_data

from hf_janus import JanusCallback
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
    # the Trainer's batches of 4, taken apart: the repair fits new_task_batch_size samples a step, unpadded
    fitted = janus.rectifier.new_task_batches
    assert [len(b["input_ids"]) for b in fitted] == [REPAIR.new_task_batch_size] * (32 // REPAIR.new_task_batch_size)
    lengths = sorted(len(sample["input_ids"]) for sample in math_samples(0, 32, max_len=64))
    assert sorted(int(n) for b in fitted for n in b["attention_mask"].sum(dim=1)) == lengths
    assert all(b["input_ids"].shape[1] == int(b["attention_mask"].sum(dim=1).max()) for b in fitted)
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
    NEW_TASK_VALIDATION_MAX samples) and fits every train sample it took; with no distill_lr it trains at a tenth
    of the Trainer's learning rate, which the report and record say."""
    model = pretrained_llama()
    janus = JanusCallback(replay_data(), dataclasses.replace(REPAIR, distill_lr=None))
    trainer = make_trainer(tmp_path, model, [janus], max_steps=6)
    trainer.eval_dataset = math_samples(32, 24, max_len=64)  # GSM8K problems the fine-tune did not train on
    janus.trainer = trainer
    trainer.train()
    repair = janus.report.repair
    assert repair.validation_samples["new_task"] == NEW_TASK_VALIDATION_MAX
    assert repair.gain_measured_on == "the new task's validation samples" and repair.chosen is not None
    assert repair.lr == pytest.approx(trainer.args.learning_rate / 10)
    assert janus.report.config["distill_lr"] == pytest.approx(trainer.args.learning_rate / 10)


def test_the_repair_trains_in_the_trainers_mixed_precision(tmp_path):
    """bf16=True: the repair's training passes run under the Trainer's autocast (the report says so); the figures
    it chooses by run at the weights' own precision, so θ0's are those of a float32 run's, exactly."""
    reports = {}
    for bf16 in (False, True):
        model = pretrained_llama()
        janus = JanusCallback(replay_data(), REPAIR)
        trainer = make_trainer(tmp_path / str(bf16), model, [janus], max_steps=6, bf16=bf16)
        janus.trainer = trainer
        trainer.train()
        reports[bf16] = janus.report.repair
    assert reports[True].autocast_dtype == "bfloat16" and reports[False].autocast_dtype is None
    assert "bfloat16 autocast" in reports[True].summary()
    assert reports[True].validation["reference"] == reports[False].validation["reference"]


class _AttentionCalls(TrainerCallback):
    """Counts the first layer's attention passes from train end on (registered before JanusCallback): under
    gradient checkpointing a backward pass runs the layer again."""

    calls = 0

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.model.layers[0].self_attn.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def test_the_repair_checkpoints_the_layers_training_checkpointed(tmp_path):
    """gradient_checkpointing=True: each of the repair's training passes (a replay and a new-task batch a step)
    runs the checkpointed layers once more in its backward pass, and the point is the same as without."""
    runs = {}
    for checkpointing in (False, True):
        model, counter = pretrained_llama(), _AttentionCalls()
        janus = JanusCallback(replay_data(), REPAIR)
        trainer = make_trainer(tmp_path / str(checkpointing), model, [counter, janus], max_steps=6,
                               gradient_checkpointing=checkpointing)
        janus.trainer = trainer
        trainer.train()
        runs[checkpointing] = (counter.calls, janus.report.repair, model.state_dict())
    (plain_calls, plain, plain_weights), (calls, checkpointed, weights) = runs[False], runs[True]
    assert checkpointed.checkpointed_layers == len(model.model.layers) and plain.checkpointed_layers == 0
    assert calls - plain_calls == 2 * REPAIR.distill_steps
    assert checkpointed.chosen == plain.chosen
    for key, value in weights.items():
        torch.testing.assert_close(value, plain_weights[key], rtol=0, atol=1e-5)


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


def _quantized_lora(tmp_path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = tmp_path / "base"
    pretrained_llama().save_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    return get_peft_model(base, lora_config())


def test_a_qlora_trains_its_own_factors_and_its_base_stays_as_it_was(tmp_path):
    """On a quantized base the repair trains the adapter's lora_A and lora_B through the PEFT model; the quantized
    weights are never written, the adapter keeps its rank, and the chosen point is the adapter's factors."""
    pytest.importorskip("bitsandbytes")
    model = _quantized_lora(tmp_path)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    janus = JanusCallback(replay_data(), REPAIR, on_error="raise")
    trainer = make_trainer(tmp_path, model, [janus], max_steps=6)
    janus.trainer = trainer
    trainer.train()
    repair = janus.report.repair
    assert repair.chosen is not None and repair.outside_parameters == []
    assert janus.report.output["format"] == "adapter"
    for name, value in model.named_parameters():
        if name in base:
            assert torch.equal(value, base[name]), name
    ranks = {p.shape[0] for n, p in model.named_parameters() if "lora_A" in n}
    assert ranks == {lora_config().r}


def test_a_qlora_at_another_rank_trains_the_dense_stand_ins(tmp_path):
    """adapter_rank=2 on a quantized base: the adapter cannot train its own factors at its rank, so the repair trains
    the dense stand-ins of the quantized layers and the update is re-factorized at rank 2; the base stays as it was."""
    pytest.importorskip("bitsandbytes")
    model = _quantized_lora(tmp_path)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    janus = JanusCallback(replay_data(), REPAIR, on_error="raise", adapter_rank=2)
    trainer = make_trainer(tmp_path, model, [janus], max_steps=6)
    janus.trainer = trainer
    trainer.train()
    validation = janus.report.repair.validation
    assert validation["trained"] != validation["janus"]  # the stand-ins trained
    assert {p.shape[0] for n, p in model.named_parameters() if "lora_A" in n} == {2}
    for name, value in model.named_parameters():
        if name in base:
            assert torch.equal(value, base[name]), name
