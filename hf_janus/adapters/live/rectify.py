"""Rectify a live ``PeftModel`` (during or right after training) and write the result back into its adapter,
or merge it into the base weights."""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn

from hf_janus.adapters.live.adapter_beside import check_new_adapter_name, new_adapter_beside
from hf_janus.adapters.live.adapter_repair import (
    AdapterSpace,
    adapter_numel,
    adapter_repair_blocker,
    trained_factors,
)
from hf_janus.adapters.live.lora_write import (
    BaseLayerState,
    LoraState,
    check_adapter_writable,
    lora_kind,
    set_base_params,
    rectified_targets,
    validate_peft_output,
    write_adapter_layers,
)
from hf_janus.adapters.peft_layers import (
    active_adapter,
    adapted_linear_layers,
    check_lora_bias,
    check_quantized_layers,
    effective_bias,
    effective_weights,
    inner_model,
    is_mutating_init,
    lora_bias_term,
    on_quantized_base,
    plain_view,
    rebuilt_on_quantized_bases,
    theta0_weights,
)
from hf_janus.engine.config import JanusConfig
from hf_janus.engine.public import quantization_of
from hf_janus.engine.rectifier import Rectifier, WeightSource
from hf_janus.engine.report import RectificationReport
from hf_janus.engine.result import RectificationResult
from hf_janus.errors import JanusError
from hf_janus.parallel.sharding import is_sharded, sharded_inside

logger = logging.getLogger(__name__)


@dataclass
class PeftOutput:
    """How the rectified update of a live PEFT model is kept.

    ``format="adapter"`` writes it back into the LoRA factors (truncated SVD per layer, at ``rank``: ``"same"``,
    an int, ``"auto"`` or a float energy, with ``energy`` for ``"auto"``); ``format="merged"`` writes the rectified
    weights into the base layers and returns the plain merged model. With ``new_adapter_name`` the adapter output
    goes into a new adapter of that name, made active, and the trained adapter is kept unchanged beside it.
    """

    format: str = "adapter"
    rank: Any = "same"
    energy: float = 0.99
    new_adapter_name: Optional[str] = None

    def __post_init__(self) -> None:
        validate_peft_output(self.format, self.rank)
        if not 0.0 < self.energy <= 1.0:
            raise ValueError(f"adapter_energy={self.energy!r} is invalid: expected a float in (0, 1]")
        if self.new_adapter_name is not None and self.format != "adapter":
            raise ValueError(f"new_adapter_name={self.new_adapter_name!r} keeps the rectified update as a second "
                             "adapter: it needs peft_output='adapter', not 'merged'")


def check_live_peft(model: nn.Module, config: JanusConfig, output: PeftOutput) -> dict[str, nn.Module]:
    """Refuse, before training, a PEFT model whose rectified update cannot be kept as ``output`` asks.

    Returns the adapted linear layers JANUS will rectify.
    """
    check_quantized_layers(model)
    layers = adapted_linear_layers(model, config.target_modules, config.exclude_modules)
    check_lora_bias(model)
    quantized = [name for name, module in layers.items() if on_quantized_base(module)]
    if quantized and output.format == "merged":
        raise JanusError(
            f"peft_output='merged' writes the rectified weights into the base layers, but {quantized[0]!r} (and "
            f"{len(quantized) - 1} more) are quantized: requantizing would round the update away. Use "
            "peft_output='adapter' (a rectified adapter on the unchanged quantized base), or rectify the saved "
            "adapter against the full-precision base with JanusMerger and save_full()"
        )
    if any(is_sharded(p) for p in model.parameters()):
        _check_sharded(model, layers, output)
    if output.format == "adapter":
        check_adapter_writable(layers)
        init = getattr(model.peft_config.get(model.active_adapter), "init_lora_weights", True)
        if is_mutating_init(init) and output.rank != "same":
            raise JanusError(
                f"the adapter was initialized with init_lora_weights={init!r}: it is saved relative to a "
                "residual base that PEFT rebuilds at the adapter's own rank when loading, so its rank cannot "
                "change. Keep adapter_rank='same', or use peft_output='merged'"
            )
        if output.new_adapter_name is not None:
            check_new_adapter_name(model, active_adapter(model), output.new_adapter_name)
    return layers


