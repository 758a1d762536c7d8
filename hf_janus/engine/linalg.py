"""The engine's public surface for the packages above it (:mod:`hf_janus.adapters`): the row-space linear algebra,
the weights of quantized base layers, and the accelerator's memory. Import these names from here, not from the
engine modules that implement them (:mod:`.ghost`, :mod:`.quantized`, :mod:`.memory_plan`), which may change.

Linear algebra (:mod:`.ghost`):
    :class:`LayerJacobian` (a layer's per-sample Jacobian from its compressed factors), :class:`GramEig` and
    :func:`eig_psd` (the eigendecomposition of its Gram matrix), :func:`project` (an update's projection onto the
    Jacobian's null space).
Quantized base layers (:mod:`.quantized`):
    :func:`quantization_of`, :func:`is_supported_quantized`, :func:`unsupported_quantized_error`,
    :func:`compute_dtype`, :func:`dequantized_weight`.
Memory (:mod:`.memory_plan`):
    :func:`cuda_in_use_and_capacity`.
"""

from hf_janus.engine.ghost import GramEig, LayerJacobian, eig_psd, project
from hf_janus.engine.memory_plan import cuda_in_use_and_capacity
from hf_janus.engine.quantized import (
    compute_dtype,
    dequantized_weight,
    is_supported_quantized,
    quantization_of,
    unsupported_quantized_error,
)

__all__ = [
    "GramEig", "LayerJacobian", "compute_dtype", "cuda_in_use_and_capacity", "dequantized_weight", "eig_psd",
    "is_supported_quantized", "project", "quantization_of", "unsupported_quantized_error",
]
