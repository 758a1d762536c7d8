"""Splitting the replay across data-parallel ranks and combining what each rank captured.

Under DDP every rank holds a full model replica. Each captures the Jacobian factors of its own share of
the replay; the factors are then all-gathered (in rank order) so that every rank runs the same ghost math on
all m samples. Decisions that compare floats against τ, and the final weights, come from rank 0, so the
replicas end identical even if their arithmetic differed in the last bit.

Under FSDP2 the process group is the same data-parallel group; each rank stores only a slice of every
weight, but JANUS gathers and writes whole matrices (:mod:`.sharding`), so everything above holds as is.
"""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor


def _dist():
    import torch.distributed as dist

    return dist


#: Memory shared by the processes of one machine: each rank's share of its headroom there is the headroom over the
#: ranks on that machine (a device is one rank's own).
_SHARED_BY_HOST = ("host", "disk")
_UNKNOWN = torch.iinfo(torch.int64).max

#: Dtypes that travel through :meth:`World._all_gather_padded`, by their index on the wire.
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


@dataclass
class World:
    """The process group the rectification runs in; ``size == 1`` means a single process."""

    rank: int = 0
    size: int = 1
    group: Optional[Any] = None
    device: torch.device = torch.device("cpu")  # where scalars travel: the accelerator under NCCL

    @classmethod
    def detect(cls, device: Optional[torch.device] = None) -> "World":
        dist = _dist()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            wire = device if device is not None and dist.get_backend() == "nccl" else torch.device("cpu")
            return cls(rank=dist.get_rank(), size=dist.get_world_size(), device=wire)
        return cls()

    @property
    def active(self) -> bool:
        return self.size > 1

    def shard(self, items: list) -> list:
        """This rank's share: every ``size``-th item starting at ``rank``."""
        return items[self.rank::self.size] if self.active else items

    def shortfall(self, items: list) -> int:
        """How many items fewer than the largest share this rank's share holds (0 or 1)."""
        if not self.active:
            return 0
        return -(-len(items) // self.size) - len(self.shard(items))

    def shared_capacity(self, in_use: dict[str, int], capacity: dict[str, Optional[int]]) -> dict[str, Optional[int]]:
        """The capacities the memory plan may fill on this rank (each ``None``: not measured), so that the ranks'
        plans together fit and agree: the host's and the disk's headroom (``capacity − in_use``) is split among
        the ranks on this machine, which each measured all of it, and every rank plans with the smallest share of
        any rank, so that all choose the same placements and factor dtype."""
        if not self.active:
            return capacity
        dist = _dist()
        here = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.long, device=self.device)
        hosts = [torch.zeros_like(here) for _ in range(self.size)]
        dist.all_gather(hosts, here, group=self.group)
        local = sum(int(h) == int(here) for h in hosts)
        keys = sorted(capacity)
        shares = torch.tensor([_UNKNOWN if capacity[k] is None else
                               max(0, capacity[k] - in_use.get(k, 0)) // (local if k in _SHARED_BY_HOST else 1)
                               for k in keys], dtype=torch.long, device=self.device)
        dist.all_reduce(shares, op=dist.ReduceOp.MIN, group=self.group)
        return {k: None if int(v) == _UNKNOWN else in_use.get(k, 0) + int(v) for k, v in zip(keys, shares.tolist())}

    def _all_gather_padded(self, tensor: Tensor) -> list[Tensor]:
        """All-gather tensors whose leading two dims may differ per rank (zero-padded on the wire).

        Not accelerate's ``pad_across_processes`` + ``gather``: those dispatch on accelerate's ``PartialState``,
        which only knows process groups that accelerate or the launcher's environment variables set up. In a
        group made with ``torch.distributed.init_process_group`` directly (``mp.spawn`` with a ``file://`` init,
        as in tests/parallel/test_distributed.py) it reports a single process and ``gather`` returns the local tensor
        unchanged, so each rank would silently rectify with its own share of the replay (measured: accelerate
        1.15, two gloo ranks, ``DistributedType.NO``).
        """
        dist = _dist()
        code = _WIRE_DTYPES.index(tensor.dtype)
        shape = torch.tensor([*tensor.shape[:2], code], dtype=torch.long, device=tensor.device)
        shapes = [torch.zeros_like(shape) for _ in range(self.size)]
        dist.all_gather(shapes, shape, group=self.group)
        rows = max(int(s[0]) for s in shapes)
        cols = max(int(s[1]) for s in shapes)
        # Every rank must send the same dtype (gloo aborts the process otherwise): ranks that disagree (each rank's
        # memory plan chose its own factor_dtype) travel in the common promoted dtype.
        wire = tensor.dtype
        for s in shapes:
            wire = torch.promote_types(wire, _WIRE_DTYPES[int(s[2])])
        padded = torch.zeros((rows, cols, *tensor.shape[2:]), dtype=wire, device=tensor.device)
        padded[: tensor.shape[0], : tensor.shape[1]] = tensor
        out = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(out, padded.contiguous(), group=self.group)
        return [o[: int(s[0])] for o, s in zip(out, shapes)]

    def gather_factors(self, x: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """Concatenate every rank's ``(m_rank, r, d)`` factors along samples, in rank order."""
        if not self.active:
            return x, a
        return torch.cat(self._all_gather_padded(x)), torch.cat(self._all_gather_padded(a))

    def gather_vector(self, values: Tensor) -> Tensor:
        """Concatenate every rank's 1-D per-sample values, in rank order."""
        if not self.active:
            return values
        parts = self._all_gather_padded(values.reshape(-1, 1))
        return torch.cat(parts).reshape(-1).to(values.dtype)

    def from_rank0(self, value: float) -> float:
        """Rank 0's value of a scalar every rank computed."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        _dist().broadcast(t, src=0, group=self.group)
        return float(t.item())

    def broadcast_(self, tensor: Tensor) -> None:
        """Overwrite ``tensor`` in place with rank 0's copy."""
        if self.active:
            wire = tensor.detach().to(self.device).contiguous()
            _dist().broadcast(wire, src=0, group=self.group)
            tensor.copy_(wire)

    def sum_(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` summed, in place (travelling through :attr:`device`); returns it."""
        if self.active:
            wire = tensor.detach().to(self.device).contiguous()
            _dist().all_reduce(wire, group=self.group)
            tensor.copy_(wire)
        return tensor

    def mean_(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` averaged, in place; returns it."""
        return self.sum_(tensor).div_(self.size) if self.active else tensor
