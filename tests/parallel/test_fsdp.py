"""FSDP2 (``fully_shard``, DTensor weights): 2 CPU processes (gloo) rectify a sharded model as one process
rectifies the unsharded one, restore θ̂ exactly on failure, and JanusCallback snapshots θ0 whole."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from testing_utils import VOCAB, build_tiny, random_replay, train_steps
from sharded_checks import (
    check_matches_single_process,
    fsdp_full_state,
    fail_between_passes,
    fail_during_backward,
    assert_restored,
    injected,
    setup_model,
    rank_process,
    spawn_two,
)

from hf_janus import JanusConfig, rectify
from hf_janus.engine.rectifier import Rectifier

pytestmark = pytest.mark.distributed  # several processes; see pyproject.toml's markers

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed")

CONFIG = dict(compression_rank=4, replay_batch_size=2, tau=0.95)
SAMPLE_COUNTS = (5, 2)  # 3 batches: rank 1 repeats one to match rank 0's passes; 1 batch: rank 1's share is empty


_setup = setup_model


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _target_is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    weight = model.model.layers[0].self_attn.q_proj.weight
    return isinstance(weight, DTensor) and weight.to_local().shape[0] == weight.shape[0] // 2


def _init(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


# ---- rectify() on a sharded model ----------------------------------------------------------------------

def _rectify_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    _init(rank, world, init_file)
    with rank_process():
        results = {}
        for n_samples in SAMPLE_COUNTS:
            model, reference = _setup()
            _shard(model)
            rectifier = Rectifier(model, reference, random_replay(n_samples), JanusConfig(**CONFIG), progress=False)
            report = rectifier.run().report
            results[n_samples] = {
                "state": fsdp_full_state(model), "report": report.to_dict(), "still_sharded": _target_is_sharded(model),
                "passes": (len(rectifier.local_batches), len(rectifier.idle_batches)),
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_sharded_rectify_matches_unsharded(tmp_path):
    ranks = spawn_two(_rectify_worker, tmp_path)
    torch.set_num_threads(1)
    for n_samples in SAMPLE_COUNTS:
        sharded = [r[n_samples] for r in ranks]
        check_matches_single_process(sharded, n_samples, CONFIG, "still_sharded")


# ---- failures leave θ̂ exactly ----------------------------------------------------------------------------

FAILURES = {"backward": fail_during_backward, "between_passes": fail_between_passes}


def _failure_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from hf_janus.engine.capture import replay_losses
    from hf_janus.errors import JanusError, RectificationError
    from hf_janus.replay.prepare import prepare_replay

    _init(rank, world, init_file)
    with rank_process():
        results = {}
        for name, inject in FAILURES.items():
            model, reference = _setup()
            _shard(model)
            batches = prepare_replay(random_replay(5), 2)
            before = fsdp_full_state(model)
            loss_before = replay_losses(model, batches).loss
            with injected(inject) as hooks:
                try:
                    Rectifier(model, reference, random_replay(5), JanusConfig(**CONFIG), progress=False,
                              observer=hooks).run()
                    error = None
                except RectificationError as err:
                    error = str(err)
            results[name] = {
                "error": error, "before": before, "after": fsdp_full_state(model),
                "still_sharded": _target_is_sharded(model),
                "requires_grad": all(p.requires_grad for p in model.parameters()),
                # FSDP's iteration state was reset: the model runs again, on the restored weights.
                "losses": (loss_before, replay_losses(model, batches).loss),
            }
        # A DTensor outside FSDP (tensor parallelism) would get the wrong replay split: refused up front.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        model, reference = _setup()
        q_proj = model.model.layers[0].self_attn.q_proj
        q_proj.weight = torch.nn.Parameter(distribute_tensor(q_proj.weight.detach(), init_device_mesh("cpu", (2,)),
                                                             [Shard(0)]))
        try:
            Rectifier(model, reference, random_replay(5), JanusConfig(**CONFIG), progress=False)
            results["tensor_parallel"] = None
        except JanusError as err:
            results["tensor_parallel"] = str(err)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_failure_restores_sharded_weights_exactly(tmp_path):
    ranks = spawn_two(_failure_worker, tmp_path)
    for result in ranks:
        for name in FAILURES:
            outcome = result[name]
            assert_restored(outcome, name)
            assert outcome["still_sharded"] and outcome["requires_grad"]
            assert outcome["losses"][1] == outcome["losses"][0]
        assert "FSDP2" in result["tensor_parallel"] and "1-D mesh" in result["tensor_parallel"]


# ---- JanusCallback on a sharded model --------------------------------------------------------------------

def _callback_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The Trainer's calls to the callback around an FSDP2 training loop (Trainer itself does not shard on CPU)."""
    from transformers import TrainerControl, TrainerState

    from hf_janus.integrations.trainer import JanusCallback

    _init(rank, world, init_file)
    with rank_process():
        model = _shard(build_tiny("llama"))
        args = SimpleNamespace(output_dir=out_dir, process_index=rank, fsdp="full_shard", deepspeed=None,
                               disable_tqdm=True)
        state = TrainerState(is_world_process_zero=rank == 0, is_local_process_zero=rank == 0)
        janus = JanusCallback(random_replay(6), JanusConfig(**CONFIG))
        janus.on_train_begin(args, state, TrainerControl(), model=model)
        theta0 = janus.theta0()

        data = torch.randint(0, VOCAB, (8, 10), generator=torch.Generator().manual_seed(2))[rank::world]
        train_steps(model, data, steps=8, lr=5e-3)
        finetuned = fsdp_full_state(model)
        janus.on_train_end(args, state, TrainerControl(), model=model)
        torch.save({"theta0": theta0, "finetuned": finetuned, "state": fsdp_full_state(model),
                    "report": janus.report.to_dict(), "snapshot_bytes": janus.snapshot_bytes,
                    "refused": _refusals(args, state)}, os.path.join(out_dir, f"rank{rank}.pt"))


