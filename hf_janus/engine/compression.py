"""Sequence-level SVD compression of a layer's per-sample inputs and output gradients (paper, App. B.3).

For one sample with inputs ``X_i`` (T x d_in) and output gradients ``A_i`` (T x d_out), the per-sample
gradient is ``A_iᵀ X_i``. Its best rank-r approximation is found without forming the d_out x d_in matrix:
QR of ``X_iᵀ`` and ``A_iᵀ``, SVD of the small core ``R_A R_Xᵀ``, and the singular values split evenly
between the two factors so that ``Âᵢᵀ X̂ᵢ`` is the rank-r optimum.

The QR is a Householder factorization (``torch.geqrf``) whose ``Q`` is applied to the r kept singular
vectors (``torch.ormqr``) rather than formed: 1.3-1.4x faster at T=128 on CPU. Layers that read the same
input tensor share its factorization (:class:`SequenceBasis`). Every call is batched over the samples of
a replay batch, and only the samples with more than r non-zero rows are factorized: the others are exact
as their own rows (:func:`needs_compression`).

On accelerators those per-sample factorizations are many small LAPACK calls, each slow; there
:func:`randomized_compress` (randomized subspace iteration, batched matrix products) replaces them, at
an error within 2% of the optimum's (measured in ``tests/test_compression.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor


def apply_token_mask(x: Tensor, a: Tensor, mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Zero the rows of padding tokens so they contribute nothing to any Jacobian quantity."""
    if mask is None:
        return x, a
    # where() rather than a product: padded positions may hold NaN/Inf, and 0 * NaN is NaN.
    keep = mask.bool().unsqueeze(-1)
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)), torch.where(
        keep, a, torch.zeros((), dtype=a.dtype, device=a.device))


def pad_rank(t: Tensor, rank: int) -> Tensor:
    """Zero-pad the sequence/rank dimension (dim 1) up to ``rank``; zero rows change no product."""
    missing = rank - t.shape[1]
    if missing <= 0:
        return t
    return torch.nn.functional.pad(t, (0, 0, 0, missing))


COMPRESSION_METHODS = ("exact", "randomized")
COMPRESSION_CHOICES = ("auto", *COMPRESSION_METHODS)  # JanusConfig.compression
_SMALL_MATRIX_ELEMS = 1 << 20


def resolve_method(method: str, device: torch.device) -> str:
    """``"auto"``: exact on the CPU, where LAPACK's QR/SVD are fast; randomized on accelerators."""
    if method == "auto":
        return "exact" if device.type == "cpu" else "randomized"
    if method not in COMPRESSION_METHODS:
        raise ValueError(f"compression must be 'auto' or one of {COMPRESSION_METHODS}, got {method!r}")
    return method


@contextmanager
def _single_threaded(device: torch.device, small: bool) -> Iterator[None]:
    """Run many tiny batched QR/SVD calls on one CPU thread.

    With several OpenMP threads, each small LAPACK call ends in a barrier; when other processes hold the
    cores, the spinning threads wait for a time slice and a 10 ms call took 5-30 s (measured on a shared
    2-core machine). One thread costs nothing measurable on an idle machine.
    """
    if device.type != "cpu" or torch.get_num_threads() == 1 or not small:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class SequenceBasis:
    """Householder QR of one batch of (masked) layer inputs ``Xᵢᵀ``, shareable by every layer reading them.

    In a transformer block several target layers read the same tensor (q/k/v projections, gate/up
    projections), so one factorization serves them all; ``torch.geqrf`` keeps the reflectors instead of
    forming ``Q`` (``Q`` is only ever applied to the r kept singular vectors, with ``torch.ormqr``).
    """

    reflectors: Tensor  # (B, d, T): R in the upper triangle, Householder vectors below
    tau: Tensor  # (B, min(d, T))
    length: int  # T, the sequence length it was computed for

    @property
    def k(self) -> int:
        return self.tau.shape[-1]

    def r_factor(self) -> Tensor:
        """``R`` of ``Xᵢᵀ = Q R``, shape ``(B, k, T)``."""
        return self.reflectors[:, : self.k, :].triu()

    def apply_q(self, coeff: Tensor) -> Tensor:
        """``Q @ coeff`` for ``coeff`` of shape ``(B, k, c)``; returns ``(B, d, c)``."""
        d = self.reflectors.shape[1]
        if coeff.shape[1] < d:  # Q is d x d; the rows beyond k multiply zeros
            coeff = torch.nn.functional.pad(coeff, (0, 0, 0, d - coeff.shape[1]))
        return torch.ormqr(self.reflectors, self.tau, coeff)


