"""The Trainer's mixed precision at train end: JANUS measures the model at its weights' own precision, and the repair
after it trains the way fine-tuning trained.

When a Trainer trains in mixed precision (``bf16=True``), accelerate wraps the model's forward in autocast, and the
wrapper stays on the model after ``train()``. Left in place, it would run JANUS's captures and the replay losses it
compares in bf16: the projection would follow the rounded Jacobian, and the callback's result would differ from
``rectify`` on the same weights.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Optional

from torch import nn

logger = logging.getLogger(__name__)


@contextmanager
def own_precision(model: nn.Module) -> Iterator[None]:
    """Inside the block the model runs the forward accelerate wrapped (kept as ``_original_forward``), without the
    autocast of the Trainer's mixed precision; after it, the wrapped one again, as the Trainer left it."""
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield
        return
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


def training_autocast(trainer: Any) -> Optional[Callable[[], AbstractContextManager]]:
    """The Trainer's mixed precision for the repair's training passes: its accelerator's ``autocast`` when it trains
    in bf16; None otherwise (full precision). fp16 training needs a loss scale, which the repair's steps do not keep,
    so they run at full precision then (logged)."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not getattr(accelerator, "native_amp", False):
        return None
    if str(accelerator.mixed_precision) != "bf16":
        logger.info("JANUS: the Trainer trains in %s; the repair after JANUS runs its steps at full precision (fp16 "
                    "needs a loss scale)", accelerator.mixed_precision)
        return None
    return accelerator.autocast
