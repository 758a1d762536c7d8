"""The frontier's candidates from its keyword grids (``wise_grid``, ``taus``, ``dampings``, the hybrids' grids,
``intruder_lambdas``): the same candidates, in the same order and with the same labels, as before candidates were
objects, so that results made through the keywords stay comparable; then the post-hoc peers ``peers`` names
(:data:`DEFAULT_PEERS`: the ones that beat JANUS somewhere in the benchmarks, so that the frontier can choose them;
with samples of the new task, :func:`default_peers` adds :data:`NEW_TASK_PEERS`)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from hf_janus.errors import JanusError
from hf_janus.evaluation.candidates.anchor import FINETUNED, REFERENCE
from hf_janus.evaluation.candidates.base import Candidate, SpecContext
from hf_janus.evaluation.candidates.damped_janus import DEFAULT_DAMPINGS, DampedJanus
from hf_janus.evaluation.candidates.intruder import DEFAULT_INTRUDER_LAMBDAS, Intruder
from hf_janus.evaluation.candidates.intruder_then_janus import DEFAULT_PRE_JANUS_INTRUDER_LAMBDAS, IntruderThenJanus
from hf_janus.evaluation.candidates.janus import DEFAULT_TAUS, Janus
from hf_janus.evaluation.candidates.janus_to_finetuned import JanusToFinetuned
from hf_janus.evaluation.candidates.janus_to_reference import DEFAULT_HYBRID_GRID, JanusToReference
from hf_janus.evaluation.candidates.registry import SpecLike, parse_candidates
from hf_janus.evaluation.candidates.wise import DEFAULT_WISE_GRID, Wise
from hf_janus.evaluation.candidates.wise_then_janus import DEFAULT_PRE_JANUS_GRID, WiseThenJanus

# Replay fine-tuning on the KL to θ0 at 4× JANUS's evaluations, Fisher-weighted interpolation and the input-covariance
# null space: each lies above JANUS at its defaults, or level with it, on a benchmark run (benchmarks/forgetting/
# README.md, issue 40), at a cost of the order of one JANUS run (replay SFT), one Jacobian evaluation (Fisher) or one
# forward pass over the replay (the null space, shared by its two points).
DEFAULT_PEERS = "replay-sft:budget=4:loss=kl fisher:strength=1 input-null:energy=0.5,0.9"
# JANUS with the repair after it (the engine's stage, JanusConfig.distill_steps): JANUS, then steps on the replay's KL
# to θ0 that also fit the new task's samples, then the point back toward θ0 it chooses itself. It needs the new task's
# samples, so only a frontier given them adds it.
NEW_TASK_PEERS = "janus-repair"

__all__ = ["DEFAULT_DAMPINGS", "DEFAULT_PEERS", "DEFAULT_HYBRID_GRID", "DEFAULT_INTRUDER_LAMBDAS",
           "DEFAULT_PRE_JANUS_GRID", "DEFAULT_PRE_JANUS_INTRUDER_LAMBDAS", "DEFAULT_TAUS", "DEFAULT_WISE_GRID",
           "NEW_TASK_PEERS", "candidates", "check_grids", "default_peers"]


def default_peers(new_task_samples: bool) -> str:
    """The frontier's default peers: :data:`DEFAULT_PEERS`, and :data:`NEW_TASK_PEERS` when the new task's samples
    were given (the candidates that fit them)."""
    return DEFAULT_PEERS + (" " + NEW_TASK_PEERS if new_task_samples else "")


def check_grids(wise_grid: Sequence[float], taus: Sequence[float], hybrid_grid: Sequence[float],
                pre_janus_grid: Sequence[float], dampings: Sequence[float],
                intruder_lambdas: Sequence[float] = ()) -> None:
    """Refuse coefficients that would repeat an anchor or name no model, naming the keyword (the kinds check their
    own options too, but name the spec option)."""
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
               pre_janus_intruder_lambdas: Sequence[float] = (),
               peers: Union[SpecLike, Sequence[SpecLike]] = "") -> list[Candidate]:
    """The candidates in scoring order: θ0 and θ̂ first (AP needs them), then WiSE-FT, PEFT's intruder reduction
    (at ``intruder_lambdas``; LoRA adapters only), JANUS, damped JANUS (at ``damped_tau``) and the hybrids (at
    ``hybrid_tau``; none when it is ``None``), intruder reduction then JANUS among them, and last the candidates of
    the spec ``peers`` (or the candidates parsed from it; ``""``: none; a JANUS budget it counts is JANUS at
    ``damped_tau``, the frontier's τ)."""
    check_grids(wise_grid, taus, hybrid_grid, pre_janus_grid, dampings,
                tuple(intruder_lambdas) + tuple(pre_janus_intruder_lambdas))
    out: list[Candidate] = [REFERENCE, FINETUNED]
    out += [Wise(float(a)) for a in wise_grid]
    out += [Intruder(float(lam)) for lam in intruder_lambdas]
    out += [Janus(float(t)) for t in taus]
    out += [DampedJanus(tau=float(damped_tau), damping=float(d)) for d in dampings]
    if hybrid_tau is not None:
        t = float(hybrid_tau)
        out += [JanusToReference(b=float(b), tau=t) for b in hybrid_grid]
        out += [JanusToFinetuned(b=float(b), tau=t) for b in hybrid_grid]
        out += [WiseThenJanus(a=float(a), tau=t) for a in pre_janus_grid]
        out += [IntruderThenJanus(mitigation_lambda=float(lam), tau=t) for lam in pre_janus_intruder_lambdas]
    if peers:
        out += [c for c in parse_candidates(peers, SpecContext(tau=float(damped_tau)))
                if not c.is_anchor and c not in out]
    return out
