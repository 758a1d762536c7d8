"""A layer's Jacobian at a capture: the stored factors of that capture as a :class:`~.ghost.LayerJacobian`, in the
configured dtypes, and the timed ghost phase in which the loop and the statistics use them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

from hf_janus.engine.config import JanusConfig
from hf_janus.engine.ghost import LayerJacobian, tensor_cores
from hf_janus.engine.observer import RunObserver
from hf_janus.engine.store import FactorStore
from hf_janus.engine.timing import PhaseTimer
from hf_janus.engine.workspace import Workspace


class JacobianSource:
    """Gives the Jacobian of a layer at a capture tag; shared by the step loop and the statistics, so that neither
    reaches back into the rectifier."""

    def __init__(self, store: FactorStore, device: torch.device, config: JanusConfig, workspace: Workspace,
                 timer: PhaseTimer, observer: Optional[RunObserver] = None):
        self.store, self.device, self.config, self.workspace, self.timer = store, device, config, workspace, timer
        self.observer = observer if observer is not None else RunObserver()  # may choose each Jacobian's path

    def jacobian(self, name: str, tag: str, pooled: bool = True, exact: bool = False) -> LayerJacobian:
        """Layer ``name``'s Jacobian at capture ``tag``. ``exact``: every product in ``gram_dtype`` (for callers
        that measure residuals on the result), otherwise in ``config.ghost_matmul``. ``pooled``: its gradient
        buffers come from and go back to the shared workspace (not for Jacobians that outlive the run)."""
        x, a = self.store.get(tag, name)
        matmul = self.config.gram_dtype if exact else getattr(torch, self.config.ghost_matmul)
        return LayerJacobian(x.to(self.device), a.to(self.device), dtype=self.config.gram_dtype,
                             path=self.observer.jacobian_path(name, tag), max_bytes=self.config.materialize_max_bytes,
                             workspace=self.workspace if pooled else None, matmul_dtype=matmul)

    @contextmanager
    def ghost_phase(self) -> Iterator[None]:
        """Time the enclosed ghost math, with tensor cores as ``config.ghost_matmul`` allows."""
        with self.timer.phase("ghost"), tensor_cores(self.device, getattr(torch, self.config.ghost_matmul)):
            yield
