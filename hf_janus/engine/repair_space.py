"""Where the repair after JANUS (:mod:`hf_janus.engine.repair`) trains: the space its points live in and how the model
is put at one. :class:`WeightSpace` holds the target layers' weights and the other parameters fine-tuning changed;
an adapter's own factors are another space (:class:`hf_janus.adapters.live.adapter_repair.AdapterSpace`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from hf_janus.engine.capture import model_device
from hf_janus.engine.target_layers import TargetLayers


class RepairSpace:
    """Where the repair's points live and how the model is put at one: what :class:`Repair` trains and chooses
    through. A point is a list of float32 tensors on the model's device, one per tensor the repair trains, in
    :meth:`trained_tensors`' order. :class:`WeightSpace` trains the target layers' weights (and the other
    parameters fine-tuning changed); a LoRA adapter trains its own factors
    (:class:`hf_janus.adapters.live.adapter_repair.AdapterSpace`)."""

    #: the model the points are written into and run
    model: nn.Module
    #: parameters outside the target layers that move with them, by name (the report lists them)
    outside_names: list[str] = []
    #: what the repair trains, in words, for the report
    trained: str = "the target layers' weights"

    def points(self, device: torch.device) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """θ0, θ̂ and the JANUS point (the one the model holds when the repair starts)."""
        raise NotImplementedError

    def trained_tensors(self) -> list[Tensor]:
        """The model's tensors the gradients are taken for, in a point's order."""
        raise NotImplementedError

    def tensor_names(self) -> list[str]:
        """A name per trained tensor, for messages."""
        return [f"tensor {i}" for i in range(len(self.trained_tensors()))]

    def gradient_layouts(self) -> list[Callable[[Tensor], Tensor]]:
        """Per trained tensor, its gradient in the point's layout."""
        return [lambda g: g] * len(self.trained_tensors())

    def write(self, point: list[Tensor]) -> None:
        """Put the model at ``point``."""
        raise NotImplementedError

    def moved(self, b: float, reference: list[Tensor], trained: list[Tensor]) -> list[Tensor]:
        """The point ``θ0 + b(θ_T − θ0)`` of the model's weights."""
        return trained if b == 1.0 else [r + b * (t - r) for r, t in zip(reference, trained)]

    def keep(self, point: list[Tensor]) -> None:
        """Keep ``point`` for good: the model holds it from now on."""
        self.write(point)

    def undo(self) -> None:
        """After a failure: put back what the space changed that its owner does not restore."""


class WeightSpace(RepairSpace):
    """The target layers' weights (as ``(d_out, d_in)`` matrices), then every changed parameter outside them in its
    own shape (:func:`~hf_janus.engine.repair.changed_outside`). The layers' ``current`` ends at the point kept; the
    :class:`~hf_janus.engine.rectifier.Rectifier` restores them after a failure, the space the others."""

    def __init__(self, layers: TargetLayers, outside: Optional[Mapping[str, Tensor]] = None):
        self.layers, self.model = layers, layers.model
        params = dict(self.model.named_parameters())
        outside = dict(outside or {})
        self.outside_names = list(outside)
        self.outside = [params[name] for name in outside]
        #: θ0 and θ̂ of the changed parameters outside the target layers (float32, on the host until used)
        self.outside_reference = [outside[name].float() for name in outside]
        self.outside_finetuned = [p.detach().float().cpu().clone() for p in self.outside]

    def points(self, device: torch.device) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        finetuned_outside = [t.to(device) for t in self.outside_finetuned]
        reference = ([layer.reference(device) for layer in self.layers]
                     + [t.to(device) for t in self.outside_reference])
        finetuned = [layer.finetuned(device) for layer in self.layers] + finetuned_outside
        janus = [layer.current.detach().float().clone() for layer in self.layers] + finetuned_outside
        return reference, finetuned, janus

    def trained_tensors(self) -> list[Tensor]:
        return [layer.module.weight for layer in self.layers] + self.outside

    def tensor_names(self) -> list[str]:
        return [f"{layer.name}.weight" for layer in self.layers] + self.outside_names

    def gradient_layouts(self) -> list[Callable[[Tensor], Tensor]]:
        return [layer.rule.to_matrix for layer in self.layers] + [lambda g: g] * len(self.outside)

    def write(self, point: list[Tensor]) -> None:
        self.layers.held = None
        device = model_device(self.model)
        for layer, matrix in zip(self.layers, point):
            layer.write(matrix.to(device))
        self._write_outside(point[len(self.layers):])

    def keep(self, point: list[Tensor]) -> None:
        for layer, matrix in zip(self.layers, point):
            layer.current.copy_(matrix.to(layer.current.device))
        self.layers.rewrite_current()
        self._write_outside(point[len(self.layers):])

    def undo(self) -> None:
        self._write_outside(self.outside_finetuned)  # θ̂ back; the rectifier restores the target layers

    def _write_outside(self, values: list[Tensor]) -> None:
        for param, value in zip(self.outside, values):
            param.data.copy_(value)
