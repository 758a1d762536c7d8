"""The merger's repair after JANUS in a saved LoRA adapter's own factors, as :class:`~hf_janus.JanusCallback` trains
a live one: the adapter is loaded by PEFT onto θ0, the JANUS point is written into it at its own rank, and the
distillation trains its ``lora_A`` and ``lora_B`` (:class:`~hf_janus.adapters.live.adapter_repair.AdapterSpace`).

Training the effective model's dense weights instead, and re-factorizing after, gave back far less of the repair on
a real model: the dense update the distillation finds is not of the adapter's rank, and the truncation drops what
the repair added. The dense repair stays for the adapters that have no such factors (DoRA, LoHa, LoKr, IA3, ...)
and for those whose θ0 is not the adapter at zero (unconverted PiSSA-like initializations).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from hf_janus.adapters.live.adapter_repair import AdapterSpace, trained_factors
from hf_janus.adapters.live.lora_write import LoraState, rectified_targets, write_adapter_layers
from hf_janus.adapters.saved.effective import EffectiveModel, load_peft_adapter
from hf_janus.engine.layers import rule_for
from hf_janus.engine.rectifier import Rectifier
from hf_janus.engine.report import RepairReport
from hf_janus.engine.result import RectificationResult

logger = logging.getLogger(__name__)

_ADAPTER = "default"


def factor_repair_blocker(effective: EffectiveModel) -> Optional[str]:
    """Why the repair cannot train the saved adapter's own factors (None when it can): it then trains the adapted
    layers' dense weights, and the record says why."""
    kind = effective.adapter.kind
    if kind != "lora":
        return f"a {kind} adapter has no plain lora_A/lora_B factors to train"
    if effective.adapter_factors:
        return "the adapter's initialization moved part of the base into it, so θ0 is not the adapter at zero"
    if effective.lora_biases:
        return "the adapter has a bias (lora_bias=True)"
    if effective.changes_bias:
        return "the adapter also trains the base layers' biases (bias != 'none')"
    other = [name for name, layer in effective.layers.items() if layer.layer_type == "other"]
    if other:
        return f"the adapter also changes {other[0]}, a layer LoRA factors do not hold"
    return None


def factor_numel(effective: EffectiveModel, targets: list[str]) -> int:
    """The elements the factor repair of ``targets`` trains (their lora_A and lora_B), for the memory plan."""
    return sum(int(effective.layers[name].rank or 0) * sum(effective.layers[name].shape or [0])
               for name in targets)


@dataclass
class FactorRepair:
    """What :func:`repair_in_factors` did: the repair's report and each target layer's update at the point it
    chose, ``(d_out, d_in)`` float32 on the CPU."""

    report: RepairReport
    deltas: dict[str, Tensor]


def repair_in_factors(effective: EffectiveModel, rectifier: Rectifier, result: RectificationResult) -> FactorRepair:
    """Run ``rectifier``'s repair (it ran with ``defer_repair``) in the adapter's factors of ``result``'s layers.

    The effective model ends with each target layer at θ0 + the update chosen, every other adapted layer as it
    was, and no PEFT wrapper; on a failure it is put back as the rectifier left it."""
    model = effective.model
    adapted = [name for name, layer in effective.layers.items() if layer.layer_type in ("linear", "embedding")]
    held = {name: model.get_submodule(name).weight.data for name in adapted}
    peft_model = None
    try:
        with torch.no_grad():  # PEFT's adapter sits on θ0: put it under every layer the adapter changes
            for name in adapted:
                weight = model.get_submodule(name).weight
                weight.data = effective.reference[name + ".weight"].to(weight.device, weight.dtype)
        peft_model = load_peft_adapter(model, effective.adapter, effective.base_model)
        inner = peft_model.get_base_model()
        layers = {name: inner.get_submodule(name) for name in result.layers}
        trained = [LoraState.capture(module, _ADAPTER) for module in layers.values()]
        # at the adapter's own rank: the layout the repair trains and the output keeps ("same")
        write_adapter_layers(peft_model, layers, rectified_targets(result), _ADAPTER, "same", 1.0)
        report = rectifier.repair(AdapterSpace(peft_model, layers, _ADAPTER, trained_factors(trained)))
        with torch.no_grad():
            deltas = {name: _update(module) for name, module in layers.items()}
    except BaseException:
        if peft_model is not None:
            peft_model.unload()
        with torch.no_grad():
            for name, value in held.items():
                model.get_submodule(name).weight.data = value
        raise
    effective.model = peft_model.unload()
    with torch.no_grad():
        for name in list(held):  # popped as they go, so that two copies of every layer are never held at once
            value, module = held.pop(name), effective.model.get_submodule(name)
            if name in deltas:  # θ0 + the chosen update, as the full weights are saved
                rule = rule_for(module)
                value = (effective.reference[name + ".weight"].float()
                         + rule.from_matrix(deltas[name])).to(value.device, value.dtype)
            module.weight.data = value
    logger.info("JANUS: the repair trained the adapter's own factors of %d layers, at its rank", len(deltas))
    return FactorRepair(report, deltas)


def _update(module: nn.Module) -> Tensor:
    """A LoRA layer's update ``s·BA`` as PEFT computes it, in the ``(d_out, d_in)`` layout, float32, on the CPU."""
    delta = module.get_delta_weight(_ADAPTER).float()
    return rule_for(module.get_base_layer()).to_matrix(delta).contiguous().cpu()
