"""Jacobian quantities of one linear layer from its (compressed) per-sample factors, never forming J.

Notation (paper, App. B): for sample ``i`` the layer's per-sample gradient is
``G_i = Σ_k a_ik x_ikᵀ = A_iᵀ X_i`` (d_out x d_in) and the Jacobian row is ``g_i = rvec(G_i)``.
With factors ``X`` (m x r x d_in) and ``A`` (m x r x d_out):

* Gram ``(J Jᵀ)_uv = Σ_kl (A_u A_vᵀ)_kl (X_u X_vᵀ)_kl``  (ghost) or ``<G_u, G_v>`` (materialized),
* JVP ``(J ΔW)_u = Σ_k a_ukᵀ ΔW x_uk``,
* VJP ``Jᵀ v = Σ_i v_i A_iᵀ X_i``,
* projection ``ΔW - Jᵀ (J Jᵀ)⁺ J ΔW`` (or its damped form ``ΔW - Jᵀ (J Jᵀ + λI)⁻¹ J ΔW``) and
  principal-angle cosines between two row spaces from ``G1``, ``G2`` and the cross-Gram ``G12``.

Two exact paths compute the same numbers: the ghost path (cost ~ m² r² (d_in + d_out)) and the
materialized path that builds the m per-sample gradients (cost ~ m r d_in d_out + m² d_in d_out,
memory m d_in d_out). :func:`choose_path` picks the cheaper one per layer.

Precision. Every function takes ``dtype`` (float64 by default: what Grams, JVPs and eigendecompositions are
accumulated and returned in) and ``matmul_dtype``, the dtype of the large matrix products. With
``matmul_dtype=float32`` the products run in float32 (TF32 tensor cores on CUDA inside :func:`tensor_cores`)
while every sum over samples, rank slots or chunks of the inner dimension is accumulated in ``dtype``;
:func:`project_with_jvp` then adds one refinement sweep whose residual JVP is computed in ``dtype``, so the
projection's null-space residual stays at float64 level (``tests/engine/test_ghost_explicit.py``, "Mixed precision").
Float64 products are far slower than float32 on GPUs (slower still than TF32) and on CPUs
(``docs/concepts/how-it-works.md`` has the measurements).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal, Optional

import torch
from torch import Tensor

from hf_janus.engine.workspace import Workspace

Path = Literal["ghost", "materialized"]


# The materialized path's FLOPs are dearer than the ghost path's: building the per-sample gradients is a
# memory-bound batched product (inner dimension r) writing m x d_out x d_in float64 values, and they are
# rebuilt for each use because keeping every layer's would hold the whole Jacobian. The factor is measured (the
# measurement: docs/concepts/how-it-works.md, "Ghost math").
MATERIALIZED_COST_FACTOR = 4

# Upper bound on the elements of one ghost Gram block (m_chunk x r x m x r), to bound peak memory.
GRAM_BLOCK_ELEMS = 1 << 24
# Factor rows per row block of a symmetric Gram: more blocks skip more of the lower triangle (the saving is
# (1 - 1/blocks)/2 of the products) but make smaller matrix products; 256 rows keep them efficient.
_SYMMETRIC_BLOCK_ROWS = 256


# Columns per chunk of the inner dimension of a materialized Gram or JVP whose products run in a lower dtype than
# the accumulation: each chunk's partial result is summed in the accumulation dtype, so a float32 product never
# accumulates more than this many terms (per-sample gradient rows have d_in·d_out elements, up to 45M at 7B).
_ACCUMULATION_CHUNK = 1 << 14


@contextmanager
def tensor_cores(device: torch.device, matmul_dtype: torch.dtype) -> Iterator[None]:
    """Let CUDA run the float32 products of the ghost math on TF32 tensor cores, whatever the user's global setting.

    Why: float64 and plain float32 products run on the CUDA cores, many times slower than TF32. The
    accumulations and the refinement sweep in float64 keep the results at float64 accuracy. The user's setting is
    restored afterwards; elsewhere (CPU, float64 products) this does nothing.
    """
    if torch.device(device).type != "cuda" or matmul_dtype != torch.float32:
        yield
        return
    matmul = torch.backends.cuda.matmul
    # torch >= 2.9 names the setting fp32_precision and deprecates allow_tf32
    knob, tf32 = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    before = getattr(matmul, knob)
    setattr(matmul, knob, tf32)
    try:
        yield
    finally:
        setattr(matmul, knob, before)


def _check_factors(x: Tensor, a: Tensor) -> None:
    if x.dim() != 3 or a.dim() != 3 or x.shape[:2] != a.shape[:2]:
        raise ValueError(
            f"layer factors must be X of shape (m, r, d_in) and A of shape (m, r, d_out) with equal m and r; "
            f"got {tuple(x.shape)} and {tuple(a.shape)}"
        )


def _check_delta(x: Tensor, a: Tensor, delta: Tensor) -> None:
    _check_factors(x, a)
    if tuple(delta.shape) != (a.shape[-1], x.shape[-1]):
        raise ValueError(f"delta must have shape (d_out, d_in)={(a.shape[-1], x.shape[-1])}, got {tuple(delta.shape)}")


def _check_v(x: Tensor, a: Tensor, v: Tensor) -> None:
    _check_factors(x, a)
    if tuple(v.shape) != (x.shape[0],):
        raise ValueError(f"v must have shape (m,)=({x.shape[0]},), got {tuple(v.shape)}")


def per_sample_gradients(x: Tensor, a: Tensor, dtype: torch.dtype = torch.float64,
                         out: Optional[Tensor] = None) -> Tensor:
    """Materialize the per-sample gradients ``G_i = A_iᵀ X_i``, shape ``(m, d_out, d_in)`` (into ``out``)."""
    _check_factors(x, a)
    return torch.bmm(a.to(dtype).transpose(1, 2), x.to(dtype), out=out)


def ghost_gram(
    x1: Tensor, a1: Tensor, x2: Optional[Tensor] = None, a2: Optional[Tensor] = None,
    dtype: torch.dtype = torch.float64, matmul_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """(Cross-)Gram ``J1 J2ᵀ`` of shape ``(m1, m2)`` without forming either Jacobian.

    Without ``x2``/``a2`` the Gram ``J1 J1ᵀ`` is symmetric: only the blocks on and above the diagonal are
    computed (row blocks of about :data:`_SYMMETRIC_BLOCK_ROWS` factor rows) and mirrored, which saves up
    to half of the dominant products. The ``(XXᵀ)`` and ``(AAᵀ)`` blocks are products in ``matmul_dtype``
    (default ``dtype``); their elementwise product is summed over rank slots in ``dtype``.
    """
    mm = matmul_dtype or dtype
    _check_factors(x1, a1)
    symmetric = x2 is None
    if symmetric:
        x2, a2 = x1, a1
    _check_factors(x2, a2)
    if x1.shape[-1] != x2.shape[-1] or a1.shape[-1] != a2.shape[-1]:
        raise ValueError(
            f"cross-Gram needs factors of the same layer shape: (d_in, d_out)={(x1.shape[-1], a1.shape[-1])} vs "
            f"{(x2.shape[-1], a2.shape[-1])}"
        )
    m1, r1, _ = x1.shape
    m2, r2, _ = x2.shape
    x2f = x2.to(mm).reshape(m2 * r2, -1)
    a2f = a2.to(mm).reshape(m2 * r2, -1)
    chunk = max(1, GRAM_BLOCK_ELEMS // max(1, r1 * m2 * r2))
    if symmetric:
        chunk = min(chunk, max(1, -(-_SYMMETRIC_BLOCK_ROWS // max(1, r1))))
    out = torch.empty(m1, m2, dtype=dtype, device=x1.device)
    for start in range(0, m1, chunk):
        stop = min(m1, start + chunk)
        if symmetric:
            # Rows start:stop against columns start: only; the converted factors are reused.
            rows_x, rows_a = x2f[start * r2: stop * r2], a2f[start * r2: stop * r2]
            col0 = start
        else:
            rows_x = x1[start:stop].to(mm).reshape(-1, x1.shape[-1])
            rows_a = a1[start:stop].to(mm).reshape(-1, a1.shape[-1])
            col0 = 0
        xx = rows_x @ x2f[col0 * r2:].T
        aa = rows_a @ a2f[col0 * r2:].T
        block = (xx * aa).reshape(stop - start, r1, m2 - col0, r2).sum(dim=(1, 3), dtype=dtype)
        out[start:stop, col0:] = block
        if symmetric and stop < m2:
            out[stop:, start:stop] = block[:, stop - start:].T
    return out


def symmetric_gram(flat: Tensor, block_rows: int = 64, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``flat @ flat.T`` from the row blocks on and above the diagonal, mirrored below, in ``dtype``.

    Skips (1 - 1/blocks)/2 of the products; 64-row blocks keep each product large enough to run efficiently. With
    ``dtype`` above ``flat``'s, the products are accumulated in ``dtype`` chunk by chunk of the inner dimension.
    """
    m = flat.shape[0]
    dtype = dtype or flat.dtype
    out = torch.empty(m, m, dtype=dtype, device=flat.device)
    for start in range(0, m, block_rows):
        stop = min(m, start + block_rows)
        block = inner_products(flat[start:stop], flat[start:], dtype)
        out[start:stop, start:] = block
        out[stop:, start:stop] = block[:, stop - start:].T
    return out


