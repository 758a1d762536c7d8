"""The weights of the frontier's candidates, written in turn into one working model (each candidate builds its
own, :meth:`~hf_janus.evaluation.candidates.base.Candidate.weights`, from what this holds).

Only the parameters that fine-tuning changed are kept (θ0, θ̂ and each JANUS result, on the host), so scoring a
candidate costs a copy into the model rather than a model per candidate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from hf_janus.engine.public import free_bytes
from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.base import BuildContext, Candidate
from hf_janus.evaluation.intruder_reduction import IntruderReduction


class WeightBuilder:
    """Writes any candidate's weights into the working model; holds θ0 and θ̂ of the parameters that differ, the
    JANUS results and what other candidates prepared (replay statistics, replay-trained weights) on the host, in
    float32 or the model's dtype (host memory: (2 + JANUS runs + trained candidates) × the changed parameters)."""

    def __init__(self, model: nn.Module, theta0: dict[str, Tensor], finetuned: dict[str, Tensor],
                 tokenizer: Any, base_name: Any, replay: Any, *, intruders: Optional[IntruderReduction] = None,
                 adapter_ranks: Optional[dict[str, int]] = None, new_task: Any = None,
                 free_memory: Callable[[torch.device], Optional[int]] = free_bytes):
        self.model = model
        self.params = dict(model.named_parameters())
        # θ0 and θ̂ of the changed parameters; float32 where known more exactly than the model holds them (an
        # adapter merged by PEFT in float32 on a bf16 base), so that every candidate is built from the exact update
        self.theta0, self.finetuned = theta0, finetuned
        #: PEFT's intruder reduction of a LoRA adapter's layers (None: not a LoRA adapter, no intruder candidates)
        self.intruders = intruders
        #: ``"<layer>.weight"`` → the adapter's rank, when θ̂ is a saved adapter (None: full weights)
        self.adapter_ranks = adapter_ranks
        self.janus: dict[str, dict[str, Tensor]] = {}  # run key -> rectified values of the changed parameters
        self.reports: dict[str, RectificationReport] = {}
        #: the layers JANUS rectifies (JanusConfig.target_modules), for the peers that work layer by layer
        #: (None: every changed linear layer)
        self.target_layers: Optional[frozenset[str]] = None
        #: what candidates prepared once for all of their kind (replay batches, input Grams, a Fisher, trained weights)
        self.artifacts: dict[Any, Any] = {}
        #: bytes a device may still take (``None``: unknown), asked by candidates that hold large state there
        self.free_memory = free_memory
        self.tokenizer, self.base_name, self.replay = tokenizer, base_name, replay
        #: samples of the new task (what fine-tuning trained on), for the replay-training candidates that keep the
        #: gain by fitting them too (None: not given)
        self.new_task = new_task

    @staticmethod
    def candidate_of(c: Any) -> Candidate:
        """The candidate of a candidate or of a scored point."""
        return c.candidate if hasattr(c, "candidate") else c

    def run_key(self, c: Any) -> Optional[str]:
        return self.candidate_of(c).run_key()

    def weights(self, c: Any) -> dict[str, Tensor]:
        """The changed parameters of candidate (or point) ``c``, in float32; the anchors exactly θ0 and θ̂."""
        return self.candidate_of(c).weights(self)

    def write(self, values: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for name, value in values.items():
                self.params[name].copy_(value)

    @contextlib.contextmanager
    def applied(self, c: Any) -> Iterator[nn.Module]:
        """The model holding candidate (or point) ``c`` inside the block, θ̂ (as given) after it."""
        self.write(self.weights(c))
        try:
            yield self.model
        finally:
            self.write(self.finetuned)

    def report_for(self, c: Any) -> RectificationReport:
        key = self.run_key(c)
        if key is not None:
            return self.reports[key]
        # No JANUS in this point: the record still says what the weights are, and that nothing was rectified.
        return RectificationReport(config={}, stop_reason=f"not rectified: {self.candidate_of(c).label} chosen by "
                                                          "hf-janus frontier")


def differing_parameters(model: nn.Module, base: Mapping[str, Tensor],
                         allow_identical: bool = False) -> dict[str, tuple[Tensor, Tensor]]:
    """``name -> (θ0, θ̂)`` on the host for every parameter that fine-tuning changed (``allow_identical``: none may
    differ, when the caller knows the update more exactly than the model's dtype holds it)."""
    out = {}
    for name, param in model.named_parameters():
        if name not in base:
            raise JanusError(f"the reference model has no parameter {name!r}: θ0 and θ̂ must share an architecture")
        # copies: on a CPU model .to() would alias the live weights, which each candidate overwrites
        ref = base[name].detach().to("cpu", param.dtype, copy=True)
        now = param.detach().to("cpu", copy=True)
        if ref.shape != now.shape:
            raise JanusError(f"parameter {name!r} has shape {tuple(ref.shape)} in θ0 but {tuple(now.shape)} in θ̂")
        if not torch.equal(ref, now):
            out[name] = (ref, now)
    if not out and not allow_identical:
        raise JanusError("θ0 and θ̂ are identical: there is no fine-tuning to trade off")
    return out


def run_janus(builder: WeightBuilder, key: str, start: Mapping[str, Tensor], changes: Mapping[str, Any],
              context: BuildContext) -> RectificationReport:
    """Rectify from ``start`` (θ̂, or the point a hybrid starts at) with ``changes`` to the context's config, and
    keep what changed under ``key``. The start is given to the rectifier exactly (float32), so that a bf16 model's
    rounding of it does not stand in for the update."""
    builder.write(start)
    # θ0 and θ̂ of every layer: the kept copies where fine-tuning changed it, the model's own weights elsewhere.
    own = {k: p.detach() for k, p in builder.params.items()}
    reference = {**own, **builder.theta0}
    # the repair after JANUS only where the candidate asks for it: a JANUS point is the projection's alone
    config = dataclasses.replace(context.config, **{"distill_steps": 0, **changes})
    repair = {"new_task": builder.new_task} if config.distill_steps else {}
    report = context.rectify_fn(builder.model, reference, builder.replay, config, progress=context.progress,
                                finetuned={**own, **start}, **repair)
    builder.janus[key] = {k: builder.params[k].detach().to("cpu", copy=True) for k in builder.theta0}
    builder.reports[key] = report
    builder.write(builder.finetuned)
    return report