def _check_sharded(model: nn.Module, layers: dict[str, nn.Module], output: PeftOutput) -> None:
    """Under FSDP2 the rectified update goes into the trained adapter's own shards, in place: what would give a
    layer new parameters FSDP does not manage (another rank, a new adapter, merged weights) is refused, and so is
    what the 2-rank tests do not cover (DoRA and other variants, 8-bit bases)."""
    fix = "train with DDP, or save the adapter and rectify it with hf_janus.JanusMerger afterwards"
    if output.format != "adapter" or output.rank != "same" or output.new_adapter_name is not None:
        raise JanusError(
            "under FSDP2 JanusCallback writes the rectified update into the trained adapter's shards, at its own "
            f"rank: peft_output={output.format!r}, adapter_rank={output.rank!r}"
            f"{f', new_adapter_name={output.new_adapter_name!r}' if output.new_adapter_name else ''} would give "
            "the layers parameters FSDP2 does not manage. Keep peft_output='adapter' and adapter_rank='same', or "
            + fix)
    inner = inner_model(model)
    for name, module in layers.items():
        if not sharded_inside(inner, name):
            # the passes run on the inner model, holding what outer FSDP2 modules shard whole throughout: a write
            # into the shards of such a layer would not reach them
            raise JanusError(
                f"layer {name!r} is sharded by an FSDP2 module around the whole {type(inner).__name__} (the "
                "PeftModel's own fully_shard): JANUS needs each adapted layer inside an FSDP2 module of its own "
                "block. Apply fully_shard to each decoder layer before the root (accelerate's FSDP2 auto-wrap "
                f"policy does), or {fix}")
        kind = lora_kind(module, active_adapter(module))
        base = module.get_base_layer()
        other_base = on_quantized_base(module) and type(base).__name__ != "Linear4bit"
        if kind != "lora" or other_base:
            what = f"a {quantization_of(base)} base" if other_base else f"a {kind or type(module).__name__} adapter"
            raise JanusError(f"layer {name!r} has {what}: under FSDP2 hf-janus rectifies plain LoRA adapters on "
                             f"unquantized or 4-bit bases; {fix}")


class LivePeftRun(NamedTuple):
    """What :func:`rectify_live_peft` did."""

    report: RectificationReport  # its ``output`` says what was written
    model: nn.Module  # the model to use from now on: the PeftModel itself, or the merged plain model
    # the finished engine run (replay split, layers), for inspection; it holds copies of the target layers until its
    # release() (JanusCallback releases it at train end)
    rectifier: Rectifier


def rectify_live_peft(model: nn.Module, initial: dict[str, Tensor], replay: Any, config: JanusConfig,
                      output: PeftOutput, *, progress: bool = True, new_task: Any = None,
                      new_task_validation: Any = None,
                      repair_autocast: Optional[Callable[[], AbstractContextManager]] = None) -> LivePeftRun:
    """Rectify the effective weights of the adapted layers of ``model``, then keep them as ``output`` asks.

    ``initial``: what :func:`~hf_janus.adapters.peft_layers.initial_state` took at train begin (θ0 itself for
    layers on a dense base, the initial adapter tensors for layers on a quantized one). Everything that can
    fail (capture, projection, re-factorization) runs before the model is changed for good: on failure the
    tuner layers and their weights are exactly as training left them.

    Returns:
        A :class:`LivePeftRun`: the report, the model to use from now on (``model`` itself for
        ``format="adapter"``, the merged plain model for ``format="merged"``) and the rectifier.
    """
    layers = adapted_linear_layers(model, config.target_modules, config.exclude_modules)
    # the repair after JANUS trains the adapter's own factors where it can (always on a quantized base, which
    # check_live_peft and the callback refuse otherwise), the effective weights elsewhere
    in_adapter = (bool(config.distill_steps) and new_task is not None
                  and adapter_repair_blocker(layers, output, initial) is None)
    rectifier = rectify_adapted_layers(model, layers, initial, replay, config, progress=progress,
                                       keep_reference_factors=output.format == "adapter", new_task=new_task,
                                       new_task_validation=new_task_validation, repair_autocast=repair_autocast,
                                       defer_repair=in_adapter,
                                       repair_numel=adapter_numel(layers) if in_adapter else None)
    result = rectifier.result
    report = result.report
    if output.format == "merged":
        merged = _merge(model, layers, result)
        report.output = {"format": "merged"}
        return LivePeftRun(report, merged, rectifier)
    try:
        report.output = _write_adapter(model, layers, result, output, rectifier if in_adapter else None)
    finally:
        result.release()
    return LivePeftRun(report, model, rectifier)


