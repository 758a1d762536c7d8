"""Sequence-level SVD compression (``hf_janus.engine.compression``, paper App. B.3) against explicit SVDs.

The object that matters is the per-sample gradient ``A_iᵀ X_i`` (d_out x d_in): compression must return
factors whose product is its optimal rank-r approximation, computed here from a full SVD of the
explicit matrix. Factors themselves are not unique (signs, rotations), so only products are compared,
except where the paper fixes the factors' form.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from hf_janus.engine.compression import (
    apply_token_mask,
    compress_sequence,
    merge_calls,
    needs_compression,
    pad_rank,
    randomized_compress,
    sequence_basis,
)
from hf_janus.engine.ghost import LayerJacobian, per_sample_gradients

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def random_factors(B: int, T: int, d_in: int, d_out: int, seed: int) -> tuple[Tensor, Tensor]:
    torch.manual_seed(seed)
    return torch.randn(B, T, d_in, dtype=DT), torch.randn(B, T, d_out, dtype=DT)


def products(x: Tensor, a: Tensor) -> Tensor:
    """Per-sample gradients ``A_iᵀ X_i``, shape (B, d_out, d_in)."""
    return torch.einsum("bto,bti->boi", a, x)


def truncated_svd(g: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Optimal rank-r approximation of each matrix in ``g`` and its discarded singular values."""
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    return (u[..., :r] * s[..., None, :r]) @ vh[..., :r, :], s[..., r:]


# --------------------------------------------------------------------------------------------------
# Optimal rank-r approximation
# --------------------------------------------------------------------------------------------------

# (T, d_in, d_out, r): T > r always; the last case has min(d_in, d_out) < r, so the product is exact.
SVD_CASES = [(6, 5, 7, 2), (6, 7, 3, 1), (5, 4, 4, 3), (9, 6, 5, 4), (6, 3, 4, 5)]


@pytest.mark.parametrize("T, d_in, d_out, r", SVD_CASES)
def test_product_is_optimal_rank_r(T, d_in, d_out, r):
    x, a = random_factors(7, T, d_in, d_out, seed=0)
    x_hat, a_hat = compress_sequence(x, a, r)
    assert x_hat.shape == (7, r, d_in) and a_hat.shape == (7, r, d_out)
    expected, _ = truncated_svd(products(x, a), r)
    torch.testing.assert_close(products(x_hat, a_hat), expected, **TOL)


@pytest.mark.parametrize("T, d_in, d_out, r", SVD_CASES)
def test_eckart_young_error(T, d_in, d_out, r):
    x, a = random_factors(6, T, d_in, d_out, seed=1)
    x_hat, a_hat = compress_sequence(x, a, r)
    full = products(x, a)
    _, discarded = truncated_svd(full, r)
    err = torch.linalg.matrix_norm(full - products(x_hat, a_hat))
    torch.testing.assert_close(err, discarded.pow(2).sum(-1).sqrt(), rtol=1e-9, atol=1e-10)


def test_singular_values_split_evenly():
    # Paper: X̂_i = (Q_X V_r Σ_r^½)ᵀ, Â_i = (Q_A U_r Σ_r^½)ᵀ, i.e. orthogonal rows of norm √σ_k in both.
    x, a = random_factors(5, 6, 5, 4, seed=2)
    r = 3
    x_hat, a_hat = compress_sequence(x, a, r)
    sigma = torch.linalg.svdvals(products(x, a))[:, :r]
    for f in (x_hat, a_hat):
        torch.testing.assert_close(f @ f.transpose(1, 2), torch.diag_embed(sigma), **TOL)


@pytest.mark.parametrize("T, r", [(3, 5), (4, 4)])
def test_exact_and_zero_padded_when_T_le_r(T, r):
    x, a = random_factors(5, T, 4, 6, seed=3)
    x_hat, a_hat = compress_sequence(x, a, r)
    assert x_hat.shape == (5, r, 4) and a_hat.shape == (5, r, 6)
    torch.testing.assert_close(products(x_hat, a_hat), products(x, a), **TOL)
    assert not x_hat[:, T:].any() and not a_hat[:, T:].any()


def test_exact_when_each_sample_has_at_most_r_valid_tokens():
    B, T, r = 6, 8, 3
    x, a = random_factors(B, T, 5, 4, seed=4)
    torch.manual_seed(5)
    # Valid tokens scattered anywhere in the sequence, between 0 and r of them per sample.
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n_valid in enumerate([3, 1, 2, 3, 0, 2]):
        mask[i, torch.randperm(T)[:n_valid]] = True
    x_hat, a_hat = compress_sequence(x, a, r, mask)
    assert x_hat.shape == (B, r, 5)
    expected = products(x * mask[..., None], a * mask[..., None])
    torch.testing.assert_close(products(x_hat, a_hat), expected, **TOL)


