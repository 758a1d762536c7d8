"""SVD re-factorization of ΔW into LoRA factors and the rank-k / null-space refinement, checked against explicit
SVDs, PEFT's energy rule and explicitly materialized Jacobians."""

from __future__ import annotations

import pytest
import torch

from hf_janus.errors import JanusError
from hf_janus.engine.ghost import LayerJacobian, eig_psd, per_sample_gradients, project
from hf_janus.adapters.low_rank import (
    choose_rank,
    energy_rank,
    parse_rank_spec,
    refactor_delta,
    refine_low_rank,
    truncate,
    validate_rank_spec,
)


def random_jacobian(m: int = 5, r: int = 3, d_in: int = 12, d_out: int = 10, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, r, d_in, generator=gen, dtype=torch.float64)
    a = torch.randn(m, r, d_out, generator=gen, dtype=torch.float64)
    jac = LayerJacobian(x, a, path="ghost")
    explicit = per_sample_gradients(x, a).reshape(m, -1)  # J, one row per sample
    return jac, explicit


def random_delta(d_out: int = 10, d_in: int = 12, seed: int = 1, decay: float = 0.7) -> torch.Tensor:
    """A matrix with a decaying spectrum, so that truncation is meaningful."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(d_out, d_out, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d_in, d_in, generator=gen, dtype=torch.float64))
    k = min(d_out, d_in)
    s = decay ** torch.arange(k, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:, :k].T


def test_energy_rank_follows_peft_convert_to_lora():
    from peft.tuners.lora.conversion import _find_cutoff_index

    s = torch.sort(torch.rand(20, generator=torch.Generator().manual_seed(0)), descending=True).values
    for threshold in (0.1, 0.5, 0.9, 0.99, 0.999):
        assert energy_rank(s, threshold) == _find_cutoff_index(s, threshold)
    assert energy_rank(s, 1.0) == 20
    assert energy_rank(torch.zeros(5), 0.9) == 0


def test_choose_rank_specs_and_clipping():
    s = torch.tensor([4.0, 2.0, 1.0, 0.5])
    assert choose_rank(s, "same", same_rank=2) == 2
    assert choose_rank(s, "same", same_rank=16) == 4  # clipped to min(d_out, d_in)
    assert choose_rank(s, 3) == 3 and choose_rank(s, 100) == 4
    assert choose_rank(s, "auto", energy=0.9) == energy_rank(s, 0.9) == 2  # 16+4 = 20 of 21.25 = 94 %
    assert choose_rank(s, 0.9) == 2  # a float rank is an energy threshold, as in convert_to_lora
    with pytest.raises(JanusError, match="rank='same'.*layer 'x'"):
        choose_rank(s, "same", name="x")
    for bad in (0, -1, 1.5, "full", True, None):
        with pytest.raises(JanusError):
            validate_rank_spec(bad)
    with pytest.raises(JanusError, match="energy"):
        validate_rank_spec("auto", energy=0.0)


def test_parse_rank_spec():
    assert parse_rank_spec("same") == "same" and parse_rank_spec(" auto ") == "auto"
    assert parse_rank_spec("16") == 16 and parse_rank_spec("0.95") == 0.95
    for bad in ("abc", "0", "2.5"):
        with pytest.raises(JanusError):
            parse_rank_spec(bad)


def test_truncate_is_the_best_rank_k_approximation():
    delta = random_delta()
    s = torch.linalg.svdvals(delta)
    for k in (1, 3, 10):
        b, a, sv = truncate(delta, k)
        assert b.shape == (10, k) and a.shape == (k, 12)
        torch.testing.assert_close(sv, s)
        # Eckart-Young: the squared error is the energy of the dropped singular values
        torch.testing.assert_close((delta - b @ a).norm() ** 2, (s[k:] ** 2).sum())
        torch.testing.assert_close(a @ a.T, torch.eye(k, dtype=torch.float64))  # A = V_kᵀ, B = U_k S_k
        torch.testing.assert_close(b.norm(dim=0), s[:k])


def test_full_rank_refactor_is_exact_and_refinement_keeps_it():
    delta = random_delta().float()
    jac, explicit = random_jacobian()
    jvp0_norm = 2.0
    a, b, stats = refactor_delta(delta, 1000, jacobian=jac, jvp0_norm=jvp0_norm, refine=True)
    torch.testing.assert_close((b @ a).float(), delta, rtol=0, atol=1e-6)
    assert stats.rank == 10 and stats.kept_energy == pytest.approx(1.0) and stats.approx_error < 1e-6
    assert stats.refined is False and stats.leak_truncated < 1e-10  # nothing to give back at full rank
    expected = float((explicit @ delta.double().reshape(-1)).norm()) / jvp0_norm
    assert stats.residual_rect == pytest.approx(expected) and stats.residual_truncated == pytest.approx(expected)


def test_refine_keeps_the_null_space_repair_that_truncation_gives_back():
    jac, explicit = random_jacobian()
    eig = eig_psd(jac.gram(), 1e-10)
    original = random_delta(seed=3)  # the fine-tuning update ΔW
    rect = project(jac, original, eig)  # single-step JANUS: J ΔW_rect = 0
    assert (explicit @ rect.reshape(-1)).norm() < 1e-10
    jvp0_norm = float((explicit @ original.reshape(-1)).norm())
    k = 3
    a, b, stats = refactor_delta(rect, k, jacobian=jac, eig=eig, jvp0_norm=jvp0_norm, refine=True,
                                 refine_iterations=10)
    saved = b @ a
    assert a.shape[0] == k and torch.linalg.matrix_rank(saved) == k
    plain_b, plain_a, _ = truncate(rect, k)
    plain = plain_b @ plain_a

    def res(x):  # ||J0 X|| / ||J0 ΔW|| with the explicit Jacobian
        return float((explicit @ x.reshape(-1)).norm()) / jvp0_norm

    assert stats.residual_truncated == pytest.approx(res(plain), rel=1e-6)
    assert stats.residual_refined == pytest.approx(res(saved), rel=1e-6)
    assert stats.leak_refined == pytest.approx(res(saved - rect), rel=1e-6)
    assert stats.refined and stats.residual_refined < 0.5 * stats.residual_truncated
    # the price: a slightly worse Frobenius approximation than the optimal truncation
    assert stats.approx_error >= stats.approx_error_truncated - 1e-12
    assert stats.kept_energy == pytest.approx(float((torch.linalg.svdvals(rect)[:k] ** 2).sum() / rect.norm() ** 2))


def test_refine_targets_j_delta_rect_when_it_is_not_zero():
    """Multi-step JANUS leaves J0 ΔW_rect ≠ 0; refinement keeps J0 ΔW_k close to J0 ΔW_rect, not to 0."""
    jac, explicit = random_jacobian(seed=4)
    delta = random_delta(seed=5)
    best, history = refine_low_rank(delta, 2, jac, iterations=8)
    leak = lambda x: float((explicit @ (x - delta).reshape(-1)).norm())  # noqa: E731
    b, a, _ = truncate(delta, 2)
    assert history[0] == pytest.approx(leak(b @ a))
    assert leak(best) == pytest.approx(min(history)) and min(history) < history[0]
    assert torch.linalg.matrix_rank(best) == 2


def test_refine_needs_a_jacobian_and_zero_updates_are_dropped():
    with pytest.raises(JanusError, match="refine=True needs"):
        refactor_delta(random_delta(), 2, refine=True, name="layer")
    a, b, stats = refactor_delta(torch.zeros(4, 6), "auto")
    assert stats.rank == 0 and a.shape == (0, 6) and b.shape == (4, 0)
    a, b, stats = refactor_delta(torch.zeros(4, 6), 2)  # a fixed rank gives zero factors, still loadable
    assert a.shape == (2, 6) and float((b @ a).abs().max()) == 0.0
