"""Context managers that put a model in a mode for a while and give the caller's mode back, whatever happens."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


@contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout), so that passes over the replay are deterministic, then the mode the caller had (the
    Trainer's, when θ0 answers at train begin)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
