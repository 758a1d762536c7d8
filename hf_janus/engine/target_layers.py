"""The layers a rectification changes: their θ0, θ̂ and θ_t, reading θ0 from a reference model or state dict, and
the one place that decides which point the model's weights hold.

Weights are kept as ``(d_out, d_in)`` matrices whatever the module stores (:mod:`.layers` knows each layout).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union, runtime_checkable

import torch
from torch import Tensor, nn

from hf_janus.engine.ghost import GramEig, LayerJacobian
from hf_janus.engine.layers import LayerRule, rule_for
from hf_janus.errors import JanusError
from hf_janus.parallel.sharding import full_master_weight, full_shape, full_weight, reshard, write_full_

Reference = Union[nn.Module, Mapping[str, Tensor]]


@runtime_checkable
class RebuiltWeights(Protocol):
    """θ0 and θ̂ of one layer computed when needed instead of held: for an adapter on a quantized base they are the
    dequantized base plus the reference (untrained) or the trained adapter, so that no dense copy of every adapted
    layer is kept through the run (at 7B two float32 copies would take 52 GB). Each call returns a fresh float32
    ``(d_out, d_in)`` matrix on ``device``; the two must be the same every time they are asked for."""

    def reference(self, device: torch.device) -> Tensor: ...

    def finetuned(self, device: torch.device) -> Tensor: ...


@dataclass(frozen=True)
class WeightSource:
    """Where a rectification reads θ0 (the *reference*: the weights before fine-tuning) and θ̂ of its target layers.

    - ``reference``: θ0 as a model with the same architecture, or a state dict holding ``"<layer name>.weight"``
      (native layout) for every target layer not in ``rebuilt``;
    - ``finetuned``: θ̂ of every such layer, same keys, when the caller knows it more exactly than the model's weights
      hold it (an adapter's update on a bf16 base: the model holds round(W + ΔW), and round(W + ΔW) − W is rounding
      noise where ΔW is small). ΔW is then ``finetuned − reference`` in float32, and the caller keeps the float32
      θ_rect (``result.layers[name].rectified``). None: θ̂ is the model's weights;
    - ``rebuilt``: ``{layer name: RebuiltWeights}`` for layers whose θ0 and θ̂ are computed when needed instead of
      read and held (an adapter on a quantized base); as with ``finetuned``, the caller keeps θ_rect.

    ``Rectifier(model, reference, ...)`` takes one, or a bare model or state dict (``WeightSource(reference)``).
    """

    reference: Reference = field(default_factory=dict)
    finetuned: Optional[Mapping[str, Tensor]] = None
    rebuilt: Mapping[str, RebuiltWeights] = field(default_factory=dict)

    @classmethod
    def of(cls, weights: Union[WeightSource, Reference]) -> WeightSource:
        """``weights`` itself, or a bare reference (model or state dict) as a source of θ0 alone."""
        return weights if isinstance(weights, WeightSource) else cls(weights)

    @property
    def reference_borrowed(self) -> bool:
        """θ0 is the caller's tensors (a state dict), not copied out of a model."""
        return isinstance(self.reference, Mapping)

    def held(self, names: set[str]) -> set[str]:
        """Which of the layers ``names`` read θ0 and θ̂ and hold them (every one not rebuilt when needed)."""
        return set(names) - set(self.rebuilt)


class LayerWeights:
    """θ0 and θ̂ of one target layer, in whichever form the run holds them. The kinds differ in what they hold (and
    so in memory); the rectification asks each the same questions, so that the choice is made once, when the layer
    is built, and not again in every method that reads a weight."""

    #: whether the caller keeps the float32 θ_t rather than the model's weights (an exact or rebuilt θ̂: the model's
    #: low-precision weight would round the rectification away)
    keeps_current: bool = False

    def reference(self, device: torch.device) -> Tensor:
        """θ0 as float32 (d_out, d_in) on ``device``."""
        raise NotImplementedError

    def finetuned(self, device: torch.device) -> Tensor:
        """θ̂ as float32 (d_out, d_in) on ``device``."""
        raise NotImplementedError

    @property
    def reference_matrix(self) -> Optional[Tensor]:
        """The held θ0, (d_out, d_in) in its own dtype; None where it is rebuilt when needed."""
        return None

    def finetuned_native(self) -> Optional[Tensor]:
        """The held θ̂ in the module's layout; None where it is rebuilt when needed."""
        return None

    @property
    def rebuilt(self) -> Optional[RebuiltWeights]:
        """The caller's rebuilder of θ0 and θ̂, where they are computed when needed."""
        return None

    def stored_finetuned(self, device: torch.device) -> Tensor:
        """θ̂ in the module's layout, which written back gives the stored weight bit for bit (for restoring)."""
        raise NotImplementedError


