"""The memory plan of a rectification, made before any work: predicted peak bytes per phase on the device and the
host, where each large piece lives, or a refusal up front that names the knobs.

Why: a LLaMA-7B rectification needs more than 80 GB of GPU memory if every piece sits there in float32 (model 13.5,
θ0 13, the current point 26 and the projection 26 GiB, plus activations), and its compressed factors take 38-76 GiB
of host memory per capture, with up to four captures alive. Without a plan such a run fails an hour in; with one it
either fits (pieces moved to the host or to disk) or is refused at once with what to change.

The figures are arithmetic on the model's shapes, the replay (samples m, batch size, longest sequence T), the
compression rank r and the dtypes. ``tests/engine/test_memory_plan.py`` checks the predicted host bytes of whole
rectifications on the CPU against those measured (peak RSS above the RSS before the run, within 15%); they model
live bytes, plus on the CPU a share for what glibc's malloc keeps after a free (:data:`HEAP_RETENTION`). On a GPU
the performance benchmarks log the prediction next to ``torch.cuda.max_memory_allocated`` (docs/benchmarks.md).

Pieces (all bytes, summed over the target layers):

* ``backup``: the fine-tuned weights, kept on the host to restore the model on failure (native dtype; none when
  the caller gives the exact θ̂, which restores the model as well);
* ``theta0``: the reference weights, under the name reports have always given them (native dtype; a state dict's
  tensors on the host are kept, not copied, and add nothing; nothing where θ0 and θ̂ are rebuilt when needed, as
  for an adapter on a quantized base);
* ``current``: θ_t in float32; ``proj``: the projected update of the step in float32;
* ``factors``: compressed Jacobian factors, per capture ``m · slots · (d_in + d_out)`` in the factor dtype, with
  up to four captures alive (θ0's, the current point's, a passing trial held by the adaptive controller, the trial),
  or two (``JanusConfig.captures="two"``, which ``"auto"`` picks when four do not fit in memory: the current
  point's and the trial's, θ0's and a kept trial's taken again when needed). With factors below float32, θ0's
  capture is taken once more in float32 at the end, for the residuals, after every other capture is dropped: the
  bytes of two bf16 captures, within what the plan counts;
* ``activations``: one replay batch's forward/backward with the recorders' inputs held until their gradient arrives;
* ``ghost``: the largest layer's Gram blocks, eigendecompositions and update-sized temporaries;
* ``repair`` (with ``JanusConfig.distill_steps``, after the factors are dropped): the distillation's float32 copies
  of the target layers and of the changed parameters outside them, or of an adapter's own factors (the trained
  point, its gradient, Adam's two moments, θ0, the JANUS point, θ̂ and the point being scored), the weights'
  gradients in their dtype, and θ0's float32 logits at the replay's counted tokens, kept up to
  ``REPAIR_REFERENCE_CACHE_BYTES`` so that θ0 runs once; its phase adds one step's forward/backward, gradients
  flowing into the weights, over a distillation replay batch and a new-task batch together (one backward takes
  both), or over a JANUS replay batch when that is longer.
"""

from __future__ import annotations

import logging
import math
import platform
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

import torch

from hf_janus.engine.capture import PENDING_SKETCH_BYTES
from hf_janus.engine.ghost import GRAM_BLOCK_ELEMS, MATERIALIZED_COST_FACTOR
from hf_janus.engine.stacked_compression import STACK_BYTES
from hf_janus.engine.start_environment import START_ENVIRONMENT
from hf_janus.engine.workspace import WORKSPACE_MAX_BYTES

logger = logging.getLogger(__name__)

GIB = float(1 << 30)

