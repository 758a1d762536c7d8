"""The PEFT-shape matrix: every adapter a user can build with peft today that hf-janus accepts, on the bases users
run (dense float32 and bf16, nf4 with bf16 compute), through ``JanusCallback`` in a real ``Trainer`` (live) and
``JanusMerger`` (saved). For each shape:

- the plain model the engine captures computes PEFT's forward (biases of ``lora_bias`` adapters included);
- what is written back (the adapter, at its own or another rank, or the merged weights) is θ_rect, computed
  independently by ``rectify`` on a plain twin holding θ̂, and nothing the rectification did not change moves;
- the saved result reloads with stock PEFT / transformers to the same outputs;
- what cannot be done right is refused at train begin, before any optimizer step.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
from adapter_fixtures import collate, samples, train
from merge_fixtures import char_tokenizer, fast_config, write_jsonl
from testing_utils import VOCAB, build_tiny
from transformers import TrainerCallback

from hf_janus import JanusCallback, JanusError, JanusMerger, rectify
from hf_janus.adapters.peft_layers import (
    adapted_linear_layers,
    effective_params,
    effective_weights,
    initial_state,
    plain_view,
    rebuilt_on_quantized_bases,
)
from hf_janus.model_modes import standard_quantized_layout

pytestmark = pytest.mark.slow

EXACT = fast_config(replay_batch_size=4)  # one step, no compression: θ_rect is a deterministic projection
FULL_RANK = 96  # >= min(d_out, d_in) of every layer: the re-factorization is exact
IDS = torch.tensor([[1, 5, 9, 13, 2, 30, 11, 4], [7, 3, 3, 40, 12, 6, 8, 19]])


REPLAY = samples(8, length=10, seed=3)


# ---- bases -----------------------------------------------------------------------------------------------------
# hidden 64: bitsandbytes quantizes in blocks of 64 values. Qwen2 has biases on q/k/v and none on o/up/down, so one
# model gives both kinds of layer; GPT-2 stores its projections as Conv1D (transposed) with biases.
FAMILY_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    import transformers as tf

    out = {}
    root = tmp_path_factory.mktemp("shapes")
    for family in ("qwen2", "llama", "gpt2"):
        torch.manual_seed(0)
        if family == "gpt2":
            model = build_tiny("gpt2")
        elif family == "qwen2":
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**FAMILY_CONFIG))
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**FAMILY_CONFIG))
        path = root / family
        model.save_pretrained(path)
        char_tokenizer().save_pretrained(path)
        out[family] = os.fspath(path)
    return out


def load_base(path: str, precision: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if precision == "nf4":
        pytest.importorskip("bitsandbytes")
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# ---- shapes ------------------------------------------------------------------------------------------------------
@dataclass
class Shape:
    family: str
    lora: dict[str, Any]
    setup: Optional[Callable[[Any], None]] = None  # more adapters, set_adapter, ...
    rank_can_change: bool = True
    dense_only: bool = False  # PEFT or hf-janus have no such adapter on a quantized base
    refused: Optional[str] = None  # the train-begin refusal, when the shape cannot be rectified right
    trains_bias: bool = False  # lora_bias: the merged output must carry it


def _second_adapter(targets, activate=False, **lora):
    def setup(model):
        from peft import LoraConfig

        model.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=targets, **lora))
        with torch.no_grad():  # a trained-looking second adapter, so that using it by mistake shows
            for name, p in model.named_parameters():
                if ".other." in name and "lora_B" in name:
                    p.normal_(0, 0.05)
        if activate:
            model.set_adapter("other")
            # set_adapter leaves only the active adapter trainable, as PEFT's own training would
    return setup


QKV = ["q_proj", "v_proj", "up_proj"]
SHAPES = {
    "lora": Shape("qwen2", dict(target_modules=QKV)),
    "lora-bias": Shape("qwen2", dict(target_modules=["q_proj", "v_proj"], lora_bias=True), trains_bias=True),
    "rslora-patterns": Shape("qwen2", dict(target_modules=QKV, use_rslora=True, rank_pattern={"v_proj": 2},
                                           alpha_pattern={"up_proj": 3})),
    "dora": Shape("qwen2", dict(target_modules=QKV, use_dora=True), dense_only=True),
    "modules-to-save": Shape("qwen2", dict(target_modules=QKV, modules_to_save=["lm_head"])),
    "second-same-layers": Shape("qwen2", dict(target_modules=QKV), setup=_second_adapter(QKV)),
    "second-other-layers": Shape("qwen2", dict(target_modules=QKV), setup=_second_adapter(["k_proj", "down_proj"])),
    "second-other-layers-active": Shape("qwen2", dict(target_modules=QKV),
                                        setup=_second_adapter(["k_proj", "down_proj"], activate=True)),
    "pissa": Shape("qwen2", dict(target_modules=QKV, init_lora_weights="pissa"), rank_can_change=False,
                   dense_only=True),
    "olora": Shape("qwen2", dict(target_modules=QKV, init_lora_weights="olora"), rank_can_change=False,
                   dense_only=True),
    "gpt2-conv1d": Shape("gpt2", dict(target_modules=["c_attn", "c_fc"], fan_in_fan_out=True), dense_only=True),
    "gpt2-lora-bias": Shape("gpt2", dict(target_modules=["c_attn"], fan_in_fan_out=True, lora_bias=True),
                            dense_only=True, trains_bias=True),
    "llama-lora-bias": Shape("llama", dict(target_modules=["q_proj", "v_proj"], lora_bias=True),
                             refused="lora_bias=True on layer.*without a bias"),
}
LIVE_CASES = [(shape, precision, output)
              for shape, spec in SHAPES.items()
              for precision in ("fp32", "bf16", "nf4") if not (spec.dense_only and precision == "nf4")
              for output in ("adapter", "adapter-rank-2", "merged")
              if not (output == "adapter-rank-2" and not spec.rank_can_change)
              if not (output == "merged" and precision == "nf4")  # refused by design: test_qlora covers it
              # the merged and rank-2 outputs are one code path whatever the dtype: fp32 and nf4/bf16 cover them
              if not (output != "adapter" and precision == "bf16" and shape not in ("lora", "lora-bias"))]


def peft_model(shape: Shape, bases, precision: str):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(load_base(bases[shape.family], precision), LoraConfig(r=4, lora_alpha=8, **shape.lora))
    with torch.no_grad():  # lora_B starts at zero: make the adapter's bias non-trivial from the start too
        for name, p in model.named_parameters():
            if "lora_B" in name and name.endswith(".bias"):
                p.normal_(0, 0.1)
    if shape.setup is not None:
        shape.setup(model)
    return model


class Probe(TrainerCallback):
    """Keeps θ̂ (effective weights and biases of the adapted layers, float32) and the model's outputs just before
    ``JanusCallback`` rectifies, and counts optimizer steps."""

    def __init__(self):
        self.steps, self.finetuned, self.logits, self.twin = 0, {}, None, None

    def on_step_begin(self, *args, **kwargs):
        self.steps += 1

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.finetuned = effective_state(model)
        self.logits = logits(model)
        if not any(getattr(p, "quant_state", None) is not None for p in model.parameters()):
            # θ̂ as a plain float32 model: PEFT's merge of a copy (modules_to_save and inactive adapters resolved
            # as PEFT does), the adapted layers then given their exact float32 effective weights
            twin = copy.deepcopy(model).float().merge_and_unload()
            state = twin.state_dict()
            state.update({k: v for k, v in self.finetuned.items() if k.endswith(".weight")})
            twin.load_state_dict(state)
            self.twin = twin.eval()


def logits(model) -> torch.Tensor:
    model.eval()
    # bitsandbytes' AVX512-BF16 repacking of a Linear4bit fails on rows that are not whole 64-blocks (these layers'
    # are not); the engine keeps it off for its own passes, and so do the test's
    with torch.no_grad(), standard_quantized_layout(model):
        return model(input_ids=IDS).logits.float()


def effective_state(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in adapted_linear_layers(model).items():
        weight, bias = effective_params(module, torch.float32)
        out[f"{name}.weight"] = weight.detach().float().clone()
        if bias is not None:
            out[f"{name}.bias"] = bias.detach().float().clone()
    return out


def plain_logits(model) -> torch.Tensor:
    """The outputs of the plain model the engine captures (θ̂ in float32, stand-ins for quantized layers)."""
    layers = adapted_linear_layers(model)
    rebuilt = rebuilt_on_quantized_bases(layers, initial_state(layers))
    dense = {n: m for n, m in layers.items() if n not in rebuilt}
    with plain_view(model, effective_weights(dense), rebuilt) as plain:
        return logits(plain)


def tolerance(precision: str) -> dict[str, float]:
    # Same arithmetic in another order: float32 rounding on O(1) logits of a 2-block model; bf16 (8 bits of
    # mantissa) and nf4 with bf16 compute round every activation to 2^-8 relative, and the plain view merges W + ΔW
    # before rounding where PEFT rounds W x and ΔW x apart.
    return dict(rtol=0, atol=1e-4) if precision == "fp32" else dict(rtol=2 ** -5, atol=2 ** -5)


def expected_rect(shape: Shape, probe: Probe, theta0: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ_rect computed independently: ``rectify`` on a plain float32 twin holding θ̂ (dense bases only)."""
    twin = probe.twin
    names = sorted({k.rsplit(".", 1)[0] for k in probe.finetuned})
    reference = {k: v.clone() for k, v in twin.state_dict().items()}
    reference.update(theta0)
    rectify(twin, reference, REPLAY, fast_config(replay_batch_size=4, target_modules=names), progress=False)
    return {f"{n}.weight": twin.get_submodule(n).weight.detach().float() for n in names}