# --------------------------------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------------------------------


def pad_batch(samples: list[tuple[Tensor, Tensor]], T: int, side: str, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pad variable-length samples to length T with random (finite) garbage, like a collator would."""
    torch.manual_seed(seed)
    B, d_in, d_out = len(samples), samples[0][0].shape[-1], samples[0][1].shape[-1]
    x = 10 * torch.randn(B, T, d_in, dtype=DT)
    a = 10 * torch.randn(B, T, d_out, dtype=DT)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, (xi, ai) in enumerate(samples):
        n = xi.shape[0]
        span = slice(T - n, T) if side == "left" else slice(0, n)
        x[i, span], a[i, span], mask[i, span] = xi, ai, 1
    return x, a, mask


def variable_length_samples(lengths: list[int], d_in: int, d_out: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    torch.manual_seed(seed)
    return [(torch.randn(n, d_in, dtype=DT), torch.randn(n, d_out, dtype=DT)) for n in lengths]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("rank", [2, 4, 12, None])  # 12 > T: the mask must apply on the no-SVD branch too
def test_padding_invariance(side, rank):
    lengths = [5, 2, 6, 1, 4]  # some samples longer than r, some shorter
    samples = variable_length_samples(lengths, d_in=4, d_out=5, seed=6)
    x, a, mask = pad_batch(samples, T=9, side=side, seed=7)

    x_hat, a_hat = compress_sequence(x, a, rank, mask)

    got = products(x_hat, a_hat)
    for i, (xi, ai) in enumerate(samples):
        unpadded = ai.T @ xi
        expected = unpadded if rank is None else truncated_svd(unpadded, rank)[0]
        torch.testing.assert_close(got[i], expected, **TOL)
        # The same sample compressed alone, without any padding, gives the same product.
        alone = compress_sequence(xi[None], ai[None], rank)
        torch.testing.assert_close(got[i], products(*alone)[0], **TOL)


# Padding positions of captured activations are not guaranteed finite (e.g. fully masked attention rows).
@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_non_finite_padding_is_ignored(garbage):
    samples = variable_length_samples([5, 3], d_in=4, d_out=5, seed=8)
    x, a, mask = pad_batch(samples, T=7, side="left", seed=9)
    x[mask == 0] = garbage
    x_hat, a_hat = compress_sequence(x, a, 2, mask)
    for i, (xi, ai) in enumerate(samples):
        torch.testing.assert_close(products(x_hat, a_hat)[i], truncated_svd(ai.T @ xi, 2)[0], **TOL)


def test_rank_none_keeps_shapes_and_only_zeroes_padding():
    x, a = random_factors(4, 6, 3, 5, seed=10)
    assert all(out is inp for out, inp in zip(compress_sequence(x, a, None), (x, a)))

    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1] * 6, [0] * 6])
    x_m, a_m = compress_sequence(x, a, None, mask)
    assert x_m.shape == x.shape and a_m.shape == a.shape
    valid = mask.bool()
    torch.testing.assert_close(x_m[valid], x[valid], rtol=0, atol=0)
    torch.testing.assert_close(a_m[valid], a[valid], rtol=0, atol=0)
    assert not x_m[~valid].any() and not a_m[~valid].any()


def test_apply_token_mask_bool_and_float_masks_agree():
    x, a = random_factors(3, 5, 4, 2, seed=11)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    for m in (mask.bool(), mask.float(), mask):
        x_m, a_m = apply_token_mask(x, a, m)
        assert x_m.dtype == x.dtype and a_m.dtype == a.dtype
        torch.testing.assert_close(x_m, x * mask[..., None], rtol=0, atol=0)
        torch.testing.assert_close(a_m, a * mask[..., None], rtol=0, atol=0)
    x_none, a_none = apply_token_mask(x, a, None)
    assert x_none is x and a_none is a


def test_pad_rank():
    t = torch.randn(2, 3, 4, dtype=DT)
    padded = pad_rank(t, 5)
    assert padded.shape == (2, 5, 4)
    torch.testing.assert_close(padded[:, :3], t, rtol=0, atol=0)
    assert not padded[:, 3:].any()
    assert pad_rank(t, 3) is t and pad_rank(t, 2) is t


# --------------------------------------------------------------------------------------------------
# Several calls of one module
# --------------------------------------------------------------------------------------------------


def two_calls(seed: int, T1: int = 2, T2: int = 3) -> list[tuple[Tensor, Tensor]]:
    x1, a1 = random_factors(5, T1, 4, 3, seed)
    x2, a2 = random_factors(5, T2, 4, 3, seed + 1)
    return [(x1, a1), (x2, a2)]


@pytest.mark.parametrize("rank", [5, 7])
def test_merge_calls_exact_when_total_rows_fit(rank):
    calls = two_calls(seed=12)
    x, a = merge_calls(calls, rank)
    assert x.shape == (5, rank, 4) and a.shape == (5, rank, 3)
    torch.testing.assert_close(products(x, a), sum(products(*c) for c in calls), **TOL)


@pytest.mark.parametrize("rank", [1, 2])
def test_merge_calls_optimal_rank_r_otherwise(rank):
    calls = two_calls(seed=14)
    x, a = merge_calls(calls, rank)
    assert x.shape == (5, rank, 4)
    expected, _ = truncated_svd(sum(products(*c) for c in calls), rank)
    torch.testing.assert_close(products(x, a), expected, **TOL)


def test_merge_calls_single_call_and_no_rank():
    calls = two_calls(seed=16)
    assert merge_calls(calls[:1], 1) is calls[0]
    x, a = merge_calls(calls, None)
    assert x.shape == (5, 5, 4)
    torch.testing.assert_close(products(x, a), sum(products(*c) for c in calls), **TOL)


def test_merge_calls_matches_explicit_gradient_of_shared_layer():
    # A layer applied to two different inputs in one forward; its per-sample gradient is the explicit one.
    torch.manual_seed(18)
    layer = nn.Linear(4, 3).to(DT)
    m, T = 6, 4
    x1, x2 = torch.randn(m, T, 4, dtype=DT), torch.randn(m, T + 1, 4, dtype=DT)

    def head(y1, y2):
        return torch.tanh(y1).pow(2).sum() + torch.sin(y2).sum()

    def loss(params, u1, u2):
        return head(functional_call(layer, params, (u1,)), functional_call(layer, params, (u2,)))

    params = {k: v.detach() for k, v in layer.named_parameters()}
    jac = vmap(grad(loss), in_dims=(None, 0, 0))(params, x1, x2)["weight"]
    with torch.no_grad():
        y1, y2 = layer(x1), layer(x2)
    a1, a2 = vmap(grad(head, argnums=(0, 1)))(y1, y2)

    # Uncompressed; all 2T+1 rows kept (padded); and recompressed to rank d_out, which is still exact.
    for rank in (None, 2 * T + 3, 3):
        x, a = merge_calls([(x1, a1), (x2, a2)], rank)
        torch.testing.assert_close(per_sample_gradients(x, a), jac, **TOL)


# --------------------------------------------------------------------------------------------------
# Compressed factors feed the ghost Jacobian
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["ghost", "materialized"])
def test_compressed_gram_is_gram_of_truncated_gradients(path):
    x, a = random_factors(6, 7, 5, 4, seed=19)
    r = 2
    truncated, _ = truncated_svd(products(x, a), r)
    rows = truncated.reshape(6, -1)
    jac = LayerJacobian(*compress_sequence(x, a, r), path=path)
    torch.testing.assert_close(jac.gram(), rows @ rows.T, **TOL)


# --------------------------------------------------------------------------------------------------
# Shape validation
# --------------------------------------------------------------------------------------------------

_X = torch.zeros(3, 5, 4, dtype=DT)
_A = torch.zeros(3, 5, 2, dtype=DT)


@pytest.mark.parametrize(
    "x, a",
    [(_X[0], _A), (_X, _A[0]), (_X[:2], _A), (_X[:, :4], _A)],
    ids=["x_2d", "a_2d", "batch_mismatch", "length_mismatch"],
)
def test_bad_factor_shapes_raise(x, a):
    with pytest.raises(ValueError, match=r"\(B, T, d_in\).*\(B, T, d_out\)"):
        compress_sequence(x, a, 2)


@pytest.mark.parametrize(
    "mask", [torch.ones(3, 6), torch.ones(2, 5), torch.ones(5), torch.ones(3, 5, 1)],
    ids=["too_long", "batch_mismatch", "1d", "3d"],
)
def test_bad_mask_shape_raises(mask):
    with pytest.raises(ValueError, match=r"mask must have shape \(3, 5\)"):
        compress_sequence(_X, _A, 2, mask)


# --------------------------------------------------------------------------------------------------
# Randomized compression (the accelerator path)
# --------------------------------------------------------------------------------------------------


def relative_excess_error(x: Tensor, a: Tensor, x_hat: Tensor, a_hat: Tensor, r: int) -> Tensor:
    """Per sample, ‖G − Ĝ‖_F / ‖G − G_r‖_F with G_r the optimal rank-r approximation (1 = optimal)."""
    full = products(x, a)
    _, discarded = truncated_svd(full, r)
    return (full - products(x_hat, a_hat)).norm(dim=(1, 2)) / discarded.norm(dim=-1)


@pytest.mark.parametrize("T, d_in, d_out, r", [(20, 30, 25, 8), (12, 6, 40, 3), (30, 50, 9, 4)])
def test_randomized_is_optimal_when_the_rank_fits_its_sample(T, d_in, d_out, r):
    """rank(AᵢᵀXᵢ) <= min(T, d_in, d_out) <= p = r + 16: the sketch sees the whole range, so the result is exact."""
    x, a = random_factors(5, T, d_in, d_out, seed=20)
    x_hat, a_hat = compress_sequence(x, a, r, method="randomized")
    assert x_hat.shape == (5, r, d_in) and a_hat.shape == (5, r, d_out)
    torch.testing.assert_close(products(x_hat, a_hat), truncated_svd(products(x, a), r)[0], rtol=1e-8, atol=1e-8)
    # every sample is long here: the public one-call form is the same computation
    assert all(torch.equal(u, v) for u, v in zip(randomized_compress(x, a, r), (x_hat, a_hat)))


@pytest.mark.parametrize("B, T, d_in, d_out, r", [(6, 96, 64, 80, 8), (6, 200, 48, 40, 8), (4, 64, 100, 120, 4)])
def test_randomized_error_is_within_one_percent_of_optimal(B, T, d_in, d_out, r):
    """Gaussian factors (flat spectra, the hard case for a sketch) with rank far above r + 16."""
    x, a = random_factors(B, T, d_in, d_out, seed=21)
    excess = relative_excess_error(x, a, *compress_sequence(x, a, r, method="randomized"), r)
    assert bool((excess >= 1 - 1e-12).all()), "no rank-r matrix beats the truncated SVD"
    assert float(excess.max()) <= 1.01, excess


def test_randomized_error_on_a_transformer_layer():
    """Inputs and output gradients of a real (random-init) LLaMA MLP layer at T=128, in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(22)
    config = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=500)
    model = LlamaForCausalLM(config)
    seen = {}
    layer = model.model.layers[0].mlp.down_proj

    def hook(module, inputs, output):
        x = inputs[0].detach()
        output.register_hook(lambda g: seen.update(x=x, a=g.detach()))

    layer.register_forward_hook(hook)
    ids = torch.randint(0, 500, (3, 128))
    out = model(input_ids=ids, labels=ids)
    (out.loss * ids.numel()).backward()
    x, a = seen["x"], seen["a"]
    x_hat, a_hat = compress_sequence(x, a, 16, method="randomized")
    assert x_hat.dtype == torch.float32
    excess = relative_excess_error(x.double(), a.double(), x_hat.double(), a_hat.double(), 16)
    assert float(excess.max()) <= 1.01, excess


