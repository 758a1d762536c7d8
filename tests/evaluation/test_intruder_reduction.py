"""PEFT's intruder-dimension reduction as the frontier's peer: the float32 arithmetic of
hf_janus.evaluation.intruder_reduction against PEFT's own ``reduce_intruder_dimension``, and the frontier on a saved
LoRA adapter of a bf16 model (intruder points, their curve, and JANUS runs fed the adapter's exact update)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from eval_fixtures import saved_lora_setting
from hf_janus import JanusConfig, rectify
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates import Intruder, parse_candidates
from hf_janus.evaluation.frontier_result import INTRUDER_CURVE, wise_margin
from hf_janus.evaluation.frontier_search import frontier
from hf_janus.evaluation.intruder_reduction import IntruderReduction, find_intruders, reduced_delta
from testing_utils import build_tiny



def _lora_model(seed: int = 0, scale: float = 0.3):
    """A tiny Llama with a rank-4 LoRA on every linear layer, factors large enough that some layers' top singular
    directions are the adapter's own (intruders) and others are not."""
    from peft import LoraConfig, get_peft_model

    base = build_tiny("llama", seed=seed)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):
            if "lora_B" in name:  # every other layer gets a large update
                param.copy_(torch.randn(param.shape, generator=gen) * (scale if i % 4 == 1 else 0.01))
    return model.eval()


