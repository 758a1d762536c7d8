"""Ghost Jacobian quantities (``hf_janus.engine.ghost``) checked against an explicit per-sample Jacobian.

Each expectation comes from ``J`` (m x d_out*d_in, rows = rvec of dL_i/dW in (d_out, d_in) layout) built
with ``torch.func`` on a tiny float64 layer, never from the factor formulas under test. The factors the
engine consumes are the layer inputs ``X`` and the output gradients ``A = dL_i/dY_it`` of the
token-summed per-sample loss, so that ``J_i = rvec(A_iᵀ X_i)``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import scipy.linalg
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from transformers.pytorch_utils import Conv1D

from hf_janus.engine import ghost
from hf_janus.engine.ghost import (
    MATERIALIZED_COST_FACTOR,
    LayerJacobian,
    choose_path,
    eig_psd,
    ghost_gram,
    ghost_jvp,
    ghost_vjp,
    mean_cosine,
    per_sample_gradients,
    principal_cosines,
    project,
)

DT = torch.float64
RCOND = 1e-10  # the engine's default gram_rcond
TOL = dict(rtol=1e-10, atol=1e-10)
KINDS = ("linear", "conv1d")
PATHS = ("ghost", "materialized")


# --------------------------------------------------------------------------------------------------
# Explicit reference
# --------------------------------------------------------------------------------------------------


def make_layer(kind: str, d_in: int, d_out: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "linear":
        layer = nn.Linear(d_in, d_out)
    else:
        # GPT-2 Conv1D stores its weight as (d_in, d_out); its default init (std 0.02, zero bias) would
        # keep tanh in its linear regime, so draw O(1) parameters to exercise a genuinely nonlinear loss.
        layer = Conv1D(d_out, d_in)
        with torch.no_grad():
            layer.weight.normal_(0.0, 0.5)
            layer.bias.normal_(0.0, 0.5)
    return layer.to(DT)


def sample_loss(y: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss summed over tokens (the 'un-reduced' loss of the paper, App. B.1)."""
    return ((torch.tanh(y) - target) ** 2).sum()


def weight_in_out_layout(layer: nn.Module, g: Tensor) -> Tensor:
    """Bring a (batched) weight-shaped tensor to the (d_out, d_in) layout that rvec refers to."""
    return g.transpose(-1, -2) if isinstance(layer, Conv1D) else g


def explicit_jacobian(layer: nn.Module, x: Tensor, target: Tensor) -> Tensor:
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p, x_i, t_i):
        return sample_loss(functional_call(layer, p, (x_i,)), t_i)

    g_w = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)["weight"]
    return weight_in_out_layout(layer, g_w).reshape(x.shape[0], -1)


def output_gradients(layer: nn.Module, x: Tensor, target: Tensor) -> Tensor:
    with torch.no_grad():
        y = layer(x)
    return vmap(grad(sample_loss))(y, target)


@dataclass
class Problem:
    x: Tensor  # (m, T, d_in)
    a: Tensor  # (m, T, d_out)
    jac: Tensor  # (m, d_out * d_in), from torch.func

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def d_in(self) -> int:
        return self.x.shape[-1]

    @property
    def d_out(self) -> int:
        return self.a.shape[-1]

    def rows(self, index: list[int]) -> "Problem":
        """Sub-/re-sampled problem (repeated indices give duplicate Jacobian rows)."""
        return Problem(self.x[index], self.a[index], self.jac[index])


def random_inputs(m: int, T: int, d_in: int, d_out: int, seed: int) -> tuple[Tensor, Tensor]:
    torch.manual_seed(seed)
    return torch.randn(m, T, d_in, dtype=DT), torch.randn(m, T, d_out, dtype=DT)


def build(layer: nn.Module, x: Tensor, target: Tensor) -> Problem:
    return Problem(x, output_gradients(layer, x, target), explicit_jacobian(layer, x, target))


def make_problem(kind: str, m: int = 6, T: int = 5, d_in: int = 4, d_out: int = 5, seed: int = 0) -> Problem:
    layer = make_layer(kind, d_in, d_out, seed)
    return build(layer, *random_inputs(m, T, d_in, d_out, seed + 100))


