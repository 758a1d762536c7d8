"""Build the *effective* model of a base model and a saved PEFT adapter: ``W0 + ΔW`` per adapted layer, and ``θ0``.

The effective model is the base model whose adapted layers hold the fine-tuned weight ``W0 + ΔW`` as PEFT
defines it (``ΔW`` = effective weight − base weight, whatever the adapter kind), next to ``θ0``: the base
weights of only the adapted layers. That pair is exactly what :class:`hf_janus.Rectifier` needs.

Everything goes through PEFT's own code: ``PeftConfig.from_pretrained``, ``PeftModel.from_pretrained`` and,
per layer, the tuner layer's ``merge`` (via ``merge_and_unload``), so LoRA with any ``lora_alpha``,
``use_rslora``, ``rank_pattern``/``alpha_pattern``, DoRA (the magnitude vector is part of the merged weight),
LoHa, LoKr, IA3, ... give the same weights as PEFT's own merge. The base model is loaded once and merged in
place, layer by layer; only the adapted layers' base weights are copied.

PiSSA (and the other initializations that move part of the base weight into the adapter: OLoRA, CorDA,
LoRA-GA, LoftQ). ``ΔW`` is always relative to the *original* base weight ``W``:

* **converted** (saved with ``save_pretrained(..., path_initial_model_for_weight_conversion=...)``): PEFT
  stores a plain LoRA of rank ``2r`` whose delta ``s(BA − B0A0)`` is already relative to ``W``; it needs
  nothing special.
* **unconverted, ``init_lora_weights="pissa"``**: the residual base ``W_res = W − s·B0A0`` is reconstructed
  deterministically from ``W`` with PEFT's own ``pissa_init`` (an exact SVD; unique up to float rounding
  whenever ``σ_r > σ_{r+1}``), then the trained factors are put back and merged: the effective weight is
  ``W_res + s·BA``, what PEFT itself loads, and ``ΔW = s(BA − B0A0)``. ``base_model`` must be the original
  model, not the residual one.
* **unconverted, anything randomized or data-dependent** (``pissa_niter_k``, ``olora``, ``corda``,
  ``lora_ga``, ``loftq``): ``W_res`` cannot be rebuilt exactly, so the user must pass ``initial_adapter``,
  the adapter saved before training (PEFT's examples save it as ``pissa_init``); then
  ``ΔW = s(BA − B0A0)``, as PEFT's ``subtract_mutated_init`` computes it. Without it a :class:`JanusError`
  says so (or: convert the adapter with PEFT first).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from hf_janus.adapters.peft_layers import (
    check_quantized_layers,
    dense_stand_in,
    effective_params,
    lora_bias_term,
    on_quantized_base,
)
from hf_janus.adapters.saved.loading import (
    PEFT_PREFIX,
    AdapterSource,
    DTypeLike,
    check_adapter_shapes,
    check_base_matches,
    load_base_model,
    resolve_adapter,
)
from hf_janus.engine.layers import rule_for
from hf_janus.engine.public import dequantized_weight
from hf_janus.errors import JanusError

logger = logging.getLogger(__name__)

_ADAPTER_NAME = "default"


@dataclass
class AdaptedLayer:
    """One layer the adapter changes."""

    name: str  # qualified module name in the plain model, e.g. "model.layers.0.self_attn.q_proj"
    layer_type: str  # "linear" (nn.Linear / Conv1D: JANUS can rectify it), "embedding" or "other"
    module_type: str  # class name of the base layer
    tuner_type: str  # class name of PEFT's tuner layer
    shape: Optional[list[int]]  # [d_out, d_in] for linear layers, the stored weight shape otherwise
    rank: Optional[int]  # the adapter's own rank of this layer, when its type has one
    fan_in_fan_out: bool = False  # weight stored (d_in, d_out), as GPT-2's Conv1D


@dataclass
class EffectiveModel:
    """The base model with the adapter merged in (``W0 + ΔW`` per adapted layer) and ``θ0`` of those layers."""

    model: nn.Module
    reference: dict[str, Tensor]  # "<layer>.weight" -> θ0, native layout, CPU (float32 where rebuilt with PEFT)
    layers: dict[str, AdaptedLayer]
    adapter: AdapterSource
    base_model: str
    base_revision: Optional[str] = None
    modules_to_save: list[str] = field(default_factory=list)  # qualified names of fully trained modules
    changes_bias: bool = False  # the adapter trains the base layers' biases (bias != "none")
    # "<layer>.bias" -> s·lora_B.bias of a lora_bias=True adapter: what it adds to the layer's bias (float32, CPU)
    lora_biases: dict[str, Tensor] = field(default_factory=dict)
    quantized: bool = False  # the base is quantized: adapted layers are dense stand-ins, the rest stays quantized
    # "<layer>.weight" -> θ̂ = W0 + ΔW of every adapted linear layer, merged by PEFT in float32 (native layout,
    # CPU): the model holds it rounded to its dtype, and on a bf16 base that rounding would swamp a small ΔW
    finetuned: dict[str, Tensor] = field(default_factory=dict)
    # "<layer>.weight" -> the trained adapter's own update s·BA as factors (s·B, A), for adapters whose base weight is
    # not θ0 (unconverted PiSSA-like inits: the adapter sits on W_res = θ̂ − s·BA)
    adapter_factors: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def linear_layers(self) -> list[str]:
        return [n for n, layer in self.layers.items() if layer.layer_type == "linear"]

    def finetuned_weight(self, name: str) -> Tensor:
        """θ̂ of one adapted layer, float32, native layout: PEFT's float32 merge where it was kept, the model's
        weight otherwise."""
        exact = self.finetuned.get(name + ".weight")
        return exact.float() if exact is not None else self.model.get_submodule(name).weight.detach().float().cpu()

    def delta(self, name: str) -> Tensor:
        """``ΔW`` = effective − base weight of one adapted layer, float32, native layout."""
        return self.finetuned_weight(name) - self.reference[name + ".weight"].float()

    def adapter_base(self, name: str) -> Tensor:
        """The weight the adapter of one layer sits on, as PEFT holds it, float32, native layout: θ0, or W_res for
        an unconverted PiSSA-like adapter (its initialization moved s·B0A0 out of the base weight)."""
        factors = self.adapter_factors.get(name + ".weight")
        if factors is None:
            return self.reference[name + ".weight"].float()
        scaled_b, a = factors
        own = scaled_b @ a
        if self.layers[name].fan_in_fan_out:
            own = own.T
        return self.finetuned_weight(name) - own



def _own_rank(module: nn.Module) -> Optional[int]:
    ranks = getattr(module, "r", None)
    if isinstance(ranks, dict) and _ADAPTER_NAME in ranks:
        try:
            return int(ranks[_ADAPTER_NAME])
        except (TypeError, ValueError):
            return None
    return None


def _describe(name: str, module: nn.Module) -> AdaptedLayer:
    base = module.get_base_layer()
    rule = rule_for(base)
    if rule is not None:
        layer_type = "linear"
        shape = list(rule.matrix_shape(base))
    elif isinstance(base, nn.Embedding):
        layer_type, shape = "embedding", list(base.weight.shape)
    else:
        layer_type = "other"
        weight = getattr(base, "weight", None)
        shape = list(weight.shape) if isinstance(weight, Tensor) else None
    return AdaptedLayer(
        name=name, layer_type=layer_type, module_type=type(base).__name__, tuner_type=type(module).__name__,
        shape=shape, rank=_own_rank(module), fan_in_fan_out=_is_conv1d(base),
    )


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D stores W as (d_in, d_out): a LoRA on it needs fan_in_fan_out=True."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, Conv1D)


def _rebuilds_pissa(src: AdapterSource, initial_given: bool) -> bool:
    """Whether W_res of an unconverted PiSSA adapter is rebuilt from W (exact SVD) instead of from the factors
    of an initial adapter the user gave."""
    mutating = src.mutating_init
    return mutating is not None and mutating.lower() == "pissa" and not initial_given


def _reconstruct_pissa(module: nn.Module, init: str) -> Tensor:
    """Turn the loaded layer (original base W, trained A/B) into PEFT's PiSSA state: base W_res, trained A/B.
    Returns θ0 = W_res + s·B0A0 in float32 (W up to the rounding of W_res in the base's dtype)."""
    if not hasattr(module, "pissa_init"):
        raise JanusError(f"cannot rebuild the PiSSA residual of a {type(module).__name__} layer")
    trained_a = module.lora_A[_ADAPTER_NAME].weight.data.clone()
    trained_b = module.lora_B[_ADAPTER_NAME].weight.data.clone()
    module.pissa_init(_ADAPTER_NAME, init)  # base <- W - s·B0A0 (exact SVD), factors <- A0, B0
    theta0 = effective_params(module, torch.float32)[0].detach().cpu()
    module.lora_A[_ADAPTER_NAME].weight.data = trained_a.to(module.lora_A[_ADAPTER_NAME].weight.dtype)
    module.lora_B[_ADAPTER_NAME].weight.data = trained_b.to(module.lora_B[_ADAPTER_NAME].weight.dtype)
    return theta0


def _subtract_initial(module: nn.Module, name: str, initial: dict[str, Tensor], initial_name: str) -> Tensor:
    """base <- W − s·B0A0 with (A0, B0) from the adapter saved before training. Returns θ0 = that base + s·B0A0
    in float32, as the model was when training began."""
    key = PEFT_PREFIX + name
    a0, b0 = initial.get(f"{key}.lora_A.weight"), initial.get(f"{key}.lora_B.weight")
    if a0 is None or b0 is None:
        raise JanusError(
            f"initial adapter {initial_name!r} has no lora_A/lora_B weights for layer {name!r}; pass the adapter "
            "saved right after initialization of this very adapter"
        )
    a = module.lora_A[_ADAPTER_NAME].weight
    b = module.lora_B[_ADAPTER_NAME].weight
    if a0.shape != a.shape or b0.shape != b.shape:
        raise JanusError(
            f"initial adapter {initial_name!r} does not match the trained adapter at layer {name!r}: lora_A "
            f"{tuple(a0.shape)} vs {tuple(a.shape)}, lora_B {tuple(b0.shape)} vs {tuple(b.shape)}"
        )
    base = module.get_base_layer()
    scaling = module.scaling[_ADAPTER_NAME]
    product = scaling * (b0.to(torch.float32) @ a0.to(torch.float32))
    if getattr(module, "fan_in_fan_out", False):
        product = product.T
    with torch.no_grad():
        base.weight.data = (base.weight.data.to(torch.float32) - product.to(base.weight.device)).to(base.weight.dtype)
        return (base.weight.data.to(torch.float32) + product.to(base.weight.device)).cpu()


def read_adapter_weights(path: str, name: str) -> dict[str, Tensor]:
    """PEFT's ``load_peft_weights``, with a corrupt, truncated or refused file reported as such. (PEFT reads
    ``.bin`` files with ``torch.load(weights_only=True)``, which refuses pickles that would run code.)"""
    from peft.utils import load_peft_weights

    try:
        return load_peft_weights(path, device="cpu")
    except JanusError:
        raise
    except Exception as err:
        raise JanusError(
            f"cannot read the weights of adapter {name!r} in {path!r} ({type(err).__name__}: {str(err)[:200]}): the "
            "file is corrupt, truncated or not a plain tensor file (pickles that would run code are refused). Save "
            "or download the adapter again"
        ) from err


def _load_initial_adapter(initial_adapter: Union[str, os.PathLike], token: Union[str, bool, None],
                          allow_pickle: bool = False) -> dict[str, Tensor]:
    """The factors (A0, B0) of the adapter as saved right after initialization, keyed as PEFT saves them."""
    source = resolve_adapter(initial_adapter, token=token, allow_pickle=allow_pickle)
    return read_adapter_weights(source.path, source.name)


def load_effective_model(
    base_model: Union[str, os.PathLike],
    adapter: Union[str, os.PathLike, AdapterSource],
    *,
    revision: Optional[str] = None,
    base_revision: Optional[str] = None,
    torch_dtype: DTypeLike = None,
    device: Union[str, torch.device, None] = None,
    initial_adapter: Union[str, os.PathLike, None] = None,
    allow_base_mismatch: bool = False,
    token: Union[str, bool, None] = None,
    progress: bool = True,
    quantization_config: Any = None,
    allow_pickle: bool = False,
) -> EffectiveModel:
    """Load ``base_model`` once, merge ``adapter`` into it layer by layer, keep ``θ0`` of the adapted layers.

    Args:
        base_model: Hub repo id or local directory of the model the adapter was trained on (for an
            unconverted PiSSA adapter: the original model, not the residual one).
        adapter: Hub repo id or local directory of a PEFT adapter (``adapter_config.json`` + weights).
        revision: revision of the adapter repo; ``base_revision`` that of the base model.
        torch_dtype: dtype to load the base in (default: the checkpoint's). ``ΔW`` is read from PEFT's merge
            run in float32 whatever it is (``EffectiveModel.finetuned``); only full weights saved in bf16 round.
        device: where to put the model (default: where ``from_pretrained`` puts it, the CPU).
        initial_adapter: the adapter as saved right after initialization, for unconverted PiSSA/OLoRA/
            CorDA/LoRA-GA/LoftQ adapters (see the module docstring).
        allow_base_mismatch: warn instead of failing when the adapter names another base model.
        quantization_config: load the base quantized (a ``BitsAndBytesConfig``, as ``from_pretrained`` takes
            it), to rectify a QLoRA adapter against the base it was trained on. θ0 of an adapted layer is then
            its dequantized base weight, and the adapted layers become dense stand-ins holding dequantized base +
            ``ΔW`` (one layer at a time); the other layers stay quantized.
        allow_pickle: read weights stored only as a pickle (``adapter_model.bin`` of the adapter or of
            ``initial_adapter``, ``pytorch_model.bin`` of the base), with torch's restricted unpickler
            (``weights_only=True``); without it they are refused with an error that names the file.

    Raises:
        JanusError: for a missing adapter config or weights, a wrong base model (ids or shapes), an
            adapter kind without a weight delta (prompt learning), or an unconverted PiSSA-like adapter
            whose residual base cannot be rebuilt.
    """
    base_name = os.fspath(base_model)
    src = (adapter if isinstance(adapter, AdapterSource)
           else resolve_adapter(adapter, revision, token, allow_pickle=allow_pickle))
    _check_adapter_kind(src)
    check_base_matches(base_name, src, allow_base_mismatch)
    initial = _initial_factors(src, initial_adapter, token, allow_pickle)
    weights = read_adapter_weights(src.path, src.name)
    model = load_base_model(base_name, base_revision, torch_dtype, device, token, quantization_config,
                            allow_pickle=allow_pickle)
    check_adapter_shapes(model, weights, src, base_name)
    del weights
    peft_model = load_peft_adapter(model, src, base_name)
    check_quantized_layers(peft_model)
    read = _read_adapted_layers(peft_model, src, initial, os.fspath(initial_adapter or ""), progress)
    if not read.layers:
        raise JanusError(f"adapter {src.name!r} adapts no layer of base model {base_name!r}")
    modules_to_save = sorted(
        n.removeprefix(PEFT_PREFIX) for n, m in peft_model.named_modules()
        if type(m).__name__ == "ModulesToSaveWrapper"
    )
    merged = _merge(peft_model, src, base_name, progress)
    bias = getattr(src.config, "bias", "none")
    changes_bias = bias not in (None, "none")
    logger.info("loaded %s adapter %r onto %r: %d adapted layer(s)", src.kind, src.name, base_name,
                len(read.layers))
    return EffectiveModel(
        model=merged, reference=read.reference, layers=read.layers, adapter=src, base_model=base_name,
        base_revision=base_revision, modules_to_save=modules_to_save, changes_bias=changes_bias,
        quantized=read.quantized, finetuned=read.finetuned, adapter_factors=read.adapter_factors,
        lora_biases=read.lora_biases,
    )


def _merge(peft_model: nn.Module, src: AdapterSource, base_name: str, progress: bool) -> nn.Module:
    """PEFT's own merge, layer by layer, in place: the model the captures run on."""
    try:
        merged = peft_model.merge_and_unload(progressbar=progress)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        raise JanusError(f"PEFT could not merge adapter {src.name!r} into base model {base_name!r}: {err}") from err
    return merged.eval()


def _check_adapter_kind(src: AdapterSource) -> None:
    """Refuse adapters without a weight update (prompt learning) and tasks other than causal LM."""
    config = src.config
    if getattr(config, "is_prompt_learning", False) or src.peft_type.upper() in ("ADAPTION_PROMPT", "CPT"):
        raise JanusError(
            f"adapter {src.name!r} is a {src.peft_type} (prompt-learning) adapter: it adds virtual tokens instead "
            "of changing weights, so there is no weight update to rectify"
        )
    task = getattr(config, "task_type", None)
    task = str(getattr(task, "value", task)) if task is not None else None
    if task not in (None, "CAUSAL_LM"):
        raise JanusError(f"adapter {src.name!r} has task_type={task}; JANUS rectifies causal language models only")


def _initial_factors(src: AdapterSource, initial_adapter: Union[str, os.PathLike, None],
                     token: Union[str, bool, None], allow_pickle: bool) -> Optional[dict[str, Tensor]]:
    """The factors (A0, B0) of ``initial_adapter`` where θ0 needs them; refuses the PiSSA-like cases that can
    be rectified neither without it nor at all."""
    config, mutating = src.config, src.mutating_init
    reconstruct = _rebuilds_pissa(src, initial_adapter is not None)
    initial = None
    if initial_adapter is not None:
        if src.peft_type.upper() != "LORA" or getattr(config, "use_dora", False):
            raise JanusError("initial_adapter is only meaningful for unconverted PiSSA-like LoRA adapters (not DoRA)")
        initial = _load_initial_adapter(initial_adapter, token, allow_pickle)
    elif mutating is not None and not reconstruct:
        raise JanusError(
            f"adapter {src.name!r} was initialized with init_lora_weights={mutating!r} and saved unconverted: its "
            f"weights are relative to a residual base that cannot be rebuilt exactly (randomized or data-dependent "
            f"initialization). Pass initial_adapter=<the adapter saved right after initialization> "
            f"(--initial-adapter), or convert it with PEFT: peft_model.save_pretrained(out, "
            f"path_initial_model_for_weight_conversion=<that initial adapter>)"
        )
    if mutating is not None and getattr(config, "use_dora", False):
        raise JanusError(f"adapter {src.name!r} combines DoRA with init_lora_weights={mutating!r}; convert it first")
    return initial


def load_peft_adapter(model: nn.Module, src: AdapterSource, base_name: str) -> nn.Module:
    """PEFT's ``PeftModel.from_pretrained`` of the adapter onto the loaded base, in inference mode (nothing requires
    grad; the merger's factor repair switches its factors on itself)."""
    from peft import PeftModel

    load_config = copy.deepcopy(src.config)
    load_config.inference_mode = True
    if src.mutating_init is not None:
        load_config.init_lora_weights = True  # load the factors onto the untouched base; W_res is handled later
    try:
        return PeftModel.from_pretrained(model, src.path, adapter_name=_ADAPTER_NAME, config=load_config)
    except (RuntimeError, ValueError, KeyError) as err:
        raise JanusError(
            f"PEFT could not load adapter {src.name!r} onto base model {base_name!r}: {err}. Pass the base model "
            "the adapter was trained on"
        ) from err


@dataclass
class _AdaptedWeights:
    """What :func:`_read_adapted_layers` read: per adapted layer its description, θ0 and exact θ̂."""

    layers: dict[str, AdaptedLayer] = field(default_factory=dict)
    reference: dict[str, Tensor] = field(default_factory=dict)
    finetuned: dict[str, Tensor] = field(default_factory=dict)
    adapter_factors: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    lora_biases: dict[str, Tensor] = field(default_factory=dict)
    quantized: bool = False


def _read_adapted_layers(peft_model: nn.Module, src: AdapterSource, initial: Optional[dict[str, Tensor]],
                         initial_name: str, progress: bool) -> _AdaptedWeights:
    """θ0 and the exact θ̂ of every adapted layer, one layer at a time; a layer on a quantized base becomes a dense
    stand-in holding θ̂ (PEFT's merge would requantize and round ΔW away)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    mutating = src.mutating_init
    reconstruct = _rebuilds_pissa(src, initial is not None)
    tuners = [(n, m) for n, m in peft_model.named_modules() if isinstance(m, BaseTunerLayer)]
    tuners = [(n, m) for n, m in tuners if hasattr(m, "get_base_layer") and m.get_base_layer() is not m]
    out = _AdaptedWeights(quantized=any(on_quantized_base(m) for _, m in tuners))
    if out.quantized and (mutating is not None or initial is not None):
        raise JanusError(
            f"adapter {src.name!r} was initialized with init_lora_weights={mutating!r} on a quantized base: its "
            "residual base cannot be rebuilt from quantized weights. Rectify it against the full-precision base "
            "(without quantization_config)"
        )
    with torch.no_grad():
        for qualified, module in tqdm(tuners, desc="Reading adapted layers", disable=not progress, leave=False):
            name = qualified.removeprefix(PEFT_PREFIX)
            if name in out.layers:
                continue
            info = out.layers[name] = _describe(name, module)
            key = name + ".weight"
            term = lora_bias_term(module, _ADAPTER_NAME)
            if term is not None:
                out.lora_biases[name + ".bias"] = term.float().cpu()
            if on_quantized_base(module):
                out.reference[key] = dequantized_weight(module.get_base_layer()).float().cpu()
                out.finetuned[key] = effective_params(module, torch.float32)[0].cpu()
                peft_model.get_base_model().set_submodule(name, dense_stand_in(module, out.finetuned[key]))
                continue
            if info.layer_type in ("linear", "embedding"):
                out.reference[key] = module.get_base_layer().weight.detach().clone().cpu()
            if reconstruct and info.layer_type != "other":
                out.reference[key] = _reconstruct_pissa(module, mutating)
            elif initial is not None:
                out.reference[key] = _subtract_initial(module, name, initial, initial_name)
            if info.layer_type == "linear":
                out.finetuned[key] = effective_params(module, torch.float32)[0].detach().cpu()
                if (reconstruct or initial is not None) and _ADAPTER_NAME in getattr(module, "lora_A", {}):
                    out.adapter_factors[key] = (
                        module.lora_B[_ADAPTER_NAME].weight.detach().float().cpu() * module.scaling[_ADAPTER_NAME],
                        module.lora_A[_ADAPTER_NAME].weight.detach().float().cpu())
    return out
