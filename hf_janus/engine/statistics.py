"""Per-layer statistics of a finished rectification: ``||ΔW||``, ``||ΔW_rect||``, the residual
``||J0 ΔW_rect|| / ||J0 ΔW||`` and the Gram rank at θ0, with a warning where rounding to the weights' dtype undid
much of the rectification."""

from __future__ import annotations

import logging

import torch

from hf_janus.engine.jacobians import JacobianSource
from hf_janus.engine.report import LayerStats
from hf_janus.engine.target_layers import TargetLayer, TargetLayers

logger = logging.getLogger(__name__)


def layer_statistics(layers: TargetLayers, jacobians: JacobianSource) -> list[LayerStats]:
    """One :class:`LayerStats` per layer, measured at θ0's capture (tag ``"c0"``) on what the rectification leaves:
    the model's (possibly rounded) weights, or θ_t itself where the caller gave an exact or rebuilt θ̂ and keeps θ_t."""
    stats, rounded = [], []
    device = jacobians.device
    with jacobians.ghost_phase():
        for layer in layers:
            stat, lost = _one_layer(layer, jacobians, device)
            stats.append(stat)
            if lost is not None:
                rounded.append(lost)
    if rounded:
        name, as_written, unrounded, dtype = max(rounded, key=lambda r: r[1])
        logger.warning(
            "%d of %d rectified layers lost much of the rectification to %s rounding of the written weights "
            "(worst: %s, residual ||J0 ΔW_rect|| / ||J0 ΔW|| = %.3g as written, %.3g before rounding): the "
            "correction is smaller than the weights' resolution. Rectify a float32 copy (model.float()) and "
            "save that, or keep the update as an adapter.",
            len(rounded), len(layers), str(dtype).replace("torch.", ""), name, as_written, unrounded)
    return stats


def _one_layer(layer: TargetLayer, jacobians: JacobianSource, device: torch.device):
    """The layer's statistics, and ``(name, residual as written, residual before rounding, dtype)`` when rounding
    to a 16-bit weight lost much of the rectification (else None)."""
    jac = jacobians.jacobian(layer.name, "c0")
    reference = layer.reference(device)
    delta = layer.finetuned(device) - reference
    written = (layer.current.to(device) if layer.keeps_current
               else layer.rule.weight(layer.module).detach())
    rect = written.to(torch.float32) - reference
    before = float((layer.jvp0 if layer.jvp0 is not None else jac.jvp(delta)).norm())
    after = float(jac.precise_jvp(rect).norm())
    lost = None
    if (written.dtype in (torch.bfloat16, torch.float16) and layer.master_backup is None
            and before > 0 and after > 0.05 * before):
        unrounded = float(jac.precise_jvp(layer.current.to(device) - reference).norm())
        if unrounded < 0.5 * after:
            lost = (layer.name, after / before, unrounded / before, written.dtype)
    jac.release()
    stat = LayerStats(name=layer.name, shape=[layer.d_out, layer.d_in], path=layer.path,
                      delta_norm=float(delta.norm()), rect_delta_norm=float(rect.norm()),
                      residual=(after / before) if before > 0 else None, gram_rank=layer.gram_rank0)
    return stat, lost
