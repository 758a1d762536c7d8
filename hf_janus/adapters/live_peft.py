"""The adapted layers of a live ``PeftModel`` during training: which they are, their effective weights, and a
plain view of the model for rectification.

JANUS works on *effective* weights: for an adapted layer that is what PEFT's own merge would produce (base
weight plus the adapter's delta, DoRA's magnitude included). PiSSA-like initializations start from a
residual base with a non-zero adapter, so θ0 is not the base weight: it is the effective weight at train
begin. The engine itself only knows plain linear layers; :func:`plain_view` swaps each tuner layer for its
base layer holding the effective weight for the duration of the rectification, and puts everything back.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional, Union

import torch
from torch import Tensor, nn

from hf_janus.engine.layers import rule_for, select_layers
from hf_janus.errors import JanusError

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
    return {n: linear[n] for n in select_layers(list(linear), target_modules, exclude_modules)}


def active_adapter(module: nn.Module) -> str:
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
