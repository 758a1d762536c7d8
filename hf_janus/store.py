"""Where compressed Jacobian factors live between passes: in memory, or as safetensors files on disk."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import defaultdict
from typing import Optional

import torch
from torch import Tensor

from .compression import pad_rank


def concat_pieces(pieces: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Stack per-batch factors along the sample dimension, zero-padding ranks to the largest."""
    if len(pieces) == 1:
        return pieces[0]
    rank = max(p[0].shape[1] for p in pieces)
    x = torch.cat([pad_rank(p[0], rank) for p in pieces])
    a = torch.cat([pad_rank(p[1], rank) for p in pieces])
    return x, a


class FactorStore:
    """Per-capture (``tag``), per-layer factor storage.

    ``cache="memory"`` keeps tensors where they were computed. Any other value is a directory: each
    batch's factors are written as one safetensors file and read back (onto ``device``) when a layer's
    Jacobian is needed, so peak memory holds one layer of one or two captures at a time.
    """

    def __init__(self, cache: str = "memory", device: Optional[torch.device] = None):
        self.in_memory = str(cache) == "memory"
        self.device = device
        self.io_seconds = 0.0
        self._pieces: dict[tuple[str, str], list] = defaultdict(list)
        self._root: Optional[str] = None
        if not self.in_memory:
            os.makedirs(cache, exist_ok=True)
            self._root = tempfile.mkdtemp(prefix="janus-factors-", dir=cache)

    def append(self, tag: str, layer: str, x: Tensor, a: Tensor) -> None:
        key = (tag, layer)
        if self.in_memory:
            self._pieces[key].append((x, a))
            return
        from safetensors.torch import save_file

        start = time.perf_counter()
        folder = os.path.join(self._root, tag)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{_safe(layer)}.{len(self._pieces[key]):05d}.safetensors")
        save_file({"x": x.contiguous().cpu(), "a": a.contiguous().cpu()}, path)
        self._pieces[key].append(path)
        self.io_seconds += time.perf_counter() - start

    def has(self, tag: str, layer: str) -> bool:
        return (tag, layer) in self._pieces

    def replace(self, tag: str, layer: str, x: Tensor, a: Tensor) -> None:
        """Swap a layer's stored factors for new ones (e.g. after gathering them from every rank)."""
        self._pieces.pop((tag, layer), None)
        self.append(tag, layer, x, a)

    def get(self, tag: str, layer: str) -> tuple[Tensor, Tensor]:
        key = (tag, layer)
        if key not in self._pieces:
            raise KeyError(f"no factors stored for layer {layer!r} in capture {tag!r}")
        pieces = self._pieces[key]
        if self.in_memory:
            merged = concat_pieces(pieces)
            self._pieces[key] = [merged]  # concatenate once, reuse afterwards
            return merged
        from safetensors.torch import load_file

        start = time.perf_counter()
        device = str(self.device) if self.device is not None else "cpu"
        loaded = [load_file(p, device=device) for p in pieces]
        self.io_seconds += time.perf_counter() - start
        return concat_pieces([(t["x"], t["a"]) for t in loaded])

    def drop(self, tag: str) -> None:
        for key in [k for k in self._pieces if k[0] == tag]:
            del self._pieces[key]
        if self._root is not None:
            shutil.rmtree(os.path.join(self._root, tag), ignore_errors=True)

    def close(self) -> None:
        self._pieces.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
