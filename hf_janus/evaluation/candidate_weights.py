"""The weights of the frontier's candidates, written in turn into one working model.

Only the parameters that fine-tuning changed are kept (θ0, θ̂ and each JANUS result, on the host), so scoring a
candidate costs a copy into the model rather than a model per candidate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from hf_janus.engine.config import JanusConfig
from hf_janus.engine.report import RectificationReport
from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates import Candidate
from hf_janus.evaluation.intruder_reduction import IntruderReduction


class WeightBuilder:
    """Writes any candidate's weights into the working model; holds θ0 and θ̂ of the parameters that differ and
    the JANUS results on the host, in the model's dtype (host memory: (2 + JANUS runs) × the changed parameters)."""

    def __init__(self, model: nn.Module, theta0: dict[str, Tensor], finetuned: dict[str, Tensor],
                 tokenizer: Any, base_name: Any, replay: Any, *, intruders: Optional[IntruderReduction] = None):
        self.model = model
        self.params = dict(model.named_parameters())
        # θ0 and θ̂ of the changed parameters; float32 where known more exactly than the model holds them (an
        # adapter merged by PEFT in float32 on a bf16 base), so that every candidate is built from the exact update
        self.theta0, self.finetuned = theta0, finetuned
        #: PEFT's intruder reduction of a LoRA adapter's layers (None: not a LoRA adapter, no intruder candidates)
        self.intruders = intruders
        self.janus: dict[str, dict[str, Tensor]] = {}  # run key -> rectified values of the changed parameters
        self.reports: dict[str, RectificationReport] = {}
        self.tokenizer, self.base_name, self.replay = tokenizer, base_name, replay

    @staticmethod
    def run_key(c: Candidate) -> Optional[str]:
        if c.tau is None:
            return None
        return (f"tau={c.tau:g}" + (f",damping={c.damping:g}" if c.damping is not None else "")
                + (f",a={c.a:g}" if c.kind == "wise_then_janus" else "")
                + (f",intruder={c.mitigation_lambda:g}" if c.kind == "intruder_then_janus" else ""))

    def weights(self, c: Any) -> dict[str, Tensor]:
        """The changed parameters of candidate (or point) ``c``, in float32; the anchors exactly θ0 and θ̂."""
        t0, t1 = self.theta0, self.finetuned
        if c.kind == "anchor":
            return {k: v.float() for k, v in (t0 if c.a == 0 else t1).items()}
        if c.kind == "wise":
            return {k: t0[k].float() + c.a * (t1[k].float() - t0[k].float()) for k in t0}
        if c.kind == "intruder":
            if self.intruders is None:
                raise JanusError("intruder reduction needs a LoRA adapter as the fine-tuned model")
            # parameters outside the adapted linear layers (modules_to_save, biases) keep θ̂, as in PEFT
            return {**{k: v.float() for k, v in t1.items()}, **self.intruders.weights(t0, c.mitigation_lambda)}
        j = {k: v.float() for k, v in {**t1, **self.janus[self.run_key(c)]}.items()}
        if c.kind in ("janus", "damped_janus", "wise_then_janus", "intruder_then_janus"):
            return j
        if c.kind == "janus_to_reference":
            return {k: t0[k].float() + c.b * (j[k] - t0[k].float()) for k in t0}
        if c.kind == "janus_to_finetuned":
            return {k: j[k] + c.b * (t1[k].float() - j[k]) for k in t0}
        raise JanusError(f"unknown candidate kind {c.kind!r}")  # pragma: no cover

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

    def report_for(self, c: Candidate) -> RectificationReport:
        key = self.run_key(c)
        if key is not None:
            return self.reports[key]
        # No JANUS in this point: the record still says what the weights are, and that nothing was rectified.
        return RectificationReport(config={}, stop_reason=f"not rectified: {c.label} chosen by hf-janus frontier")


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


def run_janus(builder: WeightBuilder, c: Candidate, config: JanusConfig, replay: Any,
              rectify_fn: Callable[..., RectificationReport], progress: bool) -> RectificationReport:
    """Rectify from θ̂ (or, for WiSE-FT → JANUS and intruder reduction → JANUS, from the point it starts at) and
    keep what changed. The start is given to the rectifier exactly (float32), so that a bf16 model's rounding of
    it does not stand in for the update."""
    if c.kind == "wise_then_janus":
        start = Candidate(c.label, "wise", a=c.a)
    elif c.kind == "intruder_then_janus":
        start = Candidate(c.label, "intruder", mitigation_lambda=c.mitigation_lambda)
    else:
        start = Candidate(c.label, "anchor", a=1.0)
    exact_start = builder.weights(start)
    builder.write(exact_start)
    # θ0 and θ̂ of every layer: the kept copies where fine-tuning changed it, the model's own weights elsewhere.
    own = {k: p.detach() for k, p in builder.params.items()}
    reference = {**own, **builder.theta0}
    changes = {"tau": c.tau} if c.damping is None else {"tau": c.tau, "damping": c.damping}
    report = rectify_fn(builder.model, reference, replay, dataclasses.replace(config, **changes), progress=progress,
                        finetuned={**own, **exact_start})
    key = builder.run_key(c)
    builder.janus[key] = {k: builder.params[k].detach().to("cpu", copy=True) for k in builder.theta0}
    builder.reports[key] = report
    builder.write(builder.finetuned)
    return report