# Host bytes glibc's malloc keeps beyond the live ones, as a share of the plan's own bytes, while its mmap threshold
# is dynamic (the default). Each large free raises the threshold, after which a replay batch's freed activations
# and the factors' per-batch pieces stay in the heap, interleaved, and count in the RSS: the rectification's own peak
# RSS runs over the live bytes by up to this much (tests/engine/test_memory_plan.py, docs/concepts/how-it-works.md).
HEAP_RETENTION = 0.35
# Captures alive at the peak: θ0's, the current point's, and the trial's; the adaptive controller may also hold a
# passing trial while it checks a larger step. With captures="two" only the current point's and the trial's.
CAPTURES_ALIVE = {"adaptive": 4, "paper": 3}
#: float32 copies of the target layers the repair after JANUS holds (see ``repair`` in the module docstring)
REPAIR_FP32_COPIES = 8
#: most bytes of θ0's float32 logits at the replay's counted tokens the repair keeps instead of running θ0 again each
#: pass (see ``repair`` in the module docstring)
REPAIR_REFERENCE_CACHE_BYTES = 1 << 30
LEAN_CAPTURES_ALIVE = 2


@dataclass(frozen=True)
class LayerShape:
    """One target layer: its weight matrix ``(d_out, d_in)`` and the bytes of one element as stored."""

    d_out: int
    d_in: int
    itemsize: int

    @property
    def numel(self) -> int:
        return self.d_out * self.d_in


