"""Writing a rectified update back into a live LoRA/DoRA adapter: truncated SVD into its factors, ranks
recorded in its config, and a snapshot of its state to put back after a failure."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from hf_janus.adapters.low_rank import RankSpec, RefactorStats, choose_rank, truncate, validate_rank_spec
from hf_janus.adapters.peft_layers import active_adapter, inner_model
from hf_janus.engine.layers import rule_for
from hf_janus.errors import JanusError
from hf_janus.parallel.sharding import gathered


def lora_kind(module: nn.Module, adapter: str) -> Optional[str]:
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
        adapter = active_adapter(module)
        if lora_kind(module, adapter) is None:
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
    """Give the layer's LoRA factors rank ``k``, keeping ``lora_alpha`` (PEFT recomputes the scaling) and what a
    ``lora_bias`` adds to the output (``scaling · lora_B.bias``: the bias is rescaled with the scaling)."""
    a_old, b_old = module.lora_A[adapter], module.lora_B[adapter]
    dtype, device = a_old.weight.dtype, a_old.weight.device
    old_scaling = _scaling(module, adapter)
    alpha = module.lora_alpha[adapter]
    rslora = getattr(module, "use_rslora", {})
    new_scaling = alpha / (k**0.5) if (isinstance(rslora, dict) and rslora.get(adapter)) else alpha / k
    module.lora_A[adapter] = nn.Linear(a_old.in_features, k, bias=False).to(device=device, dtype=dtype)
    new_b = nn.Linear(k, b_old.out_features, bias=b_old.bias is not None).to(device=device, dtype=dtype)
    if b_old.bias is not None:
        new_b.bias.data.copy_((b_old.bias.data.double() * (old_scaling / new_scaling)).to(new_b.bias.dtype))
        new_b.bias.requires_grad_(b_old.bias.requires_grad)
    module.lora_B[adapter] = new_b
    module.r[adapter] = k
    module.scaling[adapter] = new_scaling
    module.lora_A[adapter].weight.requires_grad_(a_old.weight.requires_grad)
    module.lora_B[adapter].weight.requires_grad_(b_old.weight.requires_grad)


@dataclass
class WrittenLayer:
    """What writing one rectified layer back into its LoRA adapter kept."""

    stats: RefactorStats
    rank_changed: bool


def write_lora(module: nn.Module, name: str, target: Tensor, reference: Tensor, delta_rect: Tensor, rank: RankSpec,
               energy: float = 0.99, jacobian: Any = None, jvp0_norm: Optional[float] = None,
               adapter: Optional[str] = None) -> WrittenLayer:
    """Re-factorize one rectified layer into its LoRA adapter (``adapter``; default the active one) so the effective
    weight becomes ``target``.

    ``target``, ``reference`` and ``delta_rect`` are ``(d_out, d_in)`` float matrices: the rectified effective
    weight, θ0 and ``ΔW_rect``; ``offset = θ0 − W_base`` is zero for LoRA, ``s·B0A0`` for PiSSA-like inits. The
    base weight ``W_base`` is read here, dequantized for a quantized base (once per layer). The adapter
    must hold ``D = offset + ΔW_rect = target − W_base``; it gets the best rank-k approximation of ``D``
    (truncated SVD), split evenly between ``B`` and ``A``. For DoRA the magnitude is then set to the row
    norms of ``W_base + D_k`` so that the effective weight is exactly ``W_base + D_k``.
    """
    # under FSDP2 the layer's parameters are whole inside, and the factors written go into their shards on exit
    # (the rank stays: a change is refused before training)
    with gathered(module, write_back=True):
        return _write_lora(module, name, target, reference, delta_rect, rank, energy, jacobian, jvp0_norm, adapter)


def _write_lora(module: nn.Module, name: str, target: Tensor, reference: Tensor, delta_rect: Tensor,
                rank: RankSpec, energy: float, jacobian: Any, jvp0_norm: Optional[float],
                adapter: Optional[str]) -> WrittenLayer:
    adapter = adapter if adapter is not None else active_adapter(module)
    kind = lora_kind(module, adapter)
    base = module.get_base_layer()
    w_base = rule_for(base).weight(base).to(device=target.device, dtype=torch.float64)
    d = target.to(torch.float64) - w_base
    offset64 = reference.to(device=d.device, dtype=torch.float64) - w_base
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
    if jacobian is not None and jvp0_norm:
        jac_delta = delta64.to(jacobian.x.device)
        jac_kept = kept_delta.to(jacobian.x.device)
        stats.residual_rect = float(jacobian.jvp(jac_delta).norm()) / jvp0_norm
        stats.residual_truncated = float(jacobian.jvp(jac_kept).norm()) / jvp0_norm
        stats.leak_truncated = float(jacobian.jvp(jac_kept - jac_delta).norm()) / jvp0_norm

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


@dataclass
class LayerTarget:
    """One layer's write: the effective weight it should get, θ0 and the update between them (``(d_out, d_in)``
    float matrices), and optionally the Jacobian factors to measure what truncation leaks (see :func:`write_lora`)."""

    name: str
    target: Tensor
    reference: Tensor
    delta: Tensor
    jacobian: Any = None
    jvp0_norm: Optional[float] = None


def rectified_targets(result: Any) -> Iterator[LayerTarget]:
    """One :class:`LayerTarget` per layer of a :class:`~hf_janus.engine.result.RectificationResult` (built as it is
    written, one at a time): its rectified weight, θ0, the rectified update and the Jacobian kept at θ0."""
    for name, layer in result.layers.items():
        yield LayerTarget(name, layer.rectified.detach().float(), layer.reference, layer.rect_delta(),
                          layer.jacobian, layer.jvp0_norm())


def write_adapter_layers(peft_model: nn.Module, layers: dict[str, nn.Module], targets: Iterable[LayerTarget],
                         adapter: str, rank: RankSpec, energy: float) -> list[WrittenLayer]:
    """Write each of ``targets`` (taken one at a time) into ``adapter`` of its layer in ``layers`` and record the
    changed ranks in the adapter's config. All or nothing: on any exception (Ctrl-C included) every written layer
    and the config's patterns are put back."""
    config = peft_model.peft_config[adapter]
    patterns = (getattr(config, "rank_pattern", None), getattr(config, "alpha_pattern", None))
    written, originals = [], []
    try:
        for t in targets:
            module = layers[t.name]
            originals.append(LoraState.capture(module, adapter))
            written.append(write_lora(module, t.name, t.target, t.reference, t.delta, rank, energy,
                                      jacobian=t.jacobian, jvp0_norm=t.jvp0_norm, adapter=adapter))
        changed = {w.stats.name: w.stats.rank for w in written if w.rank_changed}
        if changed:
            record_rank_pattern(peft_model, adapter, changed)
        return written
    except BaseException:
        for state in originals:
            state.restore()
        config.rank_pattern, config.alpha_pattern = patterns
        raise


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