def rectify_adapted_layers(model: nn.Module, layers: dict[str, nn.Module], initial: dict[str, Tensor], replay: Any,
                           config: JanusConfig, *, progress: bool = True,
                           keep_reference_factors: bool = False, new_task: Any = None,
                           new_task_validation: Any = None,
                           repair_autocast: Optional[Callable[[], AbstractContextManager]] = None,
                           defer_repair: bool = False, repair_numel: Optional[int] = None) -> Rectifier:
    """The rectification of :func:`rectify_live_peft` without keeping its result: the finished :class:`Rectifier`
    (``.result`` holds θ_rect of each of ``layers``, from :func:`~hf_janus.adapters.peft_layers.adapted_linear_layers`)
    and the model exactly as it was. For callers that keep the update their own way, and for measuring the
    rectification alone. With ``defer_repair`` the repair after JANUS is left to the caller
    (:meth:`~hf_janus.engine.rectifier.Rectifier.repair`)."""
    # On a quantized base θ0 and θ̂ are rebuilt from the base and the adapter when needed, never held for all layers.
    rebuilt = rebuilt_on_quantized_bases(layers, initial)
    dense = {name: module for name, module in layers.items() if name not in rebuilt}
    # θ0 and θ̂ in float32 whatever the base dtype: the update is the adapter's own, not round(W + ΔW) − W
    theta0 = theta0_weights(dense, initial)
    finetuned = effective_weights(dense)
    # Only the adapted layers moved during training: they are the targets, whatever "all-linear" says.
    config = dataclasses.replace(config, target_modules=list(layers), exclude_modules=None)
    with plain_view(model, finetuned, rebuilt) as plain:
        weights = WeightSource(theta0, finetuned=finetuned, rebuilt=rebuilt)
        rectifier = Rectifier(plain, weights, replay, config, progress=progress,
                              keep_reference_factors=keep_reference_factors, new_task=new_task,
                              new_task_validation=new_task_validation, repair_autocast=repair_autocast,
                              defer_repair=defer_repair, repair_numel=repair_numel)
        rectifier.run()
    return rectifier


def _write_adapter(model: nn.Module, layers: dict[str, nn.Module], result: RectificationResult,
                   output: PeftOutput, repair: Optional[Rectifier] = None) -> dict[str, Any]:
    """All or nothing: an interruption (Ctrl-C included) before the last line leaves the adapters and their configs
    as training left them (a half-written adapter would not even reload): the trained adapter is put back, or the
    new one beside it (``output.new_adapter_name``) is deleted. With ``repair`` (a run deferred its repair), the
    adapter the JANUS point is written into then trains its own factors (:class:`AdapterSpace`)."""
    trained = next(iter(layers.values())).active_adapters[0]
    if output.new_adapter_name is None:
        return _write_into(model, layers, result, output, trained, repair)
    with new_adapter_beside(model, trained, output.new_adapter_name):
        written = _write_into(model, layers, result, output, output.new_adapter_name, repair)
    return {**written, "adapter_name": output.new_adapter_name, "trained_adapter": trained}


def _write_into(model: nn.Module, layers: dict[str, nn.Module], result: RectificationResult, output: PeftOutput,
                adapter: str, repair: Optional[Rectifier] = None) -> dict[str, Any]:
    # the trained factors: θ̂ of the repair, and what an interrupted repair puts back
    trained = [LoraState.capture(module, adapter) for module in layers.values()] if repair is not None else []
    written = write_adapter_layers(model, layers, rectified_targets(result), adapter, output.rank, output.energy)
    kept = [w.stats.kept_energy for w in written]
    logger.info("JANUS: rectified update written into the adapter %r (%d layers, kept energy min %.4f)",
                adapter, len(written), min(kept) if kept else 1.0)
    if repair is not None:
        try:
            result.report.repair = repair.repair(AdapterSpace(model, layers, adapter, trained_factors(trained)))
        except BaseException:
            for state in trained:
                state.restore()
            raise
    return {"format": "adapter", "adapter_rank": output.rank, "adapter_energy": output.energy,
            "layers": [w.stats.to_dict() for w in written]}


def _merge(model: nn.Module, layers: dict[str, nn.Module], result: RectificationResult) -> nn.Module:
    """Rectified weights into the base layers, every other adapter merged, PEFT wrappers removed. Until the
    wrappers go, an interruption (Ctrl-C included) puts every base layer back as training left it."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    originals: list[BaseLayerState] = []
    try:
        with torch.no_grad():
            for name, module in layers.items():
                # a lora_bias adapter's bias term is part of the fine-tuned model the rectification kept
                bias = effective_bias(module, torch.float32) if lora_bias_term(module) is not None else None
                originals.append(BaseLayerState.capture(module))
                set_base_params(module, result.layers[name].rectified.detach().float(), bias)
                originals[-1].offload()
            # Adapted layers JANUS did not rectify (narrowed targets, embeddings) keep their fine-tuned value.
            for name, module in inner_model(model).named_modules():
                if isinstance(module, BaseTunerLayer) and name not in layers and hasattr(module, "merge"):
                    originals.append(BaseLayerState.capture(module))
                    module.merge(safe_merge=True)  # into new tensors, so the captured ones stay intact
                    originals[-1].offload()
    except BaseException:
        for state in reversed(originals):
            state.restore()
        raise
    merged = model.unload()
    logger.info("JANUS: rectified weights merged into the plain %s", type(merged).__name__)
    return merged
