"""Batched kernels of randomized subspace iteration (Halko et al.): a fixed Gaussian test matrix, a shifted
Cholesky QR and a Ritz step, from which :func:`hf_janus.engine.compression.randomized_compress` is built.

Each is a few batched matrix products or small batched eigenproblems, so that on an accelerator a whole replay batch
(and, for the Ritz step, many layers' batches) costs a handful of kernel launches instead of one LAPACK call per
sample.
"""

from __future__ import annotations

import torch
from torch import Tensor

_omegas: dict[tuple, Tensor] = {}


def gaussian_test_matrix(d: int, p: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A fixed Gaussian test matrix ``(d, p)`` per shape and device.

    Fixed rather than freshly drawn: identical weights then give bitwise-identical factors at every capture,
    so the principal angles between two captures measure the weights' change and not sampling noise; and
    the user's random state is never touched.
    """
    key = (d, p, str(device), dtype)
    omega = _omegas.get(key)
    if omega is None:
        gen = torch.Generator().manual_seed(0x4A414E55 + 7919 * d + p)
        omega = _omegas[key] = torch.randn(d, p, generator=gen).to(device, dtype)
    return omega


def cholesky_qr(y: Tensor) -> Tensor:
    """Shifted Cholesky QR of a batch of tall matrices ``(B, n, p)``, computed in float64, returned in ``y``'s dtype.

    Only the power iterations use it, where a slightly non-orthogonal basis merely slows convergence; unlike
    Householder QR it is three batched matrix operations, and the shift (Fukaya et al., 2020) keeps the
    factorization defined when ``y`` is rank-deficient (short samples).
    """
    y64 = y.double()
    w = y64.mT @ y64
    n, p = y.shape[-2:]
    trace = w.diagonal(dim1=-2, dim2=-1).sum(-1)
    shift = 11 * (n * p + p * (p + 1)) * torch.finfo(torch.float64).eps * trace + torch.finfo(torch.float64).tiny
    w.diagonal(dim1=-2, dim2=-1).add_(shift.unsqueeze(-1))  # w is this call's own: shifted in place, one kernel
    chol, _ = torch.linalg.cholesky_ex(w)
    return torch.linalg.solve_triangular(chol, y64.mT, upper=False).mT.to(y.dtype)


def ritz_pairs(w: Tensor, h: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` Ritz pairs of ``G`` restricted to ``range(Y)``, from ``w = YᵀY`` and ``h = (YᵀG)(YᵀG)ᵀ``.

    With ``M`` a (masked) whitening of ``w`` (``Q = Y M`` orthonormal), ``Mᵀ h M = Ũ Σ² Ũᵀ``; returns
    ``P = M Ũ_r`` ``(B, p, r)`` and ``σ`` ``(B, r)``, descending. float64 throughout.
    """
    lam, vec = torch.linalg.eigh(w)
    tiny = torch.finfo(lam.dtype).tiny
    keep = lam > lam[..., -1:].clamp_min(tiny) * 1e-10
    whiten = vec * torch.where(keep, lam.clamp_min(tiny).rsqrt(), torch.zeros_like(lam)).unsqueeze(-2)
    mu, u = torch.linalg.eigh(whiten.mT @ h @ whiten)
    mu, u = mu[..., -rank:].flip(-1), u[..., -rank:].flip(-1)
    return whiten @ u, mu.clamp_min(0).sqrt()
