"""θ0, the weights at train begin, kept for ``JanusCallback``: in host memory or in a safetensors file, and in
every checkpoint so that a resumed run still rectifies against the weights it started from."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Optional

from torch import Tensor, nn

from hf_janus.adapters.peft_layers import initial_state
from hf_janus.engine.layers import resolve_target_modules
from hf_janus.errors import JanusError
from hf_janus.io_utils import atomic_replace
from hf_janus.parallel.sharding import check_sharding, digest_sample, full_weight

logger = logging.getLogger(__name__)

# The leading "_" keeps it out of trainer.push_to_hub() uploads (Trainer ignores "_*" there).
SNAPSHOT_NAME = "_janus_theta0.safetensors"
SNAPSHOT_PLACES = ("cpu", "disk")
#: Metadata key of a checkpoint's snapshot: the :func:`weights_fingerprint` of the weights saved with it.
FINGERPRINT_KEY = "janus.checkpoint_fingerprint"
_FINGERPRINT_SAMPLES = 257


def save_safetensors(tensors: dict[str, Tensor], path: str, metadata: Optional[dict[str, str]] = None) -> None:
    """Write a safetensors file atomically (:func:`~hf_janus.io_utils.atomic_replace`)."""
    from safetensors.torch import save_file

    with atomic_replace(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def weights_fingerprint(model: nn.Module) -> str:
    """A digest of the names, shapes and a few evenly spaced values of every trainable parameter.

    It binds a checkpoint's θ0 snapshot to the weights saved in that checkpoint: resuming loads those weights,
    so a snapshot of another run (another run's checkpoint in the same ``output_dir``, or a checkpoint resumed
    from elsewhere) gives another digest. A sample rather than every byte keeps it to milliseconds at 7B. The
    values of sharded parameters (FSDP2, ZeRO-3) are left out: each rank holds a different piece, and the
    layout may change between runs; their names and shapes still count.
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        digest_sample(digest, name, param, _FINGERPRINT_SAMPLES)
    return "sha256:" + digest.hexdigest()


def plain_targets_theta0(model: nn.Module, target_modules, exclude_modules, outside: bool = False,
                         ) -> dict[str, Tensor]:
    """``{"<layer>.weight": whole weight on the CPU}`` of a plain model's target layers; with ``outside``, also
    ``{name: parameter}`` of every other parameter that trains (``requires_grad``), whose θ0 the repair after JANUS
    distils toward.

    Under FSDP2 and ZeRO-3 every rank gathers every layer (a collective, same order on all ranks).
    """
    targets = resolve_target_modules(model, target_modules, exclude_modules)
    check_sharding(model, {name: module.weight for name, module in targets.items()})
    theta0 = {f"{name}.weight": full_weight(module.weight).to("cpu", copy=True).contiguous()
              for name, module in targets.items()}
    if outside:
        theta0.update({name: full_weight(param).to("cpu", copy=True).contiguous()
                       for name, param in model.named_parameters()
                       if param.requires_grad and param.is_floating_point() and name not in theta0})
    return theta0


