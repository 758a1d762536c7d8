"""Issue 65's CPU proxies of a GPU capture, held to their targets so that a regression fails: the engine launches no
more kernels than the model's own forward and backward, reads back per batch and never per layer or sample, and moves
exactly the factors to the host (``benchmarks/perf/capture_counts.py`` reports the same at the 130M shape)."""

from __future__ import annotations

import torch

from benchmarks.perf import capture_counts
from benchmarks.perf import measure as pr
from hf_janus.engine.store import HOST_BLOCK_BYTES


def test_a_capture_meets_the_proxies_targets():
    """At the 20M shape (4 blocks: the stacked compressions' fixed cost shared by 4 layers of each shape)."""
    model = pr.build_llama("20M", 0, torch.device("cpu"), torch.float32)
    reference = pr.fake_finetune(model, 0.05, 1, torch.device("cpu"))
    replay = pr.random_replay(8, 16, 2)
    counts, half = (capture_counts.count_capture(model, reference, replay, batch, rank=8) for batch in (8, 4))
    met = capture_counts.check(counts, half)
    assert all(met.values()), (met, counts)
    assert counts.engine_host_reads > 0 and counts.engine_kernels > 0  # the counters see the engine
    assert counts.store_allocations == -(-counts.host_bytes // HOST_BLOCK_BYTES)  # one per block, not per piece
