"""Where compressed Jacobian factors live between passes: in memory, or in host memory up to a budget and
as safetensors files on disk beyond it."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections import defaultdict
from typing import Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor

from hf_janus.engine.compression import pad_rank


def concat_pieces(pieces: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Stack per-batch factors along the sample dimension, zero-padding ranks to the largest."""
    if len(pieces) == 1:
        return pieces[0]
    rank = max(p[0].shape[1] for p in pieces)
    x = torch.cat([pad_rank(p[0], rank) for p in pieces])
    a = torch.cat([pad_rank(p[1], rank) for p in pieces])
    return x, a


def available_host_memory() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (Linux); ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Share of the host memory available when a directory-backed store is created that it may hold before
# spilling to disk: the rest is left to the forward/backward passes and the ghost math.
DEFAULT_MEMORY_FRACTION = 0.5


def host_footprint(nbytes: int, pinned: bool) -> int:
    """Host memory a tensor of ``nbytes`` really takes.

    torch's caching host allocator rounds every pinned allocation up to the next power of two and keeps
    freed blocks for reuse rather than returning them: 5.6 MB of factors pin 8 MB. A budget counted in
    ``nbytes`` (with pageable merged copies of pinned pieces, see :meth:`FactorStore.get`) lets the pinned pieces
    take up to twice the host memory it allows, enough to have a large run killed for memory.
    """
    if not pinned or nbytes <= 0:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