# ---- live: JanusCallback in a Trainer -------------------------------------------------------------------------
@pytest.mark.parametrize("shape_name,precision,output", LIVE_CASES)
def test_live_shape(bases, tmp_path, shape_name, precision, output):
    from peft import PeftModel

    shape = SHAPES[shape_name]
    model = peft_model(shape, bases, precision)
    # adapter at full rank where the rank can change, so that the written adapter can hold θ_rect exactly
    rank = 2 if output.endswith("2") else (FULL_RANK if shape.rank_can_change else "same")
    kwargs = dict(peft_output="merged") if output == "merged" else dict(adapter_rank=rank)
    probe, janus = Probe(), JanusCallback(REPLAY, EXACT, **kwargs)
    if shape.refused:
        with pytest.raises(JanusError, match=shape.refused):
            train(model, tmp_path, [janus, probe], steps=2)
        assert probe.steps == 0  # refused before the first optimizer step
        return

    # The engine captures what PEFT computes, before training and at train end (the Probe runs before the callback).
    torch.testing.assert_close(plain_logits(model), logits(model), **tolerance(precision))
    layers_before = sorted(adapted_linear_layers(model))
    theta0 = {k: v for k, v in effective_state(model).items() if k.endswith(".weight")}
    trainer = train(model, tmp_path, [probe, janus], steps=2)
    assert probe.steps == 2
    assert probe.logits is not None
    assert janus.report is not None and janus.report.output["format"] == ("merged" if output == "merged" else "adapter")
    assert sorted({k.rsplit(".", 1)[0] for k in probe.finetuned}) == layers_before

    # What is written back is θ_rect (dense bases: against an independent rectify of a plain twin).
    final = trainer.model
    if output == "merged":
        assert not isinstance(final, PeftModel)
        written = {}
        for name in layers_before:
            module = final.get_submodule(name)
            written[f"{name}.weight"] = module.weight.detach().float()
            if module.bias is not None:
                written[f"{name}.bias"] = module.bias.detach().float()
    else:
        written = effective_state(final)
    for key, value in probe.finetuned.items():  # biases keep their fine-tuned value (lora_bias included)
        if key.endswith(".bias"):
            torch.testing.assert_close(written[key], value, **tolerance(precision))
    if rank != "same" and output != "adapter-rank-2" and precision != "nf4":
        expected = expected_rect(shape, probe, theta0)
        for key, value in expected.items():
            if precision == "fp32":
                torch.testing.assert_close(written[key], value, rtol=0, atol=2e-5)
                continue
            # On a bf16 base the replay's activations are rounded to 8 bits of mantissa where the twin's are float32:
            # the Jacobian's row space, hence the projected update, moves by O(2^-8) of the update; a merged bf16
            # weight also rounds W itself to 2^-8 relative.
            update = float((probe.finetuned[key] - theta0[key]).norm())
            allowed = 2 ** -6 * update + (2 ** -8 * float(value.norm()) if output == "merged" else 0.0)
            assert float((written[key] - value).norm()) <= allowed, key
    if output == "adapter-rank-2":
        assert all(layer["rank"] <= 2 for layer in janus.report.output["layers"])

    # The saved result reloads with stock libraries to the same outputs.
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    if output == "merged":
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=final.dtype)
    else:
        active = final.active_adapter  # PEFT saves adapters other than "default" in a subfolder of their name
        reloaded = PeftModel.from_pretrained(load_base(bases[shape.family], precision),
                                             out if active == "default" else out / active, adapter_name=active)
    torch.testing.assert_close(logits(reloaded), logits(final), rtol=0, atol=1e-5 if precision == "fp32" else 1e-2)