def set_base_params(module: nn.Module, matrix: Tensor, bias: Optional[Tensor] = None) -> None:
    """Give the base layer of a tuner layer the weight ``matrix`` (``(d_out, d_in)``) and, when given, the bias
    ``bias`` (for merged output), as new tensors: what :class:`BaseLayerState` captured stays intact."""
    base = module.get_base_layer()
    rule = rule_for(base)
    if rule.quantized:  # refused at train begin (check_live_peft); requantizing would round the update away
        raise JanusError(f"cannot write a merged weight into a quantized {type(base).__name__} layer")
    weight = base.weight
    weight.data = rule.from_matrix(matrix).to(device=weight.device, dtype=weight.dtype, copy=True)
    if bias is not None:
        base.bias.data = bias.to(device=base.bias.device, dtype=base.bias.dtype, copy=True)


@dataclass
class BaseLayerState:
    """The base layer's tensors and merge state of a tuner layer, kept (by reference: writers give the layer new
    tensors) to put back exactly when a merged write is interrupted."""

    module: nn.Module
    weight: Tensor
    bias: Optional[Tensor]
    merged: list[str]

    @classmethod
    def capture(cls, module: nn.Module) -> "BaseLayerState":
        base = module.get_base_layer()
        bias = base.bias.data if isinstance(getattr(base, "bias", None), Tensor) else None
        return cls(module=module, weight=base.weight.data, bias=bias,
                   merged=list(getattr(module, "merged_adapters", [])))

    def offload(self) -> None:
        """Keep the captured tensors on the host once the layer holds its new ones: on an accelerator the merged write
        then needs one more layer's room, not a second copy of every adapted layer."""
        self.weight = self.weight.to("cpu")
        if self.bias is not None:
            self.bias = self.bias.to("cpu")

    def restore(self) -> None:
        base = self.module.get_base_layer()
        base.weight.data = self.weight.to(base.weight.device)
        if self.bias is not None:
            base.bias.data = self.bias.to(base.bias.device)
        if hasattr(self.module, "merged_adapters"):
            self.module.merged_adapters[:] = self.merged


def validate_peft_output(peft_output: str, adapter_rank: Any) -> None:
    if peft_output not in ("adapter", "merged"):
        raise ValueError(f"peft_output={peft_output!r} is invalid: expected 'adapter' or 'merged'")
    if adapter_rank != "same":
        validate_rank_spec(adapter_rank)


@dataclass
class LoraState:
    """What :func:`write_lora` may change in one layer, kept to put it back exactly after a failure."""

    module: nn.Module
    adapter: str
    lora_a: nn.Module
    lora_b: nn.Module
    r: int
    scaling: Any
    a_weight: Tensor
    b_weight: Tensor
    magnitude: Optional[Tensor] = None

    @classmethod
    def capture(cls, module: nn.Module, adapter: Optional[str] = None) -> "LoraState":
        adapter = adapter if adapter is not None else active_adapter(module)
        magnitude = getattr(module, "lora_magnitude_vector", {})
        return cls(module=module, adapter=adapter, lora_a=module.lora_A[adapter], lora_b=module.lora_B[adapter],
                   r=module.r[adapter], scaling=module.scaling[adapter],
                   a_weight=module.lora_A[adapter].weight.detach().clone(),
                   b_weight=module.lora_B[adapter].weight.detach().clone(),
                   magnitude=magnitude[adapter].weight.detach().clone() if adapter in magnitude else None)

    def restore(self) -> None:
        module, adapter = self.module, self.adapter
        with torch.no_grad():
            module.lora_A[adapter], module.lora_B[adapter] = self.lora_a, self.lora_b
            module.r[adapter], module.scaling[adapter] = self.r, self.scaling
            self.lora_a.weight.copy_(self.a_weight)
            self.lora_b.weight.copy_(self.b_weight)
            if self.magnitude is not None:
                module.lora_magnitude_vector[adapter].weight.copy_(self.magnitude)
