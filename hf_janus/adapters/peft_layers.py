"""The adapted layers of a live ``PeftModel`` during training: which they are, their effective weights, and a
plain view of the model for rectification.

JANUS works on *effective* weights: for an adapted layer that is what PEFT's own merge would produce (base
weight plus the adapter's delta, DoRA's magnitude included). PiSSA-like initializations start from a
residual base with a non-zero adapter, so θ0 is not the base weight: it is the effective weight at train
begin. The engine itself only knows plain linear layers; :func:`plain_view` swaps each tuner layer for its
base layer holding the effective weight for the duration of the rectification, and puts everything back.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from hf_janus.engine.layers import rule_for, select_layers
from hf_janus.engine.public import (
    compute_dtype,
    cuda_in_use_and_capacity,
    dequantized_weight,
    is_supported_quantized,
    quantization_of,
    unsupported_quantized_error,
)
from hf_janus.errors import JanusError
from hf_janus.parallel.sharding import full_weight, gathered, is_sharded, passes_inside, write_full_

logger = logging.getLogger(__name__)

# init_lora_weights values that move part of the base weight into the adapter at initialization.
MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def is_mutating_init(init: Any) -> bool:
    """Whether ``init_lora_weights`` moved part of the base weight into the adapter (PiSSA, OLoRA, ...)."""
    return isinstance(init, str) and init.lower().startswith(MUTATING_INITS)


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def inner_model(peft_model: nn.Module) -> nn.Module:
    """The transformers model inside a ``PeftModel`` (whose module names are the plain model's names)."""
    return peft_model.get_base_model()


def _tuner_layers(model: nn.Module, active_only: bool = True) -> dict[str, nn.Module]:
    """The tuner layers, by default only those that hold the active adapter. A layer that holds only other
    (inactive) adapters computes its base layer's output and did not change with the active adapter's training:
    it is no target, and it has no factors of the active adapter's name."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and hasattr(module, "get_base_layer"):
            if module.get_base_layer() is not module and (not active_only or _holds_active_adapter(module)):
                found[name] = module
    return found


def _holds_active_adapter(module: nn.Module) -> bool:
    held = set()
    for layer_name in getattr(module, "adapter_layer_names", ()):
        held.update(getattr(module, layer_name, {}) or {})
    return any(adapter in held for adapter in module.active_adapters)


def lora_bias_term(module: nn.Module, adapter: Optional[str] = None) -> Optional[Tensor]:
    """``scaling · lora_B.bias``, what a LoRA adapter trained with ``lora_bias=True`` adds to the layer's bias
    (PEFT's forward and merge), or None when the adapter has no bias of its own."""
    adapter = adapter or active_adapter(module)
    if not (getattr(module, "lora_bias", {}) or {}).get(adapter, False):
        return None
    bias = module.lora_B[adapter].bias
    return None if bias is None else bias.detach() * module.scaling[adapter]


def check_lora_bias(peft_model: nn.Module) -> None:
    """Refuse, before training, adapters trained with ``lora_bias=True`` on layers without a bias of their own:
    PEFT cannot merge them, and the plain model has no bias to hold what they add."""
    bad = [name for name, module in _tuner_layers(inner_model(peft_model)).items()
           if lora_bias_term(module) is not None and getattr(module.get_base_layer(), "bias", None) is None]
    if bad:
        raise JanusError(
            f"the adapter was trained with lora_bias=True on layer(s) without a bias ({', '.join(bad[:3])}"
            f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}): PEFT cannot merge such a layer, so its "
            "effective weights do not exist as a plain layer. Train with lora_bias=False, or narrow the adapter's "
            "target_modules to layers that have a bias"
        )


