"""Reading and writing whole weights of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Under FSDP2 a parameter is a DTensor: each rank stores one slice and the forward all-gathers it. JANUS
works on whole ``(d_out, d_in)`` matrices, so a read gathers the full weight (a collective: every rank
must read the same layers in the same order) and a write copies this rank's slice of a full matrix that
every rank holds (each computes the same trial weights from the same gathered factors; the final weights
are broadcast from rank 0 first). Writes are local, so restoring θ̂ after a failure waits on no other rank.

Between passes the weights must be the sharded parameters: FSDP2 leaves the root module unsharded after
a forward (it expects the backward next), and a write into that temporary full copy would be dropped at
the next reshard. :func:`reshard` puts every FSDP2 module back to its sharded state first.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .errors import JanusError


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def _fsdp_module_type() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return None
    return FSDPModule


def is_sharded(tensor: Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def full_weight(weight: Tensor) -> Tensor:
    """The whole tensor, detached; for a DTensor this is a collective every rank must join."""
    if is_sharded(weight):
        with torch.no_grad():
            return weight.full_tensor()
    return weight.detach()


def write_full_(weight: Tensor, full: Tensor) -> None:
    """Copy ``full`` (same shape as the whole weight, identical on every rank) into ``weight`` in place."""
    with torch.no_grad():
        if is_sharded(weight):
            from torch.distributed.tensor import distribute_tensor

            # src_data_rank=None: split locally, no communication (every rank already holds ``full``).
            local = distribute_tensor(full.to(weight.device, weight.dtype).contiguous(), weight.device_mesh,
                                      weight.placements, src_data_rank=None).to_local()
            weight.to_local().copy_(local)
        else:
            weight.copy_(full.to(dtype=weight.dtype, device=weight.device))


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    fsdp = _fsdp_module_type()
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


def is_fsdp(model: nn.Module) -> bool:
    """Whether FSDP2 manages any part of ``model``: then every forward and backward is a collective."""
    return bool(_fsdp_modules(model))


def reshard(model: nn.Module, after_error: bool = False) -> None:
    """Make every FSDP2 module of ``model`` hold its sharded parameters again (no communication).

    ``after_error``: a forward or backward was interrupted; FSDP2's iteration state is reset first
    (``reset_iter_state`` on the root), otherwise the interrupted modules refuse to reshard.
    """
    modules = _fsdp_modules(model)
    if after_error and modules and hasattr(modules[0], "reset_iter_state"):  # recent torch only
        try:
            modules[0].reset_iter_state()
        except RuntimeError:  # ``model`` lies inside the FSDP root: only the root's owner can reset it
            pass
    for module in modules:
        module.reshard()


def check_sharding(model: nn.Module, weights: Optional[dict[str, Tensor]] = None) -> None:
    """Refuse, before anything runs, sharded layouts whose whole matrices JANUS cannot read and write.

    Supported: plain weights (one process or DDP) and FSDP2 DTensors on a 1-D mesh over all ranks. The
    replay is split across every rank of the default process group, which is right for data parallelism
    only: under tensor parallelism the ranks of one group must see the same inputs.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover
        FSDP1 = None
    if FSDP1 is not None and any(isinstance(m, FSDP1) for m in model.modules()):
        raise JanusError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), whose flattened shards JANUS cannot read "
            "as weight matrices: shard it with FSDP2 instead (torch.distributed.fsdp.fully_shard; Trainer: "
            "fsdp_config={'version': 2}, accelerate: fsdp_version=2), or save the model and rectify it afterwards"
        )
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, weight in (weights or {}).items():
        if hasattr(weight, "ds_id"):
            raise JanusError(
                f"the weight of {name!r} is partitioned by DeepSpeed ZeRO-3, which JANUS does not support: save the "
                "model and rectify it afterwards (hf_janus.rectify, or hf_janus.JanusMerger for adapters)"
            )
        if not is_sharded(weight):
            continue
        mesh = weight.device_mesh
        if not is_fsdp(model) or mesh.ndim != 1 or mesh.size() != world:
            raise JanusError(
                f"the weight of {name!r} is a DTensor on a {tuple(mesh.shape)} device mesh: JANUS supports weights "
                f"sharded by FSDP2 (fully_shard) over all {world} ranks (a 1-D mesh), not tensor parallelism or "
                "HSDP. Save the model and rectify the full weights afterwards"
            )
