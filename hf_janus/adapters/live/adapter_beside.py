"""A repaired update kept as a new adapter beside the trained one, the way PEFT's ``reduce_intruder_dimension`` keeps
its result: the trained adapter stays as it was, the new one is active, the user compares the two with
``set_adapter`` without reloading anything, and ``save_pretrained`` writes both."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator, Mapping

from torch import Tensor, nn

from hf_janus.adapters.live.lora_write import LayerTarget, check_adapter_writable, write_adapter_layers
from hf_janus.adapters.low_rank import RankSpec
from hf_janus.adapters.peft_layers import active_adapter, adapted_linear_layers, is_mutating_init
from hf_janus.engine.layers import rule_for
from hf_janus.errors import JanusError


def check_new_adapter_name(peft_model: nn.Module, trained: str, new: str) -> None:
    """Refuse, before any work, a new adapter name the model cannot take beside ``trained``."""
    if not isinstance(new, str) or not new or "." in new:
        raise JanusError(f"new_adapter_name={new!r} is not a valid adapter name: give a non-empty name without '.'")
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not hasattr(peft_model, "add_adapter"):
        raise JanusError(f"new_adapter_name={new!r} adds an adapter to a PeftModel, but the model is a "
                         f"{type(peft_model).__name__}; wrap it with peft.get_peft_model or PeftModel.from_pretrained")
    if new in configs:
        raise JanusError(f"the model already has an adapter named {new!r}; choose another new_adapter_name, or "
                         f"delete it first with model.delete_adapter({new!r})")
    init = getattr(configs[trained], "init_lora_weights", True)
    if is_mutating_init(init):
        raise JanusError(
            f"the adapter {trained!r} was initialized with init_lora_weights={init!r}, which rewrites the base "
            "weights into a residual only that adapter is saved against: a second adapter cannot share that base. "
            "Leave new_adapter_name unset (the trained adapter is rewritten), or use peft_output='merged'"
        )


@contextmanager
def new_adapter_beside(peft_model: nn.Module, trained: str, new: str) -> Iterator[None]:
    """Add ``new`` to ``peft_model`` as an exact copy of ``trained`` (its config and every tensor, through PEFT's
    own state-dict helpers), let the body rewrite it, then make it the active adapter. On any exception (Ctrl-C
    included) ``new`` is deleted and ``trained`` stays active: the model is as it was."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    check_new_adapter_name(peft_model, trained, new)  # so ``new`` in the configs below is the one added here
    try:
        # a deep copy: the rank and alpha patterns the write records must not reach the trained adapter's config
        peft_model.add_adapter(new, copy.deepcopy(peft_model.peft_config[trained]))
        state = get_peft_model_state_dict(peft_model, adapter_name=trained)
        set_peft_model_state_dict(peft_model, state, adapter_name=new)
        yield
        peft_model.set_adapter(new)
    except BaseException:
        if new in peft_model.peft_config:
            peft_model.delete_adapter(new)
        peft_model.set_adapter(trained)
        raise


def add_adapter_beside(peft_model: nn.Module, weights: Mapping[str, Tensor], reference: Mapping[str, Tensor],
                       new_adapter_name: str, *, rank: RankSpec = "same", energy: float = 0.99) -> dict:
    """Write ``weights`` (``"<layer>.weight"`` of the plain model: the effective weight each adapted linear layer
    should get) into a new adapter beside the active one, re-factorized at ``rank`` as the adapter output of
    :class:`~hf_janus.JanusCallback` is; ``reference`` holds θ0 of the same layers. Layers ``weights`` does not
    name keep the trained adapter's factors. Returns what was written (per layer: rank, kept energy)."""
    layers = adapted_linear_layers(peft_model)
    trained = active_adapter(peft_model)
    unknown = sorted(k for k in weights if k.removesuffix(".weight") not in layers)
    if unknown:
        raise JanusError(f"{unknown[0]!r} (and {len(unknown) - 1} more) is not the weight of a linear layer the "
                         "adapter adapts: a new adapter can only hold updates of the adapted layers")
    check_adapter_writable(layers)
    targets = (LayerTarget(key.removesuffix(".weight"), w.float(), reference[key].float(),
                           w.float() - reference[key].float()) for key, w in weights.items())
    with new_adapter_beside(peft_model, trained, new_adapter_name):
        written = write_adapter_layers(peft_model, layers, targets, new_adapter_name, rank, energy)
    return {"format": "adapter", "adapter_name": new_adapter_name, "trained_adapter": trained,
            "adapter_rank": rank, "adapter_energy": energy, "layers": [w.stats.to_dict() for w in written]}


def as_layer_matrices(layers: Mapping[str, nn.Module], params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The entries of ``params`` (``"<layer>.weight"`` of the plain model, in its stored layout: a GPT-2 ``Conv1D``
    stores ``(d_in, d_out)``) that belong to the adapted linear layers ``layers`` (from ``adapted_linear_layers``),
    as ``(d_out, d_in)`` float32 matrices, the layout :func:`add_adapter_beside` and ``effective_weights`` use."""
    out = {}
    for key, value in params.items():
        module = layers.get(key.removesuffix(".weight"))
        if module is None or not key.endswith(".weight"):
            continue
        rule = rule_for(module.get_base_layer())
        # a quantized base stores its weight packed; the plain weight given here is an nn.Linear's (d_out, d_in)
        out[key] = (value if rule.quantized else rule.to_matrix(value)).float()
    return out
