"""Which layers JANUS can rectify, and how to read and write their weights in ``(d_out, d_in)`` layout.

One rule per layer type behind one registry (as Opacus' ``grad_sample``): adding support for a new
linear-like layer means registering how its weight maps to ``y = W x``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from hf_janus.engine.quantized import SUPPORTED_QUANTIZED, dequantized_weight, layer_key, quantization_of
from hf_janus.errors import JanusError
from hf_janus.parallel.sharding import full_shape, full_weight, write_full_


@dataclass(frozen=True)
class LayerRule:
    """How one module type stores ``W`` of ``y = W x + b``."""

    name: str
    to_matrix: Callable[[Tensor], Tensor]  # stored weight -> (d_out, d_in) view
    from_matrix: Callable[[Tensor], Tensor]  # (d_out, d_in) -> stored layout
    quantized: bool = False  # read by dequantizing (:mod:`.quantized`), never written

    def weight(self, module: nn.Module) -> Tensor:
        """The whole weight, detached; gathered when FSDP shards it (a collective, see :mod:`.sharding`), and
        dequantized (this layer only) when it is quantized."""
        if self.quantized:
            return dequantized_weight(module)
        return self.to_matrix(full_weight(module.weight))

    def matrix_shape(self, module: nn.Module) -> tuple[int, int]:
        """``(d_out, d_in)`` of the whole weight without reading it (a quantized layer stores it packed, a ZeRO-3
        parameter is empty between passes)."""
        if self.quantized:
            return int(module.out_features), int(module.in_features)
        d_out, d_in = self.to_matrix(torch.empty(full_shape(module.weight), device="meta")).shape
        return int(d_out), int(d_in)

    def set_weight(self, module: nn.Module, matrix: Tensor) -> None:
        """Write a whole ``(d_out, d_in)`` matrix; under FSDP every rank passes the same one."""
        if self.quantized:
            raise JanusError(
                f"cannot write a rectified weight into a quantized layer ({self.name}): requantizing would round "
                "the update away. Rectify the adapter trained on it (JanusCallback, JanusMerger), or load the model "
                "unquantized"
            )
        write_full_(module.weight, self.from_matrix(matrix))


_RULES: dict[type, LayerRule] = {}


def register_layer_rule(module_type: type, rule: LayerRule) -> None:
    """Teach the engine a new linear-like layer type."""
    _RULES[module_type] = rule


_QUANTIZED_RULES = {key: LayerRule(name, lambda w: w, lambda m: m, quantized=True)
                    for key, name in SUPPORTED_QUANTIZED.items()}


def rule_for(module: nn.Module) -> Optional[LayerRule]:
    """The rule of ``module``'s type; ``None`` for layers JANUS cannot rectify, quantized ones of other backends
    included (many subclass ``nn.Linear`` with a packed weight)."""
    quantized = _QUANTIZED_RULES.get(layer_key(module))
    if quantized is not None:
        return quantized
    if quantization_of(module) is not None:
        return None
    for module_type, rule in _RULES.items():
        if type(module) is module_type:
            return rule
    for module_type, rule in _RULES.items():
        if isinstance(module, module_type):
            return rule
    return None


def supported_layer_names() -> list[str]:
    return [rule.name for rule in (*_RULES.values(), *_QUANTIZED_RULES.values())]


register_layer_rule(nn.Linear, LayerRule("torch.nn.Linear", lambda w: w, lambda m: m))
try:  # GPT-2 family: y = x @ W + b with W stored (d_in, d_out)
    from transformers.pytorch_utils import Conv1D

    register_layer_rule(Conv1D, LayerRule("transformers Conv1D", lambda w: w.T, lambda m: m.T))
except ImportError:  # pragma: no cover - transformers is a dependency
    pass


def _is_tuner_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, BaseTunerLayer)


def _output_embedding_ids(model: nn.Module) -> set[int]:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return {id(head)} if head is not None else set()


def matches_module_name(name: str, patterns: Union[str, Sequence[str]]) -> bool:
    """PEFT's rule: a string is a regular expression matched against the whole name; a list matches names
    exactly or as a ``.``-separated suffix."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)


