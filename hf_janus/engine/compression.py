"""Sequence-level SVD compression of a layer's per-sample inputs and output gradients (paper, App. B.3).

For one sample with inputs ``X_i`` (T x d_in) and output gradients ``A_i`` (T x d_out), the per-sample
gradient is ``A_iᵀ X_i``. Its best rank-r approximation is found without forming the d_out x d_in matrix:
QR of ``X_iᵀ`` and ``A_iᵀ``, SVD of the small core ``R_A R_Xᵀ``, and the singular values split evenly
between the two factors so that ``Âᵢᵀ X̂ᵢ`` is the rank-r optimum.

The QR is a Householder factorization (``torch.geqrf``) whose ``Q`` is applied to the r kept singular
vectors (``torch.ormqr``) rather than formed, which is cheaper than forming it. Layers that read the same
input tensor share its factorization (:class:`SequenceBasis`). Every call is batched over the samples of
a replay batch, and only the samples with more than r non-zero rows are factorized: the others are exact
as their own rows (:func:`needs_compression`).

On accelerators those per-sample factorizations are many small LAPACK calls, each slow; there
:func:`randomized_compress` (randomized subspace iteration, batched matrix products) replaces them, at
an error within 2% of the optimum's (measured in ``tests/engine/test_compression.py``).

Inside a capture nothing is read back from the device: the decisions that set shapes come from the host
(:class:`SequencePlan`), and the randomized method's eigenproblems of many layers run as one batched call
(:class:`Pending`, :func:`finish_all`).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional

import torch
from torch import Tensor

from hf_janus.engine.config import COMPRESSION_METHODS
from hf_janus.engine.randomized_linalg import cholesky_qr, gaussian_test_matrix, ritz_pairs


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
    cores, the spinning threads wait for a time slice, and a call of milliseconds can take seconds. One thread
    costs nothing measurable on an idle machine.
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


@dataclass(frozen=True)
class SequencePlan:
    """The data-dependent decisions of compressing one replay batch, made on the host.

    Which samples need factorizing (more than ``rank`` live rows) and how many rank slots the result needs decide
    tensor shapes, so the host must know them; read back from the device, each would be a host synchronization,
    and a capture compresses once per target layer and batch (7,168 times per capture at 7B). The capture builds
    one plan per batch from the attention mask it already holds on the host (:meth:`from_mask`); a standalone call
    derives it from the data (:meth:`from_rows`, one synchronization).
    """

    live: Optional[Tensor]  # (B, T) bool on the data's device: rows that may be non-zero; None: every row
    lengths: Tensor  # (B,) int64 on the host: live rows per sample
    long_index: Tensor  # int64 on the data's device: the samples with more than ``rank`` live rows
    num_long: int
    used_rows: int  # rows up to the last one any sample uses (right padding ends in unused rows)
    rank: Optional[int]
    #: Rank slots the factors of this batch need (at least 1): the longest sample's rows, at most ``rank``; without
    #: compression, the rows up to the last used one. Every later Gram block costs (slots)², so a replay of 16-token
    #: samples at r=32 would otherwise pay 4x for zeros.
    slots: int

    @classmethod
    def from_mask(cls, mask: Optional[Tensor], batch: int, length: int, rank: Optional[int], device: torch.device,
                  device_mask: Optional[Tensor] = None) -> "SequencePlan":
        """Plan from a host ``(B, T)`` attention mask (``None``: every one of the ``length`` rows counts);
        ``device_mask`` is the same mask already on ``device``, if the caller has it."""
        if mask is None:
            return cls._build(None, torch.full((batch,), length, dtype=torch.long), length, rank, device)
        live = (device_mask if device_mask is not None else mask.to(device)).bool()
        return cls._build(live, mask.bool().sum(dim=1), _used_rows(mask.bool()), rank, device)

    @classmethod
    def from_rows(cls, x: Tensor, rank: Optional[int]) -> "SequencePlan":
        """Plan from the non-zero rows of a masked batch ``x`` ``(B, T, d)``; reads them back (one synchronization)."""
        live = _live_rows(x)
        host = live.cpu()
        return cls._build(live, host.sum(dim=1), _used_rows(host), rank, x.device)

    @classmethod
    def _build(cls, live: Optional[Tensor], lengths: Tensor, used_rows: int, rank: Optional[int],
               device: torch.device) -> "SequencePlan":
        long = lengths > rank if rank is not None else torch.zeros_like(lengths, dtype=torch.bool)
        index = long.nonzero().flatten()  # a host tensor: no synchronization
        longest = int(lengths.max()) if lengths.numel() else 1
        slots = max(1, used_rows if rank is None else min(rank, longest))
        return cls(live, lengths, index.to(device, non_blocking=True), int(index.numel()), used_rows, rank, slots)

    @property
    def batch(self) -> int:
        return int(self.lengths.numel())

    def repeat(self, copies: int) -> "SequencePlan":
        """The plan of ``copies`` batches like this one stacked along the samples, made without reading anything
        back from the device."""
        if copies == 1:
            return self
        live = self.live.repeat(copies, 1) if self.live is not None else None
        offsets = torch.arange(copies, device=self.long_index.device).repeat_interleave(self.num_long) * self.batch
        index = self.long_index.repeat(copies) + offsets
        return SequencePlan(live, self.lengths.repeat(copies), index, self.num_long * copies, self.used_rows,
                            self.rank, self.slots)


def _used_rows(live: Tensor) -> int:
    """Host ``(B, T)`` bool -> the number of rows up to the last one that any sample uses."""
    used = live.any(dim=0).nonzero()
    return int(used[-1]) + 1 if used.numel() else 0


def _compact_rows(x: Tensor, a: Tensor, live: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """The (at most ``rank``) ``live`` rows of ``x`` and the matching rows of ``a``, moved to the front in order."""
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, :rank]
    keep = live.gather(1, order).unsqueeze(-1)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    xs = torch.where(keep, x.gather(1, order.unsqueeze(-1).expand(-1, -1, x.shape[-1])), zero)
    as_ = torch.where(keep, a.gather(1, order.unsqueeze(-1).expand(-1, -1, a.shape[-1])), zero)
    return pad_rank(xs, rank), pad_rank(as_, rank)


class Pending:
    """Compressed factors of one batch whose randomized samples may still await their Ritz step.

    The Ritz step ends in two small eigendecompositions per sample, and on CUDA each ``torch.linalg.eigh`` call
    checks its status on the host (a synchronization). :func:`finish_all` therefore runs the eigenproblems of
    many layers' batches as one batched call; :meth:`factors` finishes this one alone.
    """

    def __init__(self, x_hat: Tensor, a_hat: Tensor, sketch: Optional["_Sketch"] = None,
                 index: Optional[Tensor] = None):
        self.x_hat, self.a_hat = x_hat, a_hat
        self.sketch = sketch  # the long samples' sketch (randomized), or None when done
        self.index = index  # where the sketched samples go in x_hat / a_hat; None: all of them

    @property
    def done(self) -> bool:
        return self.sketch is None

    @property
    def pending_bytes(self) -> int:
        return 0 if self.sketch is None else self.sketch.nbytes

    def _complete(self, x_long: Tensor, a_long: Tensor) -> None:
        if self.index is None:
            self.x_hat, self.a_hat = x_long, a_long
        else:
            self.x_hat.index_copy_(0, self.index, x_long)
            self.a_hat.index_copy_(0, self.index, a_long)
        self.sketch = None

    def factors(self) -> tuple[Tensor, Tensor]:
        finish_all([self])
        return self.x_hat, self.a_hat


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
    _check_inputs(x, a, mask, method)
    x, a = apply_token_mask(x, a, mask)
    if rank is None:
        return x, a
    return begin_compression(x, a, SequencePlan.from_rows(x, rank), x_basis, method).factors()


def _check_inputs(x: Tensor, a: Tensor, mask: Optional[Tensor], method: str) -> None:
    if x.dim() != 3 or a.dim() != 3 or x.shape[:2] != a.shape[:2]:
        raise ValueError(
            f"compress_sequence expects x of shape (B, T, d_in) and a of shape (B, T, d_out) with the same "
            f"B and T; got {tuple(x.shape)} and {tuple(a.shape)}"
        )
    if method not in COMPRESSION_METHODS:
        raise ValueError(f"method must be one of {COMPRESSION_METHODS}, got {method!r}")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mask must have shape {tuple(x.shape[:2])} (B, T), got {tuple(mask.shape)}")


def begin_compression(x: Tensor, a: Tensor, plan: SequencePlan, x_basis: Optional[SequenceBasis] = None,
                      method: str = "exact") -> Pending:
    """:func:`compress_sequence` of an already masked batch with the decisions of ``plan``, reading nothing back from
    the device; the randomized method's Ritz step is left to :func:`finish_all` (see :class:`Pending`)."""
    _check_inputs(x, a, None, method)
    rank, T = plan.rank, x.shape[1]
    if rank is None:
        return Pending(x, a)
    if T <= rank:
        # A rank-r approximation of a matrix with at most r summands is the matrix itself.
        return Pending(pad_rank(x, rank), pad_rank(a, rank))
    if x_basis is not None and x_basis.reflectors.shape[0] != plan.num_long:
        raise ValueError(f"x_basis covers {x_basis.reflectors.shape[0]} samples, but {plan.num_long} of this "
                         f"batch need compression: compute it as sequence_basis(x[needs_compression(x, rank)])")
    if plan.num_long == plan.batch:
        return _begin_long(x, a, rank, x_basis, method, None, Pending(x[:, :0], a[:, :0]))
    # Samples with at most r live rows are exact as their rows; only the others pay for QR + SVD.
    live = plan.live if plan.live is not None else torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    out = Pending(*_compact_rows(x, a, live, rank))
    if plan.num_long == 0:
        return out
    index = plan.long_index
    return _begin_long(x.index_select(0, index), a.index_select(0, index), rank, x_basis, method, index, out)