@pytest.mark.parametrize("mitigation_lambda", [0.75, 0.0])
def test_reduction_matches_peft(mitigation_lambda):
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.intruders import reduce_intruder_dimension

    model = _lora_model()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    reference = {n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()}
    finetuned = {n: reference[n] + m.get_delta_weight("default").detach() for n, m in layers.items()}
    ranks = {n: m.r["default"] for n, m in layers.items()}
    ours = IntruderReduction(reference, finetuned, ranks)

    lines: list[str] = []
    peft_model = copy.deepcopy(model)
    reduce_intruder_dimension(peft_model, mitigation_lambda=mitigation_lambda, logging_sink=lines.append)
    reduced = {name: m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    with_intruders = sum("Intruders:" in line for line in lines)
    assert ours.layers_with_intruders == with_intruders and 0 < with_intruders < len(layers)
    weights = ours.weights(reference, mitigation_lambda)
    for name, module in reduced.items():
        theirs = module.get_delta_weight("intruder_reduced")
        mine = weights[name] - reference[name]
        assert torch.allclose(mine, theirs, atol=1e-5 * theirs.abs().max().item()), name
        if ours.layers[name].count and mitigation_lambda < 1:
            assert not torch.allclose(mine, finetuned[name] - reference[name], atol=1e-4)


def test_unconverted_pissa_adapter_is_reduced_as_peft_reduces_it(tmp_path):
    """An unconverted PiSSA adapter sits on W_res, not on θ0: PEFT measures intruders against W_res and reduces the
    adapter's own rank-r update; the frontier's arithmetic on a saved adapter must do the same."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.intruders import reduce_intruder_dimension

    from hf_janus.adapters.saved.effective import load_effective_model

    base_dir = tmp_path / "base"
    build_tiny("llama").save_pretrained(base_dir)
    model = get_peft_model(build_tiny("llama"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights="pissa"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):
            if "lora_B" in name:  # a trained-looking adapter: some layers moved a lot
                param.add_(torch.randn(param.shape, generator=gen) * (0.5 if i % 4 == 1 else 0.01))
    model.save_pretrained(tmp_path / "adapter")  # unconverted: relative to W_res, rebuilt from W by its exact SVD
    exact = load_effective_model(os.fspath(base_dir), os.fspath(tmp_path / "adapter"), progress=False)
    keys = {name: name + ".weight" for name in exact.linear_layers}
    reference = {k: exact.reference[k].float() for k in keys.values()}
    finetuned = {k: exact.finetuned_weight(n) for n, k in keys.items()}
    ranks = {k: exact.layers[n].rank for n, k in keys.items()}
    ours = IntruderReduction(reference, finetuned, ranks, base={k: exact.adapter_base(n) for n, k in keys.items()})

    lines: list[str] = []
    # PEFT adds the reduced adapter with the old adapter's config: with init_lora_weights="pissa" that would run
    # PiSSA's initialization again and move the base weight a second time, under its own computation
    model.peft_config["default"].init_lora_weights = True
    reduce_intruder_dimension(model, mitigation_lambda=0.0, logging_sink=lines.append)
    theirs_count = {line.split(":")[0].removeprefix("base_model.model.") + ".weight": int(line.split(":")[-1])
                    for line in lines if "Intruders:" in line}
    # both measure the same matrices, W_res and the adapter's own update, as PEFT holds them
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            key = name.removeprefix("base_model.model.")
            base, delta = module.get_base_layer().weight.detach(), module.get_delta_weight("default").detach()
            assert torch.allclose(exact.adapter_base(key).float(), base, atol=1e-6 * base.abs().max().item()), key
            assert torch.allclose(ours.layers[key + ".weight"].delta, delta, atol=1e-6 * delta.abs().max().item())
    # PiSSA leaves W_res with near-equal top singular values, so the top direction's similarity sits near the
    # threshold and two SVDs of matrices equal to 1e-9 may decide it differently: one direction apart at most
    counts = {k: (ours.layers[k].count, theirs_count.get(k, 0)) for k in keys.values()}
    assert all(abs(a - b) <= 1 for a, b in counts.values()) and ours.layers_with_intruders > 0, counts
    agreed = [k for k, (a, b) in counts.items() if a == b]
    weights = ours.weights(reference, 0.0)
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        key = name.removeprefix("base_model.model.") + ".weight"
        if key not in agreed:
            continue
        theirs = module.get_base_layer().weight.detach() + module.get_delta_weight("intruder_reduced").detach()
        assert torch.allclose(weights[key], theirs, atol=1e-4 * theirs.abs().max().item()), key
    # measured against θ0 instead, the update θ̂ − θ0 has rank up to 2r and other intruders
    naive = IntruderReduction(reference, finetuned, ranks)
    assert any(not torch.allclose(naive.weights(reference, 0.0)[k], weights[k], atol=1e-4) for k in weights)


def test_reduction_edge_cases():
    w = torch.randn(6, 5)
    d = torch.zeros(6, 5)
    quiet = find_intruders(w, d, rank=2)
    assert quiet.count == 0 and torch.equal(reduced_delta(quiet, 0.0), d)  # no intruders: ΔW kept, as in PEFT
    # an update along a direction W's column space lacks (W's last row is zero): an intruder whatever the draw
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    w[-1] = 0
    loud = find_intruders(w, 50 * torch.outer(torch.eye(6)[-1], torch.ones(5)), rank=1, top_k=1)
    assert loud.count == 1
    assert torch.linalg.matrix_rank(reduced_delta(loud, 0.5)) <= 1  # truncated to the adapter's rank
    with pytest.raises(JanusError, match="shape"):
        find_intruders(w, torch.zeros(5, 6), rank=2)
    with pytest.raises(JanusError, match="rank"):
        find_intruders(w, d, rank=0)
    with pytest.raises(JanusError, match=r"\[0, 1\)"):
        parse_candidates("intruder:1")


@pytest.fixture(scope="module")
def lora_setting(tmp_path_factory):
    """θ0 that learned PAST (saved), a LoRA trained on NEW from it (saved), tasks and replay."""
    s = saved_lora_setting(os.fspath(tmp_path_factory.mktemp("frontier-lora")), "all-linear")
    exact = {f"{n}.weight": (m.get_base_layer().weight.detach().clone(),
                             m.get_base_layer().weight.detach() + m.get_delta_weight("default").detach())
             for n, m in s["lora"].base_model.model.named_modules() if hasattr(m, "get_delta_weight")}
    return s["tok"], s["base_dir"], s["adapter_dir"], s["past"], s["new"], s["replay"], exact


def test_frontier_offers_intruder_reduction_on_a_bf16_lora(lora_setting):
    tok, base_dir, adapter_dir, past, new, replay, exact = lora_setting
    config = JanusConfig(tau=0.9, max_steps=3)
    result = frontier(base_dir, adapter_dir, replay, past_tasks=[past], new_tasks=[new], config=config,
                      candidates="wise:0.5 intruder:0.5,0 janus:tau=0.9 janus-to-reference:b=0.5 "
                                 "janus-to-finetuned:b=0.5 intruder-then-janus:0.5", tokenizer=tok,
                      batch_size=2, progress=False, torch_dtype=torch.bfloat16)
    kinds = [p.kind for p in result.points]
    assert kinds.count("intruder") == 2 and kinds.count("intruder-then-janus") == 1
    builder = result._builder
    assert builder.model.dtype == torch.bfloat16 and builder.intruders is not None
    assert result.intruder_layers == {"with_intruders": builder.intruders.layers_with_intruders,
                                      "layers": len(exact)}

    # θ0 and θ̂ of the adapted layers are PEFT's float32 merge, not their bf16 rounding
    for key, (w0, w1) in exact.items():  # θ0 is the bf16 base the model holds; ΔW is the adapter's own
        assert torch.allclose(builder.finetuned[key] - builder.theta0[key], w1 - w0, atol=1e-6)
        assert torch.equal(builder.theta0[key], w0.bfloat16().float())
    rounded = {k: (w1.bfloat16().float() - w0.bfloat16().float()) for k, (w0, w1) in exact.items()}
    worst = max(((rounded[k] - (w1 - w0)).norm() / (w1 - w0).norm()).item() for k, (w0, w1) in exact.items())
    assert worst > 1e-3  # what the old path (a bf16 merge) would have rectified instead

    # an intruder point's weights are θ0 + PEFT's reduced update of each adapted layer; other parameters θ̂
    by = {p.label: p for p in result.points}
    point = by["intruder reduction λ=0"]
    weights = builder.weights(point)
    for key, layer in builder.intruders.layers.items():
        assert torch.allclose(weights[key], builder.theta0[key] + reduced_delta(layer, 0.0))
    for p in result.points:
        if p.kind not in ("anchor", "wise", "intruder"):
            assert p.above_intruder == (None if p.ap1 is None else wise_margin(result.points, p.ap1, p.ap2,
                                                                              INTRUDER_CURVE))
    assert "AP1 vs intruder" in result.to_markdown()

    # the JANUS run was given the exact update: the same rectification with finetuned= gives the same weights
    model = copy.deepcopy(builder.model)
    builder.write(builder.finetuned)
    reference = {**{k: p.detach() for k, p in model.named_parameters()}, **builder.theta0}
    own = {k: p.detach() for k, p in model.named_parameters()}
    rectify(model, reference, replay, config, progress=False, finetuned={**own, **builder.finetuned})
    janus = builder.janus["tau=0.9"]
    assert all(torch.equal(model.get_parameter(k).detach().cpu(), janus[k]) for k in janus)
    # intruder reduction → JANUS starts from the λ=0.5 point
    started = builder.weights(Intruder(0.5))
    assert result.reports["tau=0.9,intruder=0.5"]["num_jacobian_evals"] > 0
    assert any(not torch.equal(started[k], builder.finetuned[k]) for k in builder.intruders.layers)


def test_no_intruder_points_for_full_weights(lora_setting, tmp_path):
    tok, base_dir, adapter_dir, past, new, replay, _ = lora_setting
    from hf_janus.evaluation.harness import load_model

    merged = load_model(adapter_dir)  # full weights: intruder reduction is defined for LoRA adapters only
    common = dict(past_tasks=[past], new_tasks=[new], tokenizer=tok, batch_size=2, progress=False)
    result = frontier(base_dir, merged, replay, candidates="wise:0.5", **common)
    assert [p.kind for p in result.points] == ["anchor", "anchor", "wise"]
    assert "AP1 vs intruder" not in result.to_markdown() and result.intruder_layers is None
    with pytest.raises(JanusError, match="intruder needs a saved LoRA adapter"):  # named: refused before scoring
        frontier(base_dir, merged, replay, candidates="wise:0.5 intruder:0.5",
                 scorer=lambda model: pytest.fail("scored a model before refusing"), **common)


def test_frontier_refuses_a_kind_not_defined_here_before_scoring(lora_setting):
    """DG-Hard is defined for full fine-tuning only: named among an adapter's candidates, it is refused before any
    model is scored (a default peer that cannot run is left out instead: test_candidate_peers.py)."""
    tok, base_dir, adapter_dir, past, new, replay, _ = lora_setting
    common = dict(tokenizer=tok, batch_size=2, progress=False)
    with pytest.raises(JanusError, match="DG-Hard is for full fine-tuning"):
        frontier(base_dir, adapter_dir, replay, past_tasks=[past], new_tasks=[new], candidates="wise:0.5 dg-hard",
                 scorer=lambda model: pytest.fail("scored a model before refusing"), **common)
