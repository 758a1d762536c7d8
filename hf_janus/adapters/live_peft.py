"""The adapted layers of a live ``PeftModel`` during training: effective weights, a plain view for
rectification, and writing rectified weights back into the adapter or the base weights.

JANUS works on *effective* weights: for an adapted layer that is what PEFT's own merge would produce (base
weight plus the adapter's delta, DoRA's magnitude included). PiSSA-like initializations start from a
residual base with a non-zero adapter, so θ0 is not the base weight: it is the effective weight at train
begin. The engine itself only knows plain linear layers; :func:`plain_view` swaps each tuner layer for its
base layer holding the effective weight for the duration of the rectification, and puts everything back.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from hf_janus.errors import JanusError
from hf_janus.engine.layers import _matches, rule_for
from hf_janus.adapters.refactor import RankSpec, RefactorStats, choose_rank, truncate, validate_rank_spec

logger = logging.getLogger(__name__)


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def inner_model(peft_model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (whose module names are the plain model's names)."""
    return peft_model.get_base_model()


def _tuner_layers(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and hasattr(module, "get_base_layer"):
            if module.get_base_layer() is not module:
                found[name] = module
    return found


def adapted_linear_layers(peft_model: nn.Module, target_modules: Union[str, list[str]] = "all-linear",
                          exclude_modules: Union[str, list[str], None] = None) -> dict[str, nn.Module]:
    """``{name in the plain model: tuner layer}`` of the adapted linear layers, narrowed by the config.

    By default JANUS rectifies exactly the layers the adapter touches; ``target_modules`` and
    ``exclude_modules`` can only narrow that set (a layer without adapter did not change during training).
    """
    tuners = _tuner_layers(inner_model(peft_model))
    linear = {n: m for n, m in tuners.items() if rule_for(m.get_base_layer()) is not None}
    if not linear:
        kinds = sorted({type(m.get_base_layer()).__name__ for m in tuners.values()}) or ["none"]
        raise JanusError(
            f"the PEFT model adapts no linear layer (adapted layer types: {', '.join(kinds)}); JANUS rectifies "
            "linear layers"
        )
    chosen = linear
    if target_modules != "all-linear":
        chosen = {n: m for n, m in chosen.items() if _matches(n, target_modules)}
    if exclude_modules:
        chosen = {n: m for n, m in chosen.items() if not _matches(n, exclude_modules)}
    if not chosen:
        names = list(linear)
        raise JanusError(
            f"none of the adapted layers ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) is selected by "
            f"target_modules={target_modules!r} / exclude_modules={exclude_modules!r}"
        )
    return chosen


def _active_adapter(module: nn.Module) -> str:
    active = module.active_adapters
    if len(active) != 1:
        raise JanusError(
            f"{len(active)} adapters are active ({', '.join(active)}); JANUS rectifies one adapter at a time: "
            "activate a single adapter with model.set_adapter(name)"
        )
    return active[0]


def effective_params(module: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """The weight and bias PEFT's merge would give this tuner layer (stored layout of the base layer).

    Runs PEFT's own ``merge(safe_merge=True)``, which computes into copies, then puts the original tensors
    back, so any adapter kind PEFT can merge is covered and the layer is left exactly as it was.
    """
    base = module.get_base_layer()
    weight = base.weight.data
    bias = base.bias.data if isinstance(getattr(base, "bias", None), Tensor) else None
    merged_before = list(getattr(module, "merged_adapters", []))
    if merged_before:  # already merged: the base layer holds the effective values
        return weight.detach().clone(), None if bias is None else bias.detach().clone()
    try:
        module.merge(safe_merge=True)
        eff_weight = base.weight.data.detach().clone()
        eff_bias = base.bias.data.detach().clone() if bias is not None else None
    except ValueError as err:
        raise JanusError(f"PEFT could not merge the adapter of a {type(base).__name__} layer: {err}") from err
    finally:
        base.weight.data = weight
        if bias is not None:
            base.bias.data = bias
        if hasattr(module, "merged_adapters"):
            module.merged_adapters[:] = merged_before
    return eff_weight, eff_bias


def effective_weights(layers: dict[str, nn.Module]) -> dict[str, Tensor]:
    """``{"<name>.weight": effective weight on the CPU}`` for the given tuner layers."""
    with torch.no_grad():
        return {f"{name}.weight": effective_params(module)[0].to("cpu", copy=True).contiguous()
                for name, module in layers.items()}


def _set_child(root: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, child)


@contextlib.contextmanager
def plain_view(peft_model: nn.Module, weights: dict[str, Tensor]) -> Iterator[nn.Module]:
    """Yield the inner model with every tuner layer replaced by its base layer holding its effective
    weight and bias (``weights["<name>.weight"]`` where given); on exit everything is as before.

    Inside, the model is an ordinary transformers model that computes exactly what the PEFT model
    computes and that :class:`~hf_janus.Rectifier` can work on, with the plain model's module names.
    """
    model = inner_model(peft_model)
    tuners = _tuner_layers(model)
    saved: dict[str, tuple[nn.Module, Tensor, Optional[Tensor]]] = {}
    try:
        with torch.no_grad():
            for name, module in tuners.items():
                base = module.get_base_layer()
                eff_weight, eff_bias = effective_params(module)
                given = weights.get(f"{name}.weight")
                if given is not None:
                    eff_weight = given
                bias = base.bias.data if eff_bias is not None else None
                saved[name] = (module, base.weight.data, bias)
                base.weight.data = eff_weight.to(device=base.weight.device, dtype=base.weight.dtype, copy=True)
                if eff_bias is not None:
                    base.bias.data = eff_bias
                _set_child(model, name, base)
        yield model
    finally:
        for name, (module, weight, bias) in saved.items():
            base = module.get_base_layer()
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            _set_child(model, name, module)


# ---- writing back ----------------------------------------------------------------------------------------
def _lora_kind(module: nn.Module, adapter: str) -> Optional[str]:
    """``"lora"``, ``"dora"``, or None when the layer is not a LoRA layer this module can re-factorize."""
    if not (hasattr(module, "lora_A") and hasattr(module, "lora_B")) or adapter not in module.lora_A:
        return None
    variants = getattr(module, "lora_variant", {}) or {}
    if adapter not in variants:
        return "dora" if getattr(module, "use_dora", {}).get(adapter, False) else "lora"
    name = type(variants[adapter]).__name__
    return "dora" if name.startswith("Dora") else None


def check_adapter_writable(layers: dict[str, nn.Module]) -> None:
    """Refuse, before training, adapters whose rectified update cannot be written back as LoRA factors."""
    bad = []
    for name, module in layers.items():
        adapter = _active_adapter(module)
        if _lora_kind(module, adapter) is None:
            variant = (getattr(module, "lora_variant", {}) or {}).get(adapter)
            bad.append(f"{name} ({type(variant).__name__ if variant is not None else type(module).__name__})")
    if bad:
        raise JanusError(
            f"peft_output='adapter' re-factorizes the rectified update into LoRA factors, which these adapted "
            f"layers do not have: {', '.join(bad[:3])}. Use JanusCallback(..., peft_output='merged') to get full "
            "rectified weights instead"
        )


def _scaling(module: nn.Module, adapter: str) -> float:
    return float(module.scaling[adapter])


def _resize_lora(module: nn.Module, adapter: str, k: int) -> None:
    """Give the layer's LoRA factors rank ``k``, keeping ``lora_alpha`` (PEFT recomputes the scaling)."""
    a_old, b_old = module.lora_A[adapter], module.lora_B[adapter]
    dtype, device = a_old.weight.dtype, a_old.weight.device
    module.lora_A[adapter] = nn.Linear(a_old.in_features, k, bias=False).to(device=device, dtype=dtype)
    new_b = nn.Linear(k, b_old.out_features, bias=b_old.bias is not None).to(device=device, dtype=dtype)
    if b_old.bias is not None:
        new_b.bias.data.copy_(b_old.bias.data)
    module.lora_B[adapter] = new_b
    alpha = module.lora_alpha[adapter]
    module.r[adapter] = k
    rslora = getattr(module, "use_rslora", {})
    module.scaling[adapter] = alpha / (k**0.5) if (isinstance(rslora, dict) and rslora.get(adapter)) else alpha / k
    module.lora_A[adapter].weight.requires_grad_(a_old.weight.requires_grad)
    module.lora_B[adapter].weight.requires_grad_(b_old.weight.requires_grad)


@dataclass
class WrittenLayer:
    """What writing one rectified layer back into its LoRA adapter kept."""

    stats: RefactorStats
    rank_changed: bool


def write_lora(module: nn.Module, name: str, target: Tensor, offset: Tensor, delta_rect: Tensor, rank: RankSpec,
               energy: float = 0.99, jacobian: Any = None, reference_norm: Optional[float] = None) -> WrittenLayer:
    """Re-factorize one rectified layer into its LoRA adapter so the effective weight becomes ``target``.

    ``target``, ``offset`` and ``delta_rect`` are ``(d_out, d_in)`` float matrices: the rectified effective
    weight, ``θ0 − W_base`` (zero for LoRA, ``s·B0A0`` for PiSSA-like inits) and ``ΔW_rect``. The adapter
    must hold ``D = offset + ΔW_rect = target − W_base``; it gets the best rank-k approximation of ``D``
    (truncated SVD), split evenly between ``B`` and ``A``. For DoRA the magnitude is then set to the row
    norms of ``W_base + D_k`` so that the effective weight is exactly ``W_base + D_k``.
    """
    adapter = _active_adapter(module)
    kind = _lora_kind(module, adapter)
    base = module.get_base_layer()
    rule = rule_for(base)
    w_base = rule.to_matrix(base.weight.detach()).to(torch.float64)
    d = (target.to(torch.float64) - w_base).to(torch.float64)
    offset64 = offset.to(device=d.device, dtype=torch.float64)
    delta64 = delta_rect.to(device=d.device, dtype=torch.float64)
    u_s, vh, s = truncate(d, min(d.shape))
    k = choose_rank(s, rank, energy, same_rank=int(module.r[adapter]), name=name)
    k = max(k, 1)  # a zero-rank LoRA layer cannot be stored; a rank-1 zero update is exact
    d_k = u_s[:, :k] @ vh[:k]
    kept_delta = d_k - offset64  # the ΔW the saved adapter actually applies
    delta_norm = float(delta64.norm())
    err = float((kept_delta - delta64).norm()) / delta_norm if delta_norm > 0 else 0.0
    stats = RefactorStats(name=name, shape=list(d.shape), rank=k, kept_energy=max(0.0, 1.0 - err**2),
                          approx_error=err, approx_error_truncated=err)
    if jacobian is not None and reference_norm:
        jac_delta = delta64.to(jacobian.x.device)
        jac_kept = kept_delta.to(jacobian.x.device)
        stats.residual_rect = float(jacobian.jvp(jac_delta).norm()) / reference_norm
        stats.residual_truncated = float(jacobian.jvp(jac_kept).norm()) / reference_norm
        stats.leak_truncated = float(jacobian.jvp(jac_kept - jac_delta).norm()) / reference_norm

    rank_changed = k != int(module.r[adapter])
    with torch.no_grad():
        if rank_changed:
            _resize_lora(module, adapter, k)
        scale = _scaling(module, adapter)
        # B·A·s = D_k with the singular values split evenly, as PEFT's PiSSA init does.
        sv = s[:k].clamp_min(0.0).sqrt()
        u = u_s[:, :k] / s[:k].clamp_min(torch.finfo(torch.float64).tiny)
        b = (u * sv) / scale**0.5
        a = (sv[:, None] * vh[:k]) / scale**0.5
        a_mod, b_mod = module.lora_A[adapter], module.lora_B[adapter]
        a_mod.weight.copy_(a.to(a_mod.weight.dtype))
        b_mod.weight.copy_(b.to(b_mod.weight.dtype))
        if kind == "dora":
            magnitude = module.lora_magnitude_vector[adapter].weight
            new_weight = w_base + d_k  # (d_out, d_in): DoRA's norm is per output row
            magnitude.copy_(new_weight.norm(dim=1).to(magnitude.dtype).reshape(magnitude.shape))
    return WrittenLayer(stats=stats, rank_changed=rank_changed)


def record_rank_pattern(peft_model: nn.Module, adapter: str, ranks: dict[str, int]) -> None:
    """Note changed layer ranks in the adapter config so ``save_pretrained``/``from_pretrained`` agree."""
    config = peft_model.peft_config[adapter]
    pattern = dict(getattr(config, "rank_pattern", None) or {})
    alpha = dict(getattr(config, "alpha_pattern", None) or {})
    for name, k in ranks.items():
        key = re.escape(name)  # PEFT matches keys as r"(.*\.)?(key)$" against module names
        pattern[key] = int(k)
        module = inner_model(peft_model).get_submodule(name)
        alpha[key] = module.lora_alpha[adapter]
    config.rank_pattern = pattern
    config.alpha_pattern = alpha


def set_base_weight(module: nn.Module, matrix: Tensor) -> None:
    """Write ``matrix`` (``(d_out, d_in)``) into the base layer of a tuner layer (for merged output)."""
    base = module.get_base_layer()
    rule_for(base).set_weight(base, matrix)


def validate_peft_output(peft_output: str, adapter_rank: Any) -> None:
    if peft_output not in ("adapter", "merged"):
        raise ValueError(f"peft_output={peft_output!r} is invalid: expected 'adapter' or 'merged'")
    if adapter_rank != "same":
        validate_rank_spec(adapter_rank)
