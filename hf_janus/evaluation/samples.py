"""The frontier's samples (the replay and the new task's, as :mod:`hf_janus.replay.resolve` read them), checked
against the model before any work, so that a sample tokenized for another model is refused by its position rather
than failing inside an embedding lookup or a loss after the anchors' scoring and the JANUS runs."""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_janus.replay.prepare import check_vocabulary, prepare_replay

#: samples per batch while checking: the batches are only read, so any size gives the same answer
CHECK_BATCH = 64


def check_frontier_samples(model: nn.Module, replay: Any, new_task: Any) -> None:
    """The replay's and the new task's samples (those given) are token ids of ``model``."""
    for samples, what in ((replay, "replay"), (new_task, "new-task")):
        if samples is not None:
            check_vocabulary(prepare_replay(samples, CHECK_BATCH, group_by_length=False), model, what)
