"""A capture reads nothing back from the device per target layer (the 80 GB GPU issue, item 3).

On a GPU every value read back by the host (``.item()``, ``bool(t)``, ``.nonzero()``, ``.cpu()``, boolean-mask
indexing, and linear-algebra calls whose status CUDA checks on the host, such as ``eigh`` and ``svd``) waits for the
device to finish its queue; a LLaMA-7B capture compresses 7,168 times, so one such read per compression call keeps
the GPU idle. There is no GPU in CI, so the reads are counted on the CPU, where they are calls: a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` sees the operators (also inside the backward pass, where the
hooks run), ``Tensor.cpu``/``tolist``/``numpy`` are wrapped (``benchmarks.perf.capture_counts.HostReads``, which
the capture-counts benchmark reports), and the engine's own waits go through ``PhaseTimer.synchronize``. Host-side
work on the replay's attention mask is counted too (on the CPU it cannot be told apart), which is why the assertion is
about growth with the number of layers rather than an absolute zero. ``Tensor.to`` is not counted: on the CPU a copy to
the host cannot be told from one to the device (which does not wait); the engine reads device values back with
``.cpu()``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import transformers as tf
from testing_utils import random_replay

from benchmarks.perf.capture_counts import HostReads
from hf_janus.engine.capture import capture_factors
from hf_janus.engine.compression import compress_sequence
from hf_janus.engine.layers import resolve_target_modules, rule_for
from hf_janus.engine.store import FactorStore
from hf_janus.engine.timing import PhaseTimer
from hf_janus.replay.prepare import prepare_replay


def llama(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return tf.LlamaForCausalLM(config).eval()


def count_capture(layers: int, method: str, batches: int = 3) -> Counter:
    model = llama(layers)
    targets = {}
    for name, module in resolve_target_modules(model).items():
        d_out, d_in = rule_for(module).matrix_shape(module)
        targets[name] = (module, d_in, d_out)
    replay = prepare_replay(random_replay(4 * batches, min_len=3, max_len=12), 4)  # rank 5: short and long samples
    waits = Counter()

    class CountingTimer(PhaseTimer):
        def synchronize(self) -> None:
            waits.update(["PhaseTimer.synchronize"])

    with HostReads() as reads:
        capture_factors(model, targets, replay, FactorStore(), "c0", 5, CountingTimer(torch.device("cpu")), method)
    return reads.calls + waits


def test_randomized_capture_reads_back_per_batch_not_per_layer():
    """The accelerator path: the same reads with 1 and 3 transformer blocks (7 and 21 target layers), a few per
    batch."""
    one, three = count_capture(1, "randomized"), count_capture(3, "randomized")
    assert one == three
    # per batch: two waits around the pass, the replay-loss checks and copies, one NaN flag read for all layers, the
    # plan's host work, and the Ritz step's eigenproblems of every layer, one batched pair per sketch size
    assert sum(three.values()) <= 20 * 3, three
    # torch.linalg.eigh dispatches as aten::_linalg_eigh (the name READS counts); two sketch sizes in this model,
    # (16 -> 16) and (16 -> 8) layers, so at most two batched pairs per batch, and at least one pair ran
    assert 2 <= three["_linalg_eigh"] <= 2 * 2 * 3, three


def test_the_counter_sees_per_layer_reads():
    """The counter is not blind: the exact method's per-layer SVDs (a host check each on CUDA) grow with the layers,
    and a standalone compress_sequence call derives its plan from the data, reading it back."""
    one, three = count_capture(1, "exact"), count_capture(3, "exact")
    assert three["_linalg_svd"] > one["_linalg_svd"] > 0
    x, a = torch.randn(2, 8, 3), torch.randn(2, 8, 4)
    with HostReads() as reads:
        compress_sequence(x, a, 2, method="randomized")
    assert reads.total >= 1
    assert reads.calls["_linalg_eigh"] == 2, reads.calls  # the Ritz step's pair: eigh is seen under its aten name


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_planned_capture_matches_data_driven_compression(method):
    """The plan made from the attention mask gives the factors the data-driven decisions give."""
    model = llama(1)
    targets = {}
    for name, module in resolve_target_modules(model).items():
        d_out, d_in = rule_for(module).matrix_shape(module)
        targets[name] = (module, d_in, d_out)
    replay = prepare_replay(random_replay(8, min_len=3, max_len=12), 4)
    store, uncompressed = FactorStore(), FactorStore()
    capture_factors(model, targets, replay, store, "c0", 5, PhaseTimer(), method)
    capture_factors(model, targets, replay, uncompressed, "c0", None, PhaseTimer(), method)
    for name in targets:
        x, a = store.get("c0", name)
        full_x, full_a = uncompressed.get("c0", name)
        want_x, want_a = compress_sequence(full_x, full_a, 5, method=method)
        got = torch.einsum("bri,bro->bio", x.double(), a.double())
        want = torch.einsum("bri,bro->bio", want_x.double(), want_a.double())
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
        assert x.shape[1] <= 5