def _is_small(t: Tensor) -> bool:
    return t.shape[1] * t.shape[2] <= _SMALL_MATRIX_ELEMS


def sequence_basis(t: Tensor) -> SequenceBasis:
    """QR of ``tᵢᵀ`` for a batch ``t`` of shape ``(B, T, d)`` (already masked)."""
    with _single_threaded(t.device, small=_is_small(t)):
        reflectors, tau = torch.geqrf(t.transpose(1, 2))
    return SequenceBasis(reflectors, tau, t.shape[1])


def needs_compression(x: Tensor, rank: int) -> Tensor:
    """``(B,)`` bool: which samples of a masked batch ``x`` ``(B, T, d)`` have more than ``rank`` non-zero rows.

    The others are represented exactly by their non-zero rows alone. A batch is padded to its longest
    sample, so with replay samples of mixed lengths most of a batch can be in this case.
    """
    return _live_rows(x).sum(dim=1) > rank


def _live_rows(x: Tensor) -> Tensor:
    """``(B, T)`` bool: the non-zero rows of a masked batch ``x``."""
    return (x != 0).any(dim=-1)


def _compact_rows(x: Tensor, a: Tensor, live: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The (at most ``rank``) ``live`` rows of ``x`` and the matching rows of ``a``, moved to the front in order."""
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, :rank]
    keep = live.gather(1, order).unsqueeze(-1)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    xs = torch.where(keep, x.gather(1, order.unsqueeze(-1).expand(-1, -1, x.shape[-1])), zero)
    as_ = torch.where(keep, a.gather(1, order.unsqueeze(-1).expand(-1, -1, a.shape[-1])), zero)
    return pad_rank(xs, rank), pad_rank(as_, rank)


def compress_sequence(
    x: Tensor, a: Tensor, rank: Optional[int], mask: Optional[Tensor] = None,
    x_basis: Optional[SequenceBasis] = None, method: str = "exact",
) -> tuple[Tensor, Tensor]:
    """Compress a batch of per-sample factors along the sequence dimension.

    Args:
        x: layer inputs, shape ``(B, T, d_in)``.
        a: gradients of the token-summed loss w.r.t. the layer outputs, shape ``(B, T, d_out)``.
        rank: target rank ``r``; ``None`` keeps all ``T`` rows (after masking).
        mask: optional ``(B, T)`` mask of valid tokens; padding rows are zeroed first.
        x_basis: optional :func:`sequence_basis` of the masked ``x`` restricted to the samples that
            :func:`needs_compression` selects, computed once for all layers that read the same input; ``x``
            itself is then not factorized again (``"exact"`` only).
        method: ``"exact"`` (QR + SVD of the core: the rank-r optimum) or ``"randomized"``
            (:func:`randomized_compress`: near-optimal, batched matrix products, for accelerators).

    Returns:
        ``(x_hat, a_hat)`` of shapes ``(B, r, d_in)`` and ``(B, r, d_out)`` such that
        ``a_hat[i].T @ x_hat[i]`` is the best rank-r approximation of ``a[i].T @ x[i]`` (exactly equal
        when that matrix has rank <= r, e.g. when the sample has at most r valid tokens).
    """
    if x.dim() != 3 or a.dim() != 3 or x.shape[:2] != a.shape[:2]:
        raise ValueError(
            f"compress_sequence expects x of shape (B, T, d_in) and a of shape (B, T, d_out) with the same "
            f"B and T; got {tuple(x.shape)} and {tuple(a.shape)}"
        )
    if method not in COMPRESSION_METHODS:
        raise ValueError(f"method must be one of {COMPRESSION_METHODS}, got {method!r}")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mask must have shape {tuple(x.shape[:2])} (B, T), got {tuple(mask.shape)}")
    x, a = apply_token_mask(x, a, mask)
    T = x.shape[1]
    if rank is None:
        return x, a
    if T <= rank:
        # A rank-r approximation of a matrix with at most r summands is the matrix itself.
        return pad_rank(x, rank), pad_rank(a, rank)
    live = _live_rows(x)
    long = live.sum(dim=1) > rank  # needs_compression(x, rank), with the rows reused below
    if x_basis is not None and x_basis.reflectors.shape[0] != int(long.sum()):
        raise ValueError(f"x_basis covers {x_basis.reflectors.shape[0]} samples, but {int(long.sum())} of this "
                         f"batch need compression: compute it as sequence_basis(x[needs_compression(x, rank)])")
    if bool(long.all()):
        return _compress_long(x, a, rank, x_basis, method)
    # Samples with at most r non-zero rows are exact as their rows; only the others pay for QR + SVD.
    x_hat, a_hat = _compact_rows(x, a, live, rank)
    if bool(long.any()):
        x_hat[long], a_hat[long] = _compress_long(x[long], a[long], rank, x_basis, method)
    return x_hat, a_hat


def _compress_long(x: Tensor, a: Tensor, rank: int, x_basis: Optional[SequenceBasis],
                   method: str) -> tuple[Tensor, Tensor]:
    T = x.shape[1]
    if method == "randomized":
        return randomized_compress(x, a, rank)
    if x_basis is None:
        x_basis = sequence_basis(x)
    elif x_basis.reflectors.shape != (x.shape[0], x.shape[2], T):
        raise ValueError(f"x_basis was computed for inputs of shape {tuple(x_basis.reflectors.shape)} "
                         f"(B, d_in, T), not {(x.shape[0], x.shape[2], T)}")
    a_basis = sequence_basis(a)
    with _single_threaded(x.device, small=_is_small(x) and _is_small(a)):
        core = a_basis.r_factor() @ x_basis.r_factor().transpose(1, 2)  # (B, k_a, k_x)
        u, s, vh = torch.linalg.svd(core, full_matrices=False)
        kept = min(rank, s.shape[-1])
        root = s[:, :kept].clamp_min(0).sqrt().unsqueeze(1)
        x_hat = x_basis.apply_q(vh[:, :kept].transpose(1, 2) * root)  # (B, d_in, kept)
        a_hat = a_basis.apply_q(u[:, :, :kept] * root)  # (B, d_out, kept)
    return pad_rank(x_hat.transpose(1, 2), rank), pad_rank(a_hat.transpose(1, 2), rank)


def trim_rank(x: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """Drop trailing rank slots that contribute to no sample's gradient (``x_ik = 0`` or ``a_ik = 0``).

    ``compress_sequence`` zero-pads to ``rank`` when a batch has at most ``rank`` tokens (short replay
    samples), and masked positions are zero rows. Every later Gram block costs (slots)², so a replay of
    16-token samples at r=32 would pay 4x for zeros. Returns views; at least one slot is kept.
    """
    if x.dim() != 3 or a.dim() != 3 or x.shape[:2] != a.shape[:2]:
        raise ValueError(f"trim_rank expects (B, r, d_in) and (B, r, d_out), got {tuple(x.shape)}, {tuple(a.shape)}")
    live = ((x != 0).any(dim=2) & (a != 0).any(dim=2)).any(dim=0)  # (r,)
    nonzero = live.nonzero()
    keep = int(nonzero[-1]) + 1 if nonzero.numel() else 1
    if keep == x.shape[1]:
        return x, a
    return x[:, :keep], a[:, :keep]


def merge_calls(
    factors: list[tuple[Tensor, Tensor]], rank: Optional[int], method: str = "exact"
) -> tuple[Tensor, Tensor]:
    """Combine the factors of a module called several times in one forward (shared weights).

    The per-sample gradient is then the sum over calls, i.e. the factors concatenated along the rank
    dimension; recompress when that exceeds ``rank``.
    """
    if len(factors) == 1:
        return factors[0]
    x = torch.cat([f[0] for f in factors], dim=1)
    a = torch.cat([f[1] for f in factors], dim=1)
    return compress_sequence(x, a, rank, method=method)


# ------------------------------------------------------------------------------------------------------
# Randomized compression (accelerators)
# ------------------------------------------------------------------------------------------------------

OVERSAMPLE = 16
POWER_ITERATIONS = 2
_SIGMA_RCOND = 1e-6  # singular values below this fraction of the largest are dropped (under fp32 accuracy)
_omegas: dict[tuple, Tensor] = {}


def _omega(d: int, p: int, device: torch.device, dtype: torch.dtype) -> Tensor:
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


def _orthonormalize(y: Tensor) -> Tensor:
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
    eye = torch.eye(p, dtype=w.dtype, device=w.device)
    chol, _ = torch.linalg.cholesky_ex(w + shift[:, None, None] * eye)
    return torch.linalg.solve_triangular(chol, y64.mT, upper=False).mT.to(y.dtype)


def _ritz(w: Tensor, h: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` Ritz pairs of ``G`` restricted to ``range(Y)``, from ``w = YᵀY`` and ``h = (YᵀG)(YᵀG)ᵀ``.

    With ``M`` a (masked) whitening of ``w`` (``Q = Y M`` orthonormal), ``Mᵀ h M = Ũ Σ² Ũᵀ``; returns
    ``P = M Ũ_r`` ``(B, p, r)`` and ``σ`` ``(B, r)``, descending. float64 throughout.
    """
    lam, vec = torch.linalg.eigh(w)
    keep = lam > lam[..., -1:].clamp_min(torch.finfo(lam.dtype).tiny) * 1e-10
    whiten = vec * torch.where(keep, lam.clamp_min(torch.finfo(lam.dtype).tiny).rsqrt(), torch.zeros_like(lam)).unsqueeze(-2)
    mu, u = torch.linalg.eigh(whiten.mT @ h @ whiten)
    mu, u = mu[..., -rank:].flip(-1), u[..., -rank:].flip(-1)
    return whiten @ u, mu.clamp_min(0).sqrt()


def randomized_compress(x: Tensor, a: Tensor, rank: int, power_iterations: int = POWER_ITERATIONS,
                        oversample: int = OVERSAMPLE) -> tuple[Tensor, Tensor]:
    """Near-optimal rank-``rank`` factors of every ``aᵢᵀ xᵢ`` by randomized subspace iteration (Halko et al.).

    On a GPU the exact path's per-sample Householder QR and SVD of a T x T core run as one small LAPACK
    call per sample (tens of ms each at T=512); here everything but two ``(p x p)`` eigendecompositions per
    sample, done on the CPU in float64, is batched matrix products. With ``p = rank + oversample`` columns
    the result is the exact rank-``rank`` optimum whenever ``aᵢᵀ xᵢ`` has rank ``<= p`` (e.g. at most p
    valid tokens), and otherwise within a small factor of its error (``tests/test_compression.py``
    measures it). ``x`` ``(B, T, d_in)`` and ``a`` ``(B, T, d_out)`` must already be masked; returns
    ``(B, rank, d_in)`` and ``(B, rank, d_out)``.
    """
    d_in, d_out = x.shape[2], a.shape[2]
    p = min(rank + oversample, x.shape[1], d_in, d_out)
    y = a.mT @ (x @ _omega(d_in, p, x.device, x.dtype))  # (B, d_out, p): G Ω
    for _ in range(power_iterations):
        z = _orthonormalize(x.mT @ (a @ _orthonormalize(y)))  # (B, d_in, p): orth(Gᵀ Q)
        y = a.mT @ (x @ z)
    by = (a @ y).mT @ x  # (B, p, d_in): Yᵀ G
    y64, by64 = y.double(), by.double()
    w, h = y64.mT @ y64, by64 @ by64.mT
    basis, sigma = _ritz(w.cpu(), h.cpu(), min(rank, p))
    basis, sigma = basis.to(x.device), sigma.to(x.device)
    live = sigma > sigma[:, :1] * _SIGMA_RCOND
    root = torch.where(live, sigma, torch.ones_like(sigma)).sqrt()
    scale_a = torch.where(live, root, torch.zeros_like(root))
    scale_x = torch.where(live, root.reciprocal(), torch.zeros_like(root))
    a_hat = (y64 @ basis * scale_a.unsqueeze(1)).mT  # (B, r, d_out)
    x_hat = (basis.mT @ by64) * scale_x.unsqueeze(2)  # (B, r, d_in)
    return pad_rank(x_hat.to(x.dtype), rank), pad_rank(a_hat.to(a.dtype), rank)
