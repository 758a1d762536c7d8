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


@pytest.mark.parametrize("bound", [False, True])
def test_trainer_log_reaches_integrations(tmp_path, bound):
    """The janus figures go through Trainer.log (what wandb/tensorboard listen to), whether the trainer was given to
    the callback or found running it, as in the README's snippet."""
    seen = []

    class Listener(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    model = build_tiny("llama", vocab=VOCAB)
    janus = JanusCallback(replay_data(), JanusConfig(compression_rank=8, tau=0.0))
    trainer = make_trainer(tmp_path, model, [Listener(), janus])
    if bound:
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
    # DeepSpeed: ZeRO-3 runs are handled (tests/parallel/test_deepspeed.py); weights that DeepSpeed left whole mean a
    # ZeRO stage 0-2 run, which is not tested, and PEFT models are refused whatever the stage.
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


def test_mixed_precision_training_rectifies_at_the_weights_precision(tmp_path):
    """bf16=True leaves accelerate's autocast wrapper on the model's forward after train(): JANUS runs without it,
    so the callback gives what rectify gives on the same weights, and the Trainer's model keeps its wrapper."""
    model = pretrained_llama()
    theta0 = copy.deepcopy(model.state_dict())
    probe, janus = Probe(), JanusCallback(replay_data(), CONFIG)
    make_trainer(tmp_path, model, [probe, janus], bf16=True).train()
    assert "_original_forward" in model.__dict__ and model.forward is not model._original_forward
    twin = pretrained_llama()
    twin.load_state_dict(probe.finetuned)
    expected = rectify(twin, theta0, replay_data(), CONFIG, progress=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[key], rtol=0, atol=1e-6)
    assert janus.report.replay_loss == expected.replay_loss


def _tensor_bytes_reachable(root, model) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through Python references, leaving out the
    model's own parameters and buffers (the user's model, not a copy) and not walking into modules."""
    import gc
    import types

    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    # functions lead to their module's globals, i.e. everywhere: what a run keeps is held through data, not code
    skipped = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
               torch.nn.Module)
    seen_objects, seen_storages, total = set(), set(), 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, skipped):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if obj.is_floating_point() and key not in own and key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
            continue
        stack.extend(gc.get_referents(obj))
    return total


def test_the_rectifier_is_released_when_the_callback_is_done(tmp_path):
    """Issue 39 item 8: after train(), callback.rectifier holds no copy of the target layers (θ0, θ̂'s backup, θ_t,
    the factors); the report stays. Measured as the bytes of floating-point tensors reachable from the callback, and
    for a rectifier run directly, before and after Rectifier.release() (weak references to its θ0, θ̂ and θ_t die)."""
    import gc
    import weakref

    from hf_janus.engine.rectifier import Rectifier

    model = build_tiny("llama", vocab=VOCAB)
    theta0 = copy.deepcopy(model.state_dict())
    janus = JanusCallback(replay_data(), FAST)
    trainer = make_trainer(tmp_path, model, [janus])
    trainer.train()
    target_bytes = sum(layer.shape[0] * layer.shape[1] * 4 for layer in janus.report.layers)
    assert janus.report is not None and janus.rectifier.result.report is janus.report
    gc.collect()
    # the callback's own θ0 snapshot (callback.theta0()) is one copy, by design; the rectifier adds none
    snapshot = _tensor_bytes_reachable(janus.snapshot, model)
    assert _tensor_bytes_reachable(janus.rectifier, model) < target_bytes / 4
    assert _tensor_bytes_reachable(janus, model) - snapshot < target_bytes / 4

    rectifier = Rectifier(model, theta0, replay_data(), FAST, progress=False)
    rectifier.run()
    layer = rectifier.layers[0]
    refs = [weakref.ref(t) for t in (layer.current, layer.weights.backup)]
    before = _tensor_bytes_reachable(rectifier, model)
    assert before >= 2 * target_bytes  # θ_t in float32 and θ̂'s backup of every target layer, at least
    report = rectifier.result.report
    del layer
    rectifier.release()
    gc.collect()
    assert _tensor_bytes_reachable(rectifier, model) < target_bytes / 4
    assert all(ref() is None for ref in refs)
    assert rectifier.result.report is report and rectifier.result.layers == {}


def test_adapter_write_back_residuals_are_measured_against_the_float32_jacobian(tmp_path):
    """Issue 39 item 5, adapter write-back: with bf16 factors the written layers' residual_rect is measured against
    θ0's float32 capture, as the report's statistics are (it was measured against the rounded J0 the projection
    removed, near zero). One step at α=1 (τ=0): the float32 run's residual is rounding noise, the bf16 run's is not."""
    from peft import get_peft_model
    from trainer_fixtures import lora_config

    written = {}
    for dtype in ("float32", "bfloat16"):
        model = get_peft_model(build_tiny("llama", vocab=VOCAB), lora_config())
        config = JanusConfig(compression_rank=8, replay_batch_size=8, tau=0.0, factor_dtype=dtype)
        janus = JanusCallback(replay_data(), config, adapter_rank=64)  # rank 64: the update is written exactly
        make_trainer(tmp_path / dtype, model, [janus]).train()
        assert janus.report.alphas == [1.0]
        stats = {s.name: s.residual for s in janus.report.layers}
        written[dtype] = {w["name"]: w["residual_rect"] for w in janus.report.output["layers"]}
        for name, residual in written[dtype].items():
            assert residual == pytest.approx(stats[name], rel=1e-2, abs=1e-6), name
    noise = max(written["float32"].values())
    assert min(written["bfloat16"].values()) > 100 * noise, (written, noise)

