"""A disk θ0 snapshot leaves ``output_dir`` when training itself fails (issue 31, item 4d).

``Trainer`` calls no callback when ``train()`` raises (no ``on_train_end``), so ``JanusCallback`` wraps its
trainer's ``train``: found while the Trainer is built (``Trainer(callbacks=[janus])``), or given with ``trainer=``.
The copies in checkpoint folders stay, for resuming; a failed rectification keeps the working file for a retry.
"""

from __future__ import annotations

import copy
import functools
import logging
import os

import pytest
import torch
from testing_utils import build_tiny
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_janus import JanusConfig, RectificationError
from hf_janus.demo import VOCAB, full_text, math_samples, qa_samples
from hf_janus.integrations.snapshot import SNAPSHOT_NAME
from hf_janus.integrations.trainer import JanusCallback
from hf_janus.replay.prepare import prepare_replay

FAST = JanusConfig(compression_rank=8, replay_batch_size=8, tau=0.0)


class StepFailure(RuntimeError):
    """What the broken training step raises."""


def collate(samples):
    return prepare_replay(samples, len(samples))[0]


def training_args(tmp_path, max_steps=4, **kwargs):
    return TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], save_strategy=kwargs.pop("save_strategy", "no"), use_cpu=True, logging_steps=1,
        disable_tqdm=True, remove_unused_columns=False, seed=0, **kwargs)


def make_trainer(tmp_path, model, callbacks, **kwargs):
    return Trainer(model=model, args=training_args(tmp_path, **kwargs), train_dataset=math_samples(0, 32, max_len=64),
                   data_collator=collate, callbacks=callbacks)


def replay_data():
    return full_text(qa_samples(12, max_len=48))


def failing_at(model, call: int, exc: BaseException):
    """``model`` whose ``call``-th forward raises ``exc`` (a training step that fails)."""
    calls = {"n": 0}
    forward = model.forward

    @functools.wraps(forward)
    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise exc
        return forward(*args, **kwargs)

    model.forward = broken
    return model


class SnapshotSeen(TrainerCallback):
    """Records whether the snapshot file was in ``output_dir`` at each step (so its absence afterwards means
    it was removed, not that it never existed)."""

    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.seen.append(os.path.isfile(os.path.join(args.output_dir, SNAPSHOT_NAME)))


@pytest.mark.parametrize("exc", [StepFailure("step 2 broke"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failed_training_step_removes_the_snapshot_and_raises_unchanged(tmp_path, exc):
    seen = SnapshotSeen()
    janus = JanusCallback(replay_data(), FAST, snapshot="disk")  # no trainer=: found while Trainer is built
    trainer = make_trainer(tmp_path, failing_at(build_tiny("llama", vocab=VOCAB), 2, exc), [janus, seen])
    with pytest.raises(type(exc)) as info:
        trainer.train()
    assert info.value is exc and exc.__context__ is None  # the very exception, nothing chained onto it
    assert seen.seen and all(seen.seen)  # the file was there while training ran
    assert not os.path.exists(os.path.join(trainer.args.output_dir, SNAPSHOT_NAME))
    assert janus.report is None


def test_guard_through_trainer_argument_and_checkpoint_copies_stay_for_resume(tmp_path):
    """Given with trainer= (the callback added after the Trainer was built), the guard works the same; the θ0
    copy saved into a checkpoint before the failure stays, and resuming from it rectifies against θ0."""
    model = build_tiny("llama", vocab=VOCAB)
    theta0 = copy.deepcopy(model.state_dict())
    trainer = make_trainer(tmp_path, failing_at(model, 3, StepFailure("step 3 broke")), [],
                           save_strategy="steps", save_steps=1)
    trainer.add_callback(JanusCallback(replay_data(), FAST, snapshot="disk", trainer=trainer))
    with pytest.raises(StepFailure):
        trainer.train()
    out = tmp_path / "out"
    assert not (out / SNAPSHOT_NAME).exists()
    assert (out / "checkpoint-2" / SNAPSHOT_NAME).is_file()

    resumed_model = build_tiny("llama", seed=5, vocab=VOCAB)  # weights are replaced by the checkpoint's
    janus = JanusCallback(replay_data(), FAST, snapshot="disk")
    make_trainer(tmp_path, resumed_model, [janus]).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert janus.report is not None
    for key, value in janus.theta0().items():
        assert torch.equal(value, theta0[key]), f"{key}: θ0 must be the pre-training weights"
    assert (out / "checkpoint-2" / SNAPSHOT_NAME).is_file()  # a resumed run never deletes the checkpoint's copy


def test_failed_rectification_keeps_the_snapshot_for_a_retry(tmp_path, monkeypatch, caplog):
    """Training finished, the rectification raised: the file stays (the error log names it), as before."""

    class FailingRectifier:
        def __init__(self, *args, **kwargs):
            pass

        def run(self):
            raise RectificationError("rectification broke")

        def release(self):  # the callback frees a failed run's tensors too
            pass

    monkeypatch.setattr("hf_janus.integrations.trainer.Rectifier", FailingRectifier)
    janus = JanusCallback(replay_data(), FAST, snapshot="disk")
    trainer = make_trainer(tmp_path, build_tiny("llama", vocab=VOCAB), [janus], max_steps=2)
    with caplog.at_level(logging.ERROR, logger="hf_janus"), pytest.raises(RectificationError):
        trainer.train()
    assert (tmp_path / "out" / SNAPSHOT_NAME).is_file()
    assert "stays in" in caplog.text


def test_unguarded_callback_warns_at_train_begin(tmp_path, caplog):
    """Added after the Trainer was built and without trainer=, the callback cannot see a failed train(): it says
    so before training, with the fix."""
    trainer = make_trainer(tmp_path, build_tiny("llama", vocab=VOCAB), [], max_steps=1)
    trainer.add_callback(JanusCallback(replay_data(), FAST, snapshot="disk"))
    with caplog.at_level(logging.WARNING, logger="hf_janus"):
        trainer.train()
    assert "trainer=trainer" in caplog.text and SNAPSHOT_NAME in caplog.text
    assert not (tmp_path / "out" / SNAPSHOT_NAME).exists()  # a run that ends still removes it
