"""JanusCallback on PEFT models inside Trainer: LoRA, PiSSA, DoRA; adapter and merged outputs; TRL."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from peft import LoHaConfig, LoraConfig, PeftModel, get_peft_model
from trainer_fixtures import (
    CONFIG,
    FAST,
    TARGETS,
    PeftProbe,
    collate,
    lora_config,
    make_trainer,
    merged_state,
    pretrained_llama,
    replay_data,
)
from transformers import AutoModelForCausalLM

from hf_janus import JanusConfig, JanusError, rectify
from hf_janus.adapters.peft_layers import adapted_linear_layers, effective_weights, theta0_weights
from hf_janus.integrations.trainer import JanusCallback
from hf_janus.publish.record_file import REPORT_NAME

FULL_RANK = 64  # >= min(d_out, d_in) of every tiny layer: re-factorization is exact


def peft_model(**lora_kwargs):
    return get_peft_model(pretrained_llama(), lora_config(**lora_kwargs))


def plain_twin(state):
    twin = pretrained_llama()
    twin.load_state_dict(state)
    return twin


def logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def theta0_of(model, janus):
    """θ0 of the adapted layers, rebuilt from the callback's snapshot (the adapter's initial tensors)."""
    return theta0_weights(adapted_linear_layers(model), janus.theta0())


def adapted_weight_keys(state):
    return [k for k in state if any(f"{t}.weight" in k for t in TARGETS)]


def test_lora_adapter_output_equals_rectify_and_reloads(tmp_path):
    model = peft_model()
    theta0 = merged_state(model)
    probe, janus = PeftProbe(), JanusCallback(replay_data(), CONFIG, adapter_rank=FULL_RANK)
    trainer = make_trainer(tmp_path, model, [probe, janus])
    trainer.train()

    # Same inputs through the plain engine: θ̂ merged, θ0 the base, the adapted layers as targets.
    twin = plain_twin(probe.finetuned)
    config = JanusConfig(**{**CONFIG.to_dict(), "target_modules": TARGETS})
    expected = rectify(twin, theta0, replay_data(), config, progress=False)
    assert janus.report.alphas == expected.alphas
    got = merged_state(model)
    for key in adapted_weight_keys(got):
        torch.testing.assert_close(got[key], twin.state_dict()[key], rtol=0, atol=2e-5)
    for key in got:  # everything else keeps its fine-tuned value
        if key not in adapted_weight_keys(got):
            torch.testing.assert_close(got[key], probe.finetuned[key], rtol=0, atol=0)
    assert janus.report.replay_loss["rectified"] < janus.report.replay_loss["finetuned"]
    assert janus.report.output["format"] == "adapter"
    assert all(layer["kept_energy"] > 1 - 1e-9 for layer in janus.report.output["layers"])

    trainer.save_model()
    out = trainer.args.output_dir
    assert os.path.isfile(os.path.join(out, REPORT_NAME))
    saved = json.load(open(os.path.join(out, REPORT_NAME)))
    assert saved["output"]["adapter_rank"] == FULL_RANK
    reloaded = PeftModel.from_pretrained(pretrained_llama(), out)
    batch = collate(replay_data())
    torch.testing.assert_close(logits(reloaded, batch), logits(twin, batch), rtol=1e-4, atol=1e-4)


def test_same_rank_truncates_and_reports_what_it_kept(tmp_path):
    model = peft_model()
    janus = JanusCallback(replay_data(), FAST)  # adapter_rank="same": rank 4
    make_trainer(tmp_path, model, [janus]).train()
    layers = janus.report.output["layers"]
    assert {layer["rank"] for layer in layers} == {4}
    assert all(0.0 < layer["kept_energy"] <= 1.0 for layer in layers)
    # The written adapter holds exactly the rank-4 truncation: its effective update has rank <= 4.
    for name, module in model.get_base_model().named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            assert module.lora_A["default"].weight.shape[0] == 4
    assert all(layer["residual_rect"] is not None for layer in layers)


def test_auto_rank_goes_to_rank_pattern_and_reloads(tmp_path):
    model = peft_model()
    janus = JanusCallback(replay_data(), FAST, adapter_rank="auto", adapter_energy=0.999)
    trainer = make_trainer(tmp_path, model, [janus])
    trainer.train()
    ranks = {layer["name"]: layer["rank"] for layer in janus.report.output["layers"]}
    assert all(k >= 1 for k in ranks.values())
    expected = merged_state(model)
    trainer.save_model()
    reloaded = PeftModel.from_pretrained(pretrained_llama(), trainer.args.output_dir)
    for name, k in ranks.items():
        assert reloaded.get_base_model().get_submodule(name).r["default"] == k
    got = merged_state(reloaded)
    for key in adapted_weight_keys(got):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5)


def test_pissa_snapshot_is_the_effective_weight_and_reloads(tmp_path):
    base = pretrained_llama()
    original = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights="pissa"))
    probe, janus = PeftProbe(), JanusCallback(replay_data(), CONFIG)
    trainer = make_trainer(tmp_path, model, [probe, janus])
    # PiSSA moved the top singular directions into the adapter: the base weight is not θ0.
    residual = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(residual, original["model.layers.0.self_attn.q_proj.weight"])
    trainer.train()
    theta0 = theta0_of(model, janus)
    for key, value in theta0.items():  # θ0 = W_res + s·B0A0 = the original weight
        torch.testing.assert_close(value, original[key], rtol=0, atol=1e-5)

    twin = plain_twin(probe.finetuned)
    config = JanusConfig(**{**CONFIG.to_dict(), "target_modules": TARGETS})
    rectify(twin, theta0, replay_data(), config, progress=False)
    assert janus.report.replay_loss["rectified"] < janus.report.replay_loss["finetuned"]
    written = merged_state(model)
    # Rank "same" keeps r=4: the adapter now holds the best rank-4 version of s·B0A0 + ΔW_rect.
    errors = [layer["approx_error"] for layer in janus.report.output["layers"]]
    assert max(errors) < 1.0
    for key in adapted_weight_keys(written):
        ref, rect = theta0[key], twin.state_dict()[key]
        assert (written[key] - rect).norm() <= (probe.finetuned[key] - rect).norm()
        assert not torch.equal(written[key], ref)

    trainer.save_model()  # unconverted PiSSA: PEFT rebuilds W_res from the original base on load
    reloaded = PeftModel.from_pretrained(plain_twin(original), trainer.args.output_dir)
    got = merged_state(reloaded)
    for key in adapted_weight_keys(got):
        torch.testing.assert_close(got[key], written[key], rtol=0, atol=1e-4)


def test_pissa_refuses_a_rank_change(tmp_path):
    model = get_peft_model(pretrained_llama(), LoraConfig(r=4, target_modules=TARGETS, init_lora_weights="pissa"))
    trainer = make_trainer(tmp_path, model, [JanusCallback(replay_data(), FAST, adapter_rank=8)])
    with pytest.raises(JanusError, match="adapter_rank='same'"):
        trainer.train()


def test_dora_full_rank_write_back_is_exact(tmp_path):
    model = peft_model(use_dora=True)
    probe, janus = PeftProbe(), JanusCallback(replay_data(), FAST, adapter_rank=FULL_RANK)
    trainer = make_trainer(tmp_path, model, [probe, janus])
    trainer.train()
    twin = plain_twin(probe.finetuned)
    config = JanusConfig(**{**FAST.to_dict(), "target_modules": TARGETS})
    rectify(twin, theta0_of(model, janus), replay_data(), config, progress=False)
    got = merged_state(model)
    for key in adapted_weight_keys(got):
        torch.testing.assert_close(got[key], twin.state_dict()[key], rtol=0, atol=2e-5)
    trainer.save_model()
    reloaded = merged_state(PeftModel.from_pretrained(pretrained_llama(), trainer.args.output_dir))
    for key in adapted_weight_keys(got):
        torch.testing.assert_close(reloaded[key], got[key], rtol=0, atol=2e-5)


def test_merged_output_replaces_the_trainer_model_and_saves_full_weights(tmp_path):
    model = peft_model()
    probe = PeftProbe()
    janus = JanusCallback(replay_data(), FAST, peft_output="merged")
    trainer = make_trainer(tmp_path, model, [probe, janus])
    janus.trainer = trainer
    trainer.train()
    assert not isinstance(trainer.model, PeftModel)
    twin = plain_twin(probe.finetuned)
    config = JanusConfig(**{**FAST.to_dict(), "target_modules": TARGETS})
    # θ0 is the base's weights: the adapter starts at a zero update (the model is merged now, so the snapshot's
    # initial adapter tensors have nothing left to be put into)
    rectify(twin, pretrained_llama().state_dict(), replay_data(), config, progress=False)
    trainer.save_model()
    loaded = AutoModelForCausalLM.from_pretrained(trainer.args.output_dir)
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[key], rtol=0, atol=1e-6)
    assert janus.report.output["format"] == "merged"


def test_merged_needs_the_trainer_and_loha_needs_merged(tmp_path):
    trainer = make_trainer(tmp_path, peft_model(), [JanusCallback(replay_data(), FAST, peft_output="merged")])
    with pytest.raises(JanusError, match="needs the trainer"):
        trainer.train()
    loha = get_peft_model(pretrained_llama(), LoHaConfig(r=2, target_modules=TARGETS))
    trainer = make_trainer(tmp_path, loha, [JanusCallback(replay_data(), FAST)])
    with pytest.raises(JanusError, match="peft_output='merged'"):
        trainer.train()
    with pytest.raises(ValueError, match="peft_output"):
        JanusCallback(replay_data(), peft_output="full")


def test_loha_merged_output(tmp_path):
    loha = get_peft_model(pretrained_llama(), LoHaConfig(r=2, alpha=2, target_modules=TARGETS))
    probe = PeftProbe()
    janus = JanusCallback(replay_data(), FAST, peft_output="merged")
    trainer = make_trainer(tmp_path, loha, [probe, janus])
    janus.trainer = trainer
    trainer.train()
    twin = plain_twin(probe.finetuned)
    config = JanusConfig(**{**FAST.to_dict(), "target_modules": TARGETS})
    rectify(twin, pretrained_llama().state_dict(), replay_data(), config, progress=False)  # LoHa starts at ΔW=0
    for key, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[key], rtol=0, atol=1e-6)


def test_failure_leaves_the_adapter_untouched(tmp_path):
    model = peft_model()
    probe = PeftProbe()
    bad = [{"input_ids": [1, 2, 3], "attention_mask": [0, 0, 0]}]  # no counted token at all
    trainer = make_trainer(tmp_path, model, [probe, JanusCallback(bad, FAST)])
    with pytest.raises(JanusError):
        trainer.train()
    for key, value in model.state_dict().items():
        if "lora_" in key:
            assert torch.equal(value, probe.lora[key])
    got = merged_state(model)
    for key, value in probe.finetuned.items():
        assert torch.equal(got[key], value)
    # No tuner layer was left swapped out.
    assert "lora_A" in str(model.get_base_model().model.layers[0].self_attn.q_proj)


def test_only_the_adapted_layers_are_snapshotted(tmp_path):
    model = peft_model()
    janus = JanusCallback(replay_data(), FAST)
    make_trainer(tmp_path, model, [janus], max_steps=1).train()
    names = sorted(theta0_of(model, janus))
    # a frozen base needs only the adapter's initial tensors in the snapshot
    assert all(".lora_" in key for key in janus.theta0())
    assert names == sorted(effective_weights({
        n: m for n, m in model.get_base_model().named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A
    }))
    assert all(any(f".{t}.weight" in n for t in TARGETS) for n in names)
    assert janus.report.output["snapshot_mib"] > 0


def test_bf16_lora_training(tmp_path):
    base = pretrained_llama().to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    janus = JanusCallback(replay_data(), FAST)
    make_trainer(tmp_path, model, [janus]).train()
    loss = janus.report.replay_loss
    assert loss["rectified"] < loss["finetuned"]
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "lora_" not in n)


def _bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map (as in its tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer():
    """A transformers tokenizer for the demo's byte-level ids (byte b -> id b + 2; 0 pad, 1 bos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters byte-level BPE maps bytes to
    byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
    assert set(alphabet) == set(byte_of)
    vocab = {"<pad>": 0, "<s>": 1, **{ch: byte_of[ch] + 2 for ch in alphabet}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<s>")


def test_trl_sft_trainer_full_and_lora(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hf_janus.demo import math_samples

    train = Dataset.from_list([{"input_ids": s["input_ids"]} for s in math_samples(0, 16, max_len=64)])
    for peft_config in (None, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)):
        janus = JanusCallback(replay_data(), FAST)
        args = trl.SFTConfig(output_dir=str(tmp_path / f"sft-{peft_config is None}"), max_steps=3,
                             per_device_train_batch_size=4, learning_rate=1e-2, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, dataset_text_field=None, packing=False)
        trainer = trl.SFTTrainer(model=pretrained_llama(), args=args, train_dataset=train, peft_config=peft_config,
                                 callbacks=[janus], data_collator=collate, processing_class=byte_tokenizer())
        trainer.train()
        assert janus.report is not None
        assert janus.report.replay_loss["rectified"] < janus.report.replay_loss["finetuned"]
        assert isinstance(trainer.model, PeftModel) == (peft_config is not None)


def test_gpt2_conv1d_lora_write_back(tmp_path):
    """GPT-2 stores Conv1D weights transposed (fan_in_fan_out): layouts must agree end to end."""
    from testing_utils import build_tiny

    from hf_janus.demo import VOCAB

    torch.manual_seed(0)
    base = build_tiny("gpt2", vocab=VOCAB)
    theta0_plain = copy.deepcopy(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=2, lora_alpha=2, target_modules=["c_attn", "c_fc"],
                                            fan_in_fan_out=True, lora_dropout=0.0))
    probe, janus = PeftProbe(), JanusCallback(replay_data(), FAST, adapter_rank=FULL_RANK)
    make_trainer(tmp_path, model, [probe, janus]).train()
    for key, value in theta0_of(model, janus).items():
        assert torch.equal(value, theta0_plain[key])
    twin = build_tiny("gpt2", vocab=VOCAB)
    twin.load_state_dict(probe.finetuned)
    config = JanusConfig(**{**FAST.to_dict(), "target_modules": ["c_attn", "c_fc"]})
    rectify(twin, theta0_plain, replay_data(), config, progress=False)
    got = merged_state(model)
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=2e-5)