def resolve_target_modules(
    model: nn.Module,
    target_modules: Union[str, Sequence[str]] = "all-linear",
    exclude_modules: Optional[Union[str, Sequence[str]]] = None,
) -> dict[str, nn.Module]:
    """Return ``{qualified name: module}`` of the layers to rectify, in forward (registration) order.

    ``"all-linear"`` takes every supported linear layer except the output embedding; a list matches
    names exactly or as a ``.``-separated suffix; any other string is a regular expression matched
    against the full name (as PEFT's ``target_modules``).
    """
    for name, module in model.named_modules():
        if _is_tuner_layer(module):
            raise JanusError(
                f"module {name!r} is a PEFT adapter layer: rectify() works on plain weights. Use "
                "hf_janus.JanusCallback for training with PEFT, hf_janus.JanusMerger for saved adapters, or "
                "merge the adapter first (model = model.merge_and_unload())."
            )
    heads = _output_embedding_ids(model)
    selected: dict[str, nn.Module] = {}
    if target_modules == "all-linear":
        for name, module in model.named_modules():
            if rule_for(module) is not None and id(module) not in heads and name.split(".")[-1] != "lm_head":
                selected[name] = module
    else:
        unsupported = []
        for name, module in model.named_modules():
            if name and matches_module_name(name, target_modules):
                if rule_for(module) is None:
                    unsupported.append(f"{name} ({type(module).__name__})")
                else:
                    selected[name] = module
        # A regex may sweep over activations and norms on its way; only names given one by one must all be layers.
        if unsupported and (not isinstance(target_modules, str) or not selected):
            raise JanusError(
                f"target_modules selects layer(s) JANUS cannot rectify: {', '.join(unsupported[:5])}. Supported "
                f"layer types: {', '.join(supported_layer_names())}. Narrow target_modules to those layers."
            )
        if not isinstance(target_modules, str):
            for pattern in target_modules:
                if not any(n == pattern or n.endswith("." + pattern) for n in selected):
                    raise JanusError(
                        f"target_modules entry {pattern!r} matches no module of {type(model).__name__}; "
                        f"examples of valid names: {', '.join(list(_linear_names(model))[:6])}"
                    )
    if exclude_modules:
        selected = {n: m for n, m in selected.items() if not matches_module_name(n, exclude_modules)}
    if not selected:
        raise JanusError(
            f"no layer of {type(model).__name__} matches target_modules={target_modules!r}; supported layer "
            f"types are {', '.join(supported_layer_names())}"
        )
    return selected


def _linear_names(model: nn.Module):
    return (n for n, m in model.named_modules() if rule_for(m) is not None)


def select_layers(names: Sequence[str], target_modules: Union[str, Sequence[str]] = "all-linear",
                  exclude_modules: Optional[Union[str, Sequence[str]]] = None, *,
                  what: str = "the adapted layers") -> list[str]:
    """The names among ``names`` (layers that changed in training) that the config selects, in order.

    ``target_modules``/``exclude_modules`` can only narrow ``names``: a layer outside it did not change, so
    there is nothing to rectify there. Raises :class:`~hf_janus.errors.JanusError` naming the candidates when
    nothing is left.
    """
    chosen = list(names)
    if target_modules != "all-linear":
        chosen = [n for n in chosen if matches_module_name(n, target_modules)]
    if exclude_modules:
        chosen = [n for n in chosen if not matches_module_name(n, exclude_modules)]
    if not chosen:
        shown = ", ".join(list(names)[:4]) + (", ..." if len(names) > 4 else "")
        raise JanusError(f"none of {what} ({shown}) is selected by target_modules={target_modules!r} / "
                         f"exclude_modules={exclude_modules!r}")
    return chosen
