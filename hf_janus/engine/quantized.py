"""Quantized linear layers: which backends JANUS reads (bitsandbytes 4-bit and 8-bit), how a layer's weight is
dequantized (one layer at a time, never the whole model), and a clear refusal naming any other backend.

JANUS never writes into a quantized layer: requantizing a rectified weight would round the update away. A
quantized layer is only ever the frozen base under an adapter (QLoRA); the rectified update goes into the
adapter, and its base stays bit for bit what it was.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

#: The quantized layer types JANUS reads, by (module, class) name.
SUPPORTED_QUANTIZED = {
    ("bitsandbytes", "Linear4bit"): "bitsandbytes Linear4bit (nf4/fp4, with or without double quantization)",
    ("bitsandbytes", "Linear8bitLt"): "bitsandbytes Linear8bitLt (LLM.int8)",
}

# Attributes the quantized layers of other libraries carry (GPTQ/AWQ/EETQ pack into `qweight`, HQQ into `W_q`,
# AQLM into `codes`), for naming them in a refusal.
_PACKED_ATTRIBUTES = ("qweight", "W_q", "codes")


def layer_key(module: nn.Module) -> tuple[str, str]:
    """``(top-level package, class name)`` of a layer: how quantized layer types are told apart without
    importing their libraries."""
    return type(module).__module__.split(".")[0], type(module).__name__


def quantization_of(module: nn.Module) -> Optional[str]:
    """The quantization backend of ``module`` in words (``None`` for a dense layer).

    Covers the layer types PEFT can adapt: bitsandbytes, HQQ, torchao (a tensor subclass as the weight of an
    ``nn.Linear``), GPTQ, AWQ, EETQ, AQLM, and any layer whose weight is stored as integers.
    """
    key = layer_key(module)
    if key in SUPPORTED_QUANTIZED:
        return SUPPORTED_QUANTIZED[key]
    if key[0] == "bitsandbytes":
        return f"bitsandbytes {key[1]}"
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor):
        weight_module = type(weight).__module__.split(".")[0]
        if weight_module not in ("torch", "builtins"):
            return f"{weight_module} ({type(weight).__name__} weight of a {key[1]})"
        if not (weight.is_floating_point() or weight.is_meta):
            return f"{key[0]} {key[1]} with a {weight.dtype} weight"
    if any(isinstance(getattr(module, a, None), Tensor) for a in _PACKED_ATTRIBUTES):
        return f"{key[0]} {key[1]}"
    return None


def is_supported_quantized(module: nn.Module) -> bool:
    return layer_key(module) in SUPPORTED_QUANTIZED


def unsupported_quantized_error(name: str, module: nn.Module) -> str:
    """The message refusing a quantized layer JANUS cannot dequantize: what it is, what is supported, the fix."""
    return (f"layer {name!r} is quantized with {quantization_of(module)}, which hf-janus cannot dequantize. "
            f"Supported quantized bases: {'; '.join(SUPPORTED_QUANTIZED.values())}. Quantize the base with "
            "bitsandbytes (BitsAndBytesConfig(load_in_4bit=True) or load_in_8bit=True), or train on an unquantized "
            "base")


def dequantized_weight(module: nn.Module) -> Tensor:
    """The dense ``(d_out, d_in)`` weight of one supported quantized layer, in its compute dtype, on its device.

    PEFT's own helper does the work (bitsandbytes' ``dequantize_4bit`` / int8 vector-wise dequantization), so
    the result is what PEFT's merge would start from.
    """
    from peft.utils.integrations import dequantize_module_weight

    # On the CPU PEFT's helper puts a copy of the weight parameter in the layer's place; an 8-bit layer that has run
    # keeps its scales in its state, not in that copy, and would rebuild its state from the copy at its next forward
    # and fail: the layer keeps its own parameter.
    param = module.weight
    try:
        if layer_key(module) == ("bitsandbytes", "Linear4bit") and getattr(param, "quant_state", None) is None:
            # a plain copy of the packed weight (FSDP2 gathers one): bitsandbytes keeps the state on the layer too
            from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

            fix_4bit_weight_quant_state_from_module(module)
        with torch.no_grad():
            weight = dequantize_module_weight(module).detach()
    finally:
        if module.weight is not param:
            module.weight = param
    return weight.to(compute_dtype(module))


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a quantized layer computes in: its ``compute_dtype`` (4-bit), else that of its bias, else
    float32 (8-bit layers compute their int8 matmul in fp16 and hand back the input's dtype)."""
    dtype = getattr(module, "compute_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    bias = getattr(module, "bias", None)
    if isinstance(bias, Tensor) and bias.is_floating_point():
        return bias.dtype
    return torch.float32
