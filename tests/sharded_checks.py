"""Pieces shared by the FSDP2 and DeepSpeed ZeRO-3 tests: spawning the two ranks, the failure injections, and
the check that a 2-process sharded rectification gives what one process gives on the unsharded model."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import pytest
import torch
import torch.multiprocessing as mp
from testing_utils import build_tiny, fine_tune, random_replay

from hf_janus import JanusConfig
from hf_janus.engine.observer import RunObserver
from hf_janus.engine.rectifier import Rectifier


@contextmanager
def rank_process() -> Iterator[None]:
    """The body of one spawned rank: its traceback is printed whole (mp.spawn reports only the last line) and its
    process group is destroyed however it ends."""
    import traceback

    import torch.distributed as dist

    try:
        yield
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def assert_restored(outcome: dict, name: str) -> None:
    """An injected failure raised an error that says the model was restored, and every weight is θ̂ again."""
    assert outcome["error"] is not None and "restored" in outcome["error"] and "injected" in outcome["error"]
    for key, value in outcome["before"].items():
        assert torch.equal(outcome["after"][key], value), f"{name}: {key} is not θ̂"


def fsdp_full_state(model: torch.nn.Module) -> dict:
    """The whole state dict of a model FSDP2 shards (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def spawn_two(worker, tmp_path, *args) -> list:
    """Run ``worker(rank, 2, init_file, out_dir, *args)`` on two processes; each saves ``rank<r>.pt`` in out_dir."""
    mp.spawn(worker, args=(2, str(tmp_path / "init"), str(tmp_path), *args), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


# ---- failure injections: ``inject(patch, hooks)`` steers the run through ``hooks`` (a RunObserver, given to the
# Rectifier) and, for failures inside a forward or backward pass, replaces engine functions through
# ``patch(owner, attr, value)``

class InjectionHooks(RunObserver):
    """The run's hooks of a failure injection: ``now`` is the tag of the capture in progress (trials are tagged
    ``s<step>t<n>``); with ``fail_compare`` the comparison of the first trial raises."""

    def __init__(self) -> None:
        self.now: Optional[str] = None
        self.fail_compare = False

    def capturing(self, tag: str) -> None:
        self.now = tag

    def compare(self, loop, current_tag, trial_tag):
        if self.fail_compare:
            raise RuntimeError("injected failure after the trial was written")
        return super().compare(loop, current_tag, trial_tag)


@contextmanager
def injected(inject: Callable) -> Iterator[InjectionHooks]:
    """Apply one failure injection for the duration of the block, then undo every patch it made; yields the hooks
    to give to the Rectifier (``observer=``)."""
    patches = []

    def patch(owner, attr, value):
        patches.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    hooks = InjectionHooks()
    inject(patch, hooks)
    try:
        yield hooks
    finally:
        for owner, attr, value in reversed(patches):
            setattr(owner, attr, value)


def fail_during_backward(patch, hooks: InjectionHooks) -> None:
    """The first compression of a trial capture raises: the error leaves the sharded model mid-backward."""
    import hf_janus.engine.capture as capture

    original = capture.begin_compression

    def begin_compression(*args, **kwargs):
        if hooks.now.startswith("s"):  # a trial, on every rank at the same pass
            raise RuntimeError("injected failure in the trial's backward")
        return original(*args, **kwargs)

    patch(capture, "begin_compression", begin_compression)


def fail_between_passes(patch, hooks: InjectionHooks) -> None:
    """Comparing the first trial raises: the trial weights are already written into the shards."""
    hooks.fail_compare = True


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
    single = Rectifier(model, reference, random_replay(n_samples), JanusConfig(**config), progress=False).run().report
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
