"""The one hook object of a rectification: what tests and experiments use to watch or steer a run without patching
the engine.

A :class:`RunObserver` is given to :class:`~hf_janus.engine.rectifier.Rectifier` (``observer=``), which hands it to
its :class:`~hf_janus.engine.step_loop.StepLoop`. Every default does what the engine does without one, so a run with
``RunObserver()`` is the run without it. Subclass it and override what a test needs:

- :meth:`clock`: the time source of ``config.max_seconds`` (a fake clock makes time budgets reproducible);
- :meth:`measure_memory`: the memory in use and the capacity the memory plan starts from (a smaller machine);
- :meth:`capturing` / :meth:`captured`: before and after each Jacobian evaluation (``"c0"`` at θ0, ``"s<step>t<n>"``
  for trials, recaptures under their own tag): inject a failure, or replace what a capture measured (a scripted
  replay-loss landscape);
- :meth:`make_workspace`: the run's reusable gradient buffers (a subclass that counts, or a cap);
- :meth:`jacobian_path`: the exact path of a layer's Jacobian (``"ghost"`` or ``"materialized"``) instead of the
  cheaper one, e.g. every layer materialized on a tiny model;
- :meth:`compare`: a trial's comparison with the current point (c̄ and each layer's cosine), e.g. a scripted c̄
  that skips the principal angles;
- :meth:`trial_cosine`: the measured c̄ of each trial, replaced after the comparison ran (the next step still
  projects with the trial's row space).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import torch

from hf_janus.engine.machine_memory import measure_in_use_and_capacity
from hf_janus.engine.workspace import Workspace

if TYPE_CHECKING:  # only for annotations: the step loop imports this module
    from hf_janus.engine.capture import ReplayLosses
    from hf_janus.engine.step_loop import StepLoop

__all__ = ["RunObserver"]


class RunObserver:
    """Hooks into one rectification; every default changes nothing."""

    def clock(self) -> float:
        """Seconds on a monotonic clock: what ``config.max_seconds`` is measured with."""
        return time.perf_counter()

    def measure_memory(self, device: torch.device, cache: str) -> tuple[dict[str, int], dict[str, Optional[int]]]:
        """``(in use, capacity)`` in bytes, each ``{"device": ..., "host": ...}``, that the memory plan starts from
        (:func:`~hf_janus.engine.machine_memory.measure_in_use_and_capacity`)."""
        return measure_in_use_and_capacity(device, cache)

    def capturing(self, tag: str) -> None:
        """Called before each Jacobian evaluation (the model holds the point to capture); raising here is a failure
        in the middle of the run."""

    def captured(self, tag: str, capture: ReplayLosses) -> ReplayLosses:
        """Called after each Jacobian evaluation with what it measured (every rank's losses); what it returns is
        what the run uses (its ``loss`` is the replay loss the acceptance rules and the final-step guard read)."""
        return capture

    def make_workspace(self) -> Workspace:
        """The run's reusable buffers of materialized per-sample gradients (:class:`~.workspace.Workspace`)."""
        return Workspace()

    def jacobian_path(self, name: str, tag: str) -> Optional[str]:
        """The path of layer ``name``'s Jacobian at capture ``tag`` (``"ghost"`` or ``"materialized"``, the same
        numbers either way); None: the one with fewer FLOPs that fits ``config.materialize_max_bytes``
        (:func:`~hf_janus.engine.ghost.choose_path`)."""
        return None

    def compare(self, loop: StepLoop, current_tag: str, trial_tag: str) -> tuple[float, dict[str, Optional[float]]]:
        """c̄ and each layer's mean cosine between the current point and the trial
        (:meth:`StepLoop.compare_all`). An override must leave every layer's ``trial_eig`` set: the next step
        projects with it."""
        return loop.compare_all(current_tag, trial_tag)

    def trial_cosine(self, step: int, alpha: float, measured: float) -> float:
        """The c̄ the acceptance rule and the report see for the trial of step ``step`` at ``alpha``, given the
        measured one; called with the model holding the trial."""
        return measured