def perturbed(layer: nn.Module, seed: int, scale: float = 0.3) -> nn.Module:
    torch.manual_seed(seed)
    other = copy.deepcopy(layer)
    with torch.no_grad():
        other.weight.add_(scale * torch.randn_like(other.weight))
    return other


def two_weight_points(kind: str, m: int = 6, T: int = 5, d_in: int = 4, d_out: int = 5) -> tuple[Problem, Problem]:
    """Same replay batch, Jacobians at W and at W + noise (the current and trial points of JANUS)."""
    layer = make_layer(kind, d_in, d_out, seed=1)
    x, target = random_inputs(m, T, d_in, d_out, seed=2)
    return build(layer, x, target), build(perturbed(layer, seed=3), x, target)


def two_input_sets(kind: str, m: int = 6, d_in: int = 4, d_out: int = 5) -> tuple[Problem, Problem]:
    """Same weights, two independent batches with different sequence lengths (so r1 != r2)."""
    layer = make_layer(kind, d_in, d_out, seed=4)
    return (build(layer, *random_inputs(m, 4, d_in, d_out, seed=5)),
            build(layer, *random_inputs(m, 6, d_in, d_out, seed=6)))


def random_delta(p: Problem, seed: int = 7) -> Tensor:
    torch.manual_seed(seed)
    return torch.randn(p.d_out, p.d_in, dtype=DT)


def explicit_projection(jac: Tensor, delta: Tensor) -> Tensor:
    """ΔW − P ΔW with P = J⁺J the orthogonal projector onto the row space of J (any rank)."""
    flat = delta.reshape(-1)
    return (flat - torch.linalg.pinv(jac) @ (jac @ flat)).reshape(delta.shape)


def scipy_cosines(j1: Tensor, j2: Tensor) -> Tensor:
    angles = scipy.linalg.subspace_angles(j1.T.numpy(), j2.T.numpy())
    return torch.sort(torch.cos(torch.from_numpy(angles))).values


def ghost_cosines(jac1: LayerJacobian, jac2: LayerJacobian) -> Tensor:
    cos = principal_cosines(eig_psd(jac1.gram(), RCOND), eig_psd(jac2.gram(), RCOND), jac1.cross_gram(jac2))
    return torch.sort(cos).values


# --------------------------------------------------------------------------------------------------
# The reference itself
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_factors_reproduce_torch_func_jacobian(kind):
    p = make_problem(kind)
    from_factors = torch.einsum("mto,mti->moi", p.a, p.x).reshape(p.m, -1)
    torch.testing.assert_close(from_factors, p.jac, **TOL)
    # A non-degenerate reference: full row rank, and the loss is not linear in Y (A depends on W).
    assert torch.linalg.matrix_rank(p.jac) == p.m
    w1, w2 = two_weight_points(kind)
    assert not torch.allclose(w1.a, w2.a)


@pytest.mark.parametrize("kind", KINDS)
def test_per_sample_gradients(kind):
    p = make_problem(kind)
    g = per_sample_gradients(p.x, p.a)
    assert g.shape == (p.m, p.d_out, p.d_in)
    torch.testing.assert_close(g.reshape(p.m, -1), p.jac, **TOL)


# --------------------------------------------------------------------------------------------------
# Gram, cross-Gram, JVP, VJP
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_gram(kind, path):
    p = make_problem(kind)
    expected = p.jac @ p.jac.T
    torch.testing.assert_close(LayerJacobian(p.x, p.a, path=path).gram(), expected, **TOL)
    torch.testing.assert_close(ghost_gram(p.x, p.a), expected, **TOL)


@pytest.mark.parametrize("block_elems", [1, 2 * 5 * 7 * 5 + 3])
def test_ghost_gram_row_chunking(monkeypatch, block_elems):
    # Chunk sizes 1 and 2 over m=7 rows: every block boundary, including a ragged last block.
    p = make_problem("linear", m=7, T=5)
    monkeypatch.setattr(ghost, "GRAM_BLOCK_ELEMS", block_elems)
    torch.testing.assert_close(ghost_gram(p.x, p.a), p.jac @ p.jac.T, **TOL)