def _begin_long(x: Tensor, a: Tensor, rank: int, x_basis: Optional[SequenceBasis], method: str,
                index: Optional[Tensor], out: Pending) -> Pending:
    """Compress the long samples ``x``, ``a`` (rows ``index`` of ``out``; all of them when ``None``)."""
    out.index = index
    if method == "randomized":
        out.sketch = _sketch(x, a, rank)
    else:
        out._complete(*_compress_exact(x, a, rank, x_basis))
    return out


def _compress_exact(x: Tensor, a: Tensor, rank: int, x_basis: Optional[SequenceBasis]) -> tuple[Tensor, Tensor]:
    T = x.shape[1]
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


class _Sketch(NamedTuple):
    """A randomized range sketch of the long samples of one batch, awaiting its Ritz step (:func:`finish_all`)."""

    y: Tensor  # (B, d_out, p): G Ω after the power iterations
    by: Tensor  # (B, p, d_in): Yᵀ G
    w: Tensor  # (B, p, p) float64: Yᵀ Y
    h: Tensor  # (B, p, p) float64: (Yᵀ G)(Yᵀ G)ᵀ
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.y, self.by, self.w, self.h))


def _sketch(x: Tensor, a: Tensor, rank: int, power_iterations: int = POWER_ITERATIONS,
            oversample: int = OVERSAMPLE) -> _Sketch:
    d_in, d_out = x.shape[2], a.shape[2]
    p = min(rank + oversample, x.shape[1], d_in, d_out)
    y = a.mT @ (x @ gaussian_test_matrix(d_in, p, x.device, x.dtype))  # (B, d_out, p): G Ω
    for _ in range(power_iterations):
        z = cholesky_qr(x.mT @ (a @ cholesky_qr(y)))  # (B, d_in, p): orth(Gᵀ Q)
        y = a.mT @ (x @ z)
    by = (a @ y).mT @ x  # (B, p, d_in): Yᵀ G
    y64, by64 = y.double(), by.double()
    return _Sketch(y, by, y64.mT @ y64, by64 @ by64.mT, rank)


