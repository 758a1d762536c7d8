"""The frontier's candidates: which models between θ0 and θ̂ are scored, in what order, and how each is labelled.

A :class:`Candidate` only says how its model is made (a WiSE-FT coefficient, a JANUS τ and damping, an interpolation
after JANUS, PEFT's intruder-reduction λ); :mod:`hf_janus.evaluation.candidate_weights` builds its weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hf_janus.errors import JanusError

DEFAULT_WISE_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
DEFAULT_TAUS = (0.9, 0.95, 0.98)
DEFAULT_HYBRID_GRID = (0.25, 0.5, 0.75)
DEFAULT_PRE_JANUS_GRID = (0.5, 0.75)
# Dampings of the damped-JANUS candidates (relative to each layer's largest Gram eigenvalue). In the forgetting
# benchmark's frontier study 0.01-0.1 spanned the useful range: 0.001 stayed within 2.5 AP2 points of plain JANUS and
# 1 came within 0.5 of θ̂ (benchmarks/forgetting/README.md).
DEFAULT_DAMPINGS = (0.01, 0.1)
# mitigation_lambda of PEFT's intruder-dimension reduction (LoRA adapters only): PEFT's default 0.75 and the paper's
# range down to removing the intruders (0). 1 is θ̂ itself.
DEFAULT_INTRUDER_LAMBDAS = (0.75, 0.5, 0.25, 0.0)
# the λ of "intruder reduction, then JANUS" (one more JANUS run, LoRA adapters only, with the hybrids)
DEFAULT_PRE_JANUS_INTRUDER_LAMBDAS = (0.5,)


@dataclass
class Candidate:
    """One model on the frontier and how it is made."""

    label: str
    kind: str
    a: Optional[float] = None  # WiSE-FT coefficient (wise, wise_then_janus)
    tau: Optional[float] = None  # JANUS τ (janus and the hybrids)
    b: Optional[float] = None  # interpolation after JANUS (janus_to_reference, janus_to_finetuned)
    damping: Optional[float] = None  # JanusConfig.damping of a damped_janus run (None: the config's)
    mitigation_lambda: Optional[float] = None  # PEFT's intruder reduction (intruder, intruder_then_janus)

    @property
    def uses_janus(self) -> bool:
        return self.tau is not None


def _check_grids(wise_grid: Sequence[float], taus: Sequence[float], hybrid_grid: Sequence[float],
                 pre_janus_grid: Sequence[float], dampings: Sequence[float],
                 intruder_lambdas: Sequence[float] = ()) -> None:
    """Refuse coefficients that would repeat an anchor or name no model."""
    if any(not 0.0 <= float(v) < 1.0 for v in intruder_lambdas):
        raise JanusError(f"intruder_lambdas (PEFT's mitigation_lambda) must lie in [0, 1) (1 keeps θ̂), got "
                         f"{list(intruder_lambdas)}")
    for name, grid in (("wise_grid", wise_grid), ("hybrid_grid", hybrid_grid), ("pre_janus_grid", pre_janus_grid)):
        if any(not 0.0 < float(v) < 1.0 for v in grid):
            raise JanusError(f"{name} values must lie strictly between 0 and 1 (the ends are θ0 and θ̂), got "
                             f"{list(grid)}")
    if any(not 0.0 <= float(t) < 1.0 for t in taus):
        raise JanusError(f"taus must lie in [0, 1), got {list(taus)}")
    if any(not (0.0 < float(d) < float("inf")) for d in dampings):
        raise JanusError(f"dampings must be finite and > 0 (0 is plain JANUS, already among the candidates), got "
                         f"{list(dampings)}")


def candidates(wise_grid: Sequence[float] = DEFAULT_WISE_GRID, taus: Sequence[float] = DEFAULT_TAUS, *,
               hybrid_tau: Optional[float] = None, hybrid_grid: Sequence[float] = DEFAULT_HYBRID_GRID,
               pre_janus_grid: Sequence[float] = DEFAULT_PRE_JANUS_GRID, dampings: Sequence[float] = (),
               damped_tau: float = 0.95, intruder_lambdas: Sequence[float] = (),
               pre_janus_intruder_lambdas: Sequence[float] = ()) -> list[Candidate]:
    """The candidates in scoring order: θ0 and θ̂ first (AP needs them), then WiSE-FT, PEFT's intruder reduction
    (at ``intruder_lambdas``; LoRA adapters only), JANUS, damped JANUS (at ``damped_tau``) and the hybrids (at
    ``hybrid_tau``; none when it is ``None``), intruder reduction then JANUS among them."""
    _check_grids(wise_grid, taus, hybrid_grid, pre_janus_grid, dampings,
                 tuple(intruder_lambdas) + tuple(pre_janus_intruder_lambdas))
    out = [Candidate("θ0 (reference)", "anchor", a=0.0), Candidate("θ̂ (fine-tuned)", "anchor", a=1.0)]
    out += [Candidate(f"WiSE-FT a={a:g}", "wise", a=float(a)) for a in wise_grid]
    out += [Candidate(f"intruder reduction λ={lam:g}", "intruder", mitigation_lambda=float(lam))
            for lam in intruder_lambdas]
    out += [Candidate(f"JANUS τ={t:g}", "janus", tau=float(t)) for t in taus]
    out += [Candidate(f"JANUS τ={float(damped_tau):g}, damping {d:g}", "damped_janus", tau=float(damped_tau),
                      damping=float(d)) for d in dampings]
    if hybrid_tau is not None:
        t = float(hybrid_tau)
        out += [Candidate(f"JANUS τ={t:g} → θ0 b={b:g}", "janus_to_reference", tau=t, b=float(b))
                for b in hybrid_grid]
        out += [Candidate(f"JANUS τ={t:g} → θ̂ b={b:g}", "janus_to_finetuned", tau=t, b=float(b))
                for b in hybrid_grid]
        out += [Candidate(f"WiSE-FT a={a:g} → JANUS τ={t:g}", "wise_then_janus", a=float(a), tau=t)
                for a in pre_janus_grid]
        out += [Candidate(f"intruder reduction λ={lam:g} → JANUS τ={t:g}", "intruder_then_janus", tau=t,
                          mitigation_lambda=float(lam)) for lam in pre_janus_intruder_lambdas]
    return out
