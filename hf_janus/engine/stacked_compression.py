"""Randomized compressions of many target layers run as one: the layers of one replay batch whose inputs and output
gradients have the same shape are stacked along the sample dimension and sketched by one set of batched products.

On an accelerator a layer's randomized compression is about a hundred small kernels (casts, masking, the power
iterations' products and Cholesky QRs, the Ritz step), each paying a launch and the host's dispatch; per layer and
batch that is about seven times the layer's share of the model's own forward and backward
(``benchmarks/perf/capture_counts.py`` counts both). Stacking pays those launches once per shape group: the products
are the same per sample, so the factors are the per-layer compression's. The layers' output gradients wait for their
group (their inputs are held by the recorders anyway) up to :data:`STACK_BYTES`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from hf_janus.engine.compression import Pending, SequencePlan, apply_token_mask, begin_compression

# float32 bytes of the stacked inputs and output gradients a batch holds before their compression runs: the device
# memory the stacking adds (the memory plan counts it); larger groups launch fewer kernels per layer.
STACK_BYTES = 1 << 30


class StackedShare:
    """One layer's rows of a stacked compression; :meth:`factors` once the group has run (see
    :meth:`Stacks.flush`)."""

    __slots__ = ("group", "start", "stop")

    def __init__(self) -> None:
        self.group: Optional[Pending] = None
        self.start = self.stop = 0

    def factors(self) -> tuple[Tensor, Tensor]:
        if self.group is None:
            raise RuntimeError("the stacked compression has not run: Stacks.flush() first")
        x, a = self.group.factors()
        return x[self.start:self.stop], a[self.start:self.stop]


class Stacks:
    """The output gradients of one replay batch's layers awaiting their stacked compression, grouped by shape.

    ``plan(batch, length, copies)`` gives the compression plan of ``copies`` layers' ``batch`` samples of ``length``
    rows stacked (the replay batch's plan repeated); ``track`` receives each group's :class:`Pending`, for the
    batched Ritz step.
    """

    def __init__(self, plan: Callable[[int, int, int], SequencePlan], track: Callable[[Pending], None],
                 limit_bytes: int = STACK_BYTES):
        self._plan, self._track, self.limit_bytes = plan, track, limit_bytes
        self._groups: dict[tuple, list[tuple[Tensor, Tensor, StackedShare]]] = {}
        self._bytes = 0

    def add(self, x: Tensor, a: Tensor) -> StackedShare:
        """Queue one layer's ``(B, T, d_in)`` inputs and ``(B, T, d_out)`` output gradients (unmasked, any float
        dtype); returns its share of the group's factors."""
        share = StackedShare()
        key = (tuple(x.shape), tuple(a.shape), x.dtype, a.dtype)
        self._groups.setdefault(key, []).append((x, a, share))
        self._bytes += 4 * (x.numel() + a.numel())
        if self._bytes >= self.limit_bytes:
            self.flush()
        return share

    def flush(self) -> None:
        """Compress every queued group: one stacked masking and sketch per shape."""
        # taken out first: ``track`` may run the waiting Ritz steps, and with them this flush again
        groups, self._groups, self._bytes = self._groups, {}, 0
        while groups:
            _, items = groups.popitem()  # each group's tensors are let go once it has run
            batch, length = items[0][0].shape[:2]
            plan = self._plan(batch, length, len(items))
            # cast as one expression, so that a stacked copy in the activations' dtype does not outlive the cast
            x, a = apply_token_mask(_stack([x for x, _, _ in items]).float(), _stack([a for _, a, _ in items]).float(),
                                    plan.live)
            group = begin_compression(x, a, plan, method="randomized")
            self._track(group)
            for i, (_, _, share) in enumerate(items):
                share.group, share.start, share.stop = group, i * batch, (i + 1) * batch


def _stack(tensors: list[Tensor]) -> Tensor:
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]