def finish_all(items: list[Pending]) -> None:
    """Run the Ritz step of every waiting item, as one batched pair of eigendecompositions per sketch size.

    On the device: per-sample eigenproblems sent to the CPU cost a round trip each; batched on the device they cost
    two synchronizations (``eigh``'s status checks) for all the items at once.
    """
    groups: dict[tuple[int, int], list[Pending]] = defaultdict(list)
    for item in items:
        if not item.done:
            p = item.sketch.w.shape[-1]
            groups[(p, min(item.sketch.rank, p))].append(item)
    for (_, kept), group in groups.items():
        try:
            basis, sigma = ritz_pairs(torch.cat([g.sketch.w for g in group]), torch.cat([g.sketch.h for g in group]),
                                      kept)
        except torch.linalg.LinAlgError as err:  # eigh of the sketches' small symmetric matrices fails on NaN/Inf
            raise FloatingPointError(
                "NaN/Inf in the inputs or output gradients of a target layer (the randomized compression's "
                "eigendecomposition failed on them): check the model weights (a diverged fine-tune?) and the replay "
                "data") from err
        start = 0
        for item in group:
            stop = start + item.sketch.w.shape[0]
            item._complete(*_ritz_factors(item.sketch, basis[start:stop], sigma[start:stop]))
            start = stop