def test_randomized_masking_short_and_empty_samples():
    """Padding is ignored; a sample of 3 valid tokens is exact; a fully masked sample gives zero factors."""
    samples = variable_length_samples([40, 3, 25], d_in=30, d_out=20, seed=23)
    x, a, mask = pad_batch(samples, T=40, side="right", seed=24)
    x[mask == 0] = float("nan")
    x = torch.cat([x, torch.randn(1, 40, 30, dtype=DT)])
    a = torch.cat([a, torch.randn(1, 40, 20, dtype=DT)])
    mask = torch.cat([mask, torch.zeros(1, 40, dtype=mask.dtype)])
    x_hat, a_hat = compress_sequence(x, a, 4, mask, method="randomized")
    assert torch.isfinite(x_hat).all() and torch.isfinite(a_hat).all()
    got = products(x_hat, a_hat)
    torch.testing.assert_close(got[1], truncated_svd(samples[1][1].T @ samples[1][0], 4)[0], rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(got[2], truncated_svd(samples[2][1].T @ samples[2][0], 4)[0], rtol=1e-8, atol=1e-8)
    assert float(got[3].abs().max()) == 0.0


def test_randomized_is_deterministic_and_leaves_the_global_rng_alone():
    x, a = random_factors(3, 60, 20, 24, seed=25)
    state = torch.get_rng_state()
    first = compress_sequence(x, a, 4, method="randomized")
    second = compress_sequence(x, a, 4, method="randomized")
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(first, second))


