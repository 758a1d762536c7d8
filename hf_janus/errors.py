"""Exceptions raised by hf_janus; messages name the problem and the fix."""


class JanusError(ValueError):
    """Invalid input to a JANUS operation (replay, reference weights, targets, adapters)."""


class RectificationError(RuntimeError):
    """Rectification failed; the model has been restored to its fine-tuned weights."""