class HeldWeights(LayerWeights):
    """θ0 as a matrix (copied or borrowed) and θ̂ as an exact copy of the stored weight (native layout and dtype):
    the model's weights are θ̂, and the backup is what restoring writes."""

    def __init__(self, rule: LayerRule, reference_matrix: Tensor, backup: Optional[Tensor]):
        # θ0 in its own dtype: exact, and bf16 takes half the bytes of fp32; it lives where the memory plan put it
        self.rule, self._reference, self.backup = rule, reference_matrix, backup

    def reference(self, device: torch.device) -> Tensor:
        return self._reference.to(device, torch.float32)  # no copy for float32 weights already there

    def finetuned(self, device: torch.device) -> Tensor:
        return self.rule.to_matrix(self.backup).to(device, torch.float32)

    @property
    def reference_matrix(self) -> Optional[Tensor]:
        return self._reference

    def finetuned_native(self) -> Optional[Tensor]:
        return self.backup

    def stored_finetuned(self, device: torch.device) -> Tensor:
        return self.backup


class ExactWeights(HeldWeights):
    """θ0 held as :class:`HeldWeights` does, and θ̂ as the float32 (d_out, d_in) the caller gave, on the CPU: the
    caller knows it more exactly than the model's weight holds it (an adapter's update on a bf16 base: the model
    holds round(W + ΔW), whose difference from W is rounding noise where ΔW is small)."""

    keeps_current = True

    def __init__(self, rule: LayerRule, reference_matrix: Tensor, exact: Tensor, backup: Optional[Tensor]):
        # backup: None where the exact θ̂, written back, gives the stored weight bit for bit (then no second copy
        # of θ̂ is kept)
        super().__init__(rule, reference_matrix, backup)
        self.exact = exact

    def finetuned(self, device: torch.device) -> Tensor:
        return self.exact.to(device, torch.float32)

    def finetuned_native(self) -> Optional[Tensor]:
        return self.rule.from_matrix(self.exact)

    def stored_finetuned(self, device: torch.device) -> Tensor:
        return self.backup if self.backup is not None else self.rule.from_matrix(self.exact)


class RebuiltLayerWeights(LayerWeights):
    """θ0 and θ̂ computed when needed by the caller's :class:`RebuiltWeights`: neither is held."""

    keeps_current = True

    def __init__(self, rule: LayerRule, rebuilt: RebuiltWeights, backup: Optional[Tensor]):
        # backup: None where the rebuilt θ̂, written back, gives the stored weight bit for bit
        self.rule, self._rebuilt, self.backup = rule, rebuilt, backup

    def reference(self, device: torch.device) -> Tensor:
        return self._rebuilt.reference(device)

    def finetuned(self, device: torch.device) -> Tensor:
        return self._rebuilt.finetuned(device)

    @property
    def rebuilt(self) -> Optional[RebuiltWeights]:
        return self._rebuilt

    def stored_finetuned(self, device: torch.device) -> Tensor:
        return self.backup if self.backup is not None else self.rule.from_matrix(self._rebuilt.finetuned(device))


