"""Context managers that put a model in a mode for a while and give the caller's mode back, whatever happens."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

# bitsandbytes' 4-bit layers carry this switch; on CPUs with AVX512-BF16 it is on
_REPACKING_SWITCH = "support_avx512bf16_for_cpu"


@contextmanager
def standard_quantized_layout(model: nn.Module) -> Iterator[None]:
    """Keep a model's bitsandbytes 4-bit layers in their standard layout while hf-janus runs the model.

    On CPUs with AVX512-BF16, a ``Linear4bit`` repacks its weight for a faster kernel the first time it runs in
    eval mode on an input that needs no grad, and keeps it repacked. That kernel has no autograd, so every later
    pass, in train mode too, sends no gradient back through the base: after θ0 answered the replay at train begin,
    the Trainer's steps would give no gradient to any adapter whose output feeds a 4-bit layer (q, k and v feed
    o_proj; gate and up feed down_proj), and the engine's backward passes would see no Jacobian. The repacking
    also rounds the block scales to bf16, so the base would no longer be the user's bit for bit. Inside the block
    the repacking is off, and a weight the user's own passes repacked earlier is put back in the standard layout
    (``state_dict()`` does that, as bitsandbytes needs before saving).
    """
    switched = []
    for module in model.modules():
        switch = getattr(module, _REPACKING_SWITCH, False)
        if switch:  # bitsandbytes sets it from its native library's answer, an int
            state = getattr(getattr(module, "weight", None), "quant_state", None)
            if getattr(state, "packing_format_for_cpu", False):
                module.state_dict()
            setattr(module, _REPACKING_SWITCH, False)
            switched.append((module, switch))
    try:
        yield
    finally:
        for module, switch in switched:
            setattr(module, _REPACKING_SWITCH, switch)


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout), so that passes over the replay are deterministic, with quantized layers kept in
    their standard layout (:func:`standard_quantized_layout`); then the mode the caller had (the Trainer's, when
    θ0 answers at train begin)."""
    was_training = model.training
    model.eval()
    try:
        with standard_quantized_layout(model):
            yield
    finally:
        model.train(was_training)


def _checkpoints_with_autograd_grad(layer: nn.Module) -> bool:
    """Whether ``layer`` is a transformers layer the user put under gradient checkpointing in the non-reentrant
    form (the default), the one ``torch.autograd.grad`` can run through; and whether its own forward leaves
    ``self.training`` alone (a layer that applies dropout itself would turn it on)."""
    if getattr(layer, "gradient_checkpointing", False) is not True:
        return False
    function = getattr(layer, "_gradient_checkpointing_func", None)
    if getattr(function, "keywords", {}).get("use_reentrant", True):
        return False
    forward = type(layer).forward
    forward = getattr(forward, "__wrapped__", forward)
    return "training" not in getattr(getattr(forward, "__code__", None), "co_names", ("training",))


@contextmanager
def checkpointed_layers(model: nn.Module) -> Iterator[list[nn.Module]]:
    """Inside :func:`evaluation_mode`, the layers the user trained under gradient checkpointing checkpoint again
    (their activations recomputed in the backward pass instead of kept), so that training passes after train end
    need the memory training needed. transformers checkpoints a layer only in training mode, so each such layer
    alone is put in it: its children (attention, dropout) stay in eval mode and nothing random runs. Layers in the
    reentrant form, or whose own forward reads ``self.training``, are left as they are. Yields the layers switched."""
    layers = [m for m in model.modules() if not m.training and _checkpoints_with_autograd_grad(m)]
    for layer in layers:
        layer.training = True
    try:
        yield layers
    finally:
        for layer in layers:
            layer.training = False