def test_randomized_compression_of_non_finite_factors_says_so():
    """Every randomized compression (a layer called twice merges its calls through it too), not only a capture's
    batch, fails on NaN/Inf with an error that says what it means instead of eigh's bare LinAlgError."""
    x, a = random_factors(2, 60, 20, 24, seed=26)
    x[0, 3, 5] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN/Inf in the inputs or output gradients"):
        compress_sequence(x, a, 4, method="randomized")


def test_compression_method_names():
    from hf_janus.engine.compression import resolve_method

    assert resolve_method("auto", torch.device("cpu")) == "exact"
    assert resolve_method("auto", torch.device("cuda")) == "randomized"
    assert resolve_method("randomized", torch.device("cpu")) == "randomized"
    with pytest.raises(ValueError, match="compression must be 'auto' or one of"):
        resolve_method("svd", torch.device("cpu"))
    with pytest.raises(ValueError, match="method must be one of"):
        compress_sequence(_X, _A, 2, method="svd")


# --------------------------------------------------------------------------------------------------
# Batches mixing samples that fit in r with samples that do not
# --------------------------------------------------------------------------------------------------


def mixed_batch(seed: int) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    lengths = [2, 7, 3, 9, 1, 0, 8]  # r = 3 below: samples 1, 3 and 6 need compression
    samples = variable_length_samples(lengths, d_in=6, d_out=5, seed=seed)
    samples = [(xi, ai) if n else (torch.zeros(0, 6, dtype=DT), torch.zeros(0, 5, dtype=DT))
               for (xi, ai), n in zip(samples, lengths)]
    x, a, mask = pad_batch(samples, T=10, side="left", seed=seed + 1)
    return x, a, mask, lengths


