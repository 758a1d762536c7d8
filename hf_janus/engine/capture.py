"""One batched forward/backward of the token-summed replay loss, recording each target layer's inputs X
and output gradients A through hooks, compressed along the sequence as soon as A arrives.

No parameter gradient is computed: parameters are frozen for the pass and the backward runs only
through activations, so the user's ``.grad`` buffers are never touched.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hf_janus.engine.compression import (
    SequenceBasis,
    apply_token_mask,
    compress_sequence,
    merge_calls,
    needs_compression,
    resolve_method,
    sequence_basis,
    trim_rank,
)
from hf_janus.engine.quantized import differentiable_quantized
from hf_janus.engine.store import FactorStore
from hf_janus.engine.timing import PhaseTimer, synchronize
from hf_janus.errors import JanusError
from hf_janus.replay.prepare import IGNORE_INDEX, loss_targets


@dataclass
class CaptureResult:
    """Per-sample replay losses of one pass (summed over tokens) and how many tokens counted."""

    tag: str
    sample_loss: Tensor  # (m,) float64, CPU
    sample_tokens: Tensor  # (m,) int64, CPU

    @property
    def loss(self) -> float:
        """Mean per-token replay loss."""
        return float(self.sample_loss.sum() / self.sample_tokens.sum().clamp_min(1))

    @property
    def num_samples(self) -> int:
        return int(self.sample_loss.numel())


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextmanager
def frozen_eval(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) with parameters frozen; both restored afterwards, whatever happens."""
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        with differentiable_quantized(model):
            yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