def adapted_linear_layers(peft_model: nn.Module, target_modules: Union[str, list[str]] = "all-linear",
                          exclude_modules: Union[str, list[str], None] = None) -> dict[str, nn.Module]:
    """``{name in the plain model: tuner layer}`` of the adapted linear layers, narrowed by the config.

    By default JANUS rectifies exactly the layers the adapter touches; ``target_modules`` and
    ``exclude_modules`` can only narrow that set (a layer without adapter did not change during training).
    """
    tuners = _tuner_layers(inner_model(peft_model))
    linear = {n: m for n, m in tuners.items() if rule_for(m.get_base_layer()) is not None}
    if not linear:
        kinds = sorted({type(m.get_base_layer()).__name__ for m in tuners.values()}) or ["none"]
        raise JanusError(
            f"the PEFT model adapts no linear layer (adapted layer types: {', '.join(kinds)}); JANUS rectifies "
            "linear layers"
        )
    return {n: linear[n] for n in select_layers(list(linear), target_modules, exclude_modules)}


def active_adapter(module: nn.Module) -> str:
    active = module.active_adapters
    if len(active) != 1:
        raise JanusError(
            f"{len(active)} adapters are active ({', '.join(active)}); JANUS rectifies one adapter at a time: "
            "activate a single adapter with model.set_adapter(name)"
        )
    return active[0]


def on_quantized_base(module: nn.Module) -> bool:
    """Whether the tuner layer adapts a quantized base layer (QLoRA)."""
    return is_supported_quantized(module.get_base_layer())