@pytest.mark.parametrize("block_rows", [1, 2, 3, 7, 64])
def test_materialized_symmetric_gram_blocks(block_rows):
    # Row blocks of 1..m over m=7 rows, including ragged last blocks and a single block.
    p = make_problem("linear", m=7, T=5)
    gram = ghost.symmetric_gram(per_sample_gradients(p.x, p.a).reshape(7, -1), block_rows=block_rows)
    torch.testing.assert_close(gram, p.jac @ p.jac.T, **TOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path1", PATHS)
@pytest.mark.parametrize("path2", PATHS)
@pytest.mark.parametrize("pair", [two_weight_points, two_input_sets])
def test_cross_gram(kind, path1, path2, pair):
    p1, p2 = pair(kind)
    expected = p1.jac @ p2.jac.T
    jac1, jac2 = LayerJacobian(p1.x, p1.a, path=path1), LayerJacobian(p2.x, p2.a, path=path2)
    torch.testing.assert_close(jac1.cross_gram(jac2), expected, **TOL)
    torch.testing.assert_close(jac2.cross_gram(jac1), expected.T, **TOL)
    torch.testing.assert_close(ghost_gram(p1.x, p1.a, p2.x, p2.a), expected, **TOL)


def test_cross_gram_different_sample_counts():
    p = make_problem("linear", m=7)
    p1, p2 = p.rows([0, 1, 2, 3, 4, 5, 6]), p.rows([6, 2, 4])
    torch.testing.assert_close(ghost_gram(p1.x, p1.a, p2.x, p2.a), p1.jac @ p2.jac.T, **TOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_jvp(kind, path):
    p = make_problem(kind)
    delta = random_delta(p)
    expected = p.jac @ delta.reshape(-1)
    torch.testing.assert_close(LayerJacobian(p.x, p.a, path=path).jvp(delta), expected, **TOL)
    torch.testing.assert_close(ghost_jvp(p.x, p.a, delta), expected, **TOL)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_vjp(kind, path):
    p = make_problem(kind)
    torch.manual_seed(8)
    v = torch.randn(p.m, dtype=DT)
    expected = (p.jac.T @ v).reshape(p.d_out, p.d_in)
    torch.testing.assert_close(LayerJacobian(p.x, p.a, path=path).vjp(v), expected, **TOL)
    torch.testing.assert_close(ghost_vjp(p.x, p.a, v), expected, **TOL)


@pytest.mark.parametrize("path", PATHS)
def test_products_computed_in_requested_dtype(path):
    # Captures may be float32; the engine promises its Gram/JVP/VJP in gram_dtype (float64).
    p = make_problem("linear")
    x32, a32 = p.x.float(), p.a.float()
    jac = torch.einsum("mto,mti->moi", a32.double(), x32.double()).reshape(p.m, -1)
    delta = random_delta(p).float()
    lj = LayerJacobian(x32, a32, dtype=DT, path=path)
    gram, jvp, vjp = lj.gram(), lj.jvp(delta), lj.vjp(torch.ones(p.m))
    assert gram.dtype == jvp.dtype == vjp.dtype == DT
    torch.testing.assert_close(gram, jac @ jac.T, **TOL)
    torch.testing.assert_close(jvp, jac @ delta.double().reshape(-1), **TOL)
    torch.testing.assert_close(vjp.reshape(-1), jac.sum(0), **TOL)


# --------------------------------------------------------------------------------------------------
# Projection
# --------------------------------------------------------------------------------------------------


def relative_residual(jac: Tensor, delta: Tensor, projected: Tensor) -> float:
    return float(torch.linalg.norm(jac @ projected.reshape(-1)) / torch.linalg.norm(jac @ delta.reshape(-1)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_project_full_rank(kind, path):
    p = make_problem(kind)
    delta = random_delta(p)
    lj = LayerJacobian(p.x, p.a, path=path)
    eig = eig_psd(lj.gram(), RCOND)
    assert eig.rank == p.m

    got = project(lj, delta, eig)

    flat = delta.reshape(-1)
    expected = flat - p.jac.T @ torch.linalg.solve(p.jac @ p.jac.T, p.jac @ flat)
    torch.testing.assert_close(got, expected.reshape(delta.shape), rtol=1e-9, atol=1e-9)
    assert relative_residual(p.jac, delta, got) < 1e-6


# Duplicated replay samples, and more samples than weight entries (m=8 > d_in*d_out=6).
RANK_DEFICIENT = {
    "duplicate_samples": lambda kind: make_problem(kind, m=4).rows([0, 1, 2, 3, 1, 0, 3]),
    "m_exceeds_dim": lambda kind: make_problem(kind, m=8, d_in=3, d_out=2),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", sorted(RANK_DEFICIENT))
def test_project_rank_deficient(kind, path, case):
    p = RANK_DEFICIENT[case](kind)
    delta = random_delta(p)
    lj = LayerJacobian(p.x, p.a, path=path)
    eig = eig_psd(lj.gram(), RCOND)
    true_rank = int(torch.linalg.matrix_rank(p.jac))
    assert true_rank < p.m  # the Gram really is singular
    assert eig.rank == true_rank

    got = project(lj, delta, eig)

    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, explicit_projection(p.jac, delta), rtol=1e-8, atol=1e-8)
    assert relative_residual(p.jac, delta, got) < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_project_is_idempotent_and_keeps_null_space_updates(path):
    p = make_problem("conv1d")
    lj = LayerJacobian(p.x, p.a, path=path)
    eig = eig_psd(lj.gram(), RCOND)
    once = project(lj, random_delta(p), eig)
    # An update already in the null space of J must pass through untouched.
    torch.testing.assert_close(project(lj, once, eig), once, rtol=1e-9, atol=1e-9)


def explicit_damped_projection(jac: Tensor, delta: Tensor, damping: float) -> Tensor:
    """``ΔW − Jᵀ (J Jᵀ + λI)⁻¹ J ΔW`` with ``λ = damping · max eig(J Jᵀ)``, by a dense solve."""
    gram = jac @ jac.T
    lam = damping * float(torch.linalg.eigvalsh(gram).max())
    flat = delta.reshape(-1)
    return (flat - jac.T @ torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=DT), jac @ flat)).reshape(
        delta.shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("matmul", (torch.float64, torch.float32), ids=("float64", "float32"))
@pytest.mark.parametrize("case", ("full_rank", "duplicate_samples"))
@pytest.mark.parametrize("damping", (1e-3, 0.3))
def test_damped_projection_matches_explicit_solve(kind, path, matmul, case, damping):
    """Damping λ: ΔW − Jᵀ (JJᵀ + λI)⁻¹ J ΔW, on a full-rank and a singular Gram, with float64 products and with
    float32 products (whose refinement sweep solves the damped system's residual, not the undamped one's)."""
    p = make_problem(kind) if case == "full_rank" else RANK_DEFICIENT[case](kind)
    delta = random_delta(p)
    lj = LayerJacobian(p.x, p.a, path=path, matmul_dtype=matmul)
    eig = eig_psd(lj.gram(), RCOND, damping)
    got = project(lj, delta, eig).double()
    want = explicit_damped_projection(p.jac, delta, damping)
    assert _rel(got, want) < (1e-9 if matmul == torch.float64 else 1e-6)
    # it keeps part of the update along the row space: between the exact projection and ΔW
    exact = explicit_projection(p.jac, delta)
    assert 0 < float((got - exact).norm()) < float((delta - exact).norm())


def test_damping_changes_neither_the_row_space_nor_the_angles():
    p, q = two_weight_points("linear")
    g1, g2 = LayerJacobian(p.x, p.a), LayerJacobian(q.x, q.a)
    plain, damped = eig_psd(g1.gram(), RCOND), eig_psd(g1.gram(), RCOND, 0.5)
    assert damped.rank == plain.rank and plain.shift == 0.0
    assert damped.shift == pytest.approx(0.5 * float(torch.linalg.eigvalsh(p.jac @ p.jac.T).max()), rel=1e-12)
    other = eig_psd(g2.gram(), RCOND)
    torch.testing.assert_close(principal_cosines(damped, eig_psd(g2.gram(), RCOND, 0.5), g1.cross_gram(g2)),
                               principal_cosines(plain, other, g1.cross_gram(g2)), rtol=0, atol=0)
    # damping 0 is the pseudo-inverse exactly
    delta = random_delta(p)
    assert torch.equal(project(g1, delta, eig_psd(g1.gram(), RCOND, 0.0)), project(g1, delta, plain))
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="damping"):
            eig_psd(g1.gram(), RCOND, bad)


@pytest.mark.parametrize("path", PATHS)
def test_project_zero_jacobian_is_identity(path):
    # A layer whose output gradients vanish imposes no constraint: empty spectrum, update unchanged.
    p = make_problem("linear")
    lj = LayerJacobian(p.x, torch.zeros_like(p.a), path=path)
    eig = eig_psd(lj.gram(), RCOND)
    assert eig.rank == 0
    delta = random_delta(p)
    got = project(lj, delta, eig)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, delta, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# Principal angles
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pair", [two_weight_points, two_input_sets])
def test_principal_cosines_match_scipy(kind, path, pair):
    p1, p2 = pair(kind)
    got = ghost_cosines(LayerJacobian(p1.x, p1.a, path=path), LayerJacobian(p2.x, p2.a, path=path))
    expected = scipy_cosines(p1.jac, p2.jac)
    assert got.numel() == expected.numel() == p1.m
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    assert float(expected.min()) < 0.999  # the two row spaces genuinely differ


def mixed_rows(p: Problem, mix: Tensor) -> Problem:
    """Factors whose Jacobian is ``mix @ J``: sample u carries every original sample's tokens, with its
    output gradients scaled by ``mix[u, j]`` (so its rank dimension is m * T)."""
    m = p.m
    x = p.x.reshape(1, -1, p.d_in).expand(m, -1, -1)
    a = (mix.view(m, m, 1, 1) * p.a.unsqueeze(0)).reshape(m, -1, p.d_out)
    return Problem(x, a, mix @ p.jac)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_principal_cosines_identical_row_spaces(kind, path):
    p1 = make_problem(kind)
    torch.manual_seed(9)
    p2 = mixed_rows(p1, torch.eye(p1.m, dtype=DT) + 0.3 * torch.randn(p1.m, p1.m, dtype=DT))
    torch.testing.assert_close(torch.einsum("mto,mti->moi", p2.a, p2.x).reshape(p2.m, -1), p2.jac, **TOL)

    jac1, jac2 = LayerJacobian(p1.x, p1.a, path=path), LayerJacobian(p2.x, p2.a, path=path)
    got = ghost_cosines(jac1, jac2)
    expected = scipy_cosines(p1.jac, p2.jac)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    torch.testing.assert_close(got, torch.ones(p1.m, dtype=DT), rtol=0, atol=1e-9)
    # Against itself, every cosine is 1 as well.
    torch.testing.assert_close(ghost_cosines(jac1, jac1), torch.ones(p1.m, dtype=DT), rtol=0, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_principal_cosines_different_ranks(kind, path):
    # J2 (5 rows, rank 4) shares two rows with J1 (6 rows, rank 6): four cosines, the top two equal 1.
    layer = make_layer(kind, 4, 5, seed=10)
    p1 = build(layer, *random_inputs(6, 5, 4, 5, seed=11))
    fresh = build(layer, *random_inputs(2, 5, 4, 5, seed=12))
    p2 = Problem(*(torch.cat([t1[[0, 1]], t2, t2[[0]]]) for t1, t2 in
                   ((p1.x, fresh.x), (p1.a, fresh.a), (p1.jac, fresh.jac))))
    assert int(torch.linalg.matrix_rank(p2.jac)) == 4

    jac1, jac2 = LayerJacobian(p1.x, p1.a, path=path), LayerJacobian(p2.x, p2.a, path=path)
    assert eig_psd(jac2.gram(), RCOND).rank == 4
    got = ghost_cosines(jac1, jac2)
    expected = scipy_cosines(p1.jac, p2.jac)
    assert got.numel() == expected.numel() == 4
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    torch.testing.assert_close(got[-2:], torch.ones(2, dtype=DT), rtol=0, atol=1e-9)
    # Swapping the roles gives the same angles (G21 = G12ᵀ).
    torch.testing.assert_close(ghost_cosines(jac2, jac1), got, rtol=0, atol=1e-9)


def test_principal_cosines_empty_row_space_gives_no_mean():
    p = make_problem("linear")
    empty = LayerJacobian(p.x, torch.zeros_like(p.a))
    full = LayerJacobian(p.x, p.a)
    cos = principal_cosines(eig_psd(empty.gram(), RCOND), eig_psd(full.gram(), RCOND), empty.cross_gram(full))
    assert cos.numel() == 0
    assert mean_cosine(cos) is None


def test_mean_cosine():
    assert mean_cosine(torch.zeros(0, dtype=DT)) is None
    p1, p2 = two_weight_points("linear")
    cos = ghost_cosines(LayerJacobian(p1.x, p1.a), LayerJacobian(p2.x, p2.a))
    reference = scipy_cosines(p1.jac, p2.jac)
    # cosines spread this far apart (0.82 to 0.99) tell the mean from the first, last, largest or median one
    assert float(reference.max() - reference.min()) > 0.1
    got = mean_cosine(cos)
    assert got == pytest.approx(float(reference.mean()), abs=1e-9)
    assert json.loads(json.dumps(got)) == got  # it goes into the JSON report: a number, not a 0-d tensor


# --------------------------------------------------------------------------------------------------
# Path choice
# --------------------------------------------------------------------------------------------------


def materialized_cost(m: int, r: int, d_in: int, d_out: int) -> int:
    return MATERIALIZED_COST_FACTOR * (m * r * d_in * d_out + m * m * d_in * d_out)


def cheaper_materialized(m: int, r: int, d_in: int, d_out: int) -> bool:
    return materialized_cost(m, r, d_in, d_out) < m * m * r * r * (d_in + d_out)


def test_choose_path_both_sides():
    # Many tokens, narrow layer: per-sample gradients are cheap to build.
    assert cheaper_materialized(8, 64, 4, 4)
    assert choose_path(8, 64, 4, 4, bytes_per_elem=8, max_bytes=1 << 30) == "materialized"
    # Few tokens, wide layer: the ghost Gram is cheaper.
    assert not cheaper_materialized(8, 1, 100, 100)
    assert choose_path(8, 1, 100, 100, bytes_per_elem=8, max_bytes=1 << 30) == "ghost"


def test_choose_path_matches_cost_model_on_grid():
    for m in (1, 2, 5, 16):
        for r in (1, 2, 4, 8, 32):
            for d_in, d_out in ((3, 5), (16, 16), (64, 8), (256, 1024)):
                expected = "materialized" if cheaper_materialized(m, r, d_in, d_out) else "ghost"
                assert choose_path(m, r, d_in, d_out, 8, 1 << 40) == expected, (m, r, d_in, d_out)


def test_choose_path_tie_goes_to_ghost():
    # Materialized only when strictly cheaper; search small shapes for exact ties of the two costs.
    ties = [(m, r, d_in, d_out) for m in range(1, 9) for r in range(1, 17) for d_in in range(1, 17)
            for d_out in range(1, 17) if materialized_cost(m, r, d_in, d_out) == m * m * r * r * (d_in + d_out)]
    assert ties
    for m, r, d_in, d_out in ties[:50]:
        assert choose_path(m, r, d_in, d_out, 8, 1 << 30) == "ghost"


def test_choose_path_max_bytes_cap():
    m, r, d_in, d_out = 8, 64, 4, 4
    needed = m * d_in * d_out * 8
    assert choose_path(m, r, d_in, d_out, 8, max_bytes=needed) == "materialized"
    assert choose_path(m, r, d_in, d_out, 8, max_bytes=needed - 1) == "ghost"
    # The cap is in bytes: float32 halves the footprint.
    assert choose_path(m, r, d_in, d_out, 4, max_bytes=needed // 2) == "materialized"


def test_layer_jacobian_picks_path_from_cost_and_dtype():
    torch.manual_seed(13)
    m, r, d_in, d_out = 5, 16, 3, 4  # materialized is cheaper here
    assert cheaper_materialized(m, r, d_in, d_out)
    x, a = torch.randn(m, r, d_in, dtype=DT), torch.randn(m, r, d_out, dtype=DT)
    needed64 = m * d_in * d_out * 8
    assert LayerJacobian(x, a).path == "materialized"
    assert LayerJacobian(x, a, max_bytes=needed64 - 1).path == "ghost"
    assert LayerJacobian(x, a, dtype=torch.float32, max_bytes=needed64 // 2).path == "materialized"
    # An explicit path overrides the cost model.
    assert LayerJacobian(x, a, path="ghost").path == "ghost"
    # Few tokens: ghost.
    assert not cheaper_materialized(m, 1, d_in, d_out)
    assert LayerJacobian(x[:, :1], a[:, :1]).path == "ghost"


# --------------------------------------------------------------------------------------------------
# Shape validation
# --------------------------------------------------------------------------------------------------

_X = torch.zeros(5, 4, 3, dtype=DT)
_A = torch.zeros(5, 4, 6, dtype=DT)
FACTOR_SHAPE_MSG = r"\(m, r, d_in\).*\(m, r, d_out\)"


@pytest.mark.parametrize(
    "x, a",
    [
        (_X[0], _A),  # X not batched
        (_X, _A[0]),  # A not batched
        (_X[:4], _A),  # different m
        (_X[:, :3], _A),  # different r
    ],
    ids=["x_2d", "a_2d", "m_mismatch", "r_mismatch"],
)
@pytest.mark.parametrize(
    "call",
    [
        lambda x, a: per_sample_gradients(x, a),
        lambda x, a: ghost_gram(x, a),
        lambda x, a: ghost_gram(_X, _A, x, a),
        lambda x, a: ghost_jvp(x, a, torch.zeros(6, 3, dtype=DT)),
        lambda x, a: ghost_vjp(x, a, torch.zeros(5, dtype=DT)),
        lambda x, a: LayerJacobian(x, a),
    ],
    ids=["per_sample_gradients", "ghost_gram", "ghost_gram_second", "ghost_jvp", "ghost_vjp", "LayerJacobian"],
)
def test_bad_factor_shapes_raise(call, x, a):
    with pytest.raises(ValueError, match=FACTOR_SHAPE_MSG):
        call(x, a)


def test_bad_delta_and_v_shapes_raise():
    with pytest.raises(ValueError, match=r"\(d_out, d_in\)=\(6, 3\)"):
        ghost_jvp(_X, _A, torch.zeros(3, 6, dtype=DT))
    with pytest.raises(ValueError, match=r"\(m,\)=\(5,\)"):
        ghost_vjp(_X, _A, torch.zeros(4, dtype=DT))
    with pytest.raises(ValueError, match=r"\(m,\)=\(5,\)"):
        ghost_vjp(_X, _A, torch.zeros(1, 5, dtype=DT))
    lj = LayerJacobian(_X, _A, path="ghost")
    with pytest.raises(ValueError, match=r"\(d_out, d_in\)"):
        lj.jvp(torch.zeros(3, 6, dtype=DT))
    with pytest.raises(ValueError, match=r"\(m,\)"):
        lj.vjp(torch.zeros(4, dtype=DT))


def test_eig_psd_rejects_non_square():
    with pytest.raises(ValueError, match="square"):
        eig_psd(torch.zeros(3, 4, dtype=DT), RCOND)


# The materialized path must validate ΔW / v like the ghost path it has to agree with.
def test_materialized_jvp_rejects_transposed_delta():
    lj = LayerJacobian(_X, _A, path="materialized")
    with pytest.raises(ValueError, match=r"\(d_out, d_in\)"):
        lj.jvp(torch.zeros(3, 6, dtype=DT))


def test_materialized_vjp_rejects_bad_v_shape():
    lj = LayerJacobian(_X, _A, path="materialized")
    with pytest.raises(ValueError, match=r"\(m,\)"):
        lj.vjp(torch.zeros(1, 5, dtype=DT))


@pytest.mark.parametrize("path", ["ghost", "materialized"])
def test_cross_gram_rejects_other_layer_shape(path):
    # (d_in, d_out) = (3, 6) vs (6, 3) have the same numel; a silent 5x5 "cross-Gram" would be meaningless.
    lj = LayerJacobian(_X, _A, path=path)
    other = LayerJacobian(_A, _X, path=path)
    with pytest.raises(ValueError, match="same layer shape"):
        lj.cross_gram(other)


# --------------------------------------------------------------------------------------------------
# Mixed precision (JanusConfig.ghost_matmul="float32"): float32 products, float64 sums, one refinement sweep
# --------------------------------------------------------------------------------------------------


def _rel(got: Tensor, want: Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_float32_products_match_explicit_jacobian(kind, path):
    """Gram, cross-Gram, JVP and VJP within float32 rounding of J's, and the refined projection's null-space
    residual ||J P ΔW|| / ||J ΔW|| at most 1e-6 (the 80 GB GPU issue's target), with J from torch.func."""
    p, q = two_weight_points(kind, m=12, T=6, d_in=24, d_out=20)
    mixed = LayerJacobian(p.x, p.a, path=path, matmul_dtype=torch.float32)
    other = LayerJacobian(q.x, q.a, path=path, matmul_dtype=torch.float32)
    assert mixed.refines and mixed.gram().dtype == DT
    assert _rel(mixed.gram(), p.jac @ p.jac.T) < 1e-6
    assert _rel(mixed.cross_gram(other), p.jac @ q.jac.T) < 1e-6
    torch.manual_seed(5)
    delta = torch.randn(p.d_out, p.d_in, dtype=DT)
    v = torch.randn(p.m, dtype=DT)
    assert _rel(mixed.jvp(delta), p.jac @ delta.reshape(-1)) < 1e-6
    assert _rel(mixed.vjp(v).reshape(-1), p.jac.T @ v) < 1e-6
    assert torch.equal(mixed.precise_jvp(delta), LayerJacobian(p.x, p.a, path="ghost").jvp(delta))

    eig = eig_psd(mixed.gram(), RCOND)
    proj = project(mixed, delta, eig)
    assert proj.dtype == torch.float32
    assert float((p.jac @ proj.double().reshape(-1)).norm()) <= 1e-6 * float((p.jac @ delta.reshape(-1)).norm())
    exact = project(LayerJacobian(p.x, p.a, path=path), delta, eig_psd(p.jac @ p.jac.T, RCOND))
    assert _rel(proj, exact) < 1e-5


def test_float32_products_accumulate_long_rows_in_float64():
    """A materialized Gram whose rows are longer than one accumulation chunk sums the chunks in float64."""
    torch.manual_seed(0)
    flat = torch.randn(9, 3 * ghost._ACCUMULATION_CHUNK + 17)
    want = flat.double() @ flat.double().T
    got = ghost.symmetric_gram(flat, block_rows=4, dtype=DT)
    assert got.dtype == DT
    assert _rel(got, want) < 1e-6
    # Products already in the accumulation dtype are one matrix product, as before.
    assert torch.equal(ghost.symmetric_gram(flat.double(), block_rows=4), ghost.symmetric_gram(flat.double(),
                                                                                                block_rows=4, dtype=DT))


def test_float64_products_do_not_refine():
    lj = LayerJacobian(_X, _A, path="ghost")
    assert not lj.refines and lj.matmul_dtype == DT
    assert not LayerJacobian(_X, _A, dtype=torch.float32, matmul_dtype=torch.float32).refines


def test_tensor_cores_are_scoped():
    """TF32 is switched on only inside the ghost math and only for CUDA float32 products; the user's setting returns."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with ghost.tensor_cores(torch.device("cuda"), torch.float32):
        assert matmul.fp32_precision == "tf32"
    assert matmul.fp32_precision == before
    with (ghost.tensor_cores(torch.device("cuda"), torch.float64),
          ghost.tensor_cores(torch.device("cpu"), torch.float32)):
        assert matmul.fp32_precision == before
    with pytest.raises(RuntimeError), ghost.tensor_cores(torch.device("cuda"), torch.float32):
        raise RuntimeError("boom")
    assert matmul.fp32_precision == before