def _forward_logits(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
        kwargs["use_cache"] = False
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits


def token_summed_loss(model: nn.Module, batch: Mapping[str, Tensor], offset: int = 0,
                      temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample next-token cross-entropy summed over counted tokens (the paper's un-reduced loss).

    Returns ``(sample_loss (B,), sample_tokens (B,), constrained (B,))``: ``constrained`` is the same loss at
    softmax ``temperature`` (``sample_loss`` itself at 1), the function whose per-sample Jacobian JANUS keeps
    unchanged; ``sample_loss`` is always at temperature 1, the replay loss reported and compared.
    """
    logits = _forward_logits(model, batch)
    targets = loss_targets(batch).to(logits.device)
    shifted = logits[:, :-1].float()

    def per_token_loss(scores: Tensor) -> Tensor:
        return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="none").view(targets.shape)

    per_token = per_token_loss(shifted)
    tokens = (targets != IGNORE_INDEX).sum(dim=1)
    empty = (tokens == 0).nonzero().flatten().tolist()
    if empty:
        raise JanusError(
            f"replay sample(s) {[offset + i for i in empty][:10]} have no token that counts toward the loss (every "
            "label is -100, or the sample has a single token); drop them or give them labels"
        )
    sample_loss = per_token.sum(dim=1)
    if not torch.isfinite(sample_loss).all():
        bad = (~torch.isfinite(sample_loss)).nonzero().flatten().tolist()
        raise FloatingPointError(
            f"the replay loss is NaN/Inf for sample(s) {[offset + i for i in bad][:10]}: the model weights or "
            "inputs produce non-finite logits"
        )
    constrained = sample_loss if temperature == 1.0 else per_token_loss(shifted / temperature).sum(dim=1)
    return sample_loss, tokens, constrained


def _to_device(batch: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def replay_losses(model: nn.Module, batches: list[dict[str, Tensor]], tag: str = "eval") -> CaptureResult:
    """Forward-only replay loss at the model's current weights."""
    device = model_device(model)
    losses, counts, offset = [], [], 0
    with frozen_eval(model), torch.no_grad():
        for batch in batches:
            loss, tokens, _ = token_summed_loss(model, _to_device(batch, device), offset)
            losses.append(loss.double().cpu())
            counts.append(tokens.cpu())
            offset += loss.numel()
    return _result(tag, losses, counts)


def _result(tag: str, losses: list[Tensor], counts: list[Tensor]) -> CaptureResult:
    if not losses:  # a rank whose share of the replay is empty
        return CaptureResult(tag, torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long))
    return CaptureResult(tag, torch.cat(losses), torch.cat(counts))


class _SharedInputs:
    """The inputs of one batch that several target layers read, and their sequence QR, computed once.

    q/k/v projections read one tensor, as do gate/up projections: without sharing, a LLaMA block
    factorizes 7 inputs where 4 are distinct. Keyed by storage and version so that two different tensors
    never share; each entry is dropped once its last reader has used it.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, list] = {}  # key -> [readers left, SequenceBasis or None]

    @staticmethod
    def key(x: Tensor) -> tuple:
        return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x._version, x.dtype)

    def register(self, x: Tensor) -> tuple:
        key = self.key(x)
        self._entries.setdefault(key, [0, None])[0] += 1
        return key

    def basis(self, key: tuple, masked: Tensor, rank: int) -> Optional[SequenceBasis]:
        """The basis for one reader; ``None`` when no other reader shares the input (nothing to save)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= 1 and entry[1] is None:
            del self._entries[key]
            return None
        if entry[1] is None:
            long = masked[needs_compression(masked, rank)]
            if long.shape[0] == 0:  # every sample fits in r: nothing to factorize
                del self._entries[key]
                return None
            entry[1] = sequence_basis(long)
        entry[0] -= 1
        basis = entry[1]
        if entry[0] <= 0:
            del self._entries[key]
        return basis

    def clear(self) -> None:
        self._entries.clear()


class _Pending(NamedTuple):
    """A recorded call whose output gradient has not arrived (yet, or ever: the output may not reach the loss)."""

    x: Tensor
    key: tuple


class _LayerRecorder:
    """Hooks of one target layer for one batch: pairs each call's input with its output gradient."""

    def __init__(self, name: str, rank: Optional[int], timer: PhaseTimer, device: torch.device,
                 shared: Optional[_SharedInputs] = None, method: str = "exact"):
        self.name, self.rank, self.timer, self.device, self.method = name, rank, timer, device, method
        self.shared = shared if shared is not None else _SharedInputs()
        self.mask: Optional[Tensor] = None
        self.calls: list = []

    def reset(self, mask: Tensor) -> None:
        self.mask, self.calls = mask, []

    def forward_hook(self, module: nn.Module, inputs: tuple, output: Tensor):
        x = inputs[0].detach()
        slot = len(self.calls)
        self.calls.append(_Pending(x, self.shared.register(inputs[0])))
        replaced = None
        if not output.requires_grad:
            # The first target layers see inputs that need no grad; make their outputs the graph leaves.
            replaced = output = output.detach().requires_grad_(True)
        output.register_hook(lambda grad, slot=slot: self._on_grad(slot, grad))
        return replaced

    def _on_grad(self, slot: int, grad: Tensor) -> None:
        pending = self.calls[slot]
        batch = self.mask.shape[0]
        x3 = pending.x.reshape(batch, -1, pending.x.shape[-1]).float()
        a3 = grad.detach().reshape(batch, -1, grad.shape[-1]).float()
        mask = self.mask if x3.shape[1] == self.mask.shape[1] else None
        synchronize(self.device)
        start = time.perf_counter()
        x3, a3 = apply_token_mask(x3, a3, mask)
        basis = None
        if self.method == "exact" and self.rank is not None and x3.shape[1] > self.rank:
            basis = self.shared.basis(pending.key, x3, self.rank)
        factors = compress_sequence(x3, a3, self.rank, x_basis=basis, method=self.method)
        synchronize(self.device)
        self.timer.add("compression", time.perf_counter() - start)
        if not (torch.isfinite(factors[0]).all() and torch.isfinite(factors[1]).all()):
            raise FloatingPointError(
                f"NaN/Inf in the inputs or output gradients of layer {self.name!r}: check the model weights "
                "(a diverged fine-tune?) and the replay data"
            )
        self.calls[slot] = factors

    def finish(self, batch: int, d_in: int, d_out: int) -> tuple[Tensor, Tensor]:
        done = [c for c in self.calls if not isinstance(c, _Pending)]
        if not done:
            # The layer did not influence the loss in this batch: its Jacobian rows are zero.
            zeros = torch.zeros(batch, 1, d_in, device=self.device), torch.zeros(batch, 1, d_out, device=self.device)
            return zeros
        # Zero slots (short samples padded up to r, masked tokens at the end) would cost (slots)² later.
        return trim_rank(*merge_calls(done, self.rank, self.method))


def capture_factors(
    model: nn.Module,
    targets: Mapping[str, tuple[nn.Module, int, int]],
    batches: list[dict[str, Tensor]],
    store: FactorStore,
    tag: str,
    rank: Optional[int],
    timer: PhaseTimer,
    compression: str = "auto",
    temperature: float = 1.0,
) -> CaptureResult:
    """Capture the compressed Jacobian factors of every target layer at the model's current weights.

    ``targets`` maps a layer name to ``(module, d_in, d_out)``. Factors go to ``store`` under ``tag``.
    ``compression`` and ``temperature`` are :class:`~hf_janus.JanusConfig`'s ``compression`` and
    ``constraint_temperature``: the factors are those of the per-sample loss at that softmax temperature.
    """
    device = model_device(model)
    method = resolve_method(compression, device)
    shared = _SharedInputs()
    recorders = {name: _LayerRecorder(name, rank, timer, device, shared, method) for name in targets}
    handles = [module.register_forward_hook(recorders[name].forward_hook) for name, (module, _, _) in targets.items()]
    losses, counts, offset = [], [], 0
    try:
        with frozen_eval(model), torch.enable_grad():
            for batch in batches:
                batch = _to_device(batch, device)
                mask = batch["attention_mask"]
                shared.clear()
                for rec in recorders.values():
                    rec.reset(mask)
                compression_before = timer.seconds["compression"]
                synchronize(device)
                start = time.perf_counter()
                sample_loss, tokens, constrained = token_summed_loss(model, batch, offset, temperature)
                total = constrained.sum()
                if not total.requires_grad:
                    raise JanusError("no target layer lies on the path to the loss; check target_modules")
                total.backward()
                synchronize(device)
                elapsed = time.perf_counter() - start
                timer.add("forward_backward", elapsed - (timer.seconds["compression"] - compression_before))
                for name, (_, d_in, d_out) in targets.items():
                    x, a = recorders[name].finish(mask.shape[0], d_in, d_out)
                    store.append(tag, name, x, a)
                losses.append(sample_loss.detach().double().cpu())
                counts.append(tokens.cpu())
                offset += sample_loss.numel()
    finally:
        for handle in handles:
            handle.remove()
        for rec in recorders.values():
            rec.calls = []
        shared.clear()
    return _result(tag, losses, counts)
