"""Reading and writing whole weights of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``)
or partitioned by DeepSpeed ZeRO-3.

Under FSDP2 a parameter is a DTensor: each rank stores one slice and the forward all-gathers it. JANUS
works on whole ``(d_out, d_in)`` matrices, so a read gathers the full weight (a collective: every rank
must read the same layers in the same order) and a write copies this rank's slice of a full matrix that
every rank holds (each computes the same trial weights from the same gathered factors; the final weights
are broadcast from rank 0 first). Writes are local, so restoring θ̂ after a failure waits on no other rank.

Between passes the weights must be the sharded parameters: FSDP2 leaves the root module unsharded after
a forward (it expects the backward next), and a write into that temporary full copy would be dropped at
the next reshard. :func:`reshard` puts every FSDP2 module back to its sharded state first.

Under ZeRO-3 a parameter is an empty tensor with a ``ds_id`` and this rank's flat partition in ``ds_tensor``;
the engine's hooks gather it around each submodule's forward and backward. A read gathers it with
``deepspeed.zero.GatheredParameters`` (a collective) and a write goes through the same context with
``modifier_rank=0``: rank 0 copies the whole matrix, which is broadcast and partitioned again on exit. Writes
are therefore collectives too, restoring θ̂ after a failure included: every rank writes the same layers in the
same order, which the rectifier does (it restores on every rank, and deterministic failures hit every rank at
the same point). When a ZeRO-3 optimizer holds fp32 master weights, a write updates this rank's partition of
them too (local), so that a later ``engine.step()`` or a checkpoint's fp32 weights do not undo the write.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from hf_janus.errors import JanusError

logger = logging.getLogger(__name__)


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


def is_zero3_param(tensor: Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions ``tensor`` (it then carries a ``ds_id``)."""
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_tensor")


