"""The public result of a rectification: per layer θ0, θ̂, θ_rect and J0, for the adapters and other callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from hf_janus.engine.ghost import LayerJacobian
from hf_janus.engine.layers import LayerRule
from hf_janus.engine.report import RectificationReport
from hf_janus.engine.target_layers import LayerWeights, RebuiltWeights


@dataclass
class LayerResult:
    """One rectified layer. Matrices are ``(d_out, d_in)`` (the layout of ``y = W x``), whatever the module
    stores; the tensors are the rectifier's own, shared and not copied."""

    name: str
    rule: LayerRule
    weights: LayerWeights  # θ0 and θ̂ as the rectifier held them (or rebuilds them when asked for)
    rectified: Tensor  # θ_rect, float32 (d_out, d_in), where the memory plan kept θ_t (the device, or the host)
    jacobian: Optional[LayerJacobian] = None  # J0 (compressed factors at θ0), when kept

    @property
    def reference_weight(self) -> Optional[Tensor]:
        """θ0 as (d_out, d_in), in its own dtype; None where :attr:`rebuilt`."""
        return self.weights.reference_matrix

    @property
    def finetuned_weight(self) -> Optional[Tensor]:
        """θ̂ in the module's layout on the CPU: as the module stores it, or the float32 θ̂ the caller gave the
        rectifier (an adapter's exact update on a bf16 base, see Rectifier's ``finetuned``); None where
        :attr:`rebuilt`."""
        return self.weights.finetuned_native()

    @property
    def rebuilt(self) -> Optional[RebuiltWeights]:
        """The computer of θ0 and θ̂ when asked for (see Rectifier's ``rebuilt``), where they are not held."""
        return self.weights.rebuilt

    @property
    def reference(self) -> Tensor:
        """θ0 as float32 on the device of :attr:`rectified` (no copy for float32 weights already there)."""
        return self.weights.reference(self.rectified.device)

    def finetuned(self) -> Tensor:
        """θ̂ as float32 ``(d_out, d_in)`` on the device of :attr:`rectified`."""
        return self.weights.finetuned(self.rectified.device)

    def delta(self) -> Tensor:
        """ΔW = θ̂ − θ0, the fine-tuning update."""
        return self.finetuned() - self.reference

    def rect_delta(self) -> Tensor:
        """ΔW_rect = θ_rect − θ0, the rectified update."""
        return self.rectified - self.reference

    def jvp0_norm(self) -> Optional[float]:
        """``||J0 ΔW||``, the first-order change of the replay outputs that the fine-tuning made, the denominator of
        every residual; None without :attr:`jacobian`."""
        if self.jacobian is None:
            return None
        return float(self.jacobian.jvp(self.delta()).norm())


@dataclass
class RectificationResult:
    """What :meth:`hf_janus.engine.rectifier.Rectifier.run` leaves behind: the report and every layer."""

    report: RectificationReport
    layers: dict[str, LayerResult] = field(default_factory=dict)

    def release(self) -> None:
        """Free the kept Jacobians' buffers (their factors go with the result)."""
        for layer in self.layers.values():
            if layer.jacobian is not None:
                layer.jacobian.release()
