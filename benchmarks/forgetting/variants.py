"""Post-hoc variants applied to one fine-tuned θ̂: JANUS with other settings, the average-gradient ablation,
WiSE-FT, spectral truncation, PEFT's intruder-dimension reduction, and the reset-linear diagnostic.

Every function returns a new plain model and leaves its inputs untouched. WiSE-FT, intruder reduction and the margin
over the WiSE-FT curve are the frontier's own (:mod:`hf_janus.evaluation`), so that the benchmark's comparison with
them is the one ``hf_janus.frontier`` makes; the variants the frontier does not offer (the average-gradient
ablation, spectral truncation, the reset) are built here.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.forgetting.lib import collate
from hf_janus.evaluation.candidates import FINETUNED, REFERENCE
from hf_janus.evaluation.candidates.base import interpolate
from hf_janus.evaluation.candidates.wise import Wise
from hf_janus.evaluation.frontier_result import FrontierPoint, wise_margin
from hf_janus.evaluation.intruder_reduction import IntruderReduction


def _targets(model: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    return {n: model.get_submodule(n) for n in names}


def rectify_copy(finetuned: nn.Module, theta0: dict[str, torch.Tensor], replay: list[dict], config) -> tuple:
    """``hf_janus.rectify`` on a copy of θ̂ (the same engine the callback runs)."""
    from hf_janus import rectify

    model = copy.deepcopy(finetuned)
    report = rectify(model, theta0, replay, config, progress=False)
    return model, report


def reset_linear(finetuned: nn.Module, theta0: dict[str, torch.Tensor], names: list[str]) -> nn.Module:
    """θ̂ with every rectified layer put back to θ0 (embeddings, norms, lm_head keep their fine-tuned values):
    the most knowledge that editing these layers alone can give back."""
    model = copy.deepcopy(finetuned)
    with torch.no_grad():
        for n, m in _targets(model, names).items():
            m.weight.copy_(theta0[n + ".weight"])
    return model


def wise_ft(theta0_model: nn.Module, finetuned: nn.Module, a: float) -> nn.Module:
    """WiSE-FT: every floating-point parameter and buffer θ0 + a (θ̂ − θ0), by the interpolation the frontier's
    WiSE-FT candidates are built with."""
    model = copy.deepcopy(finetuned)
    ref = theta0_model.state_dict()
    state = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    values = interpolate({k: ref[k] for k in state}, state, a)
    with torch.no_grad():
        for k, v in state.items():
            v.copy_(values[k])
    return model


def spectral_truncate(finetuned: nn.Module, theta0: dict[str, torch.Tensor], names: list[str], rank: int) -> nn.Module:
    """Data-free repair: keep only the top-``rank`` singular directions of each layer's ΔW = Ŵ − W0."""
    model = copy.deepcopy(finetuned)
    with torch.no_grad():
        for n, m in _targets(model, names).items():
            w0 = theta0[n + ".weight"].double()
            u, s, vh = torch.linalg.svd(m.weight.double() - w0, full_matrices=False)
            k = min(rank, s.numel())
            m.weight.copy_((w0 + (u[:, :k] * s[:k]) @ vh[:k]).to(m.weight.dtype))
    return model


