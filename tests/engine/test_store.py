"""FactorStore: where compressed factors live between passes (memory, host memory up to a budget, disk)."""

from __future__ import annotations

import pytest
import torch

from hf_janus.engine.store import FactorStore, HostBlocks, host_footprint


def piece(batch: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, rank, 6, generator=gen), torch.randn(batch, rank, 4, generator=gen)


def test_host_footprint_counts_the_pinned_allocators_power_of_two_rounding():
    assert host_footprint(4_200_000, pinned=True) == 1 << 23
    assert host_footprint(1 << 20, pinned=True) == 1 << 20
    assert host_footprint((1 << 20) + 1, pinned=True) == 1 << 21
    assert host_footprint(4_200_000, pinned=False) == 4_200_000
    assert host_footprint(0, pinned=True) == 0


def test_budget_keeps_what_fits_in_memory_and_spills_the_rest(tmp_path):
    pieces = [piece(2, 3, seed) for seed in range(3)]
    one = sum(t.nbytes for t in pieces[0])
    store = FactorStore(str(tmp_path), torch.device("cpu"), memory_budget_bytes=2 * one)
    for x, a in pieces:
        store.append("t0", "layer", x, a)
    assert store.held_bytes == 2 * one and store.spilled_bytes == one
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1
    x, a = store.get("t0", "layer")
    torch.testing.assert_close(x, torch.cat([p[0] for p in pieces]), rtol=0, atol=0)
    torch.testing.assert_close(a, torch.cat([p[1] for p in pieces]), rtol=0, atol=0)
    store.drop("t0")
    assert store.held_bytes == 0 and not list(tmp_path.rglob("*.safetensors"))


def test_merging_pieces_of_different_ranks_keeps_the_account(tmp_path):
    """Held pieces are merged on first use, ranks zero-padded to the largest: the account follows the padding."""
    small, large = piece(2, 2, 0), piece(3, 5, 1)
    store = FactorStore(str(tmp_path), torch.device("cpu"), memory_budget_bytes=1 << 30)
    store.append("t0", "layer", *small)
    store.append("t0", "layer", *large)
    x, a = store.get("t0", "layer")
    assert x.shape == (5, 5, 6) and a.shape == (5, 5, 4)
    assert torch.equal(x[:2, 2:], torch.zeros(2, 3, 6)) and torch.equal(x[2:], large[0])
    assert store.held_bytes == x.nbytes + a.nbytes == store.peak_held_bytes
    store.drop("t0")
    assert store.held_bytes == 0


def test_factor_dtype_and_memory_store():
    store = FactorStore("memory", torch.device("cpu"), factor_dtype="bfloat16")
    x, a = piece(2, 3, 2)
    store.append("t0", "layer", x, a)
    got_x, got_a = store.get("t0", "layer")
    assert got_x.dtype == got_a.dtype == torch.bfloat16
    torch.testing.assert_close(got_x, x.bfloat16(), rtol=0, atol=0)
    assert store.has("t0", "layer") and not store.has("t1", "layer")


def pinned_reserved() -> int:
    """Bytes torch's caching host allocator holds, in use or cached."""
    return int(torch.cuda.host_memory_stats()["reserved_bytes.current"])


def releasable_pinned_memory() -> bool:
    if not torch.cuda.is_available():
        return False
    probe = FactorStore("memory")
    probe.pinned = True
    torch.empty(1, pin_memory=True)
    return probe.host_cache_releasable() and "reserved_bytes.current" in torch.cuda.host_memory_stats()


@pytest.mark.skipif(not releasable_pinned_memory(),
                    reason="needs CUDA and a torch that empties its host cache and counts it")
def test_a_float32_capture_after_bfloat16_ones_is_not_pinned_beside_their_cached_blocks(tmp_path):
    """The end of a bf16-factor run: its captures dropped, θ0 captured again in float32. Without giving the dropped
    blocks back, the float32 pieces (another size class) are pinned beside them."""
    store = FactorStore(str(tmp_path), torch.device("cuda"), factor_dtype=torch.bfloat16,
                        memory_budget_bytes=1 << 40)
    x, a = (t.cuda() for t in piece(64, 32, 0))
    x, a = x.repeat(1, 1, 1 << 12), a.repeat(1, 1, 1 << 12)  # 64 MiB pieces in float32
    for tag in ("c0", "t1"):
        for layer in range(4):
            store.append(tag, str(layer), x, a)
    torch.cuda.synchronize()
    assert store.pinned
    held = store.held_bytes
    for tag in ("c0", "t1"):
        store.drop(tag)
    cached = pinned_reserved()
    assert cached >= held  # freed, yet cached: the mechanism the store must undo
    assert store.release_cached_host_memory()
    assert pinned_reserved() < cached - held // 2
    store.keep_exact("c0")
    for layer in range(4):
        store.append("c0", str(layer), x, a)
    torch.cuda.synchronize()
    assert pinned_reserved() <= store.held_bytes + (1 << 20)
    store.close()


def test_host_blocks_hand_out_aligned_slices_and_start_a_block_when_one_is_full():
    blocks = HostBlocks(pin=False, block_bytes=4096)
    first = blocks.take(torch.Size([10, 3]), torch.float32)  # 120 bytes
    second = blocks.take(torch.Size([7]), torch.bfloat16)
    assert first.shape == (10, 3) and first.dtype == torch.float32
    assert second.shape == (7,) and second.dtype == torch.bfloat16
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()  # one block
    assert (second.data_ptr() - first.data_ptr()) % 512 == 0 and second.data_ptr() != first.data_ptr()
    third = blocks.take(torch.Size([900]), torch.float32)  # 3600 bytes: does not fit what is left
    assert blocks.blocks == 2 and third.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert blocks.take(torch.Size([2000]), torch.float32) is None  # larger than a block: allocated alone
    first.fill_(1.0)
    second.fill_(2.0)
    assert torch.all(first == 1.0) and torch.all(second == 2.0)  # slices do not overlap


def test_a_store_in_host_blocks_gives_back_what_it_was_given_and_counts_its_bytes(tmp_path):
    """The block path (an accelerator's default), exercised on the CPU: the same factors back, each piece counted at
    its own bytes (no power-of-two rounding), the blocks let go with their capture."""
    store = FactorStore(str(tmp_path), torch.device("cpu"), memory_budget_bytes=1 << 30, host_blocks=True)
    pieces = [piece(4, 3, seed) for seed in range(3)]
    for x, a in pieces:
        store.append("c0", "layer", x, a)
        store.append("c0", "other", 2 * x, 2 * a)
    x, a = store.get("c0", "layer")
    torch.testing.assert_close(x, torch.cat([p[0] for p in pieces]))
    torch.testing.assert_close(a, torch.cat([p[1] for p in pieces]))
    assert store.held_bytes >= 2 * sum(p[0].nbytes + p[1].nbytes for p in pieces)
    store.drop("c0")
    assert store.held_bytes == 0 and not store.has("c0")
