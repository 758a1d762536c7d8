"""Data-parallel rectification: 2 CPU processes (gloo) split the replay and end with identical weights."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testing_utils import REPAIR_CONFIG, build_tiny, fine_tune, fine_tune_samples, random_replay, trained_lora

from hf_janus import JanusConfig
from hf_janus.engine.rectifier import Rectifier
from hf_janus.parallel.distributed import World

pytestmark = pytest.mark.distributed  # several processes; see pyproject.toml's markers

CONFIG = dict(compression_rank=4, replay_batch_size=2, tau=0.95)


def _setup():
    model = build_tiny("llama")
    reference = fine_tune(model)
    return model, reference


def _worker(rank: int, world: int, init_file: str, out_dir: str, n_samples: int, overrides: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, reference = _setup()
        rectifier = Rectifier(model, reference, random_replay(n_samples), JanusConfig(**CONFIG, **overrides),
                              progress=False)
        report = rectifier.run().report
        torch.save({"state": model.state_dict(), "local_batches": len(rectifier.local_batches),
                    "report": report.to_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_two_ranks(tmp_path, n_samples, **overrides):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), n_samples, overrides), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("n_samples", [10, 2])
def test_two_processes_match_one(tmp_path, n_samples):
    ranks = _run_two_ranks(tmp_path, n_samples)
    batches = (n_samples + 1) // 2
    # The replay work is split, not repeated: rank r captures batches r, r+2, ...
    assert [r["local_batches"] for r in ranks] == [len(range(0, batches, 2)), len(range(1, batches, 2))]
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), f"{key} differs between ranks"

    torch.set_num_threads(1)
    model, reference = _setup()
    single = Rectifier(model, reference, random_replay(n_samples), JanusConfig(**CONFIG), progress=False).run().report
    report = ranks[0]["report"]
    assert report["num_samples"] == single.num_samples == n_samples
    assert report["num_tokens"] == single.num_tokens
    assert [s["alpha"] for s in report["steps"]] == single.alphas
    assert report["replay_loss"]["reference"] == pytest.approx(single.replay_loss["reference"], rel=1e-6)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-5)


@pytest.mark.parametrize("captures", ["all", "two"])
def test_a_rank_without_replay_batches_with_bfloat16_factors(tmp_path, captures):
    """Issue 39 item 3: one replay batch for two ranks, factors in bfloat16. The rank without a batch sends empty
    factors in bfloat16 too (float32 ones made gloo abort both processes, SIGABRT, with θ̂ never restored), and the
    float32 θ0 capture the statistics take travels in float32 from both."""
    ranks = _run_two_ranks(tmp_path, 2, factor_dtype="bfloat16", captures=captures)
    assert [r["local_batches"] for r in ranks] == [1, 0]
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), f"{key} differs between ranks"
    torch.set_num_threads(1)
    model, reference = _setup()
    single = Rectifier(model, reference, random_replay(2), JanusConfig(**CONFIG, factor_dtype="bfloat16",
                                                                        captures=captures), progress=False).run().report
    for report in (r["report"] for r in ranks):
        assert report["memory_plan"]["factor_dtype"] == "bfloat16" and report["num_samples"] == 2
        assert [s["alpha"] for s in report["steps"]] == single.alphas
        assert [x["residual"] for x in report["layers"]] == pytest.approx([x.residual for x in single.layers],
                                                                          rel=1e-4, abs=1e-9)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-5)


def _capacity_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # rank 1 measured less headroom on the host and more on the disk; neither measured a device (CPU)
        in_use = {"device": 0, "host": 1000 + rank}
        capacity = {"device": None, "host": 1000 + rank + (800 if rank == 0 else 600),
                    "disk": 5000 if rank == 0 else 9000}
        shared = World.detect().shared_capacity(in_use, capacity)
        torch.save(shared, os.path.join(out_dir, f"capacity{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_on_one_machine_split_its_memory_and_plan_alike(tmp_path):
    """Each rank measures the whole machine's free memory; planning with all of it, two ranks would together fill
    twice what is there. The host's and the disk's headroom is split among the ranks on the machine, and every
    rank takes the smallest share, so that their plans (placements, factor dtype) agree."""
    mp.spawn(_capacity_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    shared = [torch.load(tmp_path / f"capacity{r}.pt", weights_only=False) for r in range(2)]
    for rank, capacity in enumerate(shared):
        assert capacity == {"device": None, "host": 1000 + rank + 600 // 2, "disk": 5000 // 2}
    assert World().shared_capacity({"host": 1}, {"host": 9, "disk": None}) == {"host": 9, "disk": None}


#: the callback's repair under DDP: a few steps at a set learning rate, the gain measured on every eighth sample
CALLBACK_REPAIR = dict(distill_steps=4, distill_lr=1e-3, keep_gain=0.5)


def _trainer_worker(rank: int, world: int, port: int, out_dir: str, use_peft: bool, repair: bool = False) -> None:
    """One DDP rank of a Trainer run with JanusCallback (gloo on CPU), launched like torchrun would; ``repair``: with
    the repair after JANUS, whose new-task samples (the ranks' gathered, the same on both) are saved too."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import pathlib

    from trainer_fixtures import CONFIG as CB_CONFIG
    from trainer_fixtures import Probe, make_trainer, pretrained_llama, replay_data

    from hf_janus.integrations.trainer import JanusCallback

    model = pretrained_llama()
    theta0 = copy.deepcopy(model.state_dict())
    if use_peft:
        from peft import get_peft_model
        from trainer_fixtures import PeftProbe, lora_config, merged_state

        model, probe = get_peft_model(model, lora_config()), PeftProbe()
        janus = JanusCallback(replay_data(), CB_CONFIG, adapter_rank=64)
    else:
        config = JanusConfig(**{**CB_CONFIG.to_dict(), **(CALLBACK_REPAIR if repair else {})})
        probe, janus = Probe(), JanusCallback(replay_data(), config)
    trainer = make_trainer(pathlib.Path(out_dir), model, [probe, janus], ddp_backend="gloo")
    assert trainer.args.world_size == world and dist.is_initialized()
    trainer.train()
    state = merged_state(model) if use_peft else model.state_dict()
    fitted = janus.rectifier.new_task_batches or []
    new_task = [{k: v[i][b["attention_mask"][i].bool()] for k, v in b.items()}
                for b in fitted for i in range(len(b["input_ids"]))]
    torch.save({"state": state, "finetuned": probe.finetuned, "theta0": theta0, "new_task": new_task,
                "report": janus.report.to_dict(), "local_batches": len(janus.rectifier.local_batches)},
               os.path.join(out_dir, f"trainer_rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_callback_under_ddp_matches_single_process_rectify(tmp_path, use_peft):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_trainer_worker, args=(2, port, str(tmp_path), use_peft), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"trainer_rank{r}.pt", weights_only=False) for r in range(2)]
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), f"{key} differs between ranks"
    # 12 replay samples in batches of 8: rank 0 captures batch 0, rank 1 batch 1.
    assert [r["local_batches"] for r in ranks] == [1, 1]
    assert ranks[0]["report"]["num_samples"] == 12

    from trainer_fixtures import CONFIG as CB_CONFIG
    from trainer_fixtures import pretrained_llama, replay_data

    from hf_janus import rectify

    torch.set_num_threads(1)
    twin = pretrained_llama()
    twin.load_state_dict(ranks[0]["finetuned"])
    config = CB_CONFIG
    if use_peft:  # the adapted layers are the targets
        from trainer_fixtures import TARGETS

        config = JanusConfig(**{**CB_CONFIG.to_dict(), "target_modules": TARGETS})
    single = rectify(twin, ranks[0]["theta0"], replay_data(), config, progress=False)
    assert [s["alpha"] for s in ranks[0]["report"]["steps"]] == single.alphas
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-5)


def test_the_callbacks_repair_under_ddp_matches_single_process_rectify(tmp_path):
    """The repair through JanusCallback under DDP (2 gloo ranks): both ranks fit the Trainer's samples of both
    ranks, end with the same weights, and those are what one process's rectify gives with the same samples."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_trainer_worker, args=(2, port, str(tmp_path), False, True), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"trainer_rank{r}.pt", weights_only=False) for r in range(2)]
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), f"{key} differs between ranks"
    repair = ranks[0]["report"]["repair"]
    assert repair is not None and repair["steps"] == CALLBACK_REPAIR["distill_steps"]
    # the Trainer's batches of 4 on each rank for 4 steps, gathered: every sample trained on
    assert len(ranks[0]["new_task"]) == 2 * 4 * 4

    from trainer_fixtures import CONFIG as CB_CONFIG
    from trainer_fixtures import pretrained_llama, replay_data

    from hf_janus import rectify

    torch.set_num_threads(1)
    twin = pretrained_llama()
    twin.load_state_dict(ranks[0]["finetuned"])
    config = JanusConfig(**{**CB_CONFIG.to_dict(), **CALLBACK_REPAIR})
    single = rectify(twin, ranks[0]["theta0"], replay_data(), config, new_task=ranks[0]["new_task"], progress=False)
    assert repair["chosen"] == single.repair.chosen
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-5)


# ---- the repair after JANUS: each rank takes its rows of every batch, so two ranks train as one process ----------

def _repaired(kind: str):
    """(model, report) of a repair after JANUS in one process or one rank: the target layers' weights of a full
    fine-tune (``"weights"``), or a LoRA's own factors (``"adapter"``, AdapterSpace)."""
    config = JanusConfig(**REPAIR_CONFIG)
    if kind == "weights":
        model, reference = _setup()
        return model, Rectifier(model, reference, random_replay(24), config, progress=False,
                                new_task=fine_tune_samples()).run().report
    from hf_janus.adapters.live.rectify import PeftOutput, rectify_live_peft

    model, initial = trained_lora()
    return model, rectify_live_peft(model, initial, random_replay(24), config, PeftOutput(), progress=False,
                                    new_task=fine_tune_samples()).report


def _repair_worker(rank: int, world: int, init_file: str, out_dir: str, kind: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, report = _repaired(kind)
        torch.save({"state": model.state_dict(), "report": report.to_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _two_ranks_then_one(tmp_path, kind: str):
    """Both ranks' saved states and reports (checked equal across the ranks), and a single process's model and
    report."""
    mp.spawn(_repair_worker, args=(2, str(tmp_path / "init"), str(tmp_path), kind), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), f"{key} differs between ranks"
    torch.set_num_threads(1)
    return ranks, *_repaired(kind)


def test_two_processes_repair_as_one(tmp_path):
    ranks, model, single = _two_ranks_then_one(tmp_path, "weights")
    repair = ranks[0]["report"]["repair"]
    assert repair["chosen"] == single.repair.chosen
    for point, figures in single.repair.to_dict()["validation"].items():
        assert repair["validation"][point] == pytest.approx(figures, rel=1e-4), point
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-5)


def test_two_processes_repair_an_adapter_as_one(tmp_path):
    """The adapter trains its own factors (AdapterSpace) under DDP: both ranks end with the same adapter, the one a
    single process gives."""
    ranks, model, single = _two_ranks_then_one(tmp_path, "adapter")
    assert ranks[0]["report"]["repair"]["chosen"] == single.repair.chosen
    for key, value in model.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-5)
