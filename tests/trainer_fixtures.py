"""Trainer runs for the JanusCallback tests (single process and distributed): a tiny Llama that learned the past
task (NQ-open pairs), a Trainer fine-tuning it on GSM8K, probes that keep θ̂ before the callback changes it, and
the LoRA setting of the PEFT tests."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig
from testing_utils import build_tiny
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_janus import JanusConfig
from hf_janus.demo import VOCAB, full_text, math_samples, qa_samples
from hf_janus.replay.prepare import prepare_replay

CONFIG = JanusConfig(compression_rank=8, replay_batch_size=8)
# single step: where the loop itself is not under test
FAST = JanusConfig(compression_rank=8, replay_batch_size=8, tau=0.0)


def collate(samples):
    return prepare_replay(samples, len(samples))[0]


def make_trainer(tmp_path, model, callbacks, max_steps=4, **kwargs):
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], save_strategy=kwargs.pop("save_strategy", "no"), use_cpu=True, logging_steps=1,
        disable_tqdm=True, remove_unused_columns=False, seed=0, **kwargs,
    )
    train = math_samples(0, 32, max_len=64)  # GSM8K: the new task
    return Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=callbacks)


def replay_data():
    return full_text(qa_samples(12, max_len=48))  # NQ-open: the past task


_PRETRAINED = {}


def pretrained_llama():
    """A tiny Llama that has learned the replayed QA pairs (the past task), cached per test session."""
    if not _PRETRAINED:
        model = build_tiny("llama", vocab=VOCAB)
        batch = collate(replay_data())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.train()
        for _ in range(60):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.backward()
            opt.step()
            opt.zero_grad()
        _PRETRAINED.update(copy.deepcopy(model.state_dict()))
    model = build_tiny("llama", vocab=VOCAB)
    model.load_state_dict(_PRETRAINED)
    return model


class Probe(TrainerCallback):
    """Records the weights at the end of training, before JanusCallback (registered after it) changes them."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.finetuned = copy.deepcopy(model.state_dict())


TARGETS = ["q_proj", "v_proj", "up_proj"]


def lora_config(**lora_kwargs):
    kwargs = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    kwargs.update(lora_kwargs)
    return LoraConfig(**kwargs)


class PeftProbe(Probe):
    """Keeps the merged fine-tuned model (θ̂ as a plain model) before JanusCallback changes anything."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.finetuned = copy.deepcopy(model).merge_and_unload().state_dict()
        self.lora = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def merged_state(model):
    return copy.deepcopy(model).merge_and_unload().state_dict()