def test_resume_keeps_the_effective_theta0(tmp_path):
    model = peft_model(init_lora_weights="pissa")
    first = JanusCallback(replay_data(), FAST)
    make_trainer(tmp_path, model, [first], max_steps=4, save_strategy="steps", save_steps=2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    resumed = peft_model(init_lora_weights="pissa")
    second = JanusCallback(replay_data(), FAST)
    make_trainer(tmp_path, resumed, [second], max_steps=4).train(resume_from_checkpoint=str(checkpoint))
    for key, value in second.theta0().items():
        assert torch.equal(value, first.theta0()[key])
    first_state, second_state = merged_state(model), merged_state(resumed)
    for key, value in first_state.items():
        torch.testing.assert_close(second_state[key], value, rtol=0, atol=1e-4)


def test_new_adapter_beside_the_trained_one(tmp_path):
    """new_adapter_name: the rectified update goes into a new, active adapter (the same as writing in place); the
    trained adapter stays as training left it; save_model writes both, and the record, the card and the weight
    metadata describe the new one, in its subfolder."""
    from hf_janus.publish.weights_meta import read_safetensors_metadata

    model = peft_model()
    probe = PeftProbe()
    janus = JanusCallback(replay_data(), CONFIG, adapter_rank=FULL_RANK, new_adapter_name="janus")
    trainer = make_trainer(tmp_path, model, [probe, janus])
    trainer.train()
    assert model.active_adapters == ["janus"] and set(model.peft_config) == {"default", "janus"}
    assert janus.report.output["adapter_name"] == "janus" and janus.report.output["trained_adapter"] == "default"

    twin = plain_twin(probe.finetuned)
    expected = rectify(twin, merged_state_of_default_base(model), replay_data(),
                       JanusConfig(**{**CONFIG.to_dict(), "target_modules": TARGETS}), progress=False)
    assert janus.report.alphas == expected.alphas
    got = merged_state(model)
    for key in adapted_weight_keys(got):
        torch.testing.assert_close(got[key], twin.state_dict()[key], rtol=0, atol=2e-5)
    model.set_adapter("default")  # the trained adapter, bit for bit
    assert all(torch.equal(v, probe.lora[k]) for k, v in model.state_dict().items() if k in probe.lora)
    assert all(torch.equal(v, probe.finetuned[k]) for k, v in merged_state(model).items())
    model.set_adapter("janus")

    trainer.save_model()
    out = trainer.args.output_dir
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))  # the trained adapter, at the top
    assert os.path.isfile(os.path.join(out, "janus", "adapter_model.safetensors"))
    stamped = read_safetensors_metadata(os.path.join(out, "janus", "adapter_model.safetensors"))
    assert set(stamped) - {"format"}  # the record's summary
    assert set(read_safetensors_metadata(os.path.join(out, "adapter_model.safetensors"))) <= {"format"}
    assert json.load(open(os.path.join(out, REPORT_NAME)))["output"]["adapter_name"] == "janus"
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert 'subfolder="janus"' in card and "kept beside it" in card
    batch = collate(replay_data())
    rectified = PeftModel.from_pretrained(pretrained_llama(), out, subfolder="janus", adapter_name="janus")
    torch.testing.assert_close(logits(rectified, batch), logits(twin, batch), rtol=1e-4, atol=1e-4)
    trained = PeftModel.from_pretrained(pretrained_llama(), out)
    torch.testing.assert_close(logits(trained, batch), logits(plain_twin(probe.finetuned), batch), rtol=1e-5,
                               atol=1e-5)