def _ritz_factors(sketch: _Sketch, basis: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    live = sigma > sigma[:, :1] * _SIGMA_RCOND
    root = torch.where(live, sigma, torch.ones_like(sigma)).sqrt()
    scale_a = torch.where(live, root, torch.zeros_like(root))
    scale_x = torch.where(live, root.reciprocal(), torch.zeros_like(root))
    a_hat = (sketch.y.double() @ basis * scale_a.unsqueeze(1)).mT  # (B, r, d_out)
    x_hat = (basis.mT @ sketch.by.double()) * scale_x.unsqueeze(2)  # (B, r, d_in)
    dtype = sketch.y.dtype
    return pad_rank(x_hat.to(dtype), sketch.rank), pad_rank(a_hat.to(dtype), sketch.rank)


def randomized_compress(x: Tensor, a: Tensor, rank: int, power_iterations: int = POWER_ITERATIONS,
                        oversample: int = OVERSAMPLE) -> tuple[Tensor, Tensor]:
    """Near-optimal rank-``rank`` factors of every ``aᵢᵀ xᵢ`` by randomized subspace iteration (Halko et al.).

    On a GPU the exact path's per-sample Householder QR and SVD of a T x T core run as one small LAPACK
    call per sample (tens of ms each at T=512); here everything is batched matrix products but the Ritz step's two
    ``(p x p)`` eigendecompositions per sample, done in float64 on the data's device (batched over many layers by
    :func:`finish_all` during a capture). With ``p = rank + oversample`` columns
    the result is the exact rank-``rank`` optimum whenever ``aᵢᵀ xᵢ`` has rank ``<= p`` (e.g. at most p
    valid tokens), and otherwise within a small factor of its error (``tests/engine/test_compression.py``
    measures it). ``x`` ``(B, T, d_in)`` and ``a`` ``(B, T, d_out)`` must already be masked; returns
    ``(B, rank, d_in)`` and ``(B, rank, d_out)``.
    """
    return Pending(x[:, :0], a[:, :0], _sketch(x, a, rank, power_iterations, oversample)).factors()