@dataclass
class TargetLayer:
    """Everything a rectification keeps about one target layer; weights in (d_out, d_in) layout."""

    name: str
    module: nn.Module
    rule: LayerRule
    weights: LayerWeights  # θ0 and θ̂, held or rebuilt when needed
    # θ_t, float32; θ0, θ_t and the projection live where the memory plan put them (the device, or the host when
    # the device cannot hold them all)
    current: Tensor
    proj: Optional[Tensor] = None  # Δθ_t,proj, float32
    eig: Optional[GramEig] = None  # eigendecomposition of J_t J_tᵀ
    trial_eig: Optional[GramEig] = None
    path: str = "ghost"
    gram_rank0: int = 0
    jvp0: Optional[Tensor] = None  # J_0 (θ̂ - θ0), computed by the first projection, reused by the statistics
    current_jac: Optional[LayerJacobian] = None  # J_t with its materialized rows, kept for the trials of a step
    master_backup: Optional[Tensor] = None  # a ZeRO-3 optimizer's fp32 master copy of a low-precision weight

    def reference(self, device: torch.device) -> Tensor:
        """θ0 as float32 (d_out, d_in) on ``device``; no copy for float32 weights already there."""
        return self.weights.reference(device)

    @property
    def keeps_current(self) -> bool:
        """Whether the caller keeps the float32 θ_t (an exact or rebuilt θ̂) rather than the model's weights."""
        return self.weights.keeps_current

    @property
    def d_out(self) -> int:
        return self.current.shape[0]

    @property
    def d_in(self) -> int:
        return self.current.shape[1]

    def finetuned(self, device: torch.device) -> Tensor:
        """θ̂ as float32 (d_out, d_in) on ``device``: rebuilt or the exact one when given, else the model's weight."""
        return self.weights.finetuned(device)

    def write(self, matrix: Tensor) -> None:
        self.rule.set_weight(self.module, matrix)

    def restore(self) -> None:
        """Put θ̂ back as the module stored it."""
        stored = self.weights.stored_finetuned(self.module.weight.device)
        write_full_(self.module.weight, stored, master=self.master_backup)

    def release_current_jacobian(self) -> None:
        if self.current_jac is not None:
            self.current_jac.release()
            self.current_jac = None


def reference_weight(reference: Reference, name: str, module: nn.Module, rule: LayerRule) -> Tensor:
    """θ0 of one layer in the module's native layout, from a reference model or a state dict."""
    if isinstance(reference, nn.Module):
        ref_module = dict(reference.named_modules()).get(name)
        ref_rule = rule_for(ref_module) if ref_module is not None else None
        if ref_rule is None:
            raise JanusError(
                f"the reference model has no linear layer {name!r}: pass the pre-fine-tuning model of the same "
                f"architecture as {type(module).__name__}'s owner, or a state dict of its weights"
            )
        # a quantized reference (the base a model was fine-tuned from, loaded in 4 or 8 bits): θ0 is its
        # dequantized weight, in the model's layout
        weight = rule.from_matrix(ref_rule.weight(ref_module)) if ref_rule.quantized else ref_module.weight
    elif isinstance(reference, Mapping):
        key = name + ".weight" if name + ".weight" in reference else name
        if key not in reference:
            missing = [name + ".weight"]
            sample = ", ".join(list(reference)[:3])
            raise JanusError(
                f"reference state dict is missing key(s) {missing}: it must hold the weight of every target layer, "
                f"keyed '<module name>.weight' as in model.state_dict() (found e.g. {sample or 'nothing'})"
            )
        weight = reference[key]
        if not isinstance(weight, Tensor):
            raise JanusError(f"reference[{key!r}] is a {type(weight).__name__}, expected a torch.Tensor")
    else:
        raise JanusError(
            f"reference must be a model with the same architecture or a state dict, got {type(reference).__name__}"
        )
    if not (weight.is_floating_point() or weight.is_meta):
        raise JanusError(f"reference weight of {name!r} has dtype {weight.dtype}: θ0 must be the layer's "
                         "floating-point weights (a state dict of the model before fine-tuning)")
    if full_shape(weight) != full_shape(module.weight):
        raise JanusError(
            f"reference weight of {name!r} has shape {full_shape(weight)} but the model's is "
            f"{full_shape(module.weight)}: the reference does not match this model's architecture"
        )
    return full_weight(weight)  # the reference model may be sharded too


