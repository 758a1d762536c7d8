"""The real-model study's training-time peers (issue 40 item 3) and its variant grammar, on a tiny Llama: θ̂ read
from a LoRA, a CorDA-KPM LoRA and an OSF model is the model each PEFT model computes."""

from __future__ import annotations

import copy
import re

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, OSFConfig, get_peft_model  # noqa: E402
from peft.tuners.lora.config import CordaConfig  # noqa: E402
from peft.tuners.lora.corda import preprocess_corda  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from benchmarks.forgetting.real_study import (  # noqa: E402
    HELD_OUT_NQ,
    LINEAR_NAMES,
    adapter_weights,
    chosen_point,
    finetuned_model,
    held_out_markdown,
    hybrids,
    levers,
    pool_extension,
    posthoc_points,
    replay_trained,
    variant_config,
)
from hf_janus.engine.constraints import (  # noqa: E402
    ReplayLogits,
    constraint_names,
    make_constraint,
    per_token_cross_entropy,
)
from hf_janus.replay.prepare import IGNORE_INDEX  # noqa: E402


@pytest.fixture
def theta0():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def _trained(model):
    """The PEFT model after a stand-in for training: every trainable tensor moved."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def _assert_reproduces(model, theta0):
    ids = torch.randint(0, 64, (2, 9))
    exact = adapter_weights(model, theta0)
    assert len(exact) == 14  # 7 linear layers in each of 2 blocks
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = finetuned_model(theta0, exact)(input_ids=ids).logits
        untouched = theta0(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got - untouched).abs().max() > 1e-3


def test_lora_weights(theta0):
    _assert_reproduces(_trained(get_peft_model(copy.deepcopy(theta0), LoraConfig(r=4, target_modules="all-linear"))),
                       theta0)


def test_osf_weights(theta0):
    model = copy.deepcopy(theta0)
    ranks = {re.escape(name) + "$": min(m.weight.shape) - 4 for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and name.split(".")[-1] != "lm_head"}
    _assert_reproduces(_trained(get_peft_model(model, OSFConfig(target_modules="all-linear", rank_pattern=ranks))),
                       theta0)


def test_corda_kpm_weights_start_at_theta0(theta0):
    model = copy.deepcopy(theta0)
    config = LoraConfig(r=4, target_modules=LINEAR_NAMES, init_lora_weights="corda",
                        corda_config=CordaConfig(corda_method="kpm"))
    preprocess_corda(model, config, run_model=lambda: [model(input_ids=torch.randint(0, 64, (1, 40)))
                                                       for _ in range(8)])
    model = get_peft_model(model, config)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():  # the KPM residual plus its adapter is θ0 before training
        torch.testing.assert_close(model(input_ids=ids).logits, theta0(input_ids=ids).logits, rtol=0, atol=1e-5)
    _assert_reproduces(_trained(model), theta0)


def test_variant_levers():
    assert levers("base") == {"m": 64, "base": True}
    assert levers("tokenloss2+m128+r16") == {"m": 128, "tokenloss": 2, "r": 16}
    assert levers("tau99")["tau"] == pytest.approx(0.99)
    assert levers("corda+janus") == {"m": 64, "corda": True, "janus": True}
    assert levers("corda+lr2e-4")["lr"] == pytest.approx(2e-4)
    assert levers("fromhat+kl16+kllr2e-5") == {"m": 64, "fromhat": True, "kl": [16], "kllr": pytest.approx(2e-5)}
    with pytest.raises(SystemExit, match="now the product's repair after JANUS: use repair<N>"):
        levers("r8+kl16")
    repair = variant_config(levers("r8+repair64+keep9+kllr2e-5+anchor4"))
    assert (repair.compression_rank, repair.distill_steps, repair.keep_gain, repair.distill_lr,
            repair.new_task_batch_size) == (
        8, 64, pytest.approx(0.9), pytest.approx(2e-5), 4)
    config = variant_config(levers("tokenloss2+r16+steps20"))
    assert (config.constraint, config.constraint_options, config.compression_rank, config.max_steps) == (
        "token_loss", {"tokens": 2}, 16, 20)
    with pytest.raises(SystemExit, match="unknown lever 'x1'"):
        levers("base+x1")
    assert levers("tokenloss2+r8+ref75+ref8+hat1") == {"m": 64, "tokenloss": 2, "r": 8, "ref": [0.75, 0.8],
                                                       "hat": [0.1]}
    assert levers("tokenloss2+fromhat+kl16+kl4+khat1+kref9") == {"m": 64, "tokenloss": 2, "fromhat": True,
                                                                 "kl": [16, 4], "khat": [0.1], "kref": [0.9]}
    assert variant_config(levers("damp01")).damping == pytest.approx(0.01)
    assert variant_config(levers("targetlogit")).constraint == "target_logit"


def test_hybrids_are_the_frontiers(theta0):
    """JANUS → θ0 at b is θ0 + b(θ_J − θ0), JANUS → θ̂ at b is θ_J + b(θ̂ − θ_J), labelled after the variant."""
    torch.manual_seed(2)
    names = [n for n, _ in theta0.named_parameters() if n.endswith("proj.weight")]
    finetuned = {n: theta0.get_parameter(n).detach() + torch.randn_like(theta0.get_parameter(n)) for n in names}
    rectified = finetuned_model(theta0, {n: theta0.get_parameter(n).detach() + 0.3 * (w - theta0.get_parameter(n))
                                         for n, w in finetuned.items()})
    out = dict(hybrids("v", levers("base+ref8+hat25"), theta0, rectified, finetuned))
    assert list(out) == ["v → θ0 b=0.8", "v → θ̂ b=0.25"]
    for n, w in finetuned.items():
        w0, wj = theta0.get_parameter(n).detach(), rectified.get_parameter(n).detach()
        torch.testing.assert_close(out["v → θ0 b=0.8"][n], w0 + 0.8 * (wj - w0))
        torch.testing.assert_close(out["v → θ̂ b=0.25"][n], wj + 0.25 * (w - wj))


def test_replay_training_from_the_fine_tuned_point_moves_toward_theta0(theta0):
    """``fromhat+kl<N>``: θ̂ trained N passes on the replay's KL to θ0 (the distillation alone, without JANUS) starts
    at θ̂, moves only the changed parameters, and lowers that KL."""
    torch.manual_seed(3)
    names = [n for n, _ in theta0.named_parameters() if n.endswith("proj.weight")]
    finetuned = {n: theta0.get_parameter(n).detach() + 0.2 * torch.randn_like(theta0.get_parameter(n))
                 for n in names}
    start = finetuned_model(theta0, finetuned)
    replay = [{"input_ids": torch.randint(0, 64, (10,)).tolist(), "labels": torch.randint(0, 64, (10,)).tolist()}
              for _ in range(4)]
    ids = torch.tensor([r["input_ids"] for r in replay])

    def kl(model):
        with torch.no_grad():
            p0 = torch.log_softmax(theta0(input_ids=ids).logits[:, :-1], -1)
            p = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1)
        return float((p0.exp() * (p0 - p)).sum(-1).mean())

    (label, weights, cost), = replay_trained("v", levers("fromhat+kl3"), theta0, finetuned, replay, None,
                                             variant_config(levers("base")))
    assert label == "v: θ̂ → replay KL 3 passes" and set(weights) == set(names)
    assert cost.jacobian_evaluations == 0 and cost.backward_passes == 3 and cost.seconds > 0
    steps = {n: (weights[n] - start.get_parameter(n)).abs().max() for n in names}
    assert all(s <= 3 * 2e-5 for s in steps.values()) and max(steps.values()) > 0  # Adam: about lr per step
    assert kl(finetuned_model(theta0, weights)) < kl(start)
    (faster, weights2, _), = replay_trained("v", levers("fromhat+kl3+kllr4e-5"), theta0, finetuned, replay, None,
                                            variant_config(levers("base")))
    assert faster == "v: θ̂ → replay KL 3 passes, lr 4e-05"
    assert max((weights2[n] - start.get_parameter(n)).abs().max() for n in names) > 3 * 2e-5
    (mixed_label, mixed), = hybrids(label, levers("fromhat+khat5"), theta0, weights, finetuned, prefix="k")
    assert mixed_label == "v: θ̂ → replay KL 3 passes → θ̂ b=0.5"
    for n in names:
        torch.testing.assert_close(mixed[n], (weights[n] + finetuned[n]) / 2)


def test_token_margin_rows():
    """The prototype's rows, by hand: each early answer token's target logit minus the largest other logit (with
    that token's loss after it when asked), then the loss of the rest of the answer; registered once per setting."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 5, 7, generator=gen)
    targets = torch.randint(0, 7, (2, 5), generator=gen)
    targets[0, :2] = IGNORE_INDEX  # a prompt, then 3 answer tokens
    view = ReplayLogits(scores, targets, per_token_cross_entropy(scores, targets))

    def lead(b, t):
        others = torch.cat([scores[b, t, :targets[b, t]], scores[b, t, targets[b, t] + 1:]])
        return scores[b, t, targets[b, t]] - others.max()

    only = make_constraint(variant_config(levers("marginonly2")))
    both = make_constraint(variant_config(levers("margin2")))
    assert (only.rows_per_sample, both.rows_per_sample) == (3, 5)
    name = variant_config(levers("marginonly2")).constraint  # a second config reuses the registered class
    assert variant_config(levers("marginonly2")).constraint == name and constraint_names().count(name) == 1
    rows, full = only.functions(view), both.functions(view)
    torch.testing.assert_close(rows[0], torch.stack([lead(0, 2), lead(0, 3), view.per_token[0, 4]]))
    torch.testing.assert_close(full[1], torch.stack([lead(1, 0), view.per_token[1, 0], lead(1, 1),
                                                     view.per_token[1, 1], view.per_token[1, 2:].sum()]))


def test_posthoc_peers_are_built_by_the_frontier_builder(theta0):
    """LiNeS at a flat scale of 0.5 is the midpoint of θ0 and θ̂; replay fine-tuning moves θ̂ and reports its
    passes."""
    torch.manual_seed(1)
    exact = {name: p.detach().float() + 0.05 * torch.randn_like(p) for name, p in theta0.named_parameters()
             if name.endswith("proj.weight")}
    replay = [{"input_ids": torch.randint(0, 64, (10,)).tolist(), "labels": torch.randint(0, 64, (10,)).tolist()}
              for _ in range(4)]
    seen = {}
    for label, model, cost in posthoc_points("lines:alpha=0.5:beta=0 replay-sft:passes=2",
                                             theta0, exact, replay, tok=None):
        seen[label] = ({k: model.get_parameter(k).detach().clone() for k in exact}, cost)
    (half, _), (sft, sft_cost) = seen.values()
    for k, w in exact.items():
        torch.testing.assert_close(half[k], (theta0.get_parameter(k).detach() + w) / 2, rtol=0, atol=1e-6)
    assert any((sft[k] - exact[k]).abs().max() > 0 for k in exact)
    assert sft_cost["forward_passes"] == 2 and sft_cost["backward_passes"] == 2


def _scored(em_validation: float, em_held_out: float, ap2: float) -> dict:
    """A point's record with the same EM back on both sets of each split."""
    def subset(em):
        return {"em_back": em, "nll_undone": em, "ap1_em": None}

    summary = {k: {"em": 50.0, "nll": 1.0, "token_acc": 90.0, "first_token_acc": 90.0}
               for k in ("nq", "webq", "nq_held_out", "webq_held_out")}
    return {"past_summary": summary, "gsm_nll": 1.0,
            "repair": {"nq": subset(em_validation), "webq": subset(em_validation), "nq_held_out": subset(em_held_out),
                       "webq_held_out": subset(em_held_out), "ap2": ap2}}


def test_the_held_out_choice_reads_only_the_validation_questions():
    """The point is the most EM back on the validation questions at AP2 ≥ 95, whatever the held-out questions say;
    WiSE-FT's points are the curve, never the choice; the held-out table marks the choice and reads its margins off
    the held-out WiSE-FT curve."""
    anchors = {"theta0": {"past_summary": _scored(0, 0, 0)["past_summary"]},
               "finetuned": {"past_summary": _scored(0, 0, 0)["past_summary"]}}
    points = {**anchors, "wise a=0.9": _scored(90, 90, 99.0), "wise a=0.5": _scored(95, 95, 60.0),
              "janus": _scored(20, 70, 99.0), "janus b=0.7": _scored(50, 40, 96.0),
              "janus b=0.6": _scored(60, 80, 94.0)}
    assert chosen_point(points) == "janus b=0.7"
    assert chosen_point(points, min_ap2=99.5) is None
    table = held_out_markdown({"points": points})
    assert "**janus b=0.7**" in table
    row = next(line for line in table.splitlines() if line.startswith("| **janus b=0.7**"))
    # the held-out WiSE-FT curve at AP2 96: a=0.9 (99, 90) and a=0.5 (60, 95) joined linearly
    wise = 90 + (99.0 - 96.0) / (99.0 - 60.0) * (95 - 90)
    assert f"{40 - wise:+.1f} / {40 - wise:+.1f}" in row
    assert held_out_markdown({"points": {**anchors, "janus": _scored(1, 1, 99.0)} | {
        "finetuned": {"past_summary": {"nq": {}, "webq": {}}}}}) == ""


def test_the_replay_pool_never_grows_into_the_held_out_questions():
    """From any start, the pool's extension covers the questions up to the held-out ones and none of them."""
    order = [{"question": f"q{i}"} for i in range(HELD_OUT_NQ.stop)]
    for start in (310, HELD_OUT_NQ.start - 5, HELD_OUT_NQ.start):
        chunks = list(pool_extension(order, start))
        asked = [r["question"] for _, chunk in chunks for r in chunk]
        assert asked == [f"q{i}" for i in range(start, HELD_OUT_NQ.start)]
        assert [end for end, _ in chunks] == [min(start + 64 * (k + 1), HELD_OUT_NQ.start)
                                               for k in range(len(chunks))]