def inner_products(left: Tensor, right: Tensor, dtype: torch.dtype) -> Tensor:
    """``left @ right.T`` accumulated in ``dtype``: in one product when the inputs already are ``dtype``, else by
    chunks of :data:`_ACCUMULATION_CHUNK` columns whose partial products are summed in ``dtype``."""
    if left.dtype == dtype and right.dtype == dtype:
        return left @ right.T
    n = left.shape[1]
    out = torch.zeros(left.shape[0], right.shape[0], dtype=dtype, device=left.device)
    for start in range(0, n, _ACCUMULATION_CHUNK):
        out += (left[:, start:start + _ACCUMULATION_CHUNK] @ right[:, start:start + _ACCUMULATION_CHUNK].T).to(dtype)
    return out


def ghost_jvp(x: Tensor, a: Tensor, delta: Tensor, dtype: torch.dtype = torch.float64,
              matmul_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``J rvec(ΔW)`` of shape ``(m,)`` in ``dtype``; ``delta`` is ``ΔW`` in ``(d_out, d_in)`` layout.

    ``A ΔW`` is a product in ``matmul_dtype`` (default ``dtype``); the sum over rank slots and inputs is in ``dtype``.
    """
    _check_delta(x, a, delta)
    mm = matmul_dtype or dtype
    ad = a.to(mm) @ delta.to(mm)  # (m, r, d_in)
    return (ad * x.to(mm)).sum(dim=(1, 2), dtype=dtype)


def ghost_vjp(x: Tensor, a: Tensor, v: Tensor, dtype: torch.dtype = torch.float64,
              matmul_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``Jᵀ v`` as a ``(d_out, d_in)`` matrix: ``Σ_i v_i A_iᵀ X_i``, one product in ``matmul_dtype`` (default
    ``dtype``), returned in that dtype (a refinement sweep, not the accumulation, corrects its rounding)."""
    _check_v(x, a, v)
    mm = matmul_dtype or dtype
    m, r, _ = x.shape
    av = a.to(mm) * v.to(mm).view(m, 1, 1)
    return av.reshape(m * r, -1).T @ x.to(mm).reshape(m * r, -1)


@dataclass
class GramEig:
    """Eigendecomposition of a PSD Gram matrix restricted to its numerically non-zero spectrum.

    ``shift`` is the absolute damping λ of :meth:`solve` (0: the pseudo-inverse); the row space, its rank and
    :meth:`whitened_basis` (the principal angles) never depend on it.
    """

    values: Tensor  # (k,), all > rcond * max eigenvalue
    vectors: Tensor  # (m, k)
    size: int  # m
    shift: float = 0.0

    @property
    def rank(self) -> int:
        return int(self.values.numel())

    def solve(self, b: Tensor) -> Tensor:
        """Minimum-norm least-squares solution ``G⁺ b``, or ``(G + λI)⁻¹ b`` with a shift λ > 0.

        With a shift the eigenvalues cut off as zero are left out as well: ``b`` is a JVP, so its component
        along them is at most ``sqrt(rcond)`` of its norm, and ``(G + λI)⁻¹`` would scale it by ``1/λ`` only to
        have ``Jᵀ`` multiply it by ``sqrt(rcond · max eigenvalue)`` again.
        """
        if self.rank == 0:
            return torch.zeros_like(b, dtype=self.vectors.dtype)
        coeff = (self.vectors.T @ b.to(self.vectors.dtype)) / (self.values + self.shift)
        return self.vectors @ coeff

    def whitened_basis(self) -> Tensor:
        """``L Λ^{-1/2}``: maps Gram coordinates to an orthonormal basis of the row space."""
        return self.vectors / self.values.sqrt()


def eig_psd(gram: Tensor, rcond: float, damping: float = 0.0) -> GramEig:
    """Symmetric eigendecomposition with a relative cutoff, the only inverse the engine uses.

    ``damping`` (relative, ≥ 0) sets the shift λ = damping · (largest eigenvalue) of :meth:`GramEig.solve`, so that
    the same setting means the same softness on every layer and at every point, whatever the Jacobian's scale.
    """
    if not (damping >= 0.0 and math.isfinite(damping)):
        raise ValueError(f"damping must be a finite float >= 0, got {damping!r}")
    if gram.dim() != 2 or gram.shape[0] != gram.shape[1]:
        raise ValueError(f"Gram matrix must be square, got {tuple(gram.shape)}")
    sym = 0.5 * (gram + gram.T)
    values, vectors = torch.linalg.eigh(sym)
    top = values.max() if values.numel() else torch.zeros((), dtype=gram.dtype)
    if not torch.isfinite(values).all():
        raise FloatingPointError("the Jacobian Gram matrix has non-finite eigenvalues (NaN/Inf gradients)")
    if top <= 0:
        keep = torch.zeros_like(values, dtype=torch.bool)
    else:
        keep = values > rcond * top
    return GramEig(values=values[keep], vectors=vectors[:, keep], size=gram.shape[0],
                   shift=float(damping * top) if top > 0 else 0.0)


def principal_cosines(eig1: GramEig, eig2: GramEig, cross_gram: Tensor) -> Tensor:
    """Cosines of the principal angles between the row spaces of ``J1`` and ``J2``.

    With ``G1 = L1 Λ1 L1ᵀ``, ``G2 = L2 Λ2 L2ᵀ`` and ``G12 = J1 J2ᵀ`` the cosines are the singular values
    of ``Λ1^{-1/2} L1ᵀ G12 L2 Λ2^{-1/2}`` (paper, App. B.2); ``min(rank1, rank2)`` of them, descending.
    """
    if eig1.rank == 0 or eig2.rank == 0:
        return torch.zeros(0, dtype=cross_gram.dtype, device=cross_gram.device)
    m = eig1.whitened_basis().T @ cross_gram.to(eig1.vectors.dtype) @ eig2.whitened_basis()
    return torch.linalg.svdvals(m).clamp(0.0, 1.0)


def choose_path(m: int, r: int, d_in: int, d_out: int, bytes_per_elem: int, max_bytes: int) -> Path:
    """Pick the exact path with fewer FLOPs for the Gram, the dominant cost.

    Ghost: ``m² r² (d_in + d_out)``. Materialized: ``m r d_in d_out`` to build the per-sample gradients
    plus ``m² d_in d_out`` for their Gram, weighted by :data:`MATERIALIZED_COST_FACTOR`, and only if the
    ``m d_in d_out`` tensor fits ``max_bytes``.
    """
    ghost = m * m * r * r * (d_in + d_out)
    materialized = MATERIALIZED_COST_FACTOR * (m * r * d_in * d_out + m * m * d_in * d_out)
    fits = m * d_in * d_out * bytes_per_elem <= max_bytes
    return "materialized" if fits and materialized < ghost else "ghost"


class LayerJacobian:
    """The per-sample Jacobian of one layer at one parameter point, held as factors.

    Grams, JVPs and eigendecompositions are accumulated in ``dtype`` (float64 by default), the large products run
    in ``matmul_dtype`` (default ``dtype``; see the module's "Precision"). The materialized per-sample gradients,
    in ``matmul_dtype``, are built lazily when the path says so, into a buffer of ``workspace`` when one is given
    (the caller must then :meth:`release` this Jacobian before the workspace is dropped or cleared).
    """

    def __init__(self, x: Tensor, a: Tensor, dtype: torch.dtype = torch.float64, path: Optional[Path] = None,
                 max_bytes: int = 1 << 30, workspace: Optional[Workspace] = None,
                 matmul_dtype: Optional[torch.dtype] = None):
        _check_factors(x, a)
        self.x, self.a, self.dtype = x, a, dtype
        self.matmul_dtype = matmul_dtype or dtype
        self.workspace = workspace
        m, r, d_in = x.shape
        d_out = a.shape[-1]
        self._itemsize = torch.empty((), dtype=self.matmul_dtype).element_size()
        self.path: Path = path or choose_path(m, r, d_in, d_out, self._itemsize, max_bytes)
        self._flat: Optional[Tensor] = None
        self._gram: Optional[Tensor] = None

    @property
    def num_samples(self) -> int:
        return self.x.shape[0]

    @property
    def refines(self) -> bool:
        """Whether products run below the accumulation precision, so that projections take a refinement sweep."""
        return torch.finfo(self.matmul_dtype).eps > torch.finfo(self.dtype).eps

    @property
    def materialized_bytes(self) -> int:
        """Size of the explicit per-sample gradients ``(m, d_out * d_in)`` in ``matmul_dtype``."""
        return self.num_samples * self.x.shape[-1] * self.a.shape[-1] * self._itemsize

    @property
    def flat(self) -> Tensor:
        """Explicit Jacobian rows ``(m, d_out * d_in)`` (materialized path only)."""
        if self._flat is None:
            if self.workspace is None:
                self._flat = per_sample_gradients(self.x, self.a, self.matmul_dtype).reshape(self.num_samples, -1)
            else:
                m, d_in, d_out = self.num_samples, self.x.shape[-1], self.a.shape[-1]
                out = self.workspace.take((m, d_out, d_in), self.matmul_dtype, self.x.device)
                self._flat = per_sample_gradients(self.x, self.a, self.matmul_dtype, out=out).view(m, -1)
        return self._flat

    def gram(self) -> Tensor:
        if self._gram is None:
            if self.path == "materialized":
                self._gram = symmetric_gram(self.flat, dtype=self.dtype)
            else:
                self._gram = ghost_gram(self.x, self.a, dtype=self.dtype, matmul_dtype=self.matmul_dtype)
        return self._gram

    def cross_gram(self, other: "LayerJacobian") -> Tensor:
        """``J_self J_otherᵀ``."""
        if self.path == "materialized" and other.path == "materialized":
            if self.flat.shape[1] != other.flat.shape[1] or self.x.shape[-1] != other.x.shape[-1]:
                raise ValueError("cross-Gram needs two Jacobians of the same layer shape")
            return inner_products(self.flat, other.flat.to(self.matmul_dtype), self.dtype)
        return ghost_gram(self.x, self.a, other.x, other.a, dtype=self.dtype, matmul_dtype=self.matmul_dtype)

    def jvp(self, delta: Tensor) -> Tensor:
        _check_delta(self.x, self.a, delta)
        if self.path == "materialized":
            return inner_products(self.flat, delta.to(self.matmul_dtype).reshape(1, -1), self.dtype).view(-1)
        return ghost_jvp(self.x, self.a, delta, self.dtype, self.matmul_dtype)

    def precise_jvp(self, delta: Tensor) -> Tensor:
        """``J ΔW`` with every product in ``dtype``: the residual of a refinement sweep and of the statistics."""
        if not self.refines:
            return self.jvp(delta)
        return ghost_jvp(self.x, self.a, delta, self.dtype)

    def vjp(self, v: Tensor) -> Tensor:
        """``Jᵀ v`` as a ``(d_out, d_in)`` matrix in ``matmul_dtype``."""
        _check_v(self.x, self.a, v)
        d_out, d_in = self.a.shape[-1], self.x.shape[-1]
        if self.path == "materialized":
            return (v.to(self.matmul_dtype) @ self.flat).reshape(d_out, d_in)
        return ghost_vjp(self.x, self.a, v, self.dtype, self.matmul_dtype)

    def release(self) -> None:
        """Drop cached products (the materialized gradients can be large); a workspace buffer goes back."""
        if self._flat is not None and self.workspace is not None:
            self.workspace.give(self._flat)
        self._flat = None


def project(jac: LayerJacobian, delta: Tensor, eig: GramEig) -> Tensor:
    """JANUS projection ``ΔW - Jᵀ (J Jᵀ)⁺ J ΔW`` onto the null space of ``J``.

    With a damped ``eig`` (shift λ > 0, see :func:`eig_psd`) it is ``ΔW - Jᵀ (J Jᵀ + λI)⁻¹ J ΔW``: along a
    singular direction of ``J`` with singular value σ, a share ``λ / (σ² + λ)`` of the update is kept instead of
    none, so the directions the replay barely constrains keep their fine-tuning (a ridge-regularized projection).
    """
    return project_with_jvp(jac, delta, eig)[0]


def project_with_jvp(jac: LayerJacobian, delta: Tensor, eig: GramEig) -> tuple[Tensor, Tensor]:
    """:func:`project` and the JVP ``J ΔW`` it computed on the way (a JVP costs as much as the VJP).

    The projection is returned in ``jac.matmul_dtype`` (the JVP in ``jac.dtype``). When the products run below the
    accumulation precision, one refinement sweep projects again the residual ``J P ΔW``, computed in ``jac.dtype``:
    the rounding of the first sweep's products is of the order of their unit roundoff times the update, and the
    sweep removes it from the row space (iterative refinement), at the cost of one more JVP and VJP.
    """
    jvp = jac.jvp(delta)
    coeff = eig.solve(jvp)
    proj = delta.to(jac.matmul_dtype) - jac.vjp(coeff)
    if jac.refines:
        # The residual of the system (J Jᵀ + λI) v = J ΔW at v = coeff is J proj - λ coeff (λ = 0 undamped).
        residual = jac.precise_jvp(proj)
        if eig.shift:
            residual = residual - eig.shift * coeff
        proj = proj - jac.vjp(eig.solve(residual))
    return proj, jvp


def mean_cosine(cosines: Tensor) -> Optional[float]:
    """Average principal-angle cosine, ``None`` for a layer whose Jacobian is empty (no constraint)."""
    if cosines.numel() == 0:
        return None
    return float(cosines.mean())
