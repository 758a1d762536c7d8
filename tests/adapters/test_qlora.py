"""QLoRA: a LoRA adapter trained with ``JanusCallback`` on a bitsandbytes 4-bit or 8-bit base (CPU kernels).

The rectified update must lie in the null space of explicit per-sample Jacobians (``torch.func``) taken at the
*dequantized* base weights; the quantized base must come out untouched; the adapter must reload with stock
``PeftModel.from_pretrained`` on a freshly quantized base; and what cannot work is refused at train begin.
"""

from __future__ import annotations


import pytest
import torch
from adapter_fixtures import StepProbe, samples, train
from merge_fixtures import save_base
from transformers import TrainerCallback

from hf_janus import JanusCallback, JanusConfig, JanusError
from hf_janus.model_modes import standard_quantized_layout

bnb = pytest.importorskip("bitsandbytes")

QUANTIZATIONS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}
# single step, no compression: J0 ΔW = 0 exactly
EXACT = JanusConfig(tau=0.0, compression_rank=None, replay_batch_size=4)
TARGETS = ["q_proj", "v_proj", "up_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    # hidden 64: bitsandbytes quantizes in blocks of 64 values
    return save_base(tmp_path_factory.mktemp("qlora") / "base", hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2)


def quantized_base(base_dir, quant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    return AutoModelForCausalLM.from_pretrained(base_dir,
                                                quantization_config=BitsAndBytesConfig(**QUANTIZATIONS[quant]),
                                                device_map="cpu")


def lora_model(base_dir, quant, **lora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(quantized_base(base_dir, quant),
                          LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **lora))


class FinetunedProbe(TrainerCallback):
    """θ̂ of the adapted layers at train end, before a JanusCallback listed after it rectifies them."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.weights = effective(model)


def base_state(model):
    """Every tensor of every quantized base layer (packed weights and quantization statistics)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            out[f"{name}.weight"] = module.weight.data.clone()
            quant_state = getattr(module.weight, "quant_state", None)
            if quant_state is not None:
                out[f"{name}.absmax"] = quant_state.absmax.clone()
            # bitsandbytes moves an 8-bit layer's row scales from the weight to the layer's state at its first forward
            scb = getattr(module.weight, "SCB", None)
            if scb is None:
                scb = getattr(getattr(module, "state", None), "SCB", None)
            if scb is not None:
                out[f"{name}.SCB"] = scb.clone()
    return out


def effective(model):
    """``{plain layer name: dequantized base + LoRA delta}`` of the adapted layers."""
    from hf_janus.adapters.peft_layers import adapted_linear_layers, effective_params

    return {name: effective_params(m)[0].double() for name, m in adapted_linear_layers(model).items()}


def dequantized_layers(model):
    """``{plain layer name: dequantized weight}`` of every quantized layer of ``model`` (a PeftModel or not)."""
    from hf_janus.engine.quantized import dequantized_weight

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {name: dequantized_weight(m).double() for name, m in inner.named_modules()
            if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def explicit_jacobians(base_dir, dequantized, weights, replay):
    """Per-sample loss gradients w.r.t. each layer in ``weights`` of the dense float64 model whose quantized
    layers hold their ``dequantized`` weights and whose target layers hold ``weights`` (torch.func, one sample
    at a time): ``{layer: (m, d_out, d_in)}``."""
    from torch.func import functional_call, grad
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64).eval()
    params = {k: v.detach() for k, v in dense.named_parameters()}
    params.update({f"{name.replace('.base_layer', '')}.weight": w for name, w in dequantized.items()})
    params.update({f"{name}.weight": w for name, w in weights.items()})
    targets = {f"{name}.weight": w for name, w in weights.items()}

    def loss(target_params, ids):
        out = functional_call(dense, {**params, **target_params}, kwargs={"input_ids": ids, "labels": ids})
        return out.loss

    rows = {name: [] for name in weights}
    for sample in replay:
        ids = torch.tensor([sample["input_ids"]])
        g = grad(loss)(targets, ids)
        for name in weights:
            rows[name].append(g[f"{name}.weight"])
    return {name: torch.stack(r) for name, r in rows.items()}


@pytest.mark.parametrize("quant", list(QUANTIZATIONS))
def test_qlora_rectified_update_is_in_the_null_space_at_the_dequantized_base(base_dir, tmp_path, quant):
    from hf_janus.adapters.peft_layers import adapted_linear_layers
    from hf_janus.engine.quantized import dequantized_weight

    model = lora_model(base_dir, quant)
    replay = samples(6, seed=2)
    base_before = base_state(model)
    dequantized = dequantized_layers(model)
    theta0 = {name: dequantized_weight(m.get_base_layer()).double()  # B0 = 0: θ0 is the dequantized base
              for name, m in adapted_linear_layers(model).items()}
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    janus = JanusCallback(replay, EXACT, adapter_rank=64)  # rank 64 = min(d_out, d_in): the update fits exactly
    finetuned = FinetunedProbe()  # before the callback: θ̂ (the callback releases its copies at train end)
    train(model, tmp_path, [finetuned, janus])
    assert janus.report is not None and janus.report.output["format"] == "adapter"
    rectified = effective(model)

    jac = explicit_jacobians(base_dir, dequantized, theta0, replay)
    for name, w0 in theta0.items():
        delta = rectified[name] - w0
        assert float(delta.norm()) > 0, name
        j = jac[name].reshape(len(replay), -1)
        residual = float((j @ delta.reshape(-1)).norm() / (j.norm() * delta.norm()))
        update = finetuned.weights[name] - w0
        before = float((j @ update.reshape(-1)).norm() / (j.norm() * update.norm()))
        if quant == "int8":
            # LLM.int8 also quantizes the activations (per row, to 1/127 of its absmax): the layers compute a slightly
            # different function than their dequantized weights, so the null space the engine sees is that of the
            # dequantized weights only up to that noise, a few activation steps (see test_qlora_8bit.py's INT8_STEP)
            assert residual < 8 / 254 * before, f"{name}: {residual:.2e} vs {before:.2e} before rectification"
        else:
            # ΔW_rect is orthogonal to the engine's float32 rows J32, so |J ΔW_rect| = |(J − J32) ΔW_rect|: the
            # residual is at most the float32 rows' relative error, a few unit roundoffs per layer on the path
            # (2 blocks of a float32-compute model), with 16 allowed
            bound = 16 * torch.finfo(torch.float32).eps / 2
            assert residual < bound, f"{name}: |J0 ΔW_rect| / (|J0| |ΔW_rect|) = {residual:.2e} ({before:.2e} before)"

    # the quantized base is exactly what it was
    after = base_state(model)
    assert after.keys() == base_before.keys() and after
    for key, value in base_before.items():
        assert torch.equal(after[key], value), key
    # θ0 was kept as the adapter's initial tensors, not as dense weights
    assert janus.snapshot_bytes == adapter_bytes


def test_qlora_adapter_reloads_on_a_freshly_quantized_base(base_dir, tmp_path):
    from peft import PeftModel

    model = lora_model(base_dir, "nf4")
    janus = JanusCallback(samples(6, seed=2), EXACT)
    trainer = train(model, tmp_path, [janus])
    trainer.save_model(str(tmp_path / "adapter"))
    ids = torch.tensor([samples(1, seed=9)[0]["input_ids"]])
    reloaded = PeftModel.from_pretrained(quantized_base(base_dir, "nf4"), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)


def test_qlora_new_adapter_beside_the_trained_one(base_dir, tmp_path):
    """new_adapter_name on a 4-bit base: the new adapter is the in-place write's, the trained one stays, and both
    reload on a freshly quantized base."""
    from peft import PeftModel

    ids = torch.tensor([samples(1, seed=9)[0]["input_ids"]])
    runs = {}
    for name in (None, "janus"):
        model = lora_model(base_dir, "nf4")
        janus = JanusCallback(samples(6, seed=2), EXACT, new_adapter_name=name)
        trainer = train(model, tmp_path / str(name), [janus])
        # bitsandbytes' AVX512-BF16 kernel (eval, no grad) repacks the weights with bf16 block scales: another
        # arithmetic than the trained model's; the engine keeps it off for its passes, and the test for its own
        with torch.no_grad(), standard_quantized_layout(model):
            runs[name] = model.eval()(input_ids=ids).logits
            if name:
                model.set_adapter("default")
                trained = model(input_ids=ids).logits
                model.set_adapter(name)
        trainer.save_model(str(tmp_path / f"saved-{name}"))
    torch.testing.assert_close(runs["janus"], runs[None], rtol=0, atol=1e-6)
    assert not torch.equal(trained, runs["janus"])
    reloaded = PeftModel.from_pretrained(quantized_base(base_dir, "nf4"), str(tmp_path / "saved-janus"))
    with torch.no_grad(), standard_quantized_layout(reloaded):
        torch.testing.assert_close(reloaded.eval()(input_ids=ids).logits, trained, rtol=0, atol=1e-5)
        reloaded.load_adapter(str(tmp_path / "saved-janus" / "janus"), adapter_name="janus")
        reloaded.set_adapter("janus")
        torch.testing.assert_close(reloaded(input_ids=ids).logits, runs["janus"], rtol=0, atol=1e-5)


def repacking_cpu(model) -> list:
    """Switch on bitsandbytes' repacking of 4-bit weights in every 4-bit layer, as on a CPU with AVX512-BF16."""
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = 1  # what bitsandbytes reads from its native library: an int
    return layers


def assert_base_as_it_was(model, before: dict, layers: list) -> None:
    """The 4-bit base bit for bit as ``before`` (``base_state``), none of ``layers`` repacked, their switch on."""
    after = base_state(model)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(m.support_avx512bf16_for_cpu and not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
               for m in layers)


def test_theta0_answering_at_train_begin_leaves_the_4bit_base_trainable_and_as_it_was(base_dir, tmp_path):
    """θ0 answers the replay prompts at train begin in eval mode without grad, which on an AVX512-BF16 CPU makes
    bitsandbytes repack the 4-bit weights for a kernel with no autograd, for good, with bf16 block scales. The
    training after it must still reach every adapter, the base come out bit for bit, and the switch stay on."""
    from merge_fixtures import char_tokenizer

    from hf_janus import SelfReplay

    model = lora_model(base_dir, "nf4")
    layers = repacking_cpu(model)
    before, theta0 = base_state(model), effective(model)
    replay = SelfReplay(prompts=["what is a cat?", "hi", "name a fruit:"], max_new_tokens=3, cache_dir=False,
                        progress=False, tokenizer=char_tokenizer())
    probe, janus = FinetunedProbe(), JanusCallback(replay, EXACT)
    train(model, tmp_path, [probe, janus])
    assert janus.report is not None and janus.report.num_samples == 3
    # the gradient reached every adapter, q_proj's and up_proj's through the 4-bit layers their outputs feed
    assert all(not torch.equal(probe.weights[name], theta0[name]) for name in theta0), "an adapter did not train"
    assert_base_as_it_was(model, before, layers)


def test_scoring_a_4bit_model_leaves_its_base_as_it_was(base_dir, tmp_path):
    """lm-eval's scoring (``evaluate``, each ``frontier`` candidate) runs the model in eval mode without grad: the
    base must come out bit for bit, not repacked with bf16 scales between candidates."""
    from merge_fixtures import char_tokenizer, write_jsonl

    from hf_janus.evaluation.harness import Scorer, resolve_tasks

    model = lora_model(base_dir, "nf4")
    layers = repacking_cpu(model)
    before = base_state(model)
    task = write_jsonl(tmp_path / "new.jsonl", [{"prompt": f"what is {c}", "completion": "a cat"} for c in "abc"])
    scores = Scorer(resolve_tasks([task]), char_tokenizer(), batch_size=1)(model)
    assert len(scores) == 1 and all(r.score > 0 for r in scores.values())
    assert_base_as_it_was(model, before, layers)


@pytest.mark.skipif(not bnb.functional.has_avx512bf16(), reason="the repacking kernel needs a CPU with AVX512-BF16")
def test_a_weight_the_users_own_pass_repacked_is_put_back_for_hf_janus(base_dir):
    """A user's own eval pass repacked the 4-bit weights: inside hf-janus's passes they are in the standard layout
    again, so the gradient reaches the first layer's adapter."""
    model = lora_model(base_dir, "nf4")
    ids = torch.tensor([samples(1, seed=9)[0]["input_ids"]])
    with torch.no_grad():
        model.eval()(input_ids=ids)
    assert all(m.weight.quant_state.packing_format_for_cpu for m in repacking_cpu(model))
    with standard_quantized_layout(model):
        model(input_ids=ids).logits.sum().backward()
    first = model.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert first.grad is not None and first.grad.abs().sum() > 0


def test_qlora_snapshot_dequantizes_nothing(base_dir, tmp_path, monkeypatch):
    """The θ0 snapshot at train begin holds the adapter's tensors only: it dequantizes no base weight. (What the
    rectification at train end holds densely is tracked, tensor by tensor, in test_qlora_memory.py.)"""
    import peft.utils.integrations as integrations

    real, calls = integrations.dequantize_module_weight, []

    def counting(module):
        calls.append(module)
        return real(module)

    monkeypatch.setattr(integrations, "dequantize_module_weight", counting)

    class AtTrainBegin(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.calls = self.__dict__.get("calls", len(calls))

    model = lora_model(base_dir, "nf4")
    begin = AtTrainBegin()
    janus = JanusCallback(samples(6, seed=2), EXACT)
    train(model, tmp_path, [janus, begin])
    assert janus.report is not None
    assert begin.calls == 0  # θ0 snapshot: the adapter's tensors only
    assert calls  # ... and the rectification at train end did read the base (the counter is live)


@pytest.mark.parametrize("case,fragment", [
    ("merged", "peft_output='merged'.*quantized.*requantizing"),
    ("dora", "Dora.*on a quantized base.*plain LoRA"),
    ("unknown-quantization", "cannot dequantize.*Supported quantized bases"),
])
def test_unsupported_setups_are_refused_at_train_begin(base_dir, tmp_path, case, fragment):
    if case == "unknown-quantization":
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                               LoraConfig(r=4, target_modules=TARGETS))
        layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        # a layer whose weight is stored as integers, as other quantization libraries do
        layer.weight = torch.nn.Parameter(layer.weight.data.to(torch.int8), requires_grad=False)
    else:
        model = lora_model(base_dir, "nf4", use_dora=case == "dora")
    probe = StepProbe()
    janus = JanusCallback(samples(6, seed=2), EXACT, peft_output="merged" if case == "merged" else "adapter")
    with pytest.raises(JanusError, match=fragment):
        train(model, tmp_path, [probe, janus])
    assert probe.steps == 0  # before any optimizer step


def test_rectify_refuses_quantized_target_layers(base_dir):
    from hf_janus import rectify

    model = quantized_base(base_dir, "nf4")
    reference = {}
    with pytest.raises(JanusError, match="is quantized.*requantizing.*JanusCallback or JanusMerger"):
        rectify(model, reference, samples(4), EXACT, progress=False)


# ---- JanusMerger / hf-janus merge against a quantized base ---------------------------------------------------

@pytest.fixture(scope="module")
def qlora_adapter(base_dir, tmp_path_factory):
    """A LoRA adapter trained (without JanusCallback) on the nf4 base, saved as PEFT saves it."""
    root = tmp_path_factory.mktemp("qlora-adapter")
    model = lora_model(base_dir, "nf4")
    train(model, root, [])
    model.save_pretrained(root / "adapter")
    return str(root / "adapter")


def test_merger_rectifies_a_qlora_adapter_against_its_quantized_base(base_dir, qlora_adapter, tmp_path):
    from peft import PeftModel
    from transformers import BitsAndBytesConfig

    from hf_janus import JanusMerger, load_report

    replay = samples(6, seed=2)
    delta = JanusMerger(base_dir, qlora_adapter, replay, EXACT, progress=False,
                        quantization_config=BitsAndBytesConfig(**QUANTIZATIONS["nf4"])).run()
    assert delta.report.rectification.num_jacobian_evals >= 1
    # the record names the base the adapter was rectified against
    assert delta.report.base_quantization == "bitsandbytes 4-bit nf4, float32 compute"
    with pytest.raises(JanusError, match="save_full.*quantized base.*save_adapter"):
        delta.save_full(tmp_path / "full")
    out = delta.save_adapter(tmp_path / "rectified", adapter_rank=64)
    assert load_report(out).merge["base_quantization"] == delta.report.base_quantization
    reloaded = PeftModel.from_pretrained(quantized_base(base_dir, "nf4"), out).eval()
    rectified = effective(reloaded)
    # The reloaded adapter on a fresh quantized base holds the rectified weights (compared as weights: on CPUs
    # with AVX512-BF16 bitsandbytes' eval kernel computes in bf16, so logits differ from a dense model's at 1e-3).
    for name, weight in rectified.items():
        torch.testing.assert_close(weight, delta.model.get_submodule(name).weight.double(), rtol=0, atol=1e-5)
    # and the update it carries lies in the null space of the replay's Jacobian at the dequantized base
    dequantized = dequantized_layers(reloaded)
    theta0 = {name: dequantized[f"{name}.base_layer"] for name in rectified}
    jac = explicit_jacobians(base_dir, dequantized, theta0, replay)
    for name, w0 in theta0.items():
        j, d = jac[name].reshape(len(replay), -1), (rectified[name] - w0).reshape(-1)
        assert float((j @ d).norm() / (j.norm() * d.norm())) < 1e-5, name


def test_cli_merge_with_load_in_4bit(base_dir, qlora_adapter, tmp_path, capsys):
    from merge_fixtures import text_rows, write_jsonl

    from hf_janus import load_report
    from hf_janus.cli import main

    replay = write_jsonl(tmp_path / "past.jsonl", text_rows(6))
    common = ["merge", "--base", base_dir, "--adapter", qlora_adapter, "--replay", replay, "--tau", "0",
              "--compression-rank", "0", "--no-progress", "--load-in-4bit"]
    assert main([*common, "--output", str(tmp_path / "full"), "--format", "full"]) == 2
    assert "--format adapter" in capsys.readouterr().err and not (tmp_path / "full").exists()
    assert main([*common, "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    assert load_report(tmp_path / "out").kind == "adapter"


def test_rectify_takes_a_quantized_reference_model(base_dir):
    """θ0 given as the quantized base model: read by dequantizing, as the same θ0 given as dequantized weights."""
    from transformers import AutoModelForCausalLM

    from hf_janus import rectify

    reference = quantized_base(base_dir, "nf4")
    theta0 = {f"{name}.weight": w.float() for name, w in dequantized_layers(reference).items()}
    runs = []
    for ref in (reference, theta0):
        model = AutoModelForCausalLM.from_pretrained(base_dir)  # "fine-tuned": the full-precision weights
        rectify(model, ref, samples(4), EXACT, progress=False)
        runs.append(model.state_dict())
    for key, value in runs[0].items():
        assert torch.equal(value, runs[1][key]), key
    original = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    assert not torch.equal(runs[0]["model.layers.0.self_attn.q_proj.weight"],
                           original["model.layers.0.self_attn.q_proj.weight"])  # the rectification did something