# ---- saved: JanusMerger on an adapter from disk -----------------------------------------------------------------
SAVED_SHAPES = ["lora", "lora-bias", "rslora-patterns", "dora", "modules-to-save", "pissa", "gpt2-conv1d",
                "gpt2-lora-bias"]
SAVED_CASES = [(s, p) for s in SAVED_SHAPES for p in ("fp32", "bf16", "nf4")
               if not (SHAPES[s].dense_only and p == "nf4") and not (p == "bf16" and s not in ("lora", "lora-bias"))]


@pytest.mark.parametrize("shape_name,precision", SAVED_CASES)
def test_saved_shape(bases, tmp_path, shape_name, precision):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shape = SHAPES[shape_name]
    model = peft_model(shape, bases, precision)
    if shape.lora.get("init_lora_weights") in ("pissa", "olora"):
        model.peft_config["default"].init_lora_weights = True
        model.save_pretrained(tmp_path / "initial")
        model.peft_config["default"].init_lora_weights = shape.lora["init_lora_weights"]
    train(model, tmp_path, [Probe()], steps=2)
    adapter_dir = tmp_path / "adapter"
    if shape.lora.get("init_lora_weights") in ("pissa", "olora"):
        model.save_pretrained(adapter_dir, path_initial_model_for_weight_conversion=os.fspath(tmp_path / "initial"))
    else:
        model.save_pretrained(adapter_dir)
    finetuned_logits = logits(model)
    replay = write_jsonl(tmp_path / "replay.jsonl", [{"input_ids": r["input_ids"]} for r in REPLAY])
    kwargs: dict[str, Any] = {}
    if precision == "nf4":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
    if precision == "bf16":
        kwargs["torch_dtype"] = torch.bfloat16
    merger = JanusMerger(bases[shape.family], adapter_dir, replay, EXACT, progress=False, **kwargs)
    result = merger.run()

    # The merged model the engine rectified started from what PEFT computes (θ̂), within the precision's rounding.
    assert result.report.rectification.replay_loss["finetuned"] == pytest.approx(
        float(_loss(model)), rel=1e-4 if precision == "fp32" else 2e-2)
    rect_logits = logits(result.model)
    # Biases are not rectified: the engine's model holds PEFT's effective bias (a lora_bias adapter's included).
    for name, module in adapted_linear_layers(model).items():
        base_bias = module.get_base_layer().bias
        if base_bias is None:
            continue
        expected = base_bias.detach().float()
        if shape.trains_bias:
            expected = expected + module.lora_B["default"].bias.detach().float() * module.scaling["default"]
        got = result.model.get_submodule(name).bias.detach().float()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 if precision == "fp32" else 2 ** -7)

    # Adapter output: reloads with stock PEFT to the merger's outputs (where a LoRA can hold the result).
    out = tmp_path / "out-adapter"
    result.save_adapter(out, adapter_rank="same" if not shape.rank_can_change else FULL_RANK, progress=False)
    reloaded = PeftModel.from_pretrained(load_base(bases[shape.family], precision), out)
    if shape.rank_can_change:
        torch.testing.assert_close(logits(reloaded), rect_logits, rtol=0, atol=1e-4 if precision == "fp32" else 5e-2)
    if precision == "nf4":
        return
    out = tmp_path / "out-full"
    result.save_full(out)
    full = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32 if precision == "fp32" else torch.bfloat16)
    torch.testing.assert_close(logits(full), rect_logits, rtol=0, atol=1e-5 if precision == "fp32" else 1e-2)
    assert not torch.equal(rect_logits, finetuned_logits)


def _loss(model) -> torch.Tensor:
    batch = collate(REPLAY)
    model.eval()
    with torch.no_grad(), standard_quantized_layout(model):  # see logits()
        return model(**batch).loss
