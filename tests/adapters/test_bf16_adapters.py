"""Adapters on bf16 bases (and nf4/int8 bases computing in bf16, the standard QLoRA recipe) are rectified in float32.

PEFT merges in the base's dtype: on a bf16 base the model holds round(W + ΔW), and round(W + ΔW) − W is rounding
noise wherever ΔW is small against W. JANUS must work on the adapter's own update instead. What it may change is
fixed by the paper: ΔW − ΔW_rect lies in the row space of the replay's per-sample Jacobian at θ0. These tests
measure the part of ΔW − ΔW_rect *outside* that row space, with explicit per-sample gradients (``torch.func``) of
a float64 twin of the model at θ0, relative to what was removed. Measured at |ΔW|/|W| = 1.5e-2 (the review's case),
single step, no compression: see ``OUTSIDE_OF_REMOVED`` for the figures reached.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_qlora import TARGETS, base_dir, samples, train  # noqa: F401  (base_dir is a fixture)

from hf_janus import JanusConfig, JanusMerger
from hf_janus.adapters.peft_layers import adapted_linear_layers, initial_state
from hf_janus.adapters.live.rectify import PeftOutput, rectify_live_peft

bnb = pytest.importorskip("bitsandbytes")

EXACT = JanusConfig(tau=0.0, compression_rank=None, replay_batch_size=6)  # single step, no compression
RELATIVE_UPDATE = 1.5e-2  # |ΔW| / |W| per layer
FULL_RANK = 64  # min(d_out, d_in) of every target layer: writing the adapter back truncates nothing
#: The bound on |ΔW − ΔW_rect outside the row space|, as a share of what was removed, |ΔW − ΔW_rect|. The capture runs
#: the model in bf16 (LLM.int8 also rounds the activations), so the row space the engine projects on is the float64
#: one turned by an angle θ of bf16 noise, and the part of the removed update that lands outside is sin θ of it. The
#: allowance for that angle is the one tests/real uses for bf16 captures (0.15). Reached on the live path: 4-6% of
#: the removed part (bf16 5.7e-4, nf4-bf16 5.8e-4, int8 9.0e-4 of |ΔW|, about 1.5e-2 of |ΔW| removed); before the fix
#: bf16 and nf4-bf16 left 1.1e-1 of |ΔW| outside, several times the whole removed part.
OUTSIDE_OF_REMOVED = 0.15

LOADS = {
    "bf16": {},
    "nf4-bf16": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "int8": dict(load_in_8bit=True),
}


def load(base_path, kind):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"dtype": torch.bfloat16}
    if LOADS[kind]:
        kwargs.update(quantization_config=BitsAndBytesConfig(**LOADS[kind]), device_map="cpu")
    return AutoModelForCausalLM.from_pretrained(base_path, **kwargs).eval()


def lora_update(module) -> torch.Tensor:
    """s·B·A of a LoRA layer in float64, from its factors (not from the product's code)."""
    a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
    return module.scaling["default"] * (b.detach().double() @ a.detach().double())


def trained_lora(base_path, kind, seed=0):
    """A LoRA r=8 whose update is RELATIVE_UPDATE of each base weight, and the snapshot taken before it moved."""
    from peft import LoraConfig, get_peft_model

    from hf_janus.engine.quantized import dequantized_weight

    torch.manual_seed(seed)
    model = get_peft_model(load(base_path, kind), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    layers = adapted_linear_layers(model)
    initial = initial_state(layers)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in layers.values():
            b = module.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=gen))
            base = module.get_base_layer()
            w = dequantized_weight(base) if LOADS[kind] else base.weight
            b.mul_(RELATIVE_UPDATE * float(w.double().norm()) / float(lora_update(module).norm()))
    return model, layers, initial


def twin_params(model):
    """The float64 parameters of the model as it computes (bf16 values, dequantized layers), plain names."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from hf_janus.engine.quantized import dequantized_weight, is_supported_quantized

    out = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer) or "lora_" in name:
            continue
        plain = name.replace(".base_layer", "")
        if is_supported_quantized(module):
            out[f"{plain}.weight"] = dequantized_weight(module).double()
            if module.bias is not None:
                out[f"{plain}.bias"] = module.bias.detach().double()
            continue
        for local, p in module.named_parameters(recurse=False):
            out[f"{plain}.{local}"] = p.detach().double()
    return out


def row_space_jacobians(base_path, params, names, replay):
    """Per-sample loss gradients at ``params`` w.r.t. the weights of ``names``: ``{name: (m, d_out·d_in)}``."""
    from torch.func import functional_call, grad
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float64).eval()
    targets = {f"{n}.weight": params[f"{n}.weight"] for n in names}

    def loss(target_params, ids):
        return functional_call(dense, {**params, **target_params}, kwargs={"input_ids": ids, "labels": ids}).loss

    rows = {n: [] for n in names}
    for sample in replay:
        g = grad(loss)(targets, torch.tensor([sample["input_ids"]]))
        for n in names:
            rows[n].append(g[f"{n}.weight"].reshape(-1))
    return {n: torch.stack(r) for n, r in rows.items()}


def outside_share(jac, delta, delta_rect):
    """|part of ΔW − ΔW_rect outside the row space of ``jac``| / |ΔW − ΔW_rect|: the share of what was removed that
    the past task's Jacobian does not see."""
    _, s, vh = torch.linalg.svd(jac, full_matrices=False)
    basis = vh[s > s[0] * 1e-10]
    removed = (delta - delta_rect).reshape(-1)
    outside = removed - basis.T @ (basis @ removed)
    return float(outside.norm() / removed.norm())