def check_finite(tensor: Tensor, what: str) -> None:
    if not torch.isfinite(tensor).all():
        raise JanusError(f"{what} contains NaN/Inf values; rectification needs finite weights")


def storage_of(tensor: Tensor) -> Optional[int]:
    """Where a tensor's data lives, to tell a caller's tensor from the model's own; None where that cannot be read
    (meta tensors, FSDP's DTensors, ZeRO-3's partitioned parameters: none of them is a caller's plain tensor)."""
    if tensor.is_meta:
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _given_finetuned(finetuned: Mapping[str, Tensor], name: str, stored: Tensor) -> Tensor:
    """The caller's exact θ̂ of one layer (the rectifier's ``finetuned``), checked against the model's weight."""
    key = name + ".weight"
    weight = finetuned.get(key)
    if not isinstance(weight, Tensor):
        raise JanusError(f"finetuned has no tensor {key!r}: it must hold θ̂ of every target layer, keyed "
                         "'<module name>.weight' in the module's layout")
    if tuple(weight.shape) != tuple(stored.shape) or not weight.is_floating_point():
        raise JanusError(f"finetuned[{key!r}] is a {weight.dtype} tensor of shape {tuple(weight.shape)}; the "
                         f"layer's weight is {tuple(stored.shape)}: pass θ̂ in the module's layout")
    check_finite(weight, f"fine-tuned weight of {name!r}")
    return weight


def build_target_layer(name: str, module: nn.Module, weights: WeightSource, model_storages: set,
                       reference_home: torch.device, current_home: torch.device) -> TargetLayer:
    """Read one layer's θ̂ and θ0 from ``weights`` (a collective under FSDP and ZeRO-3: every rank builds the same
    layers in the same order). ``model_storages``: the storages of the model's parameters, which a borrowed tensor
    must not share. A layer in ``weights.rebuilt`` has θ0 and θ̂ computed when needed, instead of read and held."""
    reference, finetuned, rebuilt = weights.reference, weights.finetuned, weights.rebuilt.get(name)
    rule = rule_for(module)
    if rebuilt is not None and not rule.quantized:
        return _rebuilt_target_layer(name, module, rule, rebuilt, current_home)
    if rule.quantized:
        raise JanusError(
            f"layer {name!r} is quantized ({rule.name}): rectify() writes rectified weights into the model's "
            "layers, and requantizing would round the update away. For a LoRA adapter trained on a quantized "
            "base (QLoRA) use JanusCallback or JanusMerger, which write the update into the adapter; or load "
            "the model unquantized, or leave these layers out with exclude_modules"
        )
    stored = full_weight(module.weight)
    check_finite(stored, f"fine-tuned weight of {name!r}")
    ref = reference_weight(reference, name, module, rule)
    check_finite(ref, f"reference weight of {name!r}")
    # A state dict's tensors are the caller's and nothing here writes into θ0: no copy, unless one shares storage
    # with the model (θ0 = model.state_dict() itself), whose weights every trial overwrites. A reference model's
    # weights are copied: they can change under the result that holds them.
    borrowed = isinstance(reference, Mapping) and storage_of(ref) not in model_storages | {None}
    ref_matrix = rule.to_matrix(ref).to(reference_home, copy=not borrowed)
    exact = None
    if finetuned is not None:
        exact = rule.to_matrix(_given_finetuned(finetuned, name, stored)).to("cpu", torch.float32)
        if storage_of(exact) in model_storages | {None}:
            exact = exact.clone()
    # the backup is only copied where the exact θ̂ would not write the stored weight back bit for bit
    restores = exact is not None and torch.equal(rule.from_matrix(exact).to(stored.dtype), stored.cpu())
    backup = None if restores else stored.clone().cpu()
    held = (HeldWeights(rule, ref_matrix, backup) if exact is None
            else ExactWeights(rule, ref_matrix, exact, backup))
    return TargetLayer(name=name, module=module, rule=rule, weights=held,
                       current=ref_matrix.to(current_home, torch.float32, copy=True),
                       master_backup=full_master_weight(module.weight))


