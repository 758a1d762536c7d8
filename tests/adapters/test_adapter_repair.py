"""The repair after JANUS in a LoRA adapter's own factors (``AdapterSpace``): the adapter it leaves is the point its
figures were taken at, θ0 is the adapter at zero, the moves scale lora_B, the rank stays, and an interruption puts
the trained adapter back exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from testing_utils import VOCAB, REPAIR_CONFIG, fine_tune_samples, held_out, random_replay, trained_lora

from hf_janus import JanusConfig
from hf_janus.adapters.live.adapter_repair import adapter_repair_blocker
from hf_janus.adapters.live.rectify import PeftOutput, rectify_live_peft
from hf_janus.adapters.peft_layers import adapted_linear_layers
from hf_janus.engine.memory_plan import REPAIR_FP32_COPIES
from hf_janus.replay.prepare import counted_tokens, prepare_replay

CONFIG = JanusConfig(**REPAIR_CONFIG)


def figures(model):
    return held_out(model, random_replay(24), fine_tune_samples(), CONFIG.replay_batch_size,
                    CONFIG.new_task_batch_size)


def test_the_adapter_left_is_the_point_the_figures_were_taken_at():
    model, initial = trained_lora()
    finetuned = copy.deepcopy(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    run = rectify_live_peft(model, initial, random_replay(24), CONFIG, PeftOutput(), progress=False,
                            new_task=fine_tune_samples())
    repair = run.report.repair
    assert repair.chosen.startswith("b=") and repair.outside_parameters == []
    validation = repair.validation
    for point, at in (("chosen", model), ("finetuned", finetuned)):
        new_loss, replay_nll, agreement = figures(at)
        assert validation[point].new_task_loss == pytest.approx(new_loss, rel=1e-5), point
        assert validation[point].replay_nll == pytest.approx(replay_nll, rel=1e-5), point
        assert validation[point].replay_agreement == pytest.approx(agreement), point
    with model.disable_adapter():  # θ0: the adapter at zero is the base alone
        assert validation["reference"].new_task_loss == pytest.approx(figures(model)[0], rel=1e-5)
    assert repair.gain_kept() >= CONFIG.keep_gain
    # the memory plan counted copies of the adapter, not of the layers' dense weights
    layers = adapted_linear_layers(model)
    adapter = sum(m.lora_A["default"].weight.numel() + m.lora_B["default"].weight.numel() for m in layers.values())
    logits_kept = counted_tokens(prepare_replay(random_replay(24), CONFIG.replay_batch_size)) * VOCAB * 4
    assert run.report.memory_plan["pieces"]["repair"] == (REPAIR_FP32_COPIES + 1) * 4 * adapter + logits_kept
    for name, value in model.named_parameters():
        if name in base:
            assert torch.equal(value, base[name]), name  # only the adapter trained
        elif "lora_A" in name:
            assert value.shape[0] == 4  # the rank stays


def test_the_moves_toward_theta0_scale_lora_b():
    """θ0 + b(θ_T − θ0) of the effective weights is lora_B scaled by b at lora_A as trained."""
    from hf_janus.adapters.live.adapter_repair import AdapterSpace

    model, _ = trained_lora()
    layers = adapted_linear_layers(model)
    trained = [t.detach().float().clone() for m in layers.values()
               for t in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
    space = AdapterSpace(model, layers, "default", trained)
    reference, finetuned, _ = space.points(torch.device("cpu"))
    name, layer = next(iter(layers.items()))
    delta = layer.get_delta_weight("default").detach().clone()
    space.write(space.moved(0.3, reference, finetuned))
    torch.testing.assert_close(layer.get_delta_weight("default"), 0.3 * delta, rtol=1e-6, atol=1e-7)
    space.write(reference)
    assert not layer.get_delta_weight("default").any()


@pytest.mark.parametrize("kwargs, output, blocked", [
    ({}, PeftOutput(), None),
    ({}, PeftOutput(rank=2), "adapter_rank=2"),
    ({}, PeftOutput("merged"), "merged"),
    ({"lora_bias": True}, PeftOutput(), "bias"),
    ({"use_dora": True}, PeftOutput(), "DoRA"),
])
def test_what_the_adapter_cannot_train_is_named(kwargs, output, blocked):
    model, initial = trained_lora(**kwargs)
    reason = adapter_repair_blocker(adapted_linear_layers(model), output, initial)
    assert reason is None if blocked is None else blocked in reason
    moved = {k: v.clone() for k, v in initial.items()}
    moved[next(k for k in moved if "lora_B" in k)] += 1.0  # an initialization that did not start at zero
    if blocked is None:
        assert "did not start at zero" in adapter_repair_blocker(adapted_linear_layers(model), output, moved)


def test_an_interrupted_adapter_repair_puts_the_trained_adapter_back():
    """Ctrl-C in the middle of the distillation (the JANUS point already written into the adapter): every tensor
    of the model is as training left it."""
    model, initial = trained_lora()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    calls = {"n": 0}
    janus_alone = copy.deepcopy(model)
    hook = janus_alone.get_base_model().register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    rectify_live_peft(janus_alone, initial, random_replay(24), CONFIG, PeftOutput(), progress=False,
                      new_task=fine_tune_samples())
    hook.remove()
    total, calls["n"] = calls["n"], 0

    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    key = next(k for k in before if "lora_B" in k)

    def interrupt(*_):
        calls["n"] += 1
        if calls["n"] == total - 10:  # inside the repair's choice: the JANUS point is in the adapter by then
            calls["written"] = not torch.equal(lora_b, before[key])
            raise KeyboardInterrupt

    model.get_base_model().register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        rectify_live_peft(model, initial, random_replay(24), CONFIG, PeftOutput(), progress=False,
                          new_task=fine_tune_samples())
    assert calls["written"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
