"""What every frontier candidate is: a small object that knows its options, its label, how it builds its weights
from θ0, θ̂ and the replay, what that cost, which curve it is drawn on, and what the model card says about it.

A kind is one subclass (a frozen dataclass whose fields are its options) registered under a name
(:mod:`hf_janus.evaluation.candidates.registry`), in the manner of PEFT's ``LoraVariant``: the frontier, the plot
and the card ask the object instead of dispatching on a string.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
from torch import Tensor

from hf_janus.engine.public import model_device
from hf_janus.engine.public import HostPeak
from hf_janus.errors import JanusError

if TYPE_CHECKING:  # the weight builder imports the candidates
    from hf_janus.engine.config import JanusConfig
    from hf_janus.engine.report import RectificationReport
    from hf_janus.evaluation.candidate_weights import WeightBuilder


class CandidateDiverged(JanusError):
    """A candidate's build went non-finite (replay training at too large a learning rate): the frontier reports its
    point as diverged, with no scores, instead of scoring weights that hold NaN."""


@dataclass(frozen=True)
class PlotStyle:
    """How a kind's points (or its curve) look on the frontier plot: a matplotlib marker/line format and colour."""

    marker: str
    color: str
    legend: str
    line: str = ""  # a line style ("-", "--"): the points are joined along their curve


@dataclass(frozen=True)
class Curve:
    """A peer curve: the points of one kind joined in order of AP2, with θ̂ (and, for WiSE-FT, θ0) as its ends.

    A point off the curve gets its AP1 margin over it at its own AP2 (``FrontierPoint.above``)."""

    name: str  # the key of FrontierPoint.above and of the markdown column
    title: str  # "WiSE-FT", "intruder", ...
    style: PlotStyle


WISE_CURVE_SPEC = Curve("wise", "WiSE-FT", PlotStyle("o", "0.5", "WiSE-FT", line="-"))


@dataclass
class Cost:
    """What building a candidate's weights cost, beyond scoring it.

    ``forward_passes`` and ``backward_passes`` count passes over the whole replay (a pass over m samples is one,
    whatever the batch size); a Jacobian evaluation of JANUS is one per-sample-Jacobian capture over the replay.
    ``peak_memory_bytes`` is the peak while building: of the accelerator's allocated memory, or on the CPU of the
    process's resident memory (sampled; ``None`` where it cannot be read). ``reused`` marks a candidate built from
    what an earlier one already computed (a JANUS run, the replay's Fisher or input Grams, a replay fine-tune): its
    zeros mean "charged to that candidate", not "free".
    """

    jacobian_evaluations: int = 0
    forward_passes: float = 0.0
    backward_passes: float = 0.0
    seconds: float = 0.0
    peak_memory_bytes: Optional[int] = None
    reused: bool = False


@dataclass(frozen=True)
class BuildContext:
    """What a candidate may need to build its weights besides θ0, θ̂ and the replay (held by the builder)."""

    config: "JanusConfig"
    rectify_fn: Callable[..., "RectificationReport"]
    progress: bool = False


@dataclass(frozen=True)
class Option:
    """One option of a kind, as a spec names it (``janus:tau=0.9,0.95``)."""

    name: str
    parse: Callable[[str], Any]  # one value of a spec string
    default: Any  # a tuple of values (the default grid), or a callable of the SpecContext giving one
    help: str


@dataclass(frozen=True)
class SpecContext:
    """Defaults a spec takes from the run: the JANUS τ of the hybrids and damped JANUS (``JanusConfig.tau``)."""

    tau: float = 0.95


def parse_float(text: str) -> float:
    return float(text)


def parse_int(text: str) -> int:
    value = float(text)
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def parse_str(text: str) -> str:
    return text.strip()


def require(ok: bool, kind: str, option: str, value: Any, expected: str) -> None:
    """Refuse an option value with a message that names the kind, the option, what it takes and how to give it."""
    if not ok:
        raise JanusError(f"{kind}: {option} must be {expected}, got {value!r} (in a spec: "
                         f"'{kind}:{option}=VALUE[,VALUE...]')")


def in_open_unit(value: float) -> bool:
    return 0.0 < float(value) < 1.0


