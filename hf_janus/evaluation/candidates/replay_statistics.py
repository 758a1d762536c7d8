"""What the replay-based peers share: the replay as batches, the linear layers fine-tuning changed, a model held
at other weights for a while, and each such layer's input Gram at θ0 (with its eigendecomposition), captured once
and kept in the builder for every candidate that needs it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from hf_janus.engine.public import model_device
from hf_janus.engine.layers import LayerRule, rule_for
from hf_janus.errors import JanusError
from hf_janus.model_modes import evaluation_mode
from hf_janus.replay.prepare import IGNORE_INDEX, loss_targets, prepare_replay, samples_without_loss

if TYPE_CHECKING:
    from hf_janus.evaluation.candidate_weights import WeightBuilder

TOKEN_CHOICES = ("all", "loss")


@dataclass(frozen=True)
class LinearWeight:
    """A changed parameter that is the weight of a linear-like layer, with its ``(d_out, d_in)`` rule."""

    key: str
    module: nn.Module
    rule: LayerRule

    def matrix(self, stored: Tensor) -> Tensor:
        return self.rule.to_matrix(stored)

    def stored(self, matrix: Tensor) -> Tensor:
        return self.rule.from_matrix(matrix)


def replay_batches(builder: "WeightBuilder", batch_size: int) -> list[dict[str, Tensor]]:
    """The replay as ``{input_ids, attention_mask[, labels]}`` batches on the CPU (made once per batch size)."""
    return _batches(builder, "batches", builder.replay, batch_size, group_by_length=True,
                    missing="this candidate needs the replay (past-task samples); pass replay=")


def new_task_batches(builder: "WeightBuilder", batch_size: int) -> list[dict[str, Tensor]]:
    """The new task's samples (``builder.new_task``: what fine-tuning trained on) as labelled batches on the CPU,
    made once per batch size. They keep the order given: the passes may take fewer batches than there are, and
    grouping by length would then leave out the longest samples. A sample none of whose tokens carries loss is
    refused when the batches are made: fitting it would fit nothing."""
    return _batches(builder, "new_task_batches", builder.new_task, batch_size, group_by_length=False,
                    missing="this candidate needs samples of the new task (what fine-tuning trained on); pass "
                            "new_task_samples= to frontier (hf-janus frontier --new-task-samples)",
                    labelled="new-task")


def _batches(builder: "WeightBuilder", name: str, samples: Any, batch_size: int, *, group_by_length: bool,
             missing: str, labelled: Optional[str] = None) -> list[dict[str, Tensor]]:
    """``samples`` batched by :func:`prepare_replay`, kept in the builder's artifacts under ``(name, batch_size)``;
    ``missing`` is the error when there are none. With ``labelled`` (the data's name in the error), every sample
    must have a token that carries loss."""
    key = (name, int(batch_size))
    if key not in builder.artifacts:
        if samples is None:
            raise JanusError(missing)
        batches = prepare_replay(samples, int(batch_size), group_by_length=group_by_length)
        unlabelled = samples_without_loss(batches) if labelled else []
        if unlabelled:
            shown = ", ".join(map(str, unlabelled[:5])) + (", ..." if len(unlabelled) > 5 else "")
            raise JanusError(f"{len(unlabelled)} {labelled} sample(s) have no token that carries loss (at {shown}, "
                             "counting from 0 in the order given); give them labels or drop them")
        builder.artifacts[key] = batches
    return builder.artifacts[key]


def on_device(batch: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def logits_of(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """The model's logits on a replay batch (``use_cache`` off where the model has one). The engine's own forward
    is private to its capture; this one also serves models without a config (the tests' hand-checkable ones)."""
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False
    out = model(**kwargs)
    return out.logits if hasattr(out, "logits") else out[0]


def token_mask(batch: Mapping[str, Tensor], tokens: str) -> Tensor:
    """``(B, T)`` bool: the positions whose inputs count: every non-padding token (``"all"``), or only those whose
    next token carries loss (``"loss"``, the positions the replay loss is read at)."""
    mask = batch["attention_mask"].bool()
    if tokens == "all":
        return mask
    counted = torch.zeros_like(mask)
    counted[:, :-1] = loss_targets(batch) != IGNORE_INDEX
    return counted & mask


def linear_weights(builder: "WeightBuilder") -> list[LinearWeight]:
    """The changed parameters that are weights of linear-like layers (``nn.Linear``, GPT-2's ``Conv1D``, any type
    the engine knows) among the builder's ``target_layers`` (the layers JANUS rectifies) when it names them;
    biases, norms and embeddings are not among them."""
    out = []
    for key in builder.theta0:
        if not key.endswith(".weight"):
            continue
        if builder.target_layers is not None and key[: -len(".weight")] not in builder.target_layers:
            continue
        try:
            module = builder.model.get_submodule(key[: -len(".weight")])
        except AttributeError:
            continue
        rule = rule_for(module)
        if rule is not None and not rule.quantized and builder.theta0[key].dim() == 2:
            out.append(LinearWeight(key, module, rule))
    return out


def delta_matrix(builder: "WeightBuilder", layer: LinearWeight) -> Tensor:
    """ΔW = θ̂ − θ0 of one layer in ``(d_out, d_in)`` layout, float64 (the projections are done in float64)."""
    return layer.matrix(builder.finetuned[layer.key].double() - builder.theta0[layer.key].double())


def with_deltas(builder: "WeightBuilder", deltas: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """θ0 + the given ``(d_out, d_in)`` updates of some layers, θ̂ elsewhere, float32 in stored layout."""
    layers = {layer.key: layer for layer in linear_weights(builder)}
    out = {k: v.float() for k, v in builder.finetuned.items()}
    for key, delta in deltas.items():
        out[key] = (builder.theta0[key].double() + layers[key].stored(delta)).float()
    return out


@contextlib.contextmanager
def holding(builder: "WeightBuilder", values: Mapping[str, Tensor]) -> Iterator[nn.Module]:
    """The working model holding ``values`` inside the block, θ̂ after it, whatever happens."""
    builder.write(values)
    try:
        yield builder.model
    finally:
        builder.write(builder.finetuned)


def input_grams(builder: "WeightBuilder", tokens: str, batch_size: int) -> dict[str, Tensor]:
    """``G = Σ x xᵀ`` (float64, ``(d_in, d_in)``) of each changed linear layer's inputs ``x`` at θ0 over the replay
    tokens ``tokens`` selects (:func:`token_mask`); one forward pass over the replay, with forward hooks."""
    if tokens not in TOKEN_CHOICES:
        raise JanusError(f"tokens must be one of {TOKEN_CHOICES} (every non-padding token, or those whose next "
                         f"token carries loss), got {tokens!r}")
    layers = linear_weights(builder)
    if not layers:
        raise JanusError("no changed parameter is the weight of a linear layer: the input-covariance peers have "
                         "nothing to project")
    grams: dict[str, Tensor] = {}
    current: dict[str, Tensor] = {}

    def hook_for(key: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            rows = x[current["mask"].to(x.device)].double()
            gram = rows.T @ rows
            grams[key] = gram if key not in grams else grams[key] + gram
        return hook

    device = model_device(builder.model)
    handles = [layer.module.register_forward_pre_hook(hook_for(layer.key)) for layer in layers]
    try:
        with holding(builder, builder.theta0) as model, evaluation_mode(model), torch.no_grad():
            for batch in replay_batches(builder, batch_size):
                batch = on_device(batch, device)
                current["mask"] = token_mask(batch, tokens)
                logits_of(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return {k: g.cpu() for k, g in grams.items()}


def spectra_key(tokens: str) -> tuple[str, str]:
    return ("input_spectra", tokens)


def input_spectra(builder: "WeightBuilder", tokens: str, batch_size: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Each layer's input Gram as ``(eigenvalues descending, eigenvectors as columns)``, captured and kept in
    ``builder.artifacts`` under :func:`spectra_key` (the Gram does not depend on the batching, so one capture
    serves every candidate that reads it: the caller checks for it first)."""
    spectra = {}
    for name, gram in input_grams(builder, tokens, batch_size).items():
        values, vectors = torch.linalg.eigh(gram)
        spectra[name] = (values.flip(0).clamp_min(0.0), vectors.flip(1))
    builder.artifacts[spectra_key(tokens)] = spectra
    return spectra
