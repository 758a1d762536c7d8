"""Short Trainer runs on PEFT models for the adapter tests (QLoRA, the PEFT-shape matrix): random token samples, a
collator, a step counter, and a few optimizer steps with the JanusCallbacks bound to their Trainer."""

from __future__ import annotations

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_janus import JanusCallback


def samples(n, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(4, 40, (length,), generator=gen).tolist()} for _ in range(n)]


def collate(rows):
    ids = torch.tensor([r["input_ids"] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class StepProbe(TrainerCallback):
    """Counts optimizer steps: a refusal at train begin leaves it at 0."""

    def __init__(self):
        self.steps = 0

    def on_step_begin(self, *args, **kwargs):
        self.steps += 1


def train(model, tmp_path, callbacks, steps=3):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=2e-2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=samples(16, seed=1), data_collator=collate,
                      callbacks=callbacks)
    for cb in callbacks:
        if isinstance(cb, JanusCallback):
            cb.trainer = trainer
    trainer.train()
    return trainer