def finite_positive(value: float) -> bool:
    return 0.0 < float(value) < math.inf


class Candidate(abc.ABC):
    """One model on the frontier and how it is made; subclasses are frozen dataclasses whose fields are options.

    Class attributes every kind sets: ``name`` (its spec name, ``"wise"``, and the ``kind`` of its JSON points),
    ``title`` (what the card and legend call it), ``options``, ``style`` (how its points look) and, for the kinds
    drawn as a peer curve, ``curve``.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    style: ClassVar[PlotStyle]
    curve: ClassVar[Optional[Curve]] = None
    #: defined for a LoRA adapter only (PEFT's intruder reduction): the default candidates leave it out elsewhere
    lora_only: ClassVar[bool] = False
    #: works on the linear layers JANUS rectifies (``JanusConfig.target_modules``), so that the comparison with
    #: JANUS is layer for layer; the frontier tells the builder which (``WeightBuilder.target_layers``)
    uses_target_layers: ClassVar[bool] = False

    @classmethod
    def expand(cls, values: Mapping[str, Sequence[Any]], context: SpecContext) -> list["Candidate"]:
        """The candidates of one spec item: every combination of the given option values, an option not given
        taking its default grid (or, with no default, the field's default)."""
        grid: dict[str, Sequence[Any]] = {}
        for option in cls.options:
            if option.name in values:
                grid[option.name] = values[option.name]
            elif option.default is not None:
                grid[option.name] = option.default(context) if callable(option.default) else option.default
        return [cls(**combo) for combo in grid_product(grid)]

    # ---- what it is ---------------------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def label(self) -> str:
        """The row's name in the table and the plot."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One or two sentences for the model card: what this model is and how it was made."""

    def record(self) -> dict[str, Any]:
        """Its options, as the JSON point holds them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def on_curve(self, curve: str) -> bool:
        """Whether this point is one of the points ``curve`` is drawn through."""
        return self.curve is not None and self.curve.name == curve

    @property
    def is_anchor(self) -> bool:
        return False

    # ---- how it is built ----------------------------------------------------------------------------------------
    def run_key(self) -> Optional[str]:
        """The key of the JANUS run it is built from (shared between candidates); ``None`` without JANUS."""
        return None

    @property
    def uses_janus(self) -> bool:
        return self.run_key() is not None

    def check(self, builder: "WeightBuilder") -> None:
        """Refuse, before any work, a candidate that is not defined for this fine-tuning (a JanusError saying why)."""
        if self.lora_only and builder.intruders is None:
            raise JanusError(f"{self.name} needs a saved LoRA adapter as the fine-tuned model (given by path or repo "
                             "id, with the reference by path or repo id too); drop it from the candidates")

    def prepare(self, builder: "WeightBuilder", context: BuildContext) -> Cost:
        """The expensive part, done once and kept in ``builder`` (a JANUS run, replay training, statistics of the
        replay); returns what it cost (``Cost(reused=True)`` when an earlier candidate already did it)."""
        return Cost()

    @abc.abstractmethod
    def weights(self, builder: "WeightBuilder") -> dict[str, Tensor]:
        """The changed parameters of this candidate, float32, from what ``prepare`` kept."""


def measured(builder: "WeightBuilder", work: Callable[[], Cost]) -> Cost:
    """Run ``work`` and fill in its seconds and its peak memory (the accelerator's, or on the CPU the host's)."""
    device = model_device(builder.model)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with HostPeak() if device.type == "cpu" else contextlib.nullcontext() as host:
        cost = work()
    cost.seconds = time.perf_counter() - start
    if cuda:
        cost.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    elif host is not None:
        cost.peak_memory_bytes = host.peak
    return cost


def interpolate(start: Mapping[str, Tensor], end: Mapping[str, Tensor], t: float) -> dict[str, Tensor]:
    """``start + t (end − start)`` of every parameter in ``start``, float32."""
    return {k: start[k].float() + t * (end[k].float() - start[k].float()) for k in start}


def grid_product(values: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the options' values, the first option varying slowest."""
    combos: list[dict[str, Any]] = [{}]
    for name, grid in values.items():
        combos = [{**c, name: v} for c in combos for v in grid]
    return combos