def full_shape(weight: Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor (a ZeRO-3 parameter itself is empty between passes)."""
    return tuple(weight.ds_shape) if is_zero3_param(weight) else tuple(weight.shape)


def _gathered(params: list, modifier_rank: Optional[int] = None):
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def full_weight(weight: Tensor) -> Tensor:
    """The whole tensor, detached; for a DTensor or a ZeRO-3 parameter this is a collective every rank must join."""
    if is_sharded(weight):
        with torch.no_grad():
            return weight.full_tensor()
    if is_zero3_param(weight):
        with torch.no_grad(), _gathered([weight]):
            return weight.detach().clone()  # the gathered storage is freed on exit
    return weight.detach()


def full_master_weight(weight: Tensor) -> Optional[Tensor]:
    """The whole fp32 master copy that a DeepSpeed ZeRO-3 optimizer keeps of ``weight``, when it differs from it.

    None unless a ZeRO-3 optimizer holds ``weight`` in a lower precision (a float32 parameter's master copy
    equals it). A collective (an all-gather of the partitions), like :func:`full_weight`.
    """
    if not is_zero3_param(weight) or weight.dtype == torch.float32 or not weight.requires_grad:
        return None
    if getattr(weight, "_z3_optimizer", None) is None:
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(weight)
    return None if master is None else master.detach().to("cpu", copy=True)


def write_full_(weight: Tensor, full: Tensor, master: Optional[Tensor] = None) -> None:
    """Copy ``full`` (same shape as the whole weight, identical on every rank) into ``weight`` in place.

    ``master``: under ZeRO-3 with an optimizer, the value for the optimizer's fp32 master copy (default
    ``full``); restoring passes the master copy read by :func:`full_master_weight` so it comes back exactly.
    """
    with torch.no_grad():
        if is_zero3_param(weight):
            import torch.distributed as dist

            # A collective: rank 0's copy is broadcast, then every rank keeps its partition.
            with _gathered([weight], modifier_rank=0):
                if dist.get_rank() == 0:
                    weight.data.copy_(full.to(weight.data.device, weight.dtype).reshape(weight.ds_shape))
            _write_master(weight, full if master is None else master)
        elif is_sharded(weight):
            from torch.distributed.tensor import distribute_tensor

            # src_data_rank=None: split locally, no communication (every rank already holds ``full``).
            local = distribute_tensor(full.to(weight.device, weight.dtype).contiguous(), weight.device_mesh,
                                      weight.placements, src_data_rank=None).to_local()
            weight.to_local().copy_(local)
        else:
            weight.copy_(full.to(dtype=weight.dtype, device=weight.device))


@contextlib.contextmanager
def gathered(module: nn.Module, write_back: bool = False) -> Iterator[nn.Module]:
    """``module`` with each of its FSDP2-sharded parameters (its submodules' included) replaced by a plain
    parameter holding the whole tensor, the sharded ones again on exit; a no-op where none is sharded.

    Inside, code written for plain tensors (PEFT's merge, ``.data`` swaps, in-place writes) runs unchanged. Gathering
    is a collective: every rank must enter for the same modules in the same order. ``write_back``: on exit the whole
    tensors that changed inside are written into the shards in place (:func:`write_full_`), so FSDP's next
    all-gather reads them; otherwise what was written inside is dropped. Outside a forward or backward only.
    """
    swapped = []
    try:
        for name, param in list(module.named_parameters()):
            if not is_sharded(param):
                continue
            owner_name, _, local = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            whole = full_weight(param).clone()
            owner._parameters[local] = nn.Parameter(whole, requires_grad=param.requires_grad)
            swapped.append((owner, local, param, _bits(whole).clone() if write_back else None))
        yield module
        if write_back:
            for owner, local, param, before in swapped:
                now = owner._parameters[local]
                if now.shape != param.shape:
                    raise JanusError(f"a sharded parameter changed shape ({tuple(param.shape)} → "
                                     f"{tuple(now.shape)}): FSDP2 cannot take it")
                if not torch.equal(_bits(now.detach()), before):  # bits: packed quantized words may read as NaN
                    write_full_(param, now.detach())
    finally:
        for owner, local, param, _ in reversed(swapped):
            owner._parameters[local] = param


def _bits(tensor: Tensor) -> Tensor:
    return tensor.contiguous().view(torch.uint8)


def sharded_inside(inner: nn.Module, name: str) -> bool:
    """Whether an FSDP2 module within ``inner`` (``inner`` included) holds its submodule ``name``: then the passes
    of :func:`passes_inside` gather its parameters and shard them again around each use, so writes into its
    shards reach the next pass."""
    fsdp = _fsdp_module_type()
    parts = name.split(".") if name else []
    return fsdp is not None and any(isinstance(inner.get_submodule(".".join(parts[:i])), fsdp)
                                    for i in range(len(parts), -1, -1))


@contextlib.contextmanager
def passes_inside(outer: nn.Module, inner: nn.Module) -> Iterator[nn.Module]:
    """Let ``inner``, a submodule of ``outer``, run forward and backward passes on its own although FSDP2 shards
    ``outer``: the FSDP2 modules of ``outer`` that lie outside ``inner`` (the root, whose hooks gather the parameters
    it holds directly, such as a PEFT model's embeddings, only around its own forward) hold their whole parameters
    inside, and are sharded again on exit. A collective; a no-op where nothing outside ``inner`` is an FSDP2 module.
    Writes must go to the shards (:func:`write_full_`), as between any passes."""
    inside = {id(m) for m in inner.modules()}
    outside = [m for m in _fsdp_modules(outer) if id(m) not in inside]
    unsharded = []
    try:
        for module in outside:
            # the backward's final callback reshards every group unless told not to
            unsharded.append((module, _reshards_after_backward(module)))
            module.set_reshard_after_backward(False, recurse=False)
            module.unshard()
        yield inner
    finally:
        for module, after_backward in reversed(unsharded):
            module.set_reshard_after_backward(after_backward, recurse=False)
            module.reshard()
        if unsharded and hasattr(unsharded[0][0], "reset_iter_state"):
            try:  # the passes ran without the root's own forward: start its next iteration afresh
                unsharded[0][0].reset_iter_state()
            except RuntimeError:  # ``outer`` lies inside the FSDP root: only the root's owner can reset it
                pass


def _reshards_after_backward(module: nn.Module) -> bool:
    """The FSDP2 module's own ``set_reshard_after_backward`` setting (torch has no getter; True, its default, where
    this torch keeps it elsewhere)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    groups = getattr(state, "_fsdp_param_groups", [])
    return all(getattr(group, "reshard_after_backward", True) for group in groups)


def _write_master(weight: Tensor, full: Tensor) -> None:
    """This rank's partition of a ZeRO-3 optimizer's fp32 master copy of ``weight`` (local, no communication)."""
    optimizer = getattr(weight, "_z3_optimizer", None)
    if optimizer is None:  # no optimizer: the engine runs forward and backward only
        return
    from deepspeed.utils import safe_set_full_fp32_param

    # ZeRO-3 skips parameters that do not require grad; frozen layers have no master copy.
    safe_set_full_fp32_param(weight, full.detach().to(torch.float32).reshape(weight.ds_shape))


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    fsdp = _fsdp_module_type()
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


def is_fsdp(model: nn.Module) -> bool:
    """Whether FSDP2 manages any part of ``model``: then every forward and backward is a collective."""
    return bool(_fsdp_modules(model))


def is_zero3(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions any parameter of ``model``."""
    return any(is_zero3_param(p) for p in model.parameters())


def passes_are_collective(model: nn.Module) -> bool:
    """Whether every forward and backward of ``model`` gathers weights (FSDP2, ZeRO-3): then every rank must
    run as many passes as the others."""
    return is_fsdp(model) or is_zero3(model)


def reshard(model: nn.Module, after_error: bool = False) -> None:
    """Make every FSDP2 module of ``model`` hold its sharded parameters again (no communication).

    ``after_error``: a forward or backward was interrupted; FSDP2's iteration state is reset first
    (``reset_iter_state`` on the root), otherwise the interrupted modules refuse to reshard. Under ZeRO-3 the
    parameter coordinator is reset instead (:func:`_reset_zero3`); between passes ZeRO-3 needs nothing.
    """
    if after_error:
        _reset_zero3(model)
    modules = _fsdp_modules(model)
    if after_error and modules and hasattr(modules[0], "reset_iter_state"):  # recent torch only
        try:
            modules[0].reset_iter_state()
        except RuntimeError:  # ``model`` lies inside the FSDP root: only the root's owner can reset it
            pass
    for module in modules:
        module.reshard()


def _zero3_offload(model: nn.Module):
    """The DeepSpeed object whose hooks gather ``model``'s ZeRO-3 parameters (its parameter coordinator), or None."""
    for param in model.parameters():
        offload = getattr(getattr(param, "_z3_optimizer", None), "parameter_offload", None)
        if offload is not None:
            return offload
    # An engine without optimizer: found through the forward pre-hook it registers on its module.
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        for cell in getattr(hook, "__closure__", None) or ():
            offload = getattr(cell.cell_contents, "optimizer", None)
            if hasattr(offload, "get_param_coordinator"):
                return offload
    return None


def _reset_zero3(model: nn.Module) -> None:
    """Put DeepSpeed's ZeRO-3 bookkeeping back to its state between passes after an interrupted forward or
    backward (no communication). DeepSpeed has no API for this; without it the engine stays "in a forward":
    reading ``module.weight`` gathers the weight, and the next forward stops with a "tracing error"
    (the module trace recorded up to the failure is taken for a complete one)."""
    if not is_zero3(model):
        return
    offload = _zero3_offload(model)
    coordinator = offload.get_param_coordinator() if offload is not None else None
    try:
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

        root = offload.module
        modules = list(root.modules())
        # What the engine's forward epilogue does: parameters read from now on are not a forward's.
        for module in modules:
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = False
        # The submodules whose forward began and never ended stay on DeepSpeed's module stack; the engine's
        # root sits at its bottom from the start.
        stack, ours = parameter_offload.FWD_MODULE_STACK, {id(m) for m in modules}
        while stack and id(stack[-1]) in ours:
            stack.pop()
        stack.append(root)
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()  # the next forward records a new trace
        coordinator.release_and_reset_all(root)  # release what the interrupted pass left gathered
    except (AttributeError, ImportError, RuntimeError) as err:  # pragma: no cover - other DeepSpeed versions
        logger.warning("JANUS could not reset DeepSpeed's ZeRO-3 state after the error (%s: %s): the next forward "
                       "may fail", type(err).__name__, err)


def check_sharding(model: nn.Module, weights: Optional[dict[str, Tensor]] = None) -> None:
    """Refuse, before anything runs, sharded layouts whose whole matrices JANUS cannot read and write.

    Supported: plain weights (one process or DDP), FSDP2 DTensors on a 1-D mesh over all ranks and DeepSpeed
    ZeRO-3 parameters partitioned over all ranks (the module the engine wraps, whose hooks gather them). The
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
    weights = weights or {}
    modules = dict(model.named_modules()) if any(is_zero3_param(w) for w in weights.values()) else None
    for name, weight in weights.items():
        if is_zero3_param(weight):
            group = dist.get_world_size(group=weight.ds_process_group) if world > 1 else 1
            if group != world:
                raise JanusError(
                    f"the weight of {name!r} is partitioned by DeepSpeed ZeRO-3 over {group} of the {world} ranks "
                    "(MiCS or a custom partition group): JANUS supports ZeRO-3 partitions over all ranks. Save the "
                    "model and rectify the full weights afterwards"
                )
            owner = modules.get(name) if modules is not None else None
            if owner is not None and not hasattr(owner, "ds_id"):
                raise JanusError(
                    f"the weight of {name!r} is partitioned by DeepSpeed ZeRO-3 but the model runs without the "
                    "engine's hooks that gather it: pass the module deepspeed.initialize wrapped (engine.module)"
                )
            continue
        if not is_sharded(weight):
            continue
        mesh = weight.device_mesh
        if not is_fsdp(model) or mesh.ndim != 1 or mesh.size() != world:
            raise JanusError(
                f"the weight of {name!r} is a DTensor on a {tuple(mesh.shape)} device mesh: JANUS supports weights "
                f"sharded by FSDP2 (fully_shard) over all {world} ranks (a 1-D mesh), not tensor parallelism or "
                "HSDP. Save the model and rectify the full weights afterwards"
            )


def digest_sample(digest, name: str, tensor: Tensor, count: int) -> None:
    """Feed ``digest`` (a ``hashlib`` hash) the name, shape and dtype of ``tensor`` and ``count`` evenly spaced values
    of it, where this process holds them: a fingerprint that costs milliseconds at 7B, yet any training step, merge or
    other load moves. A shard (FSDP2, ZeRO-3) or a meta tensor contributes its name, shape and dtype only, since each
    rank would hash another piece."""
    digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    if is_sharded(tensor) or is_zero3_param(tensor) or tensor.is_meta or tensor.numel() == 0:
        return
    flat = tensor.detach().reshape(-1)
    count = min(flat.numel(), count)
    # integer spacing: float indices lose precision past 2**24 elements
    index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
    digest.update(flat[index].to(torch.float64).cpu().numpy().tobytes())
