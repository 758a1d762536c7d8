"""Checks shared by the FSDP2 and DeepSpeed ZeRO-3 tests: a 2-process sharded rectification must give what one
process gives on the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny, fine_tune, random_replay

from hf_janus import JanusConfig
from hf_janus.rectifier import Rectifier


def setup_model():
    model = build_tiny("llama")
    reference = fine_tune(model)
    return model, reference


def check_matches_single_process(per_rank: list[dict], n_samples: int, config: dict, still_sharded: str) -> set[str]:
    """``per_rank``: each rank's ``{"state", "report", "passes", still_sharded}`` for one replay size.

    Returns the names of the target weights, for checks particular to one kind of sharding.
    """
    batches = (n_samples + 1) // 2
    # The replay is split as under DDP; the shorter share pads with a discarded pass so the collectives pair up.
    local = [len(range(0, batches, 2)), len(range(1, batches, 2))]
    assert [s["passes"] for s in per_rank] == [(n, local[0] - n) for n in local]
    assert all(s[still_sharded] for s in per_rank)
    for key, value in per_rank[0]["state"].items():
        assert torch.equal(value, per_rank[1]["state"][key]), f"{key} differs between ranks"

    model, reference = setup_model()
    finetuned = copy.deepcopy(model.state_dict())
    single = Rectifier(model, reference, random_replay(n_samples), JanusConfig(**config), progress=False).run()
    report = per_rank[0]["report"]
    assert report["num_samples"] == single.num_samples == n_samples
    assert report["num_tokens"] == single.num_tokens
    assert [s["alpha"] for s in report["steps"]] == single.alphas
    assert [layer["name"] for layer in report["layers"]] == [layer.name for layer in single.layers]
    assert report["replay_loss"]["finetuned"] == pytest.approx(single.replay_loss["finetuned"], rel=1e-6)
    targets = {f"{layer.name}.weight" for layer in single.layers}
    assert set(per_rank[0]["state"]) == set(finetuned)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(per_rank[0]["state"][key], value, rtol=0, atol=1e-6)
        if key not in targets:  # embeddings, norms, lm_head keep their fine-tuned values exactly
            assert torch.equal(per_rank[0]["state"][key], finetuned[key]), key
        else:
            assert not torch.equal(per_rank[0]["state"][key], finetuned[key]), key
    return targets
