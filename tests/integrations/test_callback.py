"""JanusCallback inside transformers' Trainer (full fine-tuning, single process), on real text."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from testing_utils import build_tiny
from trainer_fixtures import CONFIG, FAST, Probe, make_trainer, pretrained_llama, replay_data
from transformers import TrainerCallback

from hf_janus import JanusConfig, JanusError, rectify
from hf_janus.demo import VOCAB
from hf_janus.integrations.snapshot import SNAPSHOT_NAME
from hf_janus.integrations.trainer import JanusCallback
from hf_janus.publish.record_file import REPORT_NAME


def test_callback_equals_rectify_on_same_inputs(tmp_path):
    model = pretrained_llama()
    theta0 = copy.deepcopy(model.state_dict())
    probe, janus = Probe(), JanusCallback(replay_data(), CONFIG)
    trainer = make_trainer(tmp_path, model, [probe, janus])
    trainer.train()

    twin = pretrained_llama()
    twin.load_state_dict(probe.finetuned)
    expected = rectify(twin, theta0, replay_data(), CONFIG, progress=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[key], rtol=0, atol=1e-6)
    assert janus.report.alphas == expected.alphas
    loss = janus.report.replay_loss
    assert loss["finetuned"] > loss["reference"] and loss["rectified"] < loss["finetuned"]
    assert janus.snapshot_bytes == sum(theta0[f"{layer.name}.weight"].numel() * 4 for layer in janus.report.layers)


def test_logs_report_and_save_model(tmp_path):
    model = build_tiny("llama", vocab=VOCAB)
    janus = JanusCallback(replay_data(), FAST)
    trainer = make_trainer(tmp_path, model, [janus])
    trainer.train()
    janus_logs = [e for e in trainer.state.log_history if any(k.startswith("janus/") for k in e)]
    assert len(janus_logs) == janus.report.num_trials + 1
    assert janus_logs[-1]["janus/replay_loss_rectified"] == janus.report.replay_loss["rectified"]
    assert os.path.isfile(tmp_path / "out" / REPORT_NAME)
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = type(model).from_pretrained(str(tmp_path / "saved"))
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value)


def test_trainer_log_reaches_integrations(tmp_path):
    """With the trainer bound, janus figures go through Trainer.log (what wandb/tensorboard listen to)."""
    seen = []

    class Listener(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    model = build_tiny("llama", vocab=VOCAB)
    janus = JanusCallback(replay_data(), JanusConfig(rank=8, tau=0.0))
    trainer = make_trainer(tmp_path, model, [Listener(), janus])
    janus.trainer = trainer
    trainer.train()
    assert any("janus/replay_loss_rectified" in logs for logs in seen)


def test_disk_snapshot_matches_cpu(tmp_path):
    results = []
    for mode in ("cpu", "disk"):
        model = build_tiny("llama", vocab=VOCAB)
        janus = JanusCallback(replay_data(), FAST, snapshot=mode)
        make_trainer(tmp_path / mode, model, [janus]).train()
        results.append(model.state_dict())
        if mode == "disk":
            # read from its file during the run, deleted when the run ends: θ0 never stays next to the outputs
            assert not janus.snapshot.in_memory and janus.snapshot.nbytes > 0
            assert not os.path.exists(tmp_path / mode / "out" / SNAPSHOT_NAME)
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], rtol=0, atol=0)


def test_resume_uses_pre_training_snapshot(tmp_path):
    model = build_tiny("llama", vocab=VOCAB)
    theta0 = copy.deepcopy(model.state_dict())
    first = JanusCallback(replay_data(), FAST)
    make_trainer(tmp_path, model, [first], max_steps=4, save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / SNAPSHOT_NAME).is_file()

    resumed_model = build_tiny("llama", seed=5, vocab=VOCAB)  # weights are replaced by the checkpoint's
    second = JanusCallback(replay_data(), FAST)
    make_trainer(tmp_path, resumed_model, [second], max_steps=4).train(resume_from_checkpoint=str(checkpoint))
    for key, value in second.theta0().items():
        assert torch.equal(value, theta0[key]), f"{key}: θ0 must be the pre-training weights"
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[key], value, rtol=0, atol=1e-5)


def test_resume_never_uses_a_snapshot_from_outside_the_checkpoint(tmp_path):
    """A checkpoint without its own θ0 snapshot is refused, even when another run left one in output_dir."""
    from hf_janus.integrations.snapshot import save_safetensors

    model = build_tiny("llama", vocab=VOCAB)
    make_trainer(tmp_path, model, [JanusCallback(replay_data(), FAST)], max_steps=4, save_strategy="steps",
                 save_steps=2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    stale = {name: torch.zeros_like(value) for name, value in
             __import__("safetensors.torch", fromlist=["load_file"]).load_file(checkpoint / SNAPSHOT_NAME).items()}
    (checkpoint / SNAPSHOT_NAME).unlink()
    save_safetensors(stale, str(tmp_path / "out" / SNAPSHOT_NAME))  # another run's θ0, all zeros
    resumed = build_tiny("llama", seed=5, vocab=VOCAB)
    with pytest.raises(JanusError, match="no θ0 snapshot"):
        make_trainer(tmp_path, resumed, [JanusCallback(replay_data(), FAST)], max_steps=4).train(
            resume_from_checkpoint=str(checkpoint))


def test_resume_refuses_a_snapshot_saved_with_other_weights(tmp_path):
    """A checkpoint whose snapshot was written by another run (here: run B's copied into run A's checkpoint) is
    refused: its fingerprint does not match the weights loaded for resuming."""
    import shutil

    for run, seed in (("a", 0), ("b", 3)):
        model = build_tiny("llama", seed=seed, vocab=VOCAB)
        make_trainer(tmp_path / run, model, [JanusCallback(replay_data(), FAST)], max_steps=2,
                     save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    shutil.copyfile(tmp_path / "b" / "out" / "checkpoint-2" / SNAPSHOT_NAME, checkpoint / SNAPSHOT_NAME)
    resumed = build_tiny("llama", seed=5, vocab=VOCAB)
    seen = []

    class StepProbe(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            seen.append(1)

    with pytest.raises(JanusError, match="does not belong to the weights being resumed"):
        make_trainer(tmp_path / "a", resumed, [JanusCallback(replay_data(), FAST), StepProbe()], max_steps=4).train(
            resume_from_checkpoint=str(checkpoint))
    assert not seen  # refused at train begin, before any step


def test_on_error_warn_keeps_finetuned_weights(tmp_path):
    model = build_tiny("llama", vocab=VOCAB)
    probe = Probe()
    janus = JanusCallback([], CONFIG, on_error="warn")
    make_trainer(tmp_path, model, [probe, janus]).train()
    assert janus.report is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, probe.finetuned[key])


def test_on_error_raise(tmp_path):
    model = build_tiny("llama", vocab=VOCAB)
    with pytest.raises(JanusError, match="replay is empty"):
        make_trainer(tmp_path, model, [JanusCallback([], CONFIG)]).train()


def test_bad_arguments_and_unsupported_models(tmp_path):
    with pytest.raises(ValueError, match="snapshot"):
        JanusCallback(replay_data(), snapshot="gpu")
    with pytest.raises(ValueError, match="on_error"):
        JanusCallback(replay_data(), on_error="ignore")
    with pytest.raises(ValueError, match="adapter_energy"):
        JanusCallback(replay_data(), adapter_energy=1.5)
    with pytest.raises(ValueError, match="rank"):
        JanusCallback(replay_data(), adapter_rank=-2)
    janus = JanusCallback(replay_data(), CONFIG)
    trainer = make_trainer(tmp_path, build_tiny("llama", vocab=VOCAB), [janus])
    # fsdp= alone is no reason to refuse: on CPU Trainer wraps the model in DDP, and FSDP2's DTensor weights are
    # handled (tests/parallel/test_fsdp.py); FSDP1 wrappers are refused by looking at the model itself.
    trainer.args.fsdp = "full_shard"
    janus.on_train_begin(trainer.args, trainer.state, trainer.control, model=trainer.model)
    assert janus.snapshot_bytes > 0
    # DeepSpeed: ZeRO-3 runs are handled (tests/parallel/test_deepspeed.py); weights that DeepSpeed left whole mean a ZeRO
    # stage 0-2 run, which is not tested, and PEFT models are refused whatever the stage.
    trainer.args.fsdp, trainer.args.deepspeed = "", {"zero_optimization": {"stage": 2}}
    with pytest.raises(JanusError, match="ZeRO stage 3 only"):
        janus.on_train_begin(trainer.args, trainer.state, trainer.control, model=trainer.model)
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(build_tiny("llama", vocab=VOCAB), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(JanusError, match="PEFT models trained with DeepSpeed"):
        janus.on_train_begin(trainer.args, trainer.state, trainer.control, model=peft)


def test_gradient_checkpointing_run(tmp_path):
    """Training with gradient checkpointing: the capture runs in eval mode and gives the same rectification."""
    model = pretrained_llama()
    probe, janus = Probe(), JanusCallback(replay_data(), FAST)
    make_trainer(tmp_path, model, [probe, janus], gradient_checkpointing=True).train()
    assert model.is_gradient_checkpointing
    twin = pretrained_llama()
    theta0 = copy.deepcopy(twin.state_dict())
    twin.load_state_dict(probe.finetuned)
    rectify(twin, theta0, replay_data(), FAST, progress=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[key], rtol=0, atol=1e-6)