def _refusals(args, state) -> dict:
    """What on_train_begin says about the sharded layouts it does not handle."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from transformers import TrainerControl

    from hf_janus.errors import JanusError
    from hf_janus.integrations.trainer import JanusCallback

    peft = get_peft_model(build_tiny("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    models = {"peft": fully_shard(peft, mesh=init_device_mesh("cpu", (dist.get_world_size(),))),
              "fsdp1": FullyShardedDataParallel(build_tiny("llama"), device_id=torch.device("cpu"))}
    messages = {}
    for name, model in models.items():
        try:
            JanusCallback(random_replay(2)).on_train_begin(args, state, TrainerControl(), model=model)
            messages[name] = None
        except JanusError as err:
            messages[name] = str(err)
    return messages


def test_callback_on_sharded_model(tmp_path):
    from hf_janus.publish.record_file import REPORT_NAME

    ranks = spawn_two(_callback_worker, tmp_path)
    initial = build_tiny("llama").state_dict()
    for result in ranks:
        theta0 = result["theta0"]
        assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in theta0.values())
        for key, value in theta0.items():  # whole weights, taken before training
            assert torch.equal(value, initial[key]), key
        assert result["snapshot_bytes"] == sum(t.numel() * 4 for t in theta0.values())
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), f"{key} differs between ranks"
    assert os.path.isfile(tmp_path / REPORT_NAME)
    refused = ranks[0]["refused"]
    assert "Apply fully_shard to each decoder layer" in refused["peft"]  # the PeftModel sharded as one unit
    assert "FullyShardedDataParallel (FSDP1)" in refused["fsdp1"]

    torch.set_num_threads(1)
    twin = build_tiny("llama")
    twin.load_state_dict(ranks[0]["finetuned"])
    single = rectify(twin, ranks[0]["theta0"], random_replay(6), JanusConfig(**CONFIG), progress=False)
    assert [s["alpha"] for s in ranks[0]["report"]["steps"]] == single.alphas
    for key, value in twin.state_dict().items():
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-6)


# ---- the self-replay cache key reads every shard -------------------------------------------------------------

def _fingerprint_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from hf_janus.replay.generation_cache import model_fingerprint

    _init(rank, world, init_file)
    with rank_process():
        keys = []
        for change in (None, 0, 1):  # unchanged; one value changed in rank 0's shard; in rank 1's
            model = build_tiny("llama")
            weight = model.model.layers[1].mlp.down_proj.weight
            if change is not None:
                with torch.no_grad():
                    weight[change * (weight.shape[0] - 1), 5] += 1e-3
            keys.append(model_fingerprint(_shard(model)))
        torch.save(keys, os.path.join(out_dir, f"rank{rank}.pt"))


def test_self_replay_key_differs_for_one_value_in_any_shard(tmp_path):
    ranks = spawn_two(_fingerprint_worker, tmp_path)
    assert ranks[0] == ranks[1]  # every rank names the model alike
    unchanged, first_shard, second_shard = ranks[0]
    assert len({unchanged, first_shard, second_shard}) == 3