def avg_grad_project(finetuned: nn.Module, theta0: dict[str, torch.Tensor], names: list[str], replay: list[dict],
                     pad_id: int, batch_size: int = 64) -> tuple[nn.Module, dict]:
    """The paper's "average gradient" ablation (App., Tab. "Ablation on the use of Jacobian matrices"):
    project each layer's ΔW onto the null space of the single averaged replay gradient ḡ = (1/m) Σ_i g_i
    (one row instead of the m-row Jacobian J), computed at θ0 like the JANUS Jacobian:
    ΔW_proj = ΔW − ḡ ⟨ḡ, ΔW⟩ / ⟨ḡ, ḡ⟩. Single step (compare with single-step JANUS, τ = 0).

    Per-sample losses are summed over tokens, as in the engine; the gradient of their sum over the replay
    is m·ḡ (the scale does not matter for the projection). Only the target layers sit at θ0 during the
    backward, exactly as in ``hf_janus.rectify``'s capture at the reference point.
    """
    model = copy.deepcopy(finetuned)
    mods = _targets(model, names)
    with torch.no_grad():
        for n, m in mods.items():
            m.weight.copy_(theta0[n + ".weight"])
    for p in model.parameters():
        p.requires_grad_(False)
    for m in mods.values():
        m.weight.requires_grad_(True)
        m.weight.grad = None
    model.eval()
    for i in range(0, len(replay), batch_size):
        batch = collate(replay[i:i + batch_size], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               batch["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
        loss.backward()
    ref_finetuned = dict(finetuned.named_modules())
    removed = []
    with torch.no_grad():
        for n, m in mods.items():
            g = m.weight.grad.double()
            w0 = theta0[n + ".weight"].double()
            delta = ref_finetuned[n].weight.double() - w0
            coef = (g * delta).sum() / (g * g).sum().clamp_min(1e-300)
            proj = delta - coef * g
            removed.append(float((coef * g).norm() / delta.norm().clamp_min(1e-300)))
            m.weight.grad = None
            m.weight.requires_grad_(False)
            m.weight.copy_((w0 + proj).to(m.weight.dtype))
    for p in model.parameters():
        p.requires_grad_(False)
    return model, {"removed_fraction_max": max(removed), "removed_fraction_mean": sum(removed) / len(removed)}


def intruder_reduction(finetuned: nn.Module, theta0: dict[str, torch.Tensor], names: list[str],
                       rank: int) -> IntruderReduction:
    """PEFT's intruder-dimension reduction (``top_k=10``, ``threshold_epsilon=0.5``) of a LoRA fine-tune as the
    frontier computes it: the detection on each adapted layer of θ̂ (merged) against its θ0, once for every λ.
    ``rank``: the adapter's rank, to which each reduced update is truncated."""
    params = dict(finetuned.named_parameters())
    merged = {n + ".weight": params[n + ".weight"].detach() for n in names}
    return IntruderReduction({k: theta0[k] for k in merged}, merged, {k: rank for k in merged})


def intruder_reduced(finetuned: nn.Module, theta0: dict[str, torch.Tensor], reduction: IntruderReduction,
                     mitigation_lambda: float) -> nn.Module:
    """θ̂ with the intruder dimensions of every adapted layer scaled by ``mitigation_lambda`` (the other parameters
    keep θ̂, as in PEFT)."""
    model = copy.deepcopy(finetuned)
    with torch.no_grad():
        for k, v in reduction.weights(theta0, mitigation_lambda).items():
            model.get_parameter(k).copy_(v)
    return model


def update_change(model: nn.Module, finetuned: nn.Module, theta0: dict[str, torch.Tensor],
                  names: list[str]) -> tuple[float, float]:
    """How a variant treats the fine-tuning update ΔW = Ŵ − W0 in the rectified layers, over all of them:
    (kept, changed) = (||W − W0||_F, ||W − Ŵ||_F) / ||ΔW||_F. θ̂ itself is (1, 0), WiSE-FT (a, 1 − a), the reset
    (0, 1); an orthogonal projection that removes a component P of ΔW has kept² + changed² = 1."""
    kept = changed = total = 0.0
    mods, ref = dict(model.named_modules()), dict(finetuned.named_modules())
    with torch.no_grad():
        for n in names:
            w0, w_hat, w = theta0[n + ".weight"].double(), ref[n].weight.double(), mods[n].weight.double()
            kept += float((w - w0).pow(2).sum())
            changed += float((w - w_hat).pow(2).sum())
            total += float((w_hat - w0).pow(2).sum())
    if total == 0:
        return 0.0, 0.0
    return (kept / total) ** 0.5, (changed / total) ** 0.5


def merged_copy(peft_model: nn.Module) -> nn.Module:
    """A plain model holding the effective weights of a PEFT model (PEFT's own merge), the PEFT model untouched."""
    return copy.deepcopy(peft_model).merge_and_unload()


def above_wise(point: tuple[float, float], reference: tuple[float, float], finetuned: tuple[float, float],
               wise: Sequence[tuple[float, float, float]]) -> Optional[float]:
    """How far (AP1 points) ``point`` = (AP2, AP1) lies above the WiSE-FT curve at the same AP2, as the frontier
    measures it (:func:`hf_janus.evaluation.frontier_result.wise_margin`): the curve runs through θ0 and θ̂ (each an
    (AP2, AP1) pair) and the WiSE-FT points ``(a, AP2, AP1)``; ``None`` when AP2 is outside its range."""
    points = [FrontierPoint(REFERENCE, {}, ap1=reference[1], ap2=reference[0]),
              FrontierPoint(FINETUNED, {}, ap1=finetuned[1], ap2=finetuned[0])]
    points += [FrontierPoint(Wise(a), {}, ap1=ap1, ap2=ap2) for a, ap2, ap1 in wise]
    return wise_margin(points, point[1], point[0])