def _rebuilt_target_layer(name: str, module: nn.Module, rule: LayerRule, rebuilt: RebuiltWeights,
                          current_home: torch.device) -> TargetLayer:
    """A layer whose θ0 and θ̂ are rebuilt when needed: checked once here, then only θ_t is held."""
    stored = full_weight(module.weight)
    device = stored.device
    reference, finetuned = rebuilt.reference(device), rebuilt.finetuned(device)
    shape = tuple(rule.to_matrix(stored).shape)
    for what, matrix in (("reference", reference), ("fine-tuned", finetuned)):
        if tuple(matrix.shape) != shape or matrix.dtype != torch.float32:
            raise JanusError(f"the rebuilt {what} weight of {name!r} is a {matrix.dtype} tensor of shape "
                             f"{tuple(matrix.shape)}; the layer's weight is {shape}: rebuild float32 (d_out, d_in)")
        check_finite(matrix, f"{what} weight of {name!r}")
    # restoring writes the rebuilt θ̂; a backup only where that would not give the stored weight bit for bit
    restores = torch.equal(rule.from_matrix(finetuned).to(stored.dtype), stored)
    del finetuned
    backup = None if restores else stored.clone().cpu()
    return TargetLayer(name=name, module=module, rule=rule, weights=RebuiltLayerWeights(rule, rebuilt, backup),
                       current=reference.to(current_home, copy=True), master_backup=full_master_weight(module.weight))


#: ``TargetLayers.held``: the model holds θ_t, not a trial
CURRENT = "θ_t"


class TargetLayers(Sequence):
    """The target layers of one rectification, and which point their weights hold: θ_t (:data:`CURRENT`), the
    trial captured as some tag, or nothing known (``None``, e.g. θ̂ before the run). Every write goes through here,
    so that what the model holds is decided in one place."""

    def __init__(self, model: nn.Module, layers: list[TargetLayer], device: torch.device):
        self.model, self.layers, self.device = model, layers, device
        self.held: Optional[str] = None

    def __getitem__(self, index):  # type: ignore[override]
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[TargetLayer]:
        return iter(self.layers)

    def _write(self, alpha: Optional[float] = None) -> None:
        reshard(self.model)
        for layer in self.layers:
            current = layer.current.to(self.device)
            layer.write(current if alpha is None else current + alpha * layer.proj.to(self.device))

    def write_trial(self, alpha: float, tag: str) -> None:
        """Write the trial point θ_t + α·Δθ_proj, to be captured as ``tag``."""
        self.held = None
        self._write(alpha)
        self.held = tag

    def write_reference(self, tag: str) -> None:
        """Write θ0, to be captured (again) as ``tag``; rounded as θ0 was when the run began from it."""
        self.held = None
        reshard(self.model)
        for layer in self.layers:
            layer.write(layer.reference(self.device))
        self.held = tag

    def hold_current(self) -> None:
        """Make the model hold θ_t, unless it already does."""
        if self.held != CURRENT:
            self._write()
            self.held = CURRENT

    def rewrite_current(self) -> None:
        """Write θ_t whatever the model holds (θ_t changed in place, e.g. synchronized from another rank)."""
        self.held = None
        self.hold_current()

    def move_to(self, tag: str, alpha: float) -> None:
        """Take the trial ``tag`` at step size ``alpha``: θ_t ← θ_t + α·Δθ_proj, and the model holds the new θ_t.

        The model holds the taken trial only when it was the last one written; after a fall-back to a kept trial
        it holds the failed larger probe, so θ_t is written now, before a budget or anything else can end the loop.
        """
        for layer in self.layers:
            # in place (no second θ_t-sized tensor), rounded as the trial written by write_trial was
            layer.current.add_(alpha * layer.proj.to(layer.current.device))
            layer.proj, layer.eig, layer.trial_eig = None, layer.trial_eig, None
        if self.held == tag:
            self.held = CURRENT
        self.hold_current()

    def restore(self) -> None:
        """Put θ̂ back into every layer (after a failure)."""
        self.held = None
        reshard(self.model, after_error=True)
        for layer in self.layers:
            layer.restore()

    def release_current_jacobians(self) -> None:
        for layer in self.layers:
            layer.release_current_jacobian()