@contextlib.contextmanager
def computing_in(module: nn.Module, dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Hold the tuner layer's dense base weight and bias and its adapter tensors as ``dtype`` copies inside,
    the original tensors again on exit (``None``: as they are).

    PEFT merges in the base's dtype: on a bf16 base ``W + ΔW`` is rounded to bf16, and its difference from ``W``
    is rounding noise wherever ``ΔW`` is small against ``W``. Merging float32 copies gives the update exactly.
    """
    if dtype is None:
        yield
        return
    base = module.get_base_layer()
    tensors = list(_adapter_tensors(module).values())
    if not on_quantized_base(module):
        tensors += [t for t in (getattr(base, "weight", None), getattr(base, "bias", None)) if isinstance(t, Tensor)]
    saved = [(t, t.data) for t in tensors if t.is_floating_point() and t.dtype != dtype]
    try:
        with torch.no_grad():
            for tensor, data in saved:
                tensor.data = data.to(dtype)
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data


def effective_params(module: nn.Module, dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Optional[Tensor]]:
    """The weight and bias PEFT's merge would give this tuner layer (stored layout of the base layer).

    Runs PEFT's own ``merge(safe_merge=True)``, which computes into copies, then puts the original tensors
    back, so any adapter kind PEFT can merge is covered and the layer is left exactly as it was. On a quantized
    base, where merging would requantize, it is the dequantized base plus PEFT's ``get_delta_weight`` (the LoRA
    kinds :func:`check_quantized_layers` lets through are exactly that). ``dtype``: compute and return in this
    dtype (float32 for an exact update, see :func:`computing_in`); by default the base's (compute) dtype.
    """
    with computing_in(module, dtype):
        return _effective_params(module, dtype)


def _effective_params(module: nn.Module, dtype: Optional[torch.dtype]) -> tuple[Tensor, Optional[Tensor]]:
    base = module.get_base_layer()
    if on_quantized_base(module):
        with torch.no_grad():
            weight = dequantized_weight(base)
            weight = weight.to(dtype) if dtype is not None else weight
            weight += module.get_delta_weight(active_adapter(module)).to(weight.dtype)
        return weight, effective_bias(module, dtype)
    weight = base.weight.data
    bias = base.bias.data if isinstance(getattr(base, "bias", None), Tensor) else None
    merged_before = list(getattr(module, "merged_adapters", []))
    if merged_before:  # already merged: the base layer holds the effective values
        return weight.detach().clone(), None if bias is None else bias.detach().clone()
    try:
        module.merge(safe_merge=True)
        eff_weight = base.weight.data.detach().clone()
        eff_bias = base.bias.data.detach().clone() if bias is not None else None
    except (ValueError, RuntimeError) as err:
        raise JanusError(f"PEFT could not merge the adapter of a {type(base).__name__} layer: {err}") from err
    finally:
        base.weight.data = weight
        if bias is not None:
            base.bias.data = bias
        if hasattr(module, "merged_adapters"):
            module.merged_adapters[:] = merged_before
    return eff_weight, eff_bias


def effective_bias(module: nn.Module, dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """The bias of a tuner layer as PEFT's forward applies it: the base's, plus the LoRA bias of an adapter trained
    with ``lora_bias=True``; in ``dtype`` (default: the base bias's own). None where the base has no bias."""
    base = module.get_base_layer()
    bias = base.bias if isinstance(getattr(base, "bias", None), Tensor) else None
    if bias is None:
        return None
    out = bias.detach().to(dtype or bias.dtype, copy=True)
    term = lora_bias_term(module)
    if term is not None:
        out += term.to(device=out.device, dtype=out.dtype)
    return out


def effective_weights(layers: dict[str, nn.Module]) -> dict[str, Tensor]:
    """``{"<name>.weight": effective weight on the CPU, float32}`` for the given tuner layers (one layer at a
    time), computed in float32 whatever the base dtype (see :func:`computing_in`)."""
    return {f"{name}.weight": _effective_on_cpu(module) for name, module in layers.items()}


def _effective_on_cpu(module: nn.Module) -> Tensor:
    with torch.no_grad(), gathered(module):
        return effective_params(module, torch.float32)[0].to("cpu", copy=True).contiguous()


def check_quantized_layers(peft_model: nn.Module) -> None:
    """Refuse adapted layers whose quantized base JANUS cannot read, and adapters on a quantized base that are
    not plain LoRA, naming the layer, what it is, and what is supported."""
    for name, module in _tuner_layers(inner_model(peft_model)).items():
        base = module.get_base_layer()
        if quantization_of(base) is None:
            continue
        if not is_supported_quantized(base):
            raise JanusError(unsupported_quantized_error(name, base))
        adapter = active_adapter(module)
        variant = (getattr(module, "lora_variant", {}) or {}).get(adapter)
        if not hasattr(module, "get_delta_weight") or variant is not None:
            kind = type(variant).__name__ if variant is not None else type(module).__name__
            raise JanusError(
                f"layer {name!r} has a {kind} adapter on a quantized base: on quantized bases hf-janus rectifies "
                "plain LoRA adapters (rsLoRA and any rank or alpha included; not DoRA or other variants). Train a "
                "plain LoRA, or train on an unquantized base"
            )


def _base_trains(module: nn.Module) -> bool:
    base = module.get_base_layer()
    return any(p.requires_grad for p in base.parameters(recurse=False))


def _adapter_tensors(module: nn.Module) -> dict[str, Tensor]:
    """The adapter's own parameters of a tuner layer (everything but its base layer), by local name."""
    return {n: p for n, p in module.named_parameters() if not n.startswith("base_layer.")}


def initial_state(layers: dict[str, nn.Module]) -> dict[str, Tensor]:
    """What θ0 of the adapted layers needs, taken at train begin, on the CPU.

    For a layer whose base is frozen (PEFT's default, and always on a quantized base) it is only the adapter's
    own tensors (``"<name>.<local parameter name>"``): θ0 is rebuilt from the base and them at train end by
    :func:`theta0_weights`, in float32, and the snapshot costs about the adapter's size instead of a dense copy.
    A layer whose base weight trains too keeps its effective weight (``"<name>.weight"``, float32).
    """
    out = {}
    for name, module in layers.items():
        if on_quantized_base(module) or not _base_trains(module):
            with gathered(module):
                out.update({f"{name}.{local}": p.detach().to("cpu", copy=True).contiguous()
                            for local, p in _adapter_tensors(module).items()})
        else:
            out[f"{name}.weight"] = _effective_on_cpu(module)
    return out


def theta0_weights(layers: dict[str, nn.Module], state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{"<name>.weight": θ0 on the CPU, float32}`` from an :func:`initial_state`: as saved for a base that
    trains; otherwise the (dequantized) base merged with the initial adapter tensors in float32, put in for the
    computation (one layer at a time) and taken out again."""
    out = {}
    for name, module in layers.items():
        key = f"{name}.weight"
        if key in state:  # a base that trains: its effective weight itself was kept
            out[key] = state[key].float()
            continue
        with gathered(module), _adapter_set_to(module, name, state):
            out[key] = _effective_on_cpu(module)
    return out


@contextlib.contextmanager
def _adapter_set_to(module: nn.Module, name: str, state: dict[str, Tensor]) -> Iterator[None]:
    """The tuner layer's adapter tensors hold their values from ``state`` (``"<name>.<local name>"``, as
    :func:`initial_state` takes them) inside, their own again on exit."""
    # only the active adapter's tensors enter the effective weight; another adapter may have been added since the
    # snapshot (JanusCallback's new_adapter_name writes into one while θ0 and θ̂ are still read)
    active = set(module.active_adapters)
    current = {local: p for local, p in _adapter_tensors(module).items() if active & set(local.split("."))}
    missing = [local for local in current if f"{name}.{local}" not in state]
    if missing:
        raise JanusError(f"the θ0 snapshot has no initial {missing[0]} of layer {name!r}: it was taken of "
                         "another adapter")
    saved = {local: p.data for local, p in current.items()}
    try:
        for local, p in current.items():
            p.data = state[f"{name}.{local}"].to(device=p.device, dtype=p.dtype)
        yield
    finally:
        for local, p in current.items():
            p.data = saved[local]


class AdapterOnQuantizedBase:
    """θ0 and θ̂ of a tuner layer on a quantized base, rebuilt when the engine needs them (it implements
    :class:`~hf_janus.engine.target_layers.RebuiltWeights`): the dequantized base plus the adapter as it was at
    train begin (from :func:`initial_state`) or as it was when this was made, in float32, one layer at a time.

    Why: holding both in float32 for every adapted layer costs two dense copies of the model (52 GB at 7B) on a
    machine chosen because the quantized model fits it. The base is never written; the trained adapter is copied
    here (its size, not the layer's), so θ̂ stays what it was once the rectified update is written into the adapter.
    """

    def __init__(self, module: nn.Module, name: str, state: dict[str, Tensor]):
        self.module, self.name = module, name
        self.initial = {key: t for key, t in state.items() if key.startswith(f"{name}.")}
        with gathered(module):
            self.trained = {f"{name}.{local}": p.detach().to("cpu", copy=True)
                            for local, p in _adapter_tensors(module).items()}
        # writing the result back may change the adapter's rank, hence its scaling α/r
        self.scaling = dict(module.scaling)

    def finetuned(self, device: torch.device) -> Tensor:
        return self._effective(self.trained, device)

    def reference(self, device: torch.device) -> Tensor:
        return self._effective(self.initial, device)

    def _effective(self, state: dict[str, Tensor], device: torch.device) -> Tensor:
        scaling = dict(self.module.scaling)
        try:
            self.module.scaling.update(self.scaling)
            with torch.no_grad(), gathered(self.module), _adapter_set_to(self.module, self.name, state):
                return effective_params(self.module, torch.float32)[0].to(device)
        finally:
            self.module.scaling.clear()
            self.module.scaling.update(scaling)


def rebuilt_on_quantized_bases(layers: dict[str, nn.Module], state: dict[str, Tensor]
                               ) -> dict[str, AdapterOnQuantizedBase]:
    """``{name: AdapterOnQuantizedBase}`` for the layers of ``layers`` on a quantized base whose θ0 ``state`` holds as
    initial adapter tensors (every one :func:`initial_state` took)."""
    return {name: AdapterOnQuantizedBase(module, name, state) for name, module in layers.items()
            if on_quantized_base(module) and f"{name}.weight" not in state}


def _set_child(root: nn.Module, name: str, child: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, child)


@contextlib.contextmanager
def plain_view(peft_model: nn.Module, weights: dict[str, Tensor],
               rebuilt: Optional[dict[str, AdapterOnQuantizedBase]] = None) -> Iterator[nn.Module]:
    """Yield the inner model with every tuner layer replaced by its base layer holding its effective
    weight and bias (``weights["<name>.weight"]``, or ``rebuilt[name].finetuned``, where given); on exit everything
    is as before.

    Inside, the model is an ordinary transformers model that computes exactly what the PEFT model
    computes and that :class:`~hf_janus.Rectifier` can work on, with the plain model's module names. A layer on
    a quantized base is swapped for a :func:`dense_stand_in` instead (its base is never written); the stand-ins
    live on the host when the device has no room for them (:func:`stand_in_home`). Under FSDP2, where the forward
    gathers the shards themselves, the effective values go into the base's shards in place (and the trained ones
    back on exit), and the inner model runs inside the root (:func:`~hf_janus.parallel.sharding.passes_inside`).
    """
    model = inner_model(peft_model)
    tuners = _tuner_layers(model)
    # layers holding only inactive adapters compute their base layer: that is what stands in their place
    inactive = {n: m for n, m in _tuner_layers(model, active_only=False).items() if n not in tuners}
    rebuilt = rebuilt or {}
    home = stand_in_home([m for m in tuners.values() if on_quantized_base(m)])
    saved: dict[str, tuple[nn.Module, Tensor, Optional[Tensor]]] = {}
    in_place: list[tuple[Tensor, Tensor]] = []  # sharded parameters written in place, with their whole values before
    try:
        with torch.no_grad():
            for name, module in inactive.items():
                saved[name] = (module, None, None)
                _set_child(model, name, module.get_base_layer())
            for name, module in tuners.items():
                base = module.get_base_layer()
                given = weights.get(f"{name}.weight")
                if given is None and name in rebuilt:
                    given = rebuilt[name].finetuned(base.weight.device)
                if on_quantized_base(module):
                    # a dense stand-in, built one layer at a time; the quantized base is left untouched
                    saved[name] = (module, None, None)
                    with gathered(module):
                        stand_in = dense_stand_in(module, given, home)
                    _set_child(model, name, stand_in)
                    del given, stand_in
                    continue
                with gathered(module):
                    eff_weight, eff_bias = effective_params(module)
                if given is not None:
                    eff_weight = given
                if is_sharded(base.weight):
                    # FSDP2 all-gathers the shards themselves: the effective values go into them in place
                    _write_sharded(base, eff_weight, eff_bias, in_place)
                    saved[name] = (module, None, None)
                    _set_child(model, name, base)
                    continue
                bias = base.bias.data if eff_bias is not None else None
                saved[name] = (module, base.weight.data, bias)
                base.weight.data = eff_weight.to(device=base.weight.device, dtype=base.weight.dtype, copy=True)
                if eff_bias is not None:
                    base.bias.data = eff_bias
                _set_child(model, name, base)
        with passes_inside(peft_model, model):
            yield model
    finally:
        with torch.no_grad():
            for param, whole in reversed(in_place):
                write_full_(param, whole)
        for name, (module, weight, bias) in saved.items():
            base = module.get_base_layer()
            if weight is not None:
                base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            _set_child(model, name, module)


def _write_sharded(base: nn.Module, weight: Tensor, bias: Optional[Tensor], in_place: list) -> None:
    """Write a sharded base layer's new weight (and bias) into its shards, noting in ``in_place`` each parameter's whole
    value before, to be written back (collectives: every rank writes the same layers in the same order)."""
    for param, value in ((base.weight, weight), (getattr(base, "bias", None), bias)):
        if value is None or not isinstance(param, Tensor):
            continue
        whole = full_weight(param).to("cpu", copy=True)  # θ̂'s base, kept on the host as the engine keeps θ̂
        if torch.equal(whole, value.to("cpu", whole.dtype)):
            continue
        in_place.append((param, whole))
        write_full_(param, value)


#: Share of the device memory left to the run that the dense stand-ins of a quantized model may take; beyond it they
#: live on the host and each is brought to the device only while its layer runs (the activations need the rest).
STAND_IN_DEVICE_SHARE = 0.5


def stand_in_home(modules: list[nn.Module]) -> Optional[torch.device]:
    """Where the dense stand-ins of ``modules`` (tuner layers on quantized bases) keep their weights: ``None`` (the
    base's device) when they fit :data:`STAND_IN_DEVICE_SHARE` of what the run may still fill there (the memory
    plan's measure), else the host.

    Why: a QLoRA model is chosen because its quantized base fits the card; dense stand-ins of every adapted layer
    would need the dense model's memory (13 GB at 7B in bf16) on top of it."""
    if not modules:
        return None
    device = modules[0].get_base_layer().weight.device
    if device.type != "cuda":
        return None
    need = sum(m.get_base_layer().in_features * m.get_base_layer().out_features
               * torch.empty((), dtype=compute_dtype(m.get_base_layer())).element_size() for m in modules)
    in_use, capacity = cuda_in_use_and_capacity(device)
    if need <= STAND_IN_DEVICE_SHARE * (capacity - in_use):
        return None
    logger.info("JANUS: the dense stand-ins of %d quantized layers (%.1f GiB) stay on the host; each is brought to "
                "%s only while its layer runs", len(modules), need / 2**30, device)
    return torch.device("cpu")


class _FrozenLinear(torch.autograd.Function):
    """``y = x Wᵀ + b`` with ``W`` and ``b`` frozen, kept wherever they are (the host, for stand-ins the device cannot
    hold): they are brought to ``x``'s device for the product, in the forward and again in the backward, so that
    no layer's device copy waits for the backward. Only the input gradient flows."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(weight)
        on = weight.to(x.device, non_blocking=True)
        return nn.functional.linear(x, on, None if bias is None else bias.to(x.device, non_blocking=True))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        return grad.matmul(weight.to(grad.device, non_blocking=True)), None, None


class DenseStandIn(nn.Linear):
    """A dense ``nn.Linear`` in a quantized layer's place. Like bitsandbytes' layers it computes in its own dtype
    (the quantized layer's compute dtype) and hands back the input's dtype: an 8-bit layer of a bf16 model has no
    compute dtype of its own, so its stand-in holds float32 while the activations around it are bf16. Its weight
    may live on the host while the activations are on the device (see :func:`stand_in_home`). It is frozen (no
    weight gradient is kept) unless its weight requires grad, as the repair after JANUS asks while it trains the
    effective weights."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.weight.requires_grad:
            return _FrozenLinear.apply(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.device)
        return nn.functional.linear(x.to(self.weight.dtype), self.weight.to(x.device), bias).to(x.dtype)


def dense_stand_in(module: nn.Module, weight: Optional[Tensor], home: Optional[torch.device] = None) -> nn.Linear:
    """A :class:`DenseStandIn` computing what the tuner layer on a quantized base computes, holding ``weight`` (its
    effective weight when ``None``) in the base's compute dtype, on ``home`` (default: the base's device)."""
    base = module.get_base_layer()
    if weight is None:
        weight = effective_params(module)[0]
    bias = effective_bias(module, torch.float32)  # the adapter's own bias too (lora_bias=True)
    dense = DenseStandIn(base.in_features, base.out_features, bias=bias is not None, device="meta")
    device, dtype = home or base.weight.device, compute_dtype(base)
    dense.weight = nn.Parameter(weight.to(device=device, dtype=dtype, copy=True), requires_grad=False)
    if bias is not None:
        dense.bias = nn.Parameter(bias.detach().to(device=base.weight.device, dtype=dtype, copy=True),
                                  requires_grad=False)
    return dense
