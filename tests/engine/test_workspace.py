"""ghost.Workspace: reused CPU buffers for the materialized per-sample gradients.

The buffers only change where the numbers are written, so everything computed through a workspace must
equal the same computation without one, including after a buffer went round the pool several times.
"""

from __future__ import annotations

import copy

import torch
from testing_utils import random_replay

from hf_janus import JanusConfig
from hf_janus.engine import ghost
from hf_janus.engine.ghost import LayerJacobian, Workspace, eig_psd, principal_cosines, project
from hf_janus.engine.observer import RunObserver
from hf_janus.engine.rectifier import Rectifier


def _factors(m: int, r: int, d_in: int, d_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, d_in, generator=g), torch.randn(m, r, d_out, generator=g)


def test_take_give_reuses_the_same_memory():
    ws = Workspace()
    a = ws.take((4, 8, 16), torch.float64, torch.device("cpu"))
    ptr = a.data_ptr()
    ws.give(a)
    assert ws.held_bytes == 4 * 8 * 16 * 8
    # A smaller request is served from the held buffer (a prefix view), a larger one is not.
    b = ws.take((2, 8, 16), torch.float64, torch.device("cpu"))
    assert b.data_ptr() == ptr and b.shape == (2, 8, 16) and b.is_contiguous()
    assert ws.held_bytes == 0
    c = ws.take((8, 8, 16), torch.float64, torch.device("cpu"))
    assert c.data_ptr() != ptr
    # Another dtype never shares a buffer.
    ws.give(b)
    d = ws.take((2, 8, 16), torch.float32, torch.device("cpu"))
    assert d.data_ptr() != ptr and d.dtype == torch.float32


def test_held_bytes_are_capped_keeping_the_smaller_buffers():
    ws = Workspace(max_bytes=3000)
    bufs = [ws.take((n,), torch.float64, torch.device("cpu")) for n in (100, 200, 300)]  # 800, 1600, 2400 bytes
    for b in bufs:
        ws.give(b)
    assert ws.held_bytes <= 3000
    assert sorted(b.numel() for b in ws._free) == [100, 200]
    ws.clear()
    assert ws.held_bytes == 0


def test_unknown_and_empty_tensors_are_ignored():
    ws = Workspace()
    ws.give(torch.zeros(10, dtype=torch.float64))  # never lent: not pooled
    assert ws.held_bytes == 0
    empty = ws.take((0, 4), torch.float64, torch.device("cpu"))
    assert empty.shape == (0, 4)
    ws.give(empty)
    assert ws.held_bytes == 0


def test_non_cpu_devices_pass_through():
    ws = Workspace()
    t = ws.take((3, 4), torch.float64, torch.device("meta"))
    assert t.device.type == "meta" and t.shape == (3, 4)
    ws.give(t)
    assert ws.held_bytes == 0


def test_clear_keeps_lent_views_valid():
    ws = Workspace()
    a = ws.take((5, 5), torch.float64, torch.device("cpu"))
    a.fill_(3.0)
    ws.clear()
    assert torch.all(a == 3.0)
    ws.give(a)  # forgotten by clear: dropped, not pooled
    assert ws.held_bytes == 0