class Theta0Snapshot:
    """θ0 of the target layers (and, for the repair after JANUS, of the other parameters that train), kept in host
    memory (``place="cpu"``) or in ``output_dir`` (``"disk"``)."""

    def __init__(self, place: str = "cpu"):
        if place not in SNAPSHOT_PLACES:
            raise ValueError(f"snapshot={place!r} is invalid: expected 'cpu' or 'disk'")
        self.place = place
        self.nbytes = 0
        self._tensors: Optional[dict[str, Tensor]] = None
        self._path: Optional[str] = None

    def take(self, model: nn.Module, peft_layers: Optional[dict[str, nn.Module]], target_modules, exclude_modules,
             output_dir: str, is_writer: bool, outside: bool = False) -> None:
        """Snapshot the target layers of ``model``: for a PEFT model the
        :func:`~hf_janus.adapters.peft_layers.initial_state` of ``peft_layers`` (their effective weights, or only
        the adapter's tensors for layers on a quantized base); for a plain model with ``outside``, every other
        parameter that trains too (:func:`plain_targets_theta0`).

        With ``place="disk"`` one process (``is_writer``) writes the file and the others read the same one, so
        ``output_dir`` must be shared; the caller waits for every process before the file is read.
        """
        if peft_layers is not None:
            theta0 = initial_state(peft_layers)
        else:
            theta0 = plain_targets_theta0(model, target_modules, exclude_modules, outside)
        self.nbytes = _nbytes(theta0)
        if self.place == "disk":
            self._path, self._tensors = os.path.join(output_dir, SNAPSHOT_NAME), None
            if is_writer:
                save_safetensors(theta0, self._path)
        else:
            self._tensors = theta0
        logger.info("JANUS: θ0 snapshot of %d layers, %.1f MiB, kept on %s", len(theta0), self.nbytes / 2**20,
                    self.place)

    def resume(self, output_dir: str, global_step: int, fingerprint: str) -> None:
        """Load the snapshot the checkpoint of step ``global_step`` carries.

        Only the checkpoint's own copy is trusted, and only when it was saved with the weights now loaded
        (``fingerprint``, :func:`weights_fingerprint` of the resumed model): rectifying against a stale θ0 gives
        a wrong result without a word. A snapshot elsewhere (``output_dir``) may belong to another run into the
        same folder, so it is never used as a fallback.
        """
        from safetensors import safe_open

        path = os.path.join(output_dir, f"checkpoint-{global_step}", SNAPSHOT_NAME)
        restart = ("Start the run from scratch, or rectify afterwards with hf_janus.rectify and the weights the "
                   "run started from")
        if not os.path.isfile(path):
            raise JanusError(
                f"resuming at step {global_step}, but the checkpoint has no θ0 snapshot ({path} is missing): it "
                "was not written with JanusCallback (or its checkpoints were pushed to the Hub, which keeps θ0 out "
                f"of them), and a snapshot from another run cannot be told apart from this run's. {restart}"
            )
        with safe_open(path, framework="pt", device="cpu") as fh:
            stored = (fh.metadata() or {}).get(FINGERPRINT_KEY)
            theta0 = {name: fh.get_tensor(name) for name in fh.keys()}
        if stored != fingerprint:  # a file without a fingerprint was not written by JanusCallback
            raise JanusError(
                f"the θ0 snapshot {path} does not belong to the weights being resumed: it was saved with other "
                "weights (a checkpoint of another run into the same output_dir, or resume_from_checkpoint pointing "
                f"outside output_dir, whose checkpoint-{global_step} is then read). Resume from a checkpoint this "
                f"run wrote in output_dir={output_dir!r}, or set output_dir to the folder holding the checkpoint. "
                f"{restart}"
            )
        self.nbytes = _nbytes(theta0)
        if self.place == "disk":
            self._path, self._tensors = path, None
        else:
            self._tensors = theta0

    def discard(self, output_dir: str) -> None:
        """Delete the run's own snapshot file in ``output_dir`` (``place="disk"``) once the run has ended: it must
        not stay next to the outputs, where a later upload or a later run could pick it up. Copies inside
        checkpoints stay, for resuming."""
        path = os.path.join(output_dir, SNAPSHOT_NAME)
        if self._path == path and os.path.isfile(path):
            os.remove(path)
            self._path = None
            logger.info("JANUS: removed the θ0 snapshot %s", path)

    @property
    def in_memory(self) -> bool:
        """Whether θ0 is held in host memory (else it is read from its file when needed)."""
        return self._tensors is not None

    def save_to_checkpoint(self, folder: str, fingerprint: str) -> None:
        """Put θ0 into a checkpoint folder so that resuming from it finds the weights the run started from;
        ``fingerprint`` (:func:`weights_fingerprint` of the weights saved there) binds it to that checkpoint."""
        save_safetensors(self.tensors(), os.path.join(folder, SNAPSHOT_NAME), {FINGERPRINT_KEY: fingerprint})

    def tensors(self) -> dict[str, Tensor]:
        """``{"<layer>.weight": θ0}`` on the CPU (read from disk for ``place="disk"``)."""
        if self._tensors is not None:
            return self._tensors
        if self._path is None:
            raise JanusError("no θ0 snapshot: JanusCallback.on_train_begin did not run")
        from safetensors.torch import load_file

        return load_file(self._path, device="cpu")


def _nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