@pytest.mark.parametrize("kind", list(LOADS))
def test_live_adapter_update_is_rectified_in_float32(base_dir, kind):  # noqa: F811
    """What JanusCallback runs at train end (rectify_live_peft), adapter written back at full rank."""
    model, layers, initial = trained_lora(base_dir, kind)
    replay = samples(6, seed=2)
    deltas = {n: lora_update(m) for n, m in layers.items()}
    params = twin_params(model)  # θ0: the base as it computes (B = 0 at θ0 would add nothing)
    rectify_live_peft(model, initial, replay, EXACT, PeftOutput("adapter", rank=FULL_RANK), progress=False)

    names = list(layers)
    jac = row_space_jacobians(base_dir, params, names, replay)
    shares = {n: outside_share(jac[n], deltas[n], lora_update(layers[n])) for n in names}
    moved = {n: float((deltas[n] - lora_update(layers[n])).norm() / deltas[n].norm()) for n in names}
    assert all(v > 1e-3 for v in moved.values()), moved  # the rectification did remove something
    assert max(shares.values()) <= OUTSIDE_OF_REMOVED, shares


def test_janus_callback_on_a_bf16_lora_as_a_user_runs_it(base_dir, tmp_path):  # noqa: F811
    """JanusCallback inside Trainer on a bf16 base, a few real training steps, adapter written back at full rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import TrainerCallback

    from hf_janus import JanusCallback

    class Before(TrainerCallback):  # runs before JanusCallback at train end: ΔW as training left it
        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.deltas = {n: lora_update(m) for n, m in adapted_linear_layers(model).items()}

    torch.manual_seed(0)
    model = get_peft_model(load(base_dir, "bf16"), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    params = twin_params(model)
    replay = samples(6, seed=2)
    before, janus = Before(), JanusCallback(replay, EXACT, adapter_rank=FULL_RANK)
    train(model, tmp_path, [before, janus])
    layers = adapted_linear_layers(model)
    jac = row_space_jacobians(base_dir, params, list(layers), replay)
    for n, module in layers.items():
        share = outside_share(jac[n], before.deltas[n], lora_update(module))
        assert share <= OUTSIDE_OF_REMOVED, (n, share)
    assert janus.report.steps and janus.report.output["format"] == "adapter"


def test_full_fine_tuning_in_bf16_subtracts_and_projects_in_float32(base_dir):  # noqa: F811
    """A bf16 model fine-tuned in full: θ̂ − θ0 of two bf16 weights is exact in float32, and the projection runs
    there; the float32 θ_rect (before the model rounds it) meets the same bound."""
    import dataclasses

    from hf_janus.engine.rectifier import Rectifier

    model = load(base_dir, "bf16")
    theta0 = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: v.double() for k, v in theta0.items()}
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in TARGETS:
                w = module.weight
                w.add_((RELATIVE_UPDATE * w.float().norm() / w.numel() ** 0.5
                        * torch.randn(w.shape, generator=gen)).to(w.dtype))
    finetuned = {k: v.clone() for k, v in model.state_dict().items()}
    replay = samples(6, seed=2)
    config = dataclasses.replace(EXACT, target_modules=TARGETS)
    rectifier = Rectifier(model, theta0, replay, config, progress=False)
    rectifier.run()
    names = list(rectifier.result.layers)
    jac = row_space_jacobians(base_dir, params, names, replay)
    for n in names:
        delta = (finetuned[f"{n}.weight"].double() - theta0[f"{n}.weight"].double())
        share = outside_share(jac[n], delta, rectifier.result.layers[n].rect_delta().double())
        assert share <= OUTSIDE_OF_REMOVED, (n, share)


def test_saved_bf16_adapter_through_the_merger(base_dir, tmp_path):  # noqa: F811
    """JanusMerger on a LoRA saved from a bf16 base: ΔW_rect of every layer within the same bound."""
    model, layers, _ = trained_lora(base_dir, "bf16")
    deltas = {n: lora_update(m) for n, m in layers.items()}
    params = twin_params(model)
    model.save_pretrained(tmp_path / "adapter")
    replay = samples(6, seed=2)
    delta = JanusMerger(base_dir, tmp_path / "adapter", replay, EXACT, torch_dtype=torch.bfloat16,
                        allow_base_mismatch=True, progress=False).run()
    names = list(layers)
    jac = row_space_jacobians(base_dir, params, names, replay)
    for n in names:
        got = delta.layers[n].matrix.double()
        share = outside_share(jac[n], deltas[n], got)
        assert share <= OUTSIDE_OF_REMOVED, (n, share)
        assert not math.isclose(float((deltas[n] - got).norm()), 0.0)
