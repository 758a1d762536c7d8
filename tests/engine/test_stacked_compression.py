"""The randomized compressions of a batch's layers stacked by shape (issue 65) give each layer the factors its own
compression gives, in float32 and bf16, with padded batches, and launch far fewer kernels per layer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from testing_utils import build_tiny, random_replay
from torch.utils._python_dispatch import TorchDispatchMode

from hf_janus.engine.capture import capture_factors
from hf_janus.engine.compression import SequencePlan
from hf_janus.engine.layers import resolve_target_modules, rule_for
from hf_janus.engine.stacked_compression import Stacks
from hf_janus.engine.store import FactorStore
from hf_janus.engine.timing import PhaseTimer
from hf_janus.replay.prepare import prepare_replay

RANK = 3  # below most samples' lengths (4-12 tokens), above some: long and short samples in one batch


def targets_of(model):
    out = {}
    for name, module in resolve_target_modules(model).items():
        d_out, d_in = rule_for(module).matrix_shape(module)
        out[name] = (module, d_in, d_out)
    return out


def capture(model, replay, stack_bytes: int) -> FactorStore:
    store = FactorStore()
    capture_factors(model, targets_of(model), replay, store, "c0", RANK, PhaseTimer(), "randomized",
                    stack_bytes=stack_bytes)
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stack_bytes", [1 << 30, 3000])  # every layer of a batch stacked; groups cut by the bound
def test_stacked_factors_are_each_layers_own(dtype, stack_bytes):
    model = build_tiny("llama").to(dtype)
    replay = prepare_replay(random_replay(12, min_len=2, max_len=12), 4)
    alone, stacked = capture(model, replay, 0), capture(model, replay, stack_bytes)
    for name in targets_of(model):
        x0, a0 = alone.get("c0", name)
        x1, a1 = stacked.get("c0", name)
        assert x1.shape == x0.shape and a1.shape == a0.shape
        # the per-sample Jacobian rows aᵢᵀ xᵢ they stand for (factors are defined up to the Ritz basis' signs)
        want = torch.einsum("bri,bro->bio", x0.double(), a0.double())
        got = torch.einsum("bri,bro->bio", x1.double(), a1.double())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_repeated_plan_is_the_plan_of_the_repeated_mask():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    base = SequencePlan.from_mask(mask, 3, 5, 2, torch.device("cpu"))
    want = SequencePlan.from_mask(mask.repeat(4, 1), 12, 5, 2, torch.device("cpu"))
    got = base.repeat(4)
    assert torch.equal(got.live, want.live) and torch.equal(got.lengths, want.lengths)
    assert torch.equal(got.long_index, want.long_index)
    assert (got.num_long, got.used_rows, got.slots, got.rank) == (want.num_long, want.used_rows, want.slots, 2)


def test_a_share_before_its_group_ran_says_so():
    stacks = Stacks(lambda batch, length, copies: None, lambda pending: None)
    share = stacks.add(torch.zeros(2, 4, 3), torch.zeros(2, 4, 5))
    with pytest.raises(RuntimeError, match="flush"):
        share.factors()


def test_a_flush_run_again_from_the_ritz_steps_compresses_each_group_once():
    """A capture's Ritz steps run when the waiting sketches pass their bound, from inside a flush, and run the flush
    again: the groups already taken are not compressed twice."""
    tracked = []

    def track(pending):
        tracked.append(pending)
        stacks.flush()  # what _BatchContext.track does once the sketches pass PENDING_SKETCH_BYTES

    plan = SequencePlan.from_mask(None, 2, 6, 2, torch.device("cpu"))
    stacks = Stacks(lambda batch, length, copies: plan.repeat(copies), track)
    shares = [stacks.add(torch.randn(2, 6, d_in), torch.randn(2, 6, 4)) for d_in in (3, 3, 5)]
    stacks.flush()
    assert len(tracked) == 2  # two shapes
    assert [tuple(share.factors()[0].shape) for share in shares] == [(2, 2, 3), (2, 2, 3), (2, 2, 5)]


class Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_stacking_launches_fewer_kernels_per_layer():
    """The tiny LLaMA's 14 layers fall in 4 shape groups: the Cholesky QRs, one kernel per group instead of per
    layer, drop by the same ratio."""
    model = build_tiny("llama")
    replay = prepare_replay(random_replay(4, min_len=8, max_len=12), 4)
    counts = {}
    for stack_bytes in (0, 1 << 30):
        with Kernels() as kernels:
            capture(model, replay, stack_bytes)
        counts[stack_bytes] = kernels.count
    alone, stacked = counts[0], counts[1 << 30]
    assert alone["linalg_cholesky_ex"] == 14 * 2 * 2  # per layer: two power iterations, one QR each side
    assert stacked["linalg_cholesky_ex"] == 4 * 2 * 2
    assert sum(stacked.values()) < 0.6 * sum(alone.values())


class _DeadBranch(torch.nn.Module):
    """A causal LM whose second layer reads an overflowed input but whose output the loss never sees: the loss is
    finite, the layer's factors are not."""

    def __init__(self, vocab: int = 48, width: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.first, self.second = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)
        with torch.no_grad():
            self.first.weight[0, 0] = float("inf")

    def forward(self, input_ids, attention_mask=None, **kwargs):
        h = self.embed(input_ids)
        dead = self.second(self.first(h)).nan_to_num(0.0, 0.0, 0.0) * 0.0
        return (self.head(h + dead),)


def test_non_finite_factors_name_their_layer():
    """The check reads one flag per layer from one multi-tensor reduction (uncompressed factors: a compression of
    non-finite rows fails in its own linear algebra first)."""
    model = _DeadBranch()
    targets = {"second": (model.second, 8, 8)}
    replay = prepare_replay(random_replay(4, min_len=6, max_len=8), 4)
    with pytest.raises(FloatingPointError, match="'second'"):
        capture_factors(model, targets, replay, FactorStore(), "c0", None, PhaseTimer(), "randomized")


def test_non_finite_inputs_of_a_compressed_layer_say_so():
    """Compressed, the same overflow fails in the Ritz step's eigendecomposition: the error says what it means."""
    model = _DeadBranch()
    replay = prepare_replay(random_replay(4, min_len=6, max_len=8), 4)
    with pytest.raises(FloatingPointError, match="NaN/Inf in the inputs or output gradients"):
        capture_factors(model, {"second": (model.second, 8, 8)}, replay, FactorStore(), "c0", RANK, PhaseTimer(),
                        "randomized")