def test_needs_compression_counts_non_zero_rows():
    x, a, mask, lengths = mixed_batch(seed=20)
    xm, _ = apply_token_mask(x, a, mask)
    assert needs_compression(xm, 3).tolist() == [n > 3 for n in lengths]
    assert not needs_compression(xm, 9).any()


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_mixed_batch_factorizes_only_the_long_samples(monkeypatch, method):
    from hf_janus.engine import compression

    x, a, mask, lengths = mixed_batch(seed=21)
    r = 3
    sizes = []
    monkeypatch.setattr(compression, "sequence_basis", lambda t: sizes.append(t.shape[0]) or sequence_basis(t))
    sketch = compression._sketch
    monkeypatch.setattr(compression, "_sketch", lambda x, a, rank: sizes.append(x.shape[0]) or sketch(x, a, rank))
    x_hat, a_hat = compress_sequence(x, a, r, mask, method=method)
    long = [n > r for n in lengths]
    assert set(sizes) == {sum(long)}  # QR/SVD (or subspace iteration) ran on the 3 long samples only
    xm, am = apply_token_mask(x, a, mask)
    for i, n in enumerate(lengths):
        if not long[i]:
            # The sample's own rows, moved to the front in order, then zeros: exact, no rotation.
            assert torch.equal(x_hat[i, :n], xm[i, 10 - n:]) and torch.equal(a_hat[i, :n], am[i, 10 - n:])
            assert not x_hat[i, n:].any() and not a_hat[i, n:].any()
    # The long samples come out as they do when compressed on their own.
    alone = compress_sequence(xm[long], am[long], r, method=method)
    assert torch.equal(x_hat[long], alone[0]) and torch.equal(a_hat[long], alone[1])
    got, full = products(x_hat, a_hat), products(xm, am)
    for i, n in enumerate(lengths):
        expected = truncated_svd(full[i], r)[0] if long[i] else full[i]
        torch.testing.assert_close(got[i], expected, **TOL)  # randomized: exact too, as p >= min(d_in, d_out)


def test_shared_basis_covers_the_long_samples_only():
    x, a, mask, lengths = mixed_batch(seed=22)
    r = 3
    xm, am = apply_token_mask(x, a, mask)
    basis = sequence_basis(xm[needs_compression(xm, r)])
    with_basis = compress_sequence(xm, am, r, x_basis=basis)
    without = compress_sequence(xm, am, r)
    torch.testing.assert_close(with_basis[0], without[0], **TOL)
    torch.testing.assert_close(with_basis[1], without[1], **TOL)
    with pytest.raises(ValueError, match="needs_compression"):
        compress_sequence(xm, am, r, x_basis=sequence_basis(xm))  # a basis of the whole batch
