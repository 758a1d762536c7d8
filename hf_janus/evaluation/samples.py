"""The frontier's samples (the replay and the new task's): read as ``hf-janus merge --replay`` reads them, and checked
against the model before any work, so that a sample tokenized for another model is refused by its position rather
than failing inside an embedding lookup or a loss after the anchors' scoring and the JANUS runs."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from hf_janus.errors import JanusError
from hf_janus.replay.prepare import check_vocabulary, prepare_replay
from hf_janus.replay.self_replay import SelfReplay

#: samples per batch while checking: the batches are only read, so any size gives the same answer
CHECK_BATCH = 64


def read_samples(samples: Any, tok: Any, replay_options: Any) -> Any:
    """Samples given as a file or dataset id read with ``replay_options`` (``hf-janus merge --replay``'s reader);
    any other form as given."""
    if isinstance(samples, (str, os.PathLike)):
        from hf_janus.replay.sources import load_replay

        return load_replay(os.fspath(samples), tok, replay_options)
    return samples


def read_new_task_samples(samples: Any, tok: Any, replay_options: Any) -> Any:
    """The new task's samples as a replay is given: a file or dataset id read as ``replay`` is."""
    if isinstance(samples, SelfReplay):
        raise JanusError("new_task_samples is a SelfReplay, but θ0's answers are not the new task: pass what "
                         "fine-tuning trained on (a file, dataset id, Dataset or list of samples)")
    return read_samples(samples, tok, replay_options)


def check_frontier_samples(model: nn.Module, replay: Any, new_task: Any) -> None:
    """The replay's and the new task's samples (those given) are token ids of ``model``."""
    for samples, what in ((replay, "replay"), (new_task, "new-task")):
        if samples is not None:
            check_vocabulary(prepare_replay(samples, CHECK_BATCH, group_by_length=False), model, what)
