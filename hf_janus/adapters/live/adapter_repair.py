"""The repair after JANUS in a LoRA adapter's own factors, so that an adapter comes out an adapter and a quantized
base (QLoRA) is never written.

Once the JANUS point is written into the adapter (re-factorized at the adapter's rank), the distillation trains the
adapter's ``lora_A`` and ``lora_B`` through the PEFT model itself, as fine-tuning did. θ0 is the adapter with
``lora_B`` at zero (where training started from, for every initialization that leaves the base as it was), so the
line ``θ0 + b(θ_T − θ0)`` the choice moves along is ``lora_B`` scaled by ``b`` with ``lora_A`` as trained: exactly
the effective weights' line, at the adapter's rank.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from hf_janus.adapters.live.lora_write import LoraState, lora_kind
from hf_janus.adapters.peft_layers import active_adapter
from hf_janus.engine.repair_space import RepairSpace


def adapter_repair_blocker(layers: Mapping[str, nn.Module], output: Any,
                           initial: Optional[Mapping[str, Tensor]] = None) -> Optional[str]:
    """Why the repair cannot train the adapter's own factors (None when it can). ``initial``: the adapter's tensors at
    train begin (:func:`~hf_janus.adapters.peft_layers.initial_state`); before training, the live ones are."""
    if output.format != "adapter":
        return "peft_output='merged' keeps full weights"
    if output.rank != "same":
        return f"adapter_rank={output.rank!r} re-factorizes the update at another rank than the adapter was trained at"
    for name, module in layers.items():
        adapter = active_adapter(module)
        if lora_kind(module, adapter) != "lora":
            return f"{name} is not a plain LoRA layer (DoRA or another variant)"
        lora_b = module.lora_B[adapter]
        if lora_b.bias is not None:
            return f"{name}'s adapter has a bias (lora_bias=True)"
        start = lora_b.weight if initial is None else initial.get(f"{name}.lora_B.{adapter}.weight")
        if start is None:
            return f"{name}'s base weight trains too, so θ0 is not the adapter at zero"
        if bool(start.detach().ne(0).any()):
            return (f"{name}'s lora_B did not start at zero (init_lora_weights moved part of the base into the "
                    "adapter), so θ0 is not the adapter at zero")
    return None


def adapter_numel(layers: Mapping[str, nn.Module]) -> int:
    """The elements an :class:`AdapterSpace` of ``layers`` trains: their active adapter's lora_A and lora_B."""
    return sum(m.lora_A[a].weight.numel() + m.lora_B[a].weight.numel()
               for m in layers.values() for a in [active_adapter(m)])


def trained_factors(states: list[LoraState]) -> list[Tensor]:
    """θ̂ of an :class:`AdapterSpace` in its order (float32): the factors ``states`` captured before the JANUS point
    was written into the adapter."""
    return [t.float() for state in states for t in (state.a_weight, state.b_weight)]


class AdapterSpace(RepairSpace):
    """Each target layer's ``lora_A`` and ``lora_B`` weights of ``adapter``, in the order of ``layers``; the points
    are written into them and run through ``peft_model``."""

    trained = "the adapter's lora_A and lora_B"

    def __init__(self, peft_model: nn.Module, layers: Mapping[str, nn.Module], adapter: str,
                 finetuned: list[Tensor]):
        """``finetuned``: the trained adapter's factors (θ̂), in the space's order, taken before the JANUS point was
        written into the adapter."""
        self.model = peft_model
        self.outside_names = []
        self.tensors: list[Tensor] = []
        self.names: list[str] = []
        for name, module in layers.items():
            self.tensors += [module.lora_A[adapter].weight, module.lora_B[adapter].weight]
            self.names += [f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"]
        #: which tensors are lora_B: the move toward θ0 scales them and keeps lora_A as trained
        self.scaled = [False, True] * len(layers)
        self.finetuned = finetuned

    def points(self, device: torch.device) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        janus = [t.detach().float().to(device).clone() for t in self.tensors]
        reference = [torch.zeros_like(t) if scaled else t.clone() for t, scaled in zip(janus, self.scaled)]
        return reference, [t.to(device) for t in self.finetuned], janus

    def trained_tensors(self) -> list[Tensor]:
        return self.tensors

    def tensor_names(self) -> list[str]:
        return self.names

    @torch.no_grad()
    def write(self, point: list[Tensor]) -> None:
        for tensor, value in zip(self.tensors, point):
            tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))

    def moved(self, b: float, reference: list[Tensor], trained: list[Tensor]) -> list[Tensor]:
        if b == 1.0:
            return trained
        return [r + b * (t - r) if scaled else t for r, t, scaled in zip(reference, trained, self.scaled)]