# Host memory for an accelerator's factors is taken in blocks of this size and handed out to one capture's pieces: one
# page-locked allocation per block instead of two per layer and batch, no power-of-two rounding per piece, and one size
# class that torch's caching host allocator reuses from capture to capture, whatever the factors' dtype.
HOST_BLOCK_BYTES = 64 << 20
_ALIGN = 512  # bytes: every piece starts aligned as a fresh allocation would


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class HostBlocks:
    """Host memory of one capture, handed out as slices of large blocks (page-locked when ``pin``); a block is freed
    when the last piece in it is."""

    def __init__(self, pin: bool, block_bytes: int = HOST_BLOCK_BYTES):
        self.pin, self.block_bytes = pin, block_bytes
        self._block: Optional[Tensor] = None
        self._offset = 0
        self.blocks = 0  # allocated so far

    def take(self, shape: torch.Size, dtype: torch.dtype) -> Optional[Tensor]:
        """An uninitialized tensor in the current block (a new one when it is full); None when it is larger than a
        block. Raises what torch raises when page-locked memory cannot be had."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.block_bytes:
            return None
        if self._block is None or self._offset + nbytes > self.block_bytes:
            self._block = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
            self._offset = 0
            self.blocks += 1
        piece = self._block[self._offset:self._offset + nbytes].view(dtype).view(shape)
        self._offset += _aligned(nbytes)
        return piece


class _Held(NamedTuple):
    """A piece kept in host memory by a directory-backed store, and the host bytes it takes (see
    :func:`host_footprint`; a slice of a :class:`HostBlocks` block takes its own bytes)."""

    x: Tensor
    a: Tensor
    nbytes: int

    @property
    def pinned(self) -> bool:
        return self.x.is_pinned()


class FactorStore:
    """Per-capture (``tag``), per-layer factor storage.

    ``cache="memory"`` keeps tensors where they were computed. Any other value is a directory: each
    batch's factors are kept in host memory while the store holds at most ``memory_budget_bytes`` (default:
    :data:`DEFAULT_MEMORY_FRACTION` of the host memory available at creation), and written as one
    safetensors file beyond that; they come back onto ``device`` when a layer's Jacobian is needed. Disk
    files cost a write and a read per use (a large share of a 7B run's time in the paper); the budget
    makes the directory a spill area used only when memory really is short.

    ``factor_dtype`` stores the factors in another dtype (e.g. ``torch.bfloat16``, halving memory and I/O as
    the paper's float16 cache); the ghost math casts them back to its own dtype.

    ``host_blocks``: whether pieces held in host memory go into one capture's :class:`HostBlocks` (default: for
    factors computed on an accelerator, which are page-locked; True: also for the CPU's own, which are then copied;
    False: each piece allocated alone, as under data parallelism, where every layer's pieces are replaced by the
    gathered ones and a block would keep the replaced ones).
    """

    def __init__(self, cache: str = "memory", device: Optional[torch.device] = None,
                 factor_dtype: Optional[Union[torch.dtype, str]] = None, memory_budget_bytes: Optional[int] = None,
                 offload: bool = False, host_blocks: Optional[bool] = None):
        # offload (cache="memory" only): keep every piece in host memory, never on disk (the memory plan's "host"
        # placement, for factors the accelerator cannot hold)
        self.in_memory = str(cache) == "memory" and not offload
        self.device = device
        if isinstance(factor_dtype, str):
            factor_dtype = getattr(torch, factor_dtype.replace("torch.", ""))
        self.factor_dtype = factor_dtype
        self._exact_tags: set[str] = set()  # captures kept as computed (float32) whatever factor_dtype says
        self.io_seconds = 0.0
        self.held_bytes = 0  # bytes of the pieces a directory-backed store keeps in host memory
        self.peak_held_bytes = 0
        self.spilled_bytes = 0  # bytes written to disk in all
        #: the most captures (tags) whose factors were stored at once: what the memory plan's captures_alive bounds
        self.peak_captures = 0
        self.pinned = False  # whether any piece was ever put in page-locked memory (see release_cached_host_memory)
        self._pieces: dict[tuple[str, str], list] = defaultdict(list)
        self.host_blocks = host_blocks
        self._blocks: dict[str, HostBlocks] = {}  # per capture (tag)
        #: host allocations made for held pieces (blocks, and pieces allocated alone): each a page-locking call for an
        #: accelerator's factors
        self.host_allocations = 0
        self._pinning = True  # until the system refuses page-locked memory (some containers cap it)
        self._root: Optional[str] = None
        self.memory_budget_bytes = 0
        if offload and str(cache) == "memory":
            self.memory_budget_bytes = 1 << 62
        elif not self.in_memory:
            if memory_budget_bytes is None:
                available = available_host_memory()
                memory_budget_bytes = int(DEFAULT_MEMORY_FRACTION * available) if available else 0
            self.memory_budget_bytes = max(0, int(memory_budget_bytes))
            os.makedirs(cache, exist_ok=True)
            self._root = tempfile.mkdtemp(prefix="janus-factors-", dir=cache)

    def keep_exact(self, tag: str) -> None:
        """Store capture ``tag`` in float32, as computed, even where ``factor_dtype`` rounds the others: the
        reference capture that the report's residuals are measured against."""
        self._exact_tags.add(tag)

    def dtype_of(self, tag: str) -> torch.dtype:
        """The dtype capture ``tag``'s factors are stored in (what an empty stand-in for them must carry)."""
        if self.factor_dtype is None or tag in self._exact_tags:
            return torch.float32
        return self.factor_dtype

    def _cast(self, t: Tensor, tag: str) -> Tensor:
        if self.factor_dtype is None or tag in self._exact_tags or t.dtype == self.factor_dtype:
            return t
        return t.to(self.factor_dtype)

    def _blocked(self, t: Tensor) -> bool:
        """Whether ``t`` would go into its capture's host blocks."""
        fits = t.nbytes <= HOST_BLOCK_BYTES
        return fits and (self.host_blocks is True or (self.host_blocks is None and t.device.type != "cpu"))

    def _footprint(self, t: Tensor) -> int:
        """The host bytes ``t`` will take once held."""
        return _aligned(t.nbytes) if self._blocked(t) else host_footprint(t.nbytes, t.is_cuda)

    def _to_host(self, t: Tensor, tag: str) -> tuple[Tensor, int]:
        """``t`` in host memory and the host bytes it takes."""
        if t.device.type == "cpu" and not self._blocked(t):
            return t, t.nbytes
        # Pinned, so that bringing it back to the accelerator is a fast DMA copy; pageable if pinning fails
        # (some containers cap page-locked memory).
        host = None
        if self._blocked(t):
            blocks = self._blocks.get(tag)
            if blocks is None:
                blocks = self._blocks[tag] = HostBlocks(pin=t.is_cuda and self._pinning)
            before = blocks.blocks
            try:
                host = blocks.take(t.shape, t.dtype)
            except RuntimeError:  # page-locked memory refused: pageable blocks from now on
                self._pinning = False
                blocks, before = HostBlocks(pin=False), 0
                self._blocks[tag] = blocks
                host = blocks.take(t.shape, t.dtype)
            self.host_allocations += blocks.blocks - before
        if host is None:
            self.host_allocations += 1
            try:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda and self._pinning)
            except RuntimeError:
                self._pinning = False
                host = torch.empty(t.shape, dtype=t.dtype)
            footprint = host_footprint(host.nbytes, host.is_pinned())
        else:
            footprint = _aligned(host.nbytes)
        self.pinned = self.pinned or host.is_pinned()
        # Into pinned memory the copy is asynchronous: the capture does not wait for it (nothing reads it on the host;
        # it goes back to the device on the same stream, after the copy)
        host.copy_(t, non_blocking=host.is_pinned())
        return host, footprint

    @property
    def captures(self) -> set[str]:
        """The tags whose factors are stored now."""
        return {tag for tag, _ in self._pieces}

    def append(self, tag: str, layer: str, x: Tensor, a: Tensor) -> None:
        key = (tag, layer)
        x, a = self._cast(x, tag), self._cast(a, tag)
        if key not in self._pieces:
            self.peak_captures = max(self.peak_captures, len(self.captures | {tag}))
        if self.in_memory:
            self._pieces[key].append((x, a))
            return
        nbytes = x.nbytes + a.nbytes
        expected = self._footprint(x) + self._footprint(a)
        if self.held_bytes + expected <= self.memory_budget_bytes:
            (hx, fx), (ha, fa) = self._to_host(x, tag), self._to_host(a, tag)
            held = _Held(hx, ha, fx + fa)
            self._pieces[key].append(held)
            self.held_bytes += held.nbytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            return
        from safetensors.torch import save_file

        start = time.perf_counter()
        folder = os.path.join(self._root, tag)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{_safe(layer)}.{len(self._pieces[key]):05d}.safetensors")
        save_file({"x": x.contiguous().cpu(), "a": a.contiguous().cpu()}, path)
        self._pieces[key].append(path)
        self.spilled_bytes += nbytes
        self.io_seconds += time.perf_counter() - start

    def has(self, tag: str, layer: Optional[str] = None) -> bool:
        """Whether factors of ``layer`` (any layer when None) are stored under ``tag``."""
        return (tag, layer) in self._pieces if layer is not None else tag in self.captures

    def _release(self, pieces: list) -> None:
        self.held_bytes -= sum(p.nbytes for p in pieces if isinstance(p, _Held))

    def replace(self, tag: str, layer: str, x: Tensor, a: Tensor) -> None:
        """Swap a layer's stored factors for new ones (e.g. after gathering them from every rank)."""
        self._release(self._pieces.pop((tag, layer), []))
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
        if len(pieces) > 1 and all(isinstance(p, _Held) and not p.pinned for p in pieces):
            # Same bytes, one piece. Not for pinned pieces: the allocator would keep their blocks cached
            # next to a pageable copy of the same size; those are concatenated on the device instead.
            x, a = concat_pieces([(p.x, p.a) for p in pieces])
            merged = _Held(x, a, x.nbytes + a.nbytes)
            self.held_bytes += merged.nbytes - sum(p.nbytes for p in pieces)  # ranks padded to the largest
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            self._pieces[key] = pieces = [merged]
        device = str(self.device) if self.device is not None else "cpu"
        loaded = []
        for piece in pieces:
            if isinstance(piece, _Held):
                loaded.append((piece.x.to(device, non_blocking=True), piece.a.to(device, non_blocking=True)))
                continue
            from safetensors.torch import load_file

            start = time.perf_counter()
            tensors = load_file(piece, device=device)
            self.io_seconds += time.perf_counter() - start
            loaded.append((tensors["x"], tensors["a"]))
        return concat_pieces(loaded)

    def drop(self, tag: str) -> None:
        for key in [k for k in self._pieces if k[0] == tag]:
            self._release(self._pieces.pop(key))
        self._blocks.pop(tag, None)  # its blocks are freed with their last pieces
        if self._root is not None:
            shutil.rmtree(os.path.join(self._root, tag), ignore_errors=True)

    def host_cache_releasable(self) -> bool:
        """Whether :meth:`release_cached_host_memory` can give the page-locked blocks of dropped pieces back: always
        when none was pinned, else where this torch has ``torch.accelerator.empty_host_cache``."""
        return not self.pinned or _empty_host_cache() is not None

    def release_cached_host_memory(self) -> bool:
        """Give the page-locked blocks of dropped pieces back to the system; False where they stay cached.

        torch's caching host allocator keeps a freed pinned block for a later allocation of the same size class. The
        next capture in the same dtype reuses them; a capture in another dtype (θ0 again in float32 after bfloat16
        captures) cannot, and would be pinned beside them: twice the host memory the store's budget allows, enough
        to have a large run killed at its very end."""
        if not self.pinned:
            return True
        empty = _empty_host_cache()
        if empty is None:
            return False
        empty()
        return True

    def close(self) -> None:
        self._pieces.clear()
        self._blocks.clear()
        self.held_bytes = 0
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def _empty_host_cache() -> Optional[Callable[[], None]]:
    """torch's call that empties the caching host allocator, or None where this torch has none (older versions)."""
    return getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
