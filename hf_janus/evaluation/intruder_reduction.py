"""PEFT's post-hoc forgetting mitigation for LoRA, intruder-dimension reduction, as a frontier peer.

``peft.tuners.lora.intruders.reduce_intruder_dimension`` ("LoRA vs Full Fine-tuning: an Illusion of Equivalence",
arXiv 2410.21228) needs no replay and costs seconds: per adapted layer it takes the top-``top_k`` left singular
vectors of the merged weight ``W + ΔW``, calls those whose largest |cosine| with every left singular vector of ``W``
is below ``threshold_epsilon`` *intruders*, scales their singular components by ``mitigation_lambda`` and truncates
the resulting update back to the adapter's rank.

PEFT applies it to a live ``PeftModel`` and writes a new adapter in the base weight's dtype, which needs a dense base
weight (an nf4 base has none) and rounds the result in bf16. The frontier holds ``W`` and ``ΔW`` of each layer as
tensors, so :class:`IntruderReduction` does the same arithmetic on them, in float32: the detection (two SVDs per
layer) once, and for each ``mitigation_lambda`` one truncation. ``tests/evaluation/test_intruder_reduction.py``
checks it against PEFT's own function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from hf_janus.errors import JanusError

#: PEFT's defaults of ``reduce_intruder_dimension``.
DEFAULT_TOP_K = 10
DEFAULT_THRESHOLD_EPSILON = 0.5


def plain_lora(config: Any) -> bool:
    """PEFT's intruder reduction is defined for LoRA (not DoRA, whose magnitude vector is not a low-rank update)."""
    kind = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    return str(kind) == "LORA" and not getattr(config, "use_dora", False)


@dataclass
class IntruderLayer:
    """One layer's update and the intruder components of its merged weight (float32)."""

    delta: Tensor  # ΔW, in the layer's stored layout
    intruders: Tensor  # Σ_{i ∈ intruders} s_i u_i v_iᵀ of W + ΔW; zeros when there are none
    count: int  # how many of the top-k directions are intruders
    rank: int  # the adapter's rank: the reduced update is truncated to it


def find_intruders(weight: Tensor, delta: Tensor, rank: int, *, top_k: int = DEFAULT_TOP_K,
                   threshold_epsilon: float = DEFAULT_THRESHOLD_EPSILON) -> IntruderLayer:
    """Detect the intruder dimensions of ``weight + delta`` as PEFT does (``weight``: θ0 of the layer, ``delta``:
    the adapter's ΔW, both as the layer stores them, which is the layout PEFT's function works in)."""
    if weight.shape != delta.shape or weight.dim() != 2:
        raise JanusError(f"intruder reduction needs a matrix weight and an update of its shape, got "
                         f"{tuple(weight.shape)} and {tuple(delta.shape)}")
    if rank < 1:
        raise JanusError(f"intruder reduction needs the adapter's rank (≥ 1), got {rank}")
    w, d = weight.detach().float(), delta.detach().float()
    merged = w + d
    u_base = torch.linalg.svd(w, full_matrices=False)[0]
    u, s, vh = torch.linalg.svd(merged, full_matrices=False)
    similarity = (u.T @ u_base).abs().max(dim=1).values
    idx = torch.where(similarity[:top_k] < threshold_epsilon)[0]
    intruders = (u[:, idx] * s[idx]) @ vh[idx] if len(idx) else torch.zeros_like(d)
    return IntruderLayer(delta=d, intruders=intruders, count=int(len(idx)), rank=int(rank))


def reduced_delta(layer: IntruderLayer, mitigation_lambda: float) -> Tensor:
    """``ΔW`` with its intruder components scaled by ``mitigation_lambda``, truncated to the adapter's rank (PEFT
    re-factorizes the new adapter at that rank). A layer without intruders keeps its ΔW, as in PEFT."""
    if layer.count == 0:
        return layer.delta
    mitigated = layer.delta + (float(mitigation_lambda) - 1.0) * layer.intruders
    u, s, vh = torch.linalg.svd(mitigated, full_matrices=False)
    k = min(layer.rank, s.numel())
    return (u[:, :k] * s[:k]) @ vh[:k]


class IntruderReduction:
    """Intruder detection for every adapted layer, then the reduced weights at any ``mitigation_lambda``.

    Args:
        reference: ``"<layer>.weight"`` → θ0 of each adapted linear layer, as the layer stores it.
        finetuned: the same keys → θ̂ = θ0 + ΔW (exact, float32 where available).
        ranks: the same keys → the adapter's rank of that layer (``r``, or its ``rank_pattern`` entry).
        base: the same keys → the weight the adapter sits on where it is not θ0: W_res of an unconverted PiSSA-like
            adapter, as PEFT's model holds it. PEFT measures intruders against that weight and reduces the adapter's
            own rank-r update θ̂ − W_res; measured against θ0, the update would be θ̂ − θ0, of rank up to 2r.
    """

    def __init__(self, reference: Mapping[str, Tensor], finetuned: Mapping[str, Tensor], ranks: Mapping[str, int],
                 *, top_k: int = DEFAULT_TOP_K, threshold_epsilon: float = DEFAULT_THRESHOLD_EPSILON,
                 base: Optional[Mapping[str, Tensor]] = None):
        missing = sorted(set(finetuned) - set(ranks))
        if missing:
            raise JanusError(f"intruder reduction needs the adapter's rank of every layer; none for {missing[:3]}")
        self.top_k, self.threshold_epsilon = top_k, threshold_epsilon
        self.base = {name: (base or {}).get(name, reference[name]).float() for name in finetuned}
        self.layers = {name: find_intruders(self.base[name], finetuned[name].float() - self.base[name],
                                            ranks[name], top_k=top_k, threshold_epsilon=threshold_epsilon)
                       for name in finetuned}

    @property
    def layers_with_intruders(self) -> int:
        return sum(1 for layer in self.layers.values() if layer.count)

    def weights(self, reference: Mapping[str, Tensor], mitigation_lambda: float) -> dict[str, Tensor]:
        """The adapter's base weight (θ0 in ``reference``, or the ``base`` it was given) + the reduced update of
        every layer, float32."""
        return {name: (self.base[name] if name in self.base else reference[name].float())
                + reduced_delta(layer, mitigation_lambda) for name, layer in self.layers.items()}
