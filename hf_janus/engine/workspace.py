"""Reusable CPU buffers for the materialized per-sample gradients of
:class:`~hf_janus.engine.ghost.LayerJacobian`."""

from __future__ import annotations

import torch
from torch import Tensor

# Released CPU gradient buffers a Workspace holds for reuse by default.
WORKSPACE_MAX_BYTES = 256 << 20


class Workspace:
    """Reuses the CPU buffers of materialized per-sample gradients between layers and trials.

    Why: glibc serves every CPU allocation above 32 MiB with a fresh ``mmap``, so each rebuild of a layer's
    ``m x d_out x d_in`` gradients page-faults and zero-fills all of it and each release unmaps it again, which
    costs more than the ``bmm`` that fills it. A rectification rebuilds them for every trial and every layer that
    is not kept, so the saving repeats thousands of times. CUDA's caching allocator already reuses its blocks:
    there (and on other non-CPU devices) this is a pass-through.

    :meth:`take` hands out the smallest held buffer that is large enough (a prefix view of it), :meth:`give`
    takes one back; at most ``max_bytes`` are held (the largest buffers go first). :meth:`clear` frees them, which
    the rectifier does before each capture so that the forward/backward's peak memory is unchanged.
    """

    def __init__(self, max_bytes: int = WORKSPACE_MAX_BYTES):
        self.max_bytes = max_bytes
        self._free: list[Tensor] = []  # flat, contiguous, CPU
        self._lent: dict[int, Tensor] = {}  # data_ptr of a handed-out view -> its whole buffer

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._free)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        fits = [b for b in self._free if b.dtype == dtype and b.numel() >= numel]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not buf]
        else:
            buf = torch.empty(numel, dtype=dtype)
        view = buf[:numel].view(shape)
        self._lent[view.data_ptr()] = buf
        return view

    def give(self, view: Tensor) -> None:
        buf = self._lent.pop(view.data_ptr(), None)
        if buf is None:
            return
        self._free.append(buf)
        self._free.sort(key=lambda b: b.numel(), reverse=True)
        while self._free and self.held_bytes > self.max_bytes:
            self._free.pop(0)

    def clear(self) -> None:
        """Free the held buffers and forget the lent ones (a lent view keeps its memory until it is dropped)."""
        self._free.clear()
        self._lent.clear()