@dataclass(frozen=True)
class Workload:
    """Everything the plan's arithmetic needs, read off the model, the replay and the configuration."""

    layers: Sequence[LayerShape]
    num_samples: int  # replay samples this process captures (its share under data parallelism)
    batch_size: int
    seq_len: int  # longest replay sequence
    rank: Optional[int]
    vocab: int
    hidden: int
    intermediate: int
    blocks: int
    activation_itemsize: int  # the model's compute dtype
    factor_itemsize: int = 4
    matmul_itemsize: int = 4
    materialize_max_bytes: int = 1 << 30
    captures_alive: int = 4
    logits_copies: int = 0  # float32 logits-sized tensors the constraint adds (a tempered loss: one)
    randomized: bool = False  # randomized compression: sketches wait for their batched Ritz step (capture's budget)
    rows_per_sample: int = 1  # Jacobian rows per replay sample: the constraint's (engine/constraints), one per function
    # θ0 given as a state dict: the rectifier keeps the caller's tensors (already in memory) where they lie
    reference_borrowed: bool = False
    # False when the caller gives the exact θ̂ (adapters): the rectifier restores from it and keeps no backup
    backup_kept: bool = True
    # False when θ0 and θ̂ are rebuilt when needed (an adapter on a quantized base): neither is held
    reference_held: bool = True
    # host bytes the C allocator keeps beyond the live ones, as a share of the work's host bytes (heap_retention())
    heap_retention: float = 0.0
    # tokens of one step of the repair after JANUS: its new-task batch (new_task_batch_size x its longest sample) and
    # its replay batch (distill_replay_batch_size x its longest); 0: no repair
    repair_tokens: int = 0
    # elements of the parameters outside the target layers the repair trains with them (a full fine-tune's
    # embeddings and norms), held in as many float32 copies as the layers
    repair_outside_numel: int = 0
    # replay tokens that carry loss: θ0's logits at them are kept (up to REPAIR_REFERENCE_CACHE_BYTES)
    repair_replay_tokens: int = 0
    # elements the repair trains when they are not the target layers' weights (an adapter's own factors), held in
    # the same float32 copies, their gradients among them; None: the target layers'
    repair_numel: Optional[int] = None

    @property
    def rows(self) -> int:
        """Jacobian rows: what the factors, Grams and eigendecompositions scale with."""
        return self.num_samples * self.rows_per_sample

    @property
    def slots(self) -> int:
        return self.seq_len if self.rank is None else min(self.rank, self.seq_len)

    def pieces(self) -> dict[str, int]:
        """Bytes of each piece (see the module docstring)."""
        weights = sum(layer.numel * layer.itemsize for layer in self.layers)
        fp32 = sum(layer.numel * 4 for layer in self.layers)
        per_capture = sum(self.rows * self.slots * (layer.d_in + layer.d_out) * self.factor_itemsize
                          for layer in self.layers)
        # two eigendecompositions (current point, trial) of an m x m Gram per layer stay alive between phases
        eigs = 2 * len(self.layers) * self.rows * self.rows * 8
        pieces = {"backup": weights, "theta0": weights, "current": fp32, "proj": fp32,
                  "factors": per_capture * self.captures_alive, "eigendecompositions": eigs,
                  "activations": self.activation_bytes(), "ghost": self.ghost_bytes()}
        if self.repair_tokens:
            cache = min(self.repair_replay_tokens * self.vocab * 4, REPAIR_REFERENCE_CACHE_BYTES)
            if self.repair_numel is None:
                trained, gradients = fp32 + 4 * self.repair_outside_numel, weights
            else:
                trained, gradients = 4 * self.repair_numel, 4 * self.repair_numel
            pieces["repair"] = REPAIR_FP32_COPIES * trained + gradients + cache
            pieces["repair_activations"] = self.activation_bytes(max(self.repair_tokens,
                                                                     self.batch_size * self.seq_len))
        return pieces

    def activation_bytes(self, tokens: Optional[int] = None) -> int:
        """One batch's forward/backward (of ``tokens`` tokens, by default a replay batch's) through frozen weights,
        gradients flowing only through activations."""
        tokens = self.batch_size * self.seq_len if tokens is None else tokens
        act = self.activation_itemsize
        # recorders hold every target layer's input until its output gradient arrives (an upper bound: q/k/v and
        # gate/up share one tensor)
        held = tokens * sum(layer.d_in for layer in self.layers) * act
        # tensors autograd saves per block with frozen weights: the norms' inputs (2h), the rotated q and k (2h),
        # attention's q, k, v and output (4h), the MLP's activation input and the two factors of its product (3i)
        saved = self.blocks * tokens * (8 * self.hidden + 3 * self.intermediate) * act
        # logits, their float32 copy and the log-softmax gradient, and the constraint's own copies
        logits = tokens * self.vocab * (act + 4 + 4 + 4 * self.logits_copies)
        # the gradient flowing back and one layer's compression workspace in float32 (masked copies, QR reflectors)
        widest = max([self.hidden, self.intermediate] + [max(lay.d_in, lay.d_out) for lay in self.layers])
        transient = 6 * tokens * widest * 4
        if self.randomized:  # sketches (B x p x (d_in + d_out), float32) held for one batched eigenproblem
            p = (self.slots + 16) if self.rank is not None else self.seq_len
            sketches = sum(self.batch_size * p * (layer.d_in + layer.d_out) * 4 for layer in self.layers)
            transient += min(sketches, PENDING_SKETCH_BYTES)
            # layers stacked for one compression: their output gradients waiting, the stack in float32 and its
            # masked copy (stacked_compression)
            stacked = tokens * sum(layer.d_in + layer.d_out for layer in self.layers) * 4
            transient += 3 * min(stacked, STACK_BYTES)
        return held + saved + logits + transient

    def ghost_bytes(self) -> int:
        """The ghost phase's largest working set: one layer's Gram blocks, eigendecomposition, factor copies and
        update-sized temporaries, plus the materialized per-sample gradients kept for a step and the CPU buffer pool."""
        m, r = self.rows, self.slots
        mm = self.matmul_itemsize
        peak = 0
        for layer in self.layers:
            block = min(GRAM_BLOCK_ELEMS, m * r * m * r)
            gram = 3 * m * m * 8  # Gram, symmetrized copy, eigenvectors
            factors = m * r * (layer.d_in + layer.d_out) * (mm + 8)  # product-dtype copies, a float64 refinement copy
            update = 6 * layer.numel * 4  # θ̂ and θ_t in float32, ΔW, the VJP, the projection, its refinement
            peak = max(peak, 3 * block * mm + gram + factors + update)
        materialized = self.materialized_sizes()
        if materialized:
            total = sum(materialized)
            # the layer being built and the pool, beside the current point's kept for the step (kept_gradient_bytes)
            peak += max(materialized) + min(WORKSPACE_MAX_BYTES, total)
        return peak + self.kept_gradient_bytes()

    def materialized_sizes(self) -> list[int]:
        """Bytes of each layer's materialized per-sample gradients, for the layers on that path."""
        m, r = self.rows, self.slots
        sizes = [m * layer.numel * self.matmul_itemsize for layer in self.layers]
        return [size for size, layer in zip(sizes, self.layers)
                if size <= self.materialize_max_bytes and _materialized_is_cheaper(m, r, layer)]

    def kept_gradient_bytes(self) -> int:
        """The current point's materialized gradients kept for the trials of a step (up to materialize_max_bytes):
        alive through each trial's capture as well as the ghost math."""
        return min(self.materialize_max_bytes, sum(self.materialized_sizes()))