def test_layer_jacobian_through_a_workspace_matches_without():
    """Gram, cross-Gram, JVP, VJP, projection and cosines are bit-identical with and without a workspace,
    over several layers of different shapes that share (and re-share) the buffers."""
    ws = Workspace()
    shapes = [(12, 5, 7, 9), (12, 5, 9, 7), (12, 5, 6, 6), (12, 5, 7, 9)]
    for step in range(3):
        for i, (m, r, d_in, d_out) in enumerate(shapes):
            x1, a1 = _factors(m, r, d_in, d_out, seed=10 * step + i)
            x2, a2 = _factors(m, r, d_in, d_out, seed=100 + 10 * step + i)
            delta = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            plain1 = LayerJacobian(x1, a1, path="materialized")
            plain2 = LayerJacobian(x2, a2, path="materialized")
            pooled1 = LayerJacobian(x1, a1, path="materialized", workspace=ws)
            pooled2 = LayerJacobian(x2, a2, path="materialized", workspace=ws)
            torch.testing.assert_close(pooled1.flat, ghost.per_sample_gradients(x1, a1).reshape(m, -1), rtol=0, atol=0)
            torch.testing.assert_close(pooled1.gram(), plain1.gram(), rtol=0, atol=0)
            torch.testing.assert_close(pooled1.cross_gram(pooled2), plain1.cross_gram(plain2), rtol=0, atol=0)
            torch.testing.assert_close(pooled1.jvp(delta), plain1.jvp(delta), rtol=0, atol=0)
            v = torch.randn(m, dtype=torch.float64)
            torch.testing.assert_close(pooled1.vjp(v), plain1.vjp(v), rtol=0, atol=0)
            eig1, eig2 = eig_psd(pooled1.gram(), 1e-10), eig_psd(pooled2.gram(), 1e-10)
            torch.testing.assert_close(project(pooled1, delta, eig1), project(plain1, delta, eig1), rtol=0, atol=0)
            torch.testing.assert_close(principal_cosines(eig1, eig2, pooled1.cross_gram(pooled2)),
                                       principal_cosines(eig1, eig2, plain1.cross_gram(plain2)), rtol=0, atol=0)
            pooled1.release()
            pooled2.release()
            assert pooled1._flat is None and ws.held_bytes > 0
    ptrs = {b.data_ptr() for b in ws._free}
    # Two live Jacobians at a time: two buffers suffice for all twelve pairs.
    assert len(ptrs) == 2


def test_released_buffer_is_not_shared_by_two_live_jacobians():
    ws = Workspace()
    x, a = _factors(6, 3, 4, 5, seed=0)
    j1 = LayerJacobian(x, a, path="materialized", workspace=ws)
    j2 = LayerJacobian(2 * x, a, path="materialized", workspace=ws)
    assert j1.flat.data_ptr() != j2.flat.data_ptr()
    torch.testing.assert_close(j2.flat, 2 * j1.flat)


def test_rectification_is_identical_with_and_without_buffer_reuse(tuned_llama):
    """A whole multi-step run (several trials, materialized layers, kept J_t) gives the same weights and
    cosines whether the gradient buffers are reused or allocated afresh, and reuse does happen."""
    model, reference = tuned_llama
    allocated = []

    class CountingWorkspace(Workspace):
        def take(self, shape, dtype, device):
            held = len(self._free)
            view = super().take(shape, dtype, device)
            allocated.append(len(self._free) == held)  # nothing left the pool: a fresh allocation
            return view

    class Pooled(RunObserver):
        """Every layer on the materialized path, its buffers from a counting workspace holding at most ``cap``."""

        def __init__(self, cap):
            self.cap = cap

        def jacobian_path(self, name, tag):
            return "materialized"

        def make_workspace(self):
            return CountingWorkspace(self.cap)

    cfg = JanusConfig(tau=0.9999, beta=0.5, min_alpha=0.1, max_steps=2, compression_rank=4, final_step="paper")
    runs = []
    for cap in (256 << 20, 0):
        allocated.clear()
        m = copy.deepcopy(model)
        rectifier = Rectifier(m, reference, random_replay(4), cfg, progress=False, observer=Pooled(cap))
        report = rectifier.run().report
        assert rectifier.workspace.held_bytes == 0  # cleared when the run ends
        runs.append((m.state_dict(), [t.mean_cosine for s in report.steps for t in s.trials], list(allocated)))
    (pooled, cos_pooled, alloc_pooled), (fresh, cos_fresh, alloc_fresh) = runs
    assert len(cos_pooled) >= 3 and cos_pooled == cos_fresh
    for key in pooled:
        assert torch.equal(pooled[key], fresh[key])
    assert all(alloc_fresh) and len(alloc_pooled) == len(alloc_fresh)
    assert sum(alloc_pooled) <= len(alloc_pooled) / 2  # most buffers came from the pool