def merged_state_of_default_base(model):
    """θ0 of a LoRA model: its base weights (the adapters start at zero)."""
    return {k: v.clone() for k, v in copy.deepcopy(model).unload().state_dict().items()}


def test_new_adapter_copies_the_layers_janus_leaves_alone(tmp_path):
    """Narrowed targets: the new adapter's other layers hold the trained adapter's tensors (PEFT's add_adapter alone
    would leave them at their init, a zero update), and the rectified layers hold the write."""
    model = peft_model()
    probe = PeftProbe()
    config = JanusConfig(**{**FAST.to_dict(), "target_modules": ["q_proj"]})
    make_trainer(tmp_path, model, [probe, JanusCallback(replay_data(), config, new_adapter_name="janus")]).train()
    state = model.state_dict()
    for key, value in probe.lora.items():
        copied = state[key.replace(".default.", ".janus.")]
        if "q_proj" in key:
            assert copied.shape != value.shape or not torch.equal(copied, value)
        else:
            assert torch.equal(copied, value), key


@pytest.mark.parametrize("case", ["taken", "pissa", "merged"])
def test_new_adapter_name_refusals(tmp_path, case):
    if case == "taken":
        model = peft_model()
        model.add_adapter("janus", lora_config())
        janus, match = JanusCallback(replay_data(), FAST, new_adapter_name="janus"), "already has an adapter"
    elif case == "pissa":
        model = peft_model(init_lora_weights="pissa")
        janus, match = JanusCallback(replay_data(), FAST, new_adapter_name="janus"), "cannot share that base"
    else:
        with pytest.raises(ValueError, match="needs peft_output='adapter'"):
            JanusCallback(replay_data(), FAST, peft_output="merged", new_adapter_name="janus")
        return
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(JanusError, match=match):
        make_trainer(tmp_path, model, [janus]).train()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before any step