def _materialized_is_cheaper(m: int, r: int, layer: LayerShape) -> bool:
    ghost = m * m * r * r * (layer.d_in + layer.d_out)
    return MATERIALIZED_COST_FACTOR * (m * r * layer.numel + m * m * layer.numel) < ghost


@dataclass
class MemoryPlan:
    """Where each piece lives and the predicted peaks; ``to_dict()`` goes into the report (``report.memory_plan``)."""

    device: str
    placements: dict[str, str]
    pieces: dict[str, int]
    phases: dict[str, dict[str, int]]  # phase -> {"device": bytes, "host": bytes} added on top of what is in use
    in_use: dict[str, int]  # bytes in use when the plan was made ("device", "host")
    capacity: dict[str, Optional[int]]  # bytes the plan may fill ("device", "host"); None: unknown
    fits: bool = True
    notes: list[str] = field(default_factory=list)
    # with a cache directory: how many bytes of factors the store keeps in host memory before spilling to disk
    factor_host_budget: Optional[int] = None
    # factors the plan sends to disk at the peak (0 unless placements["factors"] == "disk")
    disk_bytes: int = 0
    # the capture schedule: "all" (θ0's and a kept trial's held too) or "two" (JanusConfig.captures)
    captures: str = "all"
    captures_alive: int = 4
    # the factors' storage dtype (JanusConfig.factor_dtype as chosen)
    factor_dtype: str = "float32"
    # the share added to the host phases for what the C allocator keeps (Workload.heap_retention)
    heap_retention: float = 0.0

    @property
    def peak_device_bytes(self) -> int:
        return self.in_use["device"] + max(p["device"] for p in self.phases.values())

    @property
    def peak_host_bytes(self) -> int:
        return self.in_use["host"] + max(p["host"] for p in self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["peak_device_bytes"], out["peak_host_bytes"] = self.peak_device_bytes, self.peak_host_bytes
        return out

    def summary(self) -> str:
        where = ", ".join(f"{name} {self.placements[name]}" for name in self.placements)
        shared = self.device == "cpu"
        peaks = (f"peak host {self.peak_host_bytes / GIB:.2f} GiB" if shared else
                 f"peak {self.device} {self.peak_device_bytes / GIB:.2f} GiB, "
                 f"peak host {self.peak_host_bytes / GIB:.2f} GiB")
        if self.heap_retention:
            peaks += f", {self.heap_retention:.0%} of its own host bytes added for what the C allocator keeps"
        return f"JANUS memory plan: {peaks} (factors {self.pieces['factors'] / GIB:.2f} GiB); {where}"


def plan_memory(work: Workload, device: torch.device, cache: str, in_use: dict[str, int],
                capacity: dict[str, Optional[int]]) -> MemoryPlan:
    """Place the pieces and predict the peaks; ``fits`` is False (with ``notes`` saying why) when nothing fits.

    On an accelerator the pieces go to the device in the order they are used (the current point every trial, the
    projection every trial, the factors every comparison, θ0 only at the end) until it is full, the rest to the
    host; factors that do not fit the host either go to ``cache`` when it is a directory. On the CPU the device
    is the host.
    """
    pieces = work.pieces()
    shared = torch.device(device).type == "cpu"
    # with a cache directory the factor store keeps factors in host memory and spills beyond its budget
    directory = str(cache) != "memory"
    placements = {"current": "device", "proj": "device", "factors": "host" if directory else "device",
                  "theta0": "device", "backup": "host"}
    plan = _phase_bytes(work, pieces, placements, shared)
    if not shared:
        for name in ("theta0", "factors", "proj", "current"):  # least used first
            if not _exceeds("device", plan, in_use, capacity):
                break
            placements[name] = "host"
            plan = _phase_bytes(work, pieces, placements, shared)
    held = 0  # factors a disk-backed store keeps in host memory before spilling (its memory budget)
    host_full = _exceeds("host", plan, in_use, capacity)
    if host_full and directory:
        placements["factors"] = "disk"
        plan = _phase_bytes(work, pieces, placements, shared)
        host_full = _exceeds("host", plan, in_use, capacity)
        if not host_full and capacity.get("host") is not None:
            # the store keeps what still fits in host memory and spills only the rest
            room = capacity["host"] - in_use["host"] - max(p["host"] for p in plan.values())
            # the held factors are host bytes of the work too: the allocator's share applies to them
            held = max(0, min(pieces["factors"], int(room / (1.0 + _retention(work, shared)))))
            plan = _phase_bytes(work, pieces, placements, shared, held)
    fits = not host_full and (shared or not _exceeds("device", plan, in_use, capacity))
    notes = [] if fits else [_refusal(work, pieces, plan, in_use, capacity, shared, cache)]
    disk = pieces["factors"] - held if placements["factors"] == "disk" else 0
    if fits and capacity.get("disk") is not None and disk > capacity["disk"]:
        fits = False
        half = ", factor_dtype='bfloat16' (halves the factors)" if work.factor_itemsize > 2 else ""
        notes = [f"the factors that do not fit in host memory need {disk / GIB:.1f} GiB of disk in cache="
                 f"{cache!r} but {capacity['disk'] / GIB:.1f} GiB are free there; point cache at a larger file "
                 f"system, or lower compression_rank or the replay samples{half} (factors: "
                 f"{pieces['factors'] / GIB:.1f} GiB for {work.captures_alive} captures)"]
    return MemoryPlan(device=str(device), placements=placements, pieces=pieces, phases=plan, in_use=dict(in_use),
                      capacity=dict(capacity), fits=fits, notes=notes, disk_bytes=disk,
                      factor_host_budget=(held if placements["factors"] == "disk"
                                          else pieces["factors"] if directory else None),
                      heap_retention=_retention(work, shared))


def plan_with_captures(work: Workload, device: torch.device, cache: str, in_use: dict[str, int],
                       capacity: dict[str, Optional[int]], captures: str, step_control: str) -> MemoryPlan:
    """:func:`plan_memory` with the capture schedule of ``JanusConfig.captures``: ``"all"``, ``"two"``, or
    ``"auto"``: all when their factors fit in memory (not on disk), else two, whichever fits."""
    full = CAPTURES_ALIVE[step_control]

    def plan_for(alive: int, schedule: str) -> MemoryPlan:
        plan = plan_memory(replace(work, captures_alive=alive), device, cache, in_use, capacity)
        plan.captures, plan.captures_alive = schedule, alive
        return plan

    if captures == "two":
        return plan_for(LEAN_CAPTURES_ALIVE, captures)
    if captures == "all":
        plan = plan_for(full, captures)
        lean = plan_for(LEAN_CAPTURES_ALIVE, "two") if not plan.fits else None
        if lean is not None and lean.fits:  # the refusal names the knob that alone would make it fit
            plan.notes[0] += (f"; or captures='two' (fits: {LEAN_CAPTURES_ALIVE} captures' factors take "
                              f"{lean.pieces['factors'] / GIB:.2f} GiB instead of {plan.pieces['factors'] / GIB:.2f}, "
                              "at the cost of one or a few more passes)")
        return plan
    plan = plan_for(full, "all")
    if plan.fits and plan.placements["factors"] != "disk":
        return plan
    lean = plan_for(LEAN_CAPTURES_ALIVE, "two")
    if lean.fits or not plan.fits:
        note = (f"captures='two': {full} captures' factors ({plan.pieces['factors'] / GIB:.2f} GiB) "
                + ("would spill to disk" if plan.fits else "do not fit") + f"; two take "
                f"{lean.pieces['factors'] / GIB:.2f} GiB, at the cost of one or a few more passes")
        logger.info("JANUS memory plan: %s", note)
        if lean.fits:  # a refusal's first note must stay the refusal
            lean.notes.insert(0, note)
        return lean
    return plan


def plan_schedule(work: Workload, device: torch.device, cache: str, in_use: dict[str, int],
                  capacity: dict[str, Optional[int]], captures: str, step_control: str,
                  factor_dtype: str) -> MemoryPlan:
    """:func:`plan_with_captures` with the factors stored as ``factor_dtype``, or for ``"auto"``: float32 where any
    schedule fits, else bfloat16 (half the bytes, at bf16 precision), logged and noted. ``factor_dtype`` names a
    torch dtype ("float32", "bfloat16", ...) or is "auto"."""
    if factor_dtype != "auto":
        itemsize = torch.empty((), dtype=getattr(torch, factor_dtype)).element_size()
        plan = plan_with_captures(replace(work, factor_itemsize=itemsize), device, cache, in_use, capacity, captures,
                                  step_control)
        plan.factor_dtype = factor_dtype
        return plan
    exact = plan_schedule(work, device, cache, in_use, capacity, captures, step_control, "float32")
    if exact.fits:
        return exact
    half = plan_schedule(work, device, cache, in_use, capacity, captures, step_control, "bfloat16")
    if not half.fits:
        # bfloat16 was the last schedule tried: its sizes are what the other knobs must bring down
        half.notes[0] = (f"{half.notes[0]} (factor_dtype='auto' tried float32 factors, then bfloat16; neither "
                         "fits)")
        return half
    note = (f"factor_dtype='bfloat16': no schedule fits float32 factors ({exact.notes[0]}); in bfloat16 they take "
            f"{half.pieces['factors'] / GIB:.2f} GiB")
    logger.info("JANUS memory plan: %s", note)
    half.notes.insert(0, note)
    return half


def _phase_bytes(work: Workload, pieces: dict[str, int], placements: dict[str, str], shared: bool,
                 held: int = 0) -> dict[str, dict[str, int]]:
    """The bytes each phase (capture, ghost math) adds on the device and the host with the pieces where
    ``placements`` puts them; ``held``: factors a disk-backed store keeps in host memory."""
    resident = {"device": 0, "host": 0}  # bytes held across phases
    for name in ("current", "proj", "factors", "theta0", "backup"):
        where = "host" if shared or placements[name] == "host" else "device"
        if placements[name] == "disk" or (name == "backup" and not work.backup_kept):
            continue
        if name == "theta0" and not work.reference_held:
            continue
        if name == "theta0" and work.reference_borrowed and where == "host":
            continue  # the caller's θ0 on the host, counted in ``in_use`` already
        resident[where] += pieces[name]
    resident["host"] += held
    work_on = "host" if shared else "device"
    resident[work_on] += pieces["eigendecompositions"]
    capture, ghost = dict(resident), dict(resident)
    # a trial's capture runs while the current point's materialized gradients wait for its comparison
    capture[work_on] += pieces["activations"] + work.kept_gradient_bytes()
    ghost[work_on] += pieces["ghost"]
    phases = {"capture": capture, "ghost": ghost}
    if "repair" in pieces:  # after the run: the factors and eigendecompositions are dropped, the layers stay
        repair = dict(resident)
        repair["host"] -= held
        if placements["factors"] != "disk":
            repair["host" if shared or placements["factors"] == "host" else "device"] -= pieces["factors"]
        repair[work_on] += pieces["repair"] + pieces["repair_activations"] - pieces["eigendecompositions"]
        phases["repair"] = repair
    share = _retention(work, shared)
    if share:
        for phase in phases.values():
            phase["host"] = math.ceil(phase["host"] * (1.0 + share))
    return phases


def _retention(work: Workload, shared: bool) -> float:
    """The allocator's share on the host where the work runs there; on an accelerator the host holds only pieces
    allocated once per capture (pinned by torch's caching host allocator), and the plan held there as modelled."""
    return work.heap_retention if shared else 0.0


def heap_retention(environ: Optional[Mapping[str, str]] = None, libc: Optional[str] = None) -> float:
    """:data:`HEAP_RETENTION` where the C allocator is glibc's malloc with its dynamic mmap threshold, else 0: with it
    fixed (``MALLOC_MMAP_THRESHOLD_`` or the ``glibc.malloc.mmap_threshold`` tunable in ``environ``, by default the
    start-up environment, the only one glibc reads) freed blocks go back to the system; other libcs are not modelled."""
    environ = START_ENVIRONMENT if environ is None else environ
    libc = platform.libc_ver()[0] if libc is None else libc
    if libc != "glibc":
        return 0.0
    if "MALLOC_MMAP_THRESHOLD_" in environ or "glibc.malloc.mmap_threshold" in environ.get("GLIBC_TUNABLES", ""):
        return 0.0
    return HEAP_RETENTION


def _exceeds(where: str, plan: dict[str, dict[str, int]], in_use: dict[str, int],
             capacity: dict[str, Optional[int]]) -> bool:
    """Whether ``plan``'s peak on ``where`` ("device" or "host") is above what may be filled there."""
    cap = capacity.get(where)
    return cap is not None and in_use[where] + max(p[where] for p in plan.values()) > cap


def _refusal(work: Workload, pieces: dict[str, int], plan: dict[str, dict[str, int]], in_use: dict[str, int],
             capacity: dict[str, Optional[int]], shared: bool, cache: str) -> str:
    where = ("host" if shared or (capacity.get("host") is not None
                                  and in_use["host"] + max(p["host"] for p in plan.values()) > capacity["host"])
             else "device")
    need = in_use[where] + max(p[where] for p in plan.values())
    if "repair" in plan and max(plan, key=lambda phase: plan[phase][where]) == "repair":
        return (f"the repair after JANUS needs about {need / GIB:.1f} GiB of "
                f"{'host' if where == 'host' else 'device'} memory at its peak (its float32 copies of the target "
                f"layers: {pieces['repair'] / GIB:.1f} GiB) but {capacity[where] / GIB:.1f} GiB can be used; lower "
                "new_task_batch_size, distill_replay_batch_size or the target layers, or set distill_steps=0 "
                "(the JANUS point)")
    knobs = ["replay_batch_size (activations: {:.1f} GiB)".format(pieces["activations"] / GIB),
             "compression_rank (factors: {:.1f} GiB for {} captures)".format(pieces["factors"] / GIB,
                                                                             work.captures_alive),
             "fewer replay samples", "target_modules / exclude_modules (fewer layers)"]
    if str(cache) == "memory":
        knobs.insert(0, "cache=<a directory> (factors spill to disk)")
    if work.factor_itemsize > 2:
        knobs.insert(1, "factor_dtype='bfloat16' (halves the factors)")
    allocator, share = "", _retention(work, shared)
    if where == "host" and share:
        # the one share of the figure that no JanusConfig knob lowers, so the refusal names how to remove it
        allocator = (f" (this includes {share:.0%} of its own host bytes for what glibc's malloc "
                     "keeps after a free; setting MALLOC_MMAP_THRESHOLD_ in the environment before Python starts, "
                     "for example to 1048576, returns those blocks to the system and drops that share, at some "
                     "speed)")
    return (f"the rectification needs about {need / GIB:.1f} GiB of {'host' if where == 'host' else 'device'} memory "
            f"at its peak{allocator} but {capacity[where] / GIB:.1f} GiB can be used; lower one of: "
            + "; ".join(knobs))


# ---- reading a workload off a model ---------------------------------------------------------------------------------


def model_dimensions(model: torch.nn.Module, layers: Sequence[LayerShape]) -> dict[str, int]:
    """Hidden size, MLP width, vocabulary and number of blocks, from the model's config where it has one."""
    config = getattr(model, "config", None)

    def pick(*names: str) -> Optional[int]:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    widths = [layer.d_in for layer in layers] or [1]
    hidden = pick("hidden_size", "n_embd", "d_model") or max(set(widths), key=widths.count)
    intermediate = pick("intermediate_size", "n_inner", "ffn_dim") or max([layer.d_out for layer in layers] or [1])
    blocks = pick("num_hidden_layers", "n_layer", "num_layers") or 1
    vocab = pick("vocab_size") or 0
    try:
        head = model.get_output_embeddings()
        if head is not None and getattr(head, "weight", None) is not None:
            vocab = int(head.weight.shape[0])
    except (AttributeError, NotImplementedError):
        pass
    return {"hidden": hidden, "intermediate": intermediate, "blocks": blocks, "vocab": vocab}
