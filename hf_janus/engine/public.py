"""The engine's public surface for the packages above it (:mod:`hf_janus.adapters`, :mod:`hf_janus.evaluation`):
the row-space linear algebra, the weights of quantized base layers, the model's replay losses and the memory.
Import these names from here, not from the engine modules that implement them (:mod:`.ghost`, :mod:`.quantized`,
:mod:`.capture`, :mod:`.memory_plan`, :mod:`.machine_memory`), which may change. (The rectifier, its config, report
and result are public modules of their own.)

Linear algebra (:mod:`.ghost`):
    :class:`LayerJacobian` (a layer's per-sample Jacobian from its compressed factors), :class:`GramEig` and
    :func:`eig_psd` (the eigendecomposition of its Gram matrix), :func:`project` (an update's projection onto the
    Jacobian's null space).
Quantized base layers (:mod:`.quantized`):
    :func:`quantization_of`, :func:`is_supported_quantized`, :func:`unsupported_quantized_error`,
    :func:`compute_dtype`, :func:`dequantized_weight`.
The model (:mod:`.capture`):
    :func:`model_device`, :func:`token_summed_loss` (the per-sample summed token losses of a replay batch).
Memory (:mod:`.memory_plan`, :mod:`.machine_memory`):
    :data:`GIB`, :func:`cuda_in_use_and_capacity`, :func:`free_bytes` (what a device has free),
    :class:`HostPeak` (the host's peak resident memory over a block).
"""

from hf_janus.engine.capture import model_device, token_summed_loss
from hf_janus.engine.ghost import GramEig, LayerJacobian, eig_psd, project
from hf_janus.engine.machine_memory import HostPeak, cuda_in_use_and_capacity, free_bytes
from hf_janus.engine.memory_plan import GIB
from hf_janus.engine.quantized import (
    compute_dtype,
    dequantized_weight,
    is_supported_quantized,
    quantization_of,
    unsupported_quantized_error,
)

__all__ = [
    "GIB", "GramEig", "HostPeak", "LayerJacobian", "compute_dtype", "cuda_in_use_and_capacity", "dequantized_weight",
    "eig_psd", "free_bytes", "is_supported_quantized", "model_device", "project", "quantization_of",
    "token_summed_loss", "unsupported_quantized_error",
]
