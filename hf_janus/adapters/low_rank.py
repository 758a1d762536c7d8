"""Re-factorize a dense weight update ``ΔW`` (``d_out x d_in``) into LoRA factors ``B @ A`` by truncated SVD.

Pure functions on tensors, shared by :class:`~hf_janus.adapters.saved.merger.JanusMerger` (saving a rectified adapter)
and anything else that has to turn a rectified ``ΔW_rect`` back into a low-rank adapter.

Conventions follow ``peft.convert_to_lora``: all singular values go into ``B`` (``B = U_k S_k``,
``A = V_kᵀ``), so a LoRA built from the factors uses ``lora_alpha = r`` (scaling 1, no rsLoRA), and a
rank given as a float in ``(0, 1]`` is an energy threshold: the smallest ``k`` whose top-``k`` squared
singular values hold that fraction of ``||ΔW||²``.

Truncation gives back part of the JANUS repair: the truncation error ``ΔW_rect − ΔW_k`` in general has a
component in the row space of the past task's Jacobian ``J0``, so ``J0 ΔW_k ≠ J0 ΔW_rect``.
:func:`refine_low_rank` alternates (von Neumann alternating projections) between the rank-``k`` matrices
and the affine set ``{X : J0 X = J0 ΔW_rect}`` (``ΔW_rect`` plus the null space of ``J0``) to find a
rank-``k`` update whose first-order effect on the past task stays that of ``ΔW_rect``. For single-step
JANUS (``J0 ΔW_rect = 0``) that set is the null space itself. :class:`RefactorStats` records kept energy,
residuals and that leak per layer, with and without refinement.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor

from hf_janus.engine.public import GramEig, LayerJacobian, eig_psd, project
from hf_janus.errors import JanusError

RankSpec = Union[str, int, float]

#: Iterations of :func:`refine_low_rank` when the caller does not say.
DEFAULT_REFINE_ITERATIONS = 5


def validate_rank_spec(rank: RankSpec, energy: float = 0.99) -> None:
    """Raise :class:`JanusError` unless ``rank`` is ``"same"``, ``"auto"``, an int >= 1 or a float in (0, 1]."""
    if not (isinstance(energy, (int, float)) and not isinstance(energy, bool) and 0.0 < energy <= 1.0):
        raise JanusError(f"adapter_energy={energy!r} is invalid: expected a float in (0, 1], e.g. 0.99")
    if isinstance(rank, str):
        if rank not in ("same", "auto"):
            raise JanusError(f"adapter_rank={rank!r} is invalid: expected 'same', 'auto', an int >= 1 or a float in "
                             "(0, 1]")
        return
    if isinstance(rank, bool) or not isinstance(rank, (int, float)):
        raise JanusError(f"adapter_rank={rank!r} is invalid: expected 'same', 'auto', an int >= 1 or a float in "
                         "(0, 1]")
    if isinstance(rank, int) and rank < 1:
        raise JanusError(f"adapter_rank={rank} is invalid: a LoRA rank must be >= 1 (use 'auto' to pick it per "
                         "layer)")
    if isinstance(rank, float) and not 0.0 < rank <= 1.0:
        raise JanusError(f"adapter_rank={rank} is invalid: a float rank is an energy threshold in (0, 1]")


def parse_rank_spec(text: str) -> RankSpec:
    """``"same"``/``"auto"``, ``"16"`` -> 16, ``"0.9"`` -> 0.9 (energy threshold); for command lines."""
    text = text.strip()
    if text in ("same", "auto"):
        return text
    try:
        value: RankSpec = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise JanusError(
                f"rank {text!r} is invalid: expected 'same', 'auto', an int or a float in (0, 1]"
            ) from None
    validate_rank_spec(value)
    return value


def energy_rank(singular_values: Tensor, energy: float) -> int:
    """Smallest ``k`` with ``Σ_{i<k} σ_i² >= energy · Σ σ_i²`` (``peft.convert_to_lora``'s rule).

    0 for ``ΔW = 0``."""
    sq = singular_values.detach().to(torch.float64) ** 2
    cumulative = torch.cumsum(sq, dim=0)
    if cumulative.numel() == 0 or float(cumulative[-1]) <= 0.0:
        return 0
    k = int(torch.searchsorted(cumulative, energy * cumulative[-1]).item()) + 1
    return min(k, int(sq.numel()))


def choose_rank(singular_values: Tensor, rank: RankSpec, energy: float = 0.99,
                same_rank: Optional[int] = None, name: str = "") -> int:
    """The rank to keep for one layer, clipped to ``min(d_out, d_in)``.

    ``"same"`` uses ``same_rank`` (the adapter's own rank of that layer); ``"auto"`` the energy rule with
    ``energy``; a float is an energy threshold; an int is used as is.
    """
    validate_rank_spec(rank, energy)
    full = int(singular_values.numel())
    if rank == "same":
        if same_rank is None:
            raise JanusError(
                f"rank='same' needs the adapter's own rank, but layer {name!r} has none (its adapter type has no "
                "rank, or the layer was trained in full); pass an int rank or rank='auto'"
            )
        k = int(same_rank)
    elif rank == "auto":
        k = energy_rank(singular_values, energy)
    elif isinstance(rank, float):
        k = energy_rank(singular_values, rank)
    else:
        k = int(rank)
    return min(k, full)


def truncate(delta: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rank-``k`` factors of ``delta``: ``(B, A, S)`` with ``B = U_k S_k`` (d_out x k), ``A = V_kᵀ`` (k x d_in)
    and ``S`` all singular values, computed in float64."""
    if delta.dim() != 2:
        raise ValueError(f"delta must be a (d_out, d_in) matrix, got shape {tuple(delta.shape)}")
    u, s, vh = torch.linalg.svd(delta.detach().to(torch.float64), full_matrices=False)
    k = max(0, min(int(k), int(s.numel())))
    return u[:, :k] * s[:k], vh[:k], s


def _rank_k(matrix: Tensor, k: int) -> Tensor:
    b, a, _ = truncate(matrix, k)
    return b @ a


def refine_low_rank(delta: Tensor, k: int, jacobian: LayerJacobian, eig: Optional[GramEig] = None,
                    iterations: int = DEFAULT_REFINE_ITERATIONS, rcond: float = 1e-10) -> tuple[Tensor, list[float]]:
    """Alternate between the rank-``k`` matrices and the JANUS null space around ``delta``.

    The null-space step is the projection onto ``{X : J X = J delta}``, i.e. the truncation error is
    projected onto the null space of ``J``: ``Z = delta + (E − Jᵀ(JJᵀ)⁺J E)`` with ``E = Y − delta``;
    the rank step is ``Y = P_k(Z)`` (truncated SVD). Starting from ``Y0 = P_k(delta)``, returns the rank-``k``
    iterate with the smallest leak ``||J (Y − delta)||`` (``Y0`` included, so refinement never leaks more
    than plain truncation) and the leak of every iterate. A full-rank ``k`` leaves ``delta`` unchanged.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    if eig is None:
        eig = eig_psd(jacobian.gram(), rcond)
    target = delta.detach().to(torch.float64)
    y = _rank_k(target, k)
    best, best_leak = y, float(jacobian.jvp(y - target).norm())
    history = [best_leak]
    for _ in range(iterations):
        z = target + project(jacobian, y - target, eig).to(torch.float64)
        y = _rank_k(z, k)
        leak = float(jacobian.jvp(y - target).norm())
        history.append(leak)
        if leak < best_leak:
            best, best_leak = y, leak
    return best, history


@dataclass
class RefactorStats:
    """What re-factorizing one layer's ``ΔW_rect`` kept and gave back.

    ``kept_energy`` is ``Σ_{i<k} σ_i² / Σ σ_i²`` of ``ΔW_rect``; ``approx_error`` is
    ``||ΔW_rect − ΔW_k|| / ||ΔW_rect||`` of the factors actually saved (``approx_error_truncated`` that of
    the plain truncation). Residuals are first-order effects on the past task relative to the original
    fine-tuning update ``ΔW``: ``||J0 X|| / ||J0 ΔW||`` for ``X = ΔW_rect`` (``residual_rect``), the plain
    truncation (``residual_truncated``) and, with refinement, the saved refined factors
    (``residual_refined``). ``leak_*`` is the part of the repair that truncation gives back,
    ``||J0 (ΔW_k − ΔW_rect)|| / ||J0 ΔW||``, which refinement minimizes. ``None`` where no Jacobian was
    available or ``J0 ΔW = 0``.
    """

    name: str
    shape: list[int]  # [d_out, d_in]
    rank: int
    kept_energy: float
    approx_error: float
    approx_error_truncated: float
    residual_rect: Optional[float] = None
    residual_truncated: Optional[float] = None
    residual_refined: Optional[float] = None
    leak_truncated: Optional[float] = None
    leak_refined: Optional[float] = None
    refine_iterations: int = 0
    refined: bool = False  # True when the saved factors come from refinement (it lowered the leak)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(num: float, den: Optional[float]) -> Optional[float]:
    if den is None or den <= 0.0 or not math.isfinite(den):
        return None
    return num / den


def refactor_delta(
    delta: Tensor,
    rank: RankSpec = "same",
    *,
    energy: float = 0.99,
    same_rank: Optional[int] = None,
    jacobian: Optional[LayerJacobian] = None,
    eig: Optional[GramEig] = None,
    jvp0_norm: Optional[float] = None,
    refine: bool = False,
    refine_iterations: int = DEFAULT_REFINE_ITERATIONS,
    rcond: float = 1e-10,
    name: str = "",
) -> tuple[Tensor, Tensor, RefactorStats]:
    """Factor one layer's ``ΔW_rect`` (``d_out x d_in``) into LoRA ``(A, B)`` with ``B @ A ≈ ΔW_rect``.

    Args:
        delta: ``ΔW_rect`` in ``(d_out, d_in)`` layout.
        rank: ``"same"`` (``same_rank``), ``"auto"`` (energy rule with ``energy``), an int, or a float
            energy threshold. Clipped to ``min(d_out, d_in)``; ``k = 0`` (only for ``ΔW_rect = 0`` with an
            energy rule) returns empty factors.
        jacobian: ``J0`` of the layer (:class:`~hf_janus.engine.public.LayerJacobian`), for residuals and refinement.
        eig: eigendecomposition of ``J0 J0ᵀ`` if already known.
        jvp0_norm: ``||J0 ΔW||`` of the original fine-tuning update, the residuals' denominator.
        refine: alternate projections (:func:`refine_low_rank`) for ``refine_iterations`` iterations;
            needs ``jacobian``.

    Returns:
        ``A`` (k x d_in) and ``B`` (d_out x k) in float64, and the layer's :class:`RefactorStats`.
    """
    if refine and jacobian is None:
        raise JanusError(f"refine=True needs the past task's Jacobian of layer {name!r}; none was kept for it")
    device = jacobian.x.device if jacobian is not None else delta.device
    delta64 = delta.detach().to(device=device, dtype=torch.float64)
    b, a, s = truncate(delta64, min(delta64.shape))  # one full SVD; truncated below
    k = choose_rank(s, rank, energy, same_rank, name)
    b, a = b[:, :k].contiguous(), a[:k].contiguous()
    total = float((s**2).sum())
    kept = float((s[:k] ** 2).sum()) / total if total > 0 else 1.0
    delta_norm = math.sqrt(total)
    truncated = b @ a
    err_trunc = float((delta64 - truncated).norm()) / delta_norm if delta_norm > 0 else 0.0
    stats = RefactorStats(name=name, shape=list(delta64.shape), rank=k, kept_energy=kept,
                          approx_error=err_trunc, approx_error_truncated=err_trunc)
    if jacobian is not None:
        stats.residual_rect = _ratio(float(jacobian.jvp(delta64).norm()), jvp0_norm)
        stats.residual_truncated = _ratio(float(jacobian.jvp(truncated).norm()), jvp0_norm)
        stats.leak_truncated = _ratio(float(jacobian.jvp(truncated - delta64).norm()), jvp0_norm)
    if refine:
        stats.refine_iterations = refine_iterations
        stats.residual_refined, stats.leak_refined = stats.residual_truncated, stats.leak_truncated
        if 0 < k < min(delta64.shape):  # at full rank the factors are exact: nothing to give back
            if eig is None:
                eig = eig_psd(jacobian.gram(), rcond)
            refined, history = refine_low_rank(delta64, k, jacobian, eig, refine_iterations, rcond)
            if min(history) < (1.0 - 1e-6) * history[0]:  # a real improvement, not round-off
                b, a, _ = truncate(refined, k)
                saved = b @ a
                stats.refined = True
                stats.approx_error = float((delta64 - saved).norm()) / delta_norm if delta_norm > 0 else 0.0
                stats.residual_refined = _ratio(float(jacobian.jvp(saved).norm()), jvp0_norm)
                stats.leak_refined = _ratio(float(jacobian.jvp(saved - delta64).norm()), jvp0_norm)
    return a, b, stats
